"""The one seam between batchgen and decode-side replay and speculation (vLLM's names).

`SpecSeam.take(engine_args, tp)` takes `speculative_config` (ngram only) and
`enable_trace_replay` out of `LLM(...)`'s engine arguments, checked before any weights load
(`checked(plan)`: no hybrid models);
`attach(llm)` sets `Engine.spec` (None when off: the plain step loop, unchanged) and lets
requests carry `trace_decode_token_ids`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from batchgen.checks import check_flag
from batchgen.model.families import classify
from batchgen.speculative.config import SpecConfig, parse_spec_config
from batchgen.speculative.decoder import SpecDecoder


class SpecSeam:
    """The LLM's speculative config (or None) and trace replay switch."""

    ARGS = ("speculative_config", "enable_trace_replay")  # vLLM's, honoured

    def __init__(self, cfg: SpecConfig | None, trace_replay: bool) -> None:
        self.cfg, self.trace_replay = cfg, trace_replay

    @classmethod
    def take(cls, engine_args: dict[str, Any], tensor_parallel_size: int) -> SpecSeam:
        """vLLM's arguments, taken out of `engine_args` and checked."""
        trace = engine_args.pop("enable_trace_replay", False)
        check_flag(trace, "enable_trace_replay")
        cfg = parse_spec_config(engine_args.pop("speculative_config", None),
                                tensor_parallel_size)
        return cls(cfg, bool(trace))

    def checked(self, plan: Any) -> Any:
        """`plan` (the engine's plan, before weights load), unless speculation is asked of a
        model with state mixers (hybrid): their state cannot rewind rejected drafts."""
        if self.cfg is not None and classify(plan.config).mixer_kinds:
            raise ValueError(f"speculative_config is served for attention models only: "
                             f"{classify(plan.config).family!r} has state mixers (hybrid), "
                             f"whose state cannot rewind rejected drafts")
        return plan

    def attach(self, llm: Any) -> SpecSeam:
        """Give the engine its SpecDecoder (ngram on) and the requests the trace switch."""
        llm.requests.limits = replace(llm.requests.limits, trace_replay=self.trace_replay)
        if self.cfg is None:
            return self
        llm.engine.spec = SpecDecoder(self.cfg, llm.max_num_batched_tokens)
        return self


def spec_counters(llm: Any) -> tuple[int, int, int]:
    """(drafts, draft tokens, accepted tokens) so far; zeros without speculation."""
    spec = getattr(llm.engine, "spec", None)
    return spec.counters() if spec is not None else (0, 0, 0)
