"""Shared test helpers: deterministic prompts and HF greedy generation as the oracle.

Import from test files as ``from helpers import ...`` (``tests/`` is on ``sys.path`` because
``tests/conftest.py`` lives there and the folder has no ``__init__.py``).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
FIRST_TEXT_ID = 3  # ids below this are special tokens


def make_prompt_token_ids(
    n: int,
    min_len: int,
    max_len: int,
    vocab_size: int,
    seed: int,
    include_lengths: Sequence[int] = (),
) -> list[list[int]]:
    """Return ``n`` deterministic random prompts: BOS then ids in ``[3, vocab_size)``.

    Lengths (BOS included) are uniform in ``[min_len, max_len]``, except that every length in
    ``include_lengths`` (e.g. block multiples 16, 32, 48) occurs exactly once more, at a
    seed-dependent position.
    """
    if len(include_lengths) > n:
        raise ValueError("more include_lengths than prompts")
    if not 1 <= min_len <= max_len or any(x < 1 for x in include_lengths):
        raise ValueError("lengths must be >= 1 and min_len <= max_len")
    rng = random.Random(seed)
    lengths = list(include_lengths)
    lengths += [rng.randint(min_len, max_len) for _ in range(n - len(lengths))]
    rng.shuffle(lengths)
    return [
        [BOS_ID] + [rng.randrange(FIRST_TEXT_ID, vocab_size) for _ in range(length - 1)]
        for length in lengths
    ]


@functools.lru_cache(maxsize=32)
def _load_hf(model_dir: str) -> Any:
    """Load (once per folder) the HF reference model in fp32 with eager attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def load_hf_model(model_dir: str | Path) -> Any:
    """Cached fp32 eager HF model for ``model_dir``; do not modify it."""
    return _load_hf(str(Path(model_dir).resolve()))


def strip_after_eos(tokens: Sequence[int], eos_id: int = EOS_ID) -> list[int]:
    """Cut everything after the first EOS (the EOS itself is kept)."""
    tokens = list(tokens)
    return tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens


