"""AttentionSpec: what one attention layer needs from a backend, fixed at load time.

The specs are read off the model itself: one probe forward of a single token through the
registered attention function records, per layer, exactly what HF passes it (the module's own
scaling, sliding window, softcap and sinks, head counts and dtype). No per-family rules to keep
in step with transformers; backends get them in their constructor and plan with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.attention.interface import NoStepContext


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention: heads, head dims, scale, window (keys k > q - window, the current
    token included, HF's convention), logit softcap, sinks (one logit per query head) and the
    dtype of its queries."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    scale: float
    window: int | None
    softcap: float | None
    dtype: torch.dtype
    sinks: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def plan_key(self) -> tuple[int | None, float | None, float, bool]:
        """What a kernel plan fixes beyond the step's shapes: layers sharing it share a plan
        (sinks choose another kernel variant; their values are passed per layer at run)."""
        return self.window, self.softcap, self.scale, self.sinks is not None


class SpecProbe:
    """Passed as the step context of one probe forward: records each layer's spec and
    returns zeros instead of attending."""

    def __init__(self) -> None:
        self.specs: dict[int, AttentionSpec] = {}

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float | None, kwargs: dict) -> torch.Tensor:
        layer = module.layer_idx
        if layer in self.specs:
            raise ValueError(f"attention layer {layer} runs twice per forward (shared KV "
                             "layers are not supported)")
        # an explicit sliding_window=None (exaone4's full layers) means none
        window = (kwargs["sliding_window"] if "sliding_window" in kwargs
                  else getattr(module, "sliding_window", None))
        softcap = kwargs.get("softcap")
        self.specs[layer] = AttentionSpec(
            num_heads=query.shape[1], num_kv_heads=key.shape[1], head_dim=query.shape[-1],
            head_dim_v=value.shape[-1],
            scale=float(scaling if scaling is not None else query.shape[-1] ** -0.5),
            window=int(window) if window else None,
            softcap=float(softcap) if softcap else None, dtype=query.dtype,
            sinks=kwargs.get("s_aux"))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


@torch.inference_mode()
def probe_specs(model: torch.nn.Module, num_layers: int, device: torch.device
                ) -> list[AttentionSpec]:
    """Every attention layer's spec, from one forward of one token."""
    probe = SpecProbe()
    family = getattr(getattr(model, "config", None), "model_type", "?")
    try:
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
              position_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
              use_cache=False, logits_to_keep=1, batchgen_step=probe)
    except NoStepContext as e:
        raise ValueError(f"model family {family!r} is not supported: its layers do not pass "
                         "the engine's step on to attention") from e
    if sorted(probe.specs) != list(range(num_layers)):
        raise ValueError(f"model family {family!r} is not supported: its attention layers "
                         f"report indices {sorted(probe.specs)}, expected 0..{num_layers - 1}")
    return [probe.specs[i] for i in range(num_layers)]


def check_pool_geometry(specs: list[AttentionSpec], num_kv_heads: int, head_dim: int,
                        head_dim_v: int) -> None:
    """Every layer's K and V (as probed) fit the pool sized from the config: a ValueError
    naming the first layer that does not, before the first step (never a crash in a copy)."""
    want = (num_kv_heads, head_dim, head_dim_v)
    for i, s in enumerate(specs):
        got = (s.num_kv_heads, s.head_dim, s.head_dim_v)
        if got != want:
            raise ValueError(
                f"attention layer {i} passes {got[0]} KV heads of keys {got[1]} and values "
                f"{got[2]} wide, but the KV pool sized from the model's config holds "
                f"{want[0]} heads of {want[1]}/{want[2]}: this attention layout is not "
                "supported")