@torch.no_grad()
def hf_greedy(
    model_dir: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[list[int]]:
    """HF ``generate`` greedy output per prompt, one unpadded prompt at a time.

    Returns only the generated ids, ending with EOS (2) if it was generated.
    """
    return model_greedy(load_hf_model(model_dir), prompts, max_new_tokens)


@torch.no_grad()
def model_greedy(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int
                 ) -> list[list[int]]:
    """`hf_greedy` on a loaded model (a PEFT model, say): generated ids per prompt."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        )
        outputs.append(strip_after_eos(out[0, ids.shape[1] :].tolist()))
    return outputs


def check_pool_invariants(bm: Any) -> None:
    """A BlockManager's bookkeeping is consistent (its own audit: reference counts equal table
    entries; free, evictable and referenced blocks partition the pool; the prefix cache and
    the blocks' hashes agree; the host pool likewise)."""
    problems = bm.audit()
    assert not problems, problems


def check_batch(engine: Any) -> None:
    """The persistent batch mirrors the running sequences exactly: one dense slot per
    sequence holding a block table, each slot's counters equal to its sequence's, its
    block-table row equal to the BlockManager's table."""
    kv, running = engine.kv, engine.scheduler.running
    batch, bm = kv.batch, kv.block_manager
    seqs = [s for g in running for s in g.seqs if bm.has_table(s)]
    assert sorted(id(s) for s in batch.seqs) == sorted(id(s) for s in seqs)
    assert bm.num_tables() == len(batch.seqs)
    c = batch.cols
    for slot, seq in enumerate(batch.seqs):
        assert seq.slot == slot and kv.num_computed(seq) == c["num_computed"][slot]
        table = bm.table(seq)
        assert c["num_blocks"][slot] == len(table)
        assert batch.block_table[slot, :len(table)].tolist() == table
        assert c["num_tokens"][slot] == len(seq.token_ids)
        assert c["last_token"][slot] == seq.token_ids[-1]
        assert c["num_prompt"][slot] == seq.group.num_prompt_tokens
        assert 0 <= c["num_computed"][slot] <= len(seq.token_ids)
        assert c["fork_pending"][slot] == (seq.group.fork_pending and seq is seq.group.leader)
        pos = int(c["num_computed"][slot])
        if not c["cow_check"][slot] and pos // bm.block_size < len(table):
            # a sequence not forked since its last reservation owns the block it writes next
            assert pos % bm.block_size == 0 or bm.ref_count[table[pos // bm.block_size]] == 1


def assert_pool_whole(llm: Any) -> None:
    """After a call (finished or aborted): no block tables, every block free or evictable."""
    bm = llm.engine.kv.block_manager
    check_pool_invariants(bm)
    assert not bm.num_tables() and bm.num_free_blocks() == bm.num_blocks
    assert not llm.engine.scheduler.has_unfinished() and not llm.engine.kv.batch.num_seqs


def cpu_kernel_or_skip() -> Any:
    """The compiled CPU decode kernel, built on first use (never while tests are collected);
    skips the calling test where it cannot be built."""
    import pytest

    from batchgen.attention import cpu_kernel

    kernel = cpu_kernel.try_load()
    if kernel is None:
        pytest.skip("CPU decode kernel unavailable here (no C compiler, or BATCHGEN_CPU_KERNEL=0)")
    return kernel


def cpu_kernel_available() -> bool:
    """Whether the default CPU backend is the compiled kernel here (built on first call)."""
    from batchgen.attention import cpu_kernel

    return cpu_kernel.try_load() is not None


def interrupt_tracer(event: int, paths: tuple[str, ...], counter: list[int]) -> Any:
    """A sys.settrace function raising KeyboardInterrupt at the `event`-th line executed in
    files under `paths` (0: never), wherever that falls; counter[0] counts the lines."""

    def local(frame: Any, what: str, arg: Any) -> Any:
        if what == "line":
            counter[0] += 1
            if counter[0] == event:
                raise KeyboardInterrupt
        return local

    return lambda frame, what, arg: local if frame.f_code.co_filename.startswith(paths) else None


def traced_workload(llm: Any, tracer: Any) -> tuple[list, list]:
    """The interrupt tests' run under `tracer` (sys.settrace; None: untraced): samples (n=2,
    greedy, seeded, n=3) and width-3 beams, small enough to preempt and fork in a small pool.
    Returns the samples' and the beams' token ids."""
    import sys

    from batchgen import BeamSearchParams, SamplingParams

    prompts = [{"prompt_token_ids": p}
               for p in make_prompt_token_ids(4, 3, 40, vocab_size=512, seed=5)]
    sys.settrace(tracer)
    try:
        a = llm.generate(prompts, [SamplingParams(n=2, seed=1, max_tokens=8),
                                   SamplingParams(temperature=0, max_tokens=12),
                                   SamplingParams(seed=2, max_tokens=6),
                                   SamplingParams(n=3, seed=3, max_tokens=5)], use_tqdm=False)
        b = llm.beam_search(prompts[:2], BeamSearchParams(beam_width=3, max_tokens=6),
                            use_tqdm=False)
    finally:
        sys.settrace(None)
    return ([[c.token_ids for c in o.outputs] for o in a],
            [[s.token_ids for s in o.sequences] for o in b])


@torch.no_grad()
def hf_greedy_top(model: Any, prompt: Sequence[int], max_new_tokens: int, k: int = 5
                  ) -> tuple[list[int], list[set[int]]]:
    """HF ``generate`` greedy tokens of one prompt on `model` (any device and dtype), up to and
    including EOS, with each step's top-`k` token ids."""
    dev = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=dev)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                         output_scores=True, return_dict_in_generate=True)
    tokens = strip_after_eos(out.sequences[0, ids.shape[1]:].tolist())
    tops = [set(s[0].float().topk(k).indices.tolist()) for s in out.scores[:len(tokens)]]
    return tokens, tops


def first_divergence_out_of_top(got: Sequence[int], got_top: Sequence[set[int]],
                                want: Sequence[int], want_top: Sequence[set[int]]
                                ) -> tuple[int, int, int] | None:
    """Where two greedy runs first part, (position, got token, wanted token) if either token is
    outside the other run's top-k there; None when they never part or part at a near-tie (the
    criterion of vLLM's `check_logprobs_close`: low-precision runs may part, but only between
    candidates both rank near the top; after a parting the contexts differ, so it stops)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return None if a in want_top[i] and b in got_top[i] else (i, a, b)
    return None


def top_ids(position: Any, k: int) -> set[int]:
    """The token ids of rank <= k in one position of a batchgen output's `logprobs`."""
    return {t for t, lp in position.items() if lp.rank is not None and lp.rank <= k}


def head_folder(src: Path, dst: Path, kind: str = "SequenceClassification", labels: int = 1,
                seed: int = 7, templates: bool = False) -> Path:
    """A tiny random `*For{kind}` model folder on `src`'s config and tokenizer (a sizeable head,
    N(0, 1), so a wrong row or position shows); with `templates`, `src`'s .jinja files too."""
    import shutil

    import transformers

    config = transformers.AutoConfig.from_pretrained(src)
    config.num_labels = labels
    config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    torch.manual_seed(seed)
    model = getattr(transformers, "AutoModelFor" + kind).from_config(config).float()
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(dst)
    for f in Path(src).iterdir():
        if "token" in f.name or (templates and f.name.endswith(".jinja")):
            shutil.copy(f, Path(dst) / f.name)
    return Path(dst)


def fresh_hf_model(model_dir: str | Path) -> Any:
    """An uncached fp32 eager HF model for `model_dir` (one PEFT may wrap and change)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def save_lora_adapter(model_dir: str | Path, folder: str | Path, r: int, targets: Sequence[str],
                      seed: int, alpha: int | None = None, rslora: bool = False) -> Path:
    """A PEFT LoRA adapter on `model_dir` saved to `folder`: every A and B drawn N(0, 0.3)
    under `seed`, so its deltas show on a tiny random model; alpha defaults to 2r."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(fresh_hf_model(model_dir), peft.LoraConfig(
        r=r, lora_alpha=2 * r if alpha is None else alpha, target_modules=list(targets),
        use_rslora=rslora, init_lora_weights=False))
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data.normal_(0, 0.3)
    model.save_pretrained(folder)
    return Path(folder)
