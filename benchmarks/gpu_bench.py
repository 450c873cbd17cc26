"""GPU throughput and decode bandwidth: batchgen vs HF ``generate`` vs HF ``generate_batch``.

The workload of issue 9's bar: a random-weight Llama-3.2-1B-shaped model (hidden 2048, 16
layers, 32/8 q/kv heads of 64, ffn 8192, vocab 128256) in bf16; ``--num-prompts`` prompts with
input lengths uniform in [``--min-prompt-len``, ``--max-prompt-len``] and output lengths uniform
in [``--min-output-len``, ``--max-output-len``], greedy, EOS ignored (every request produces
exactly its length). Output tokens per second are compared:

* batchgen: one ``LLM.generate`` call, each request its own ``max_tokens``; eager, and with
  CUDA graphs for decode steps (``--graphs``).
* HF generate: sdpa, left-padded batches of ``--hf-batch-size`` prompts in input order, each
  batch generating its longest output (static batching); only the requested tokens count. To
  keep the run short it takes the first ``--hf-prompts`` prompts: tokens/s is the comparison.
* HF generate_batch (continuous batching): its manager with each request's own
  ``max_new_tokens``, over the first ``--gb-prompts`` prompts.

Then a decode probe: batchgen decode steps at batch ``--probe-batch`` (prompts of
``--probe-len`` tokens): bytes each step must read (the weights once, every row's K/V) over the
step time, against the device's measured copy bandwidth (bytes read and written by one large
device-to-device copy, over its time).

Usage (from the repository root, on a GPU; scripts/gpu_check.sh runs it)::

    PYTHONPATH=. python benchmarks/gpu_bench.py --json $OUT/gpu_bench.json
    PYTHONPATH=. python benchmarks/gpu_bench.py --device cpu --quick   # the code path, tiny
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    PAD_ID,
    left_pad,
    machine_info,
    machine_line,
    markdown_table,
    quiet_logging,
    sync,
    write_json,
)

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256)
QUICK = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=64, intermediate_size=256, vocab_size=1024)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="a tiny model and workload (CI)")
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--min-prompt-len", type=int, default=128)
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=128)
    p.add_argument("--max-output-len", type=int, default=512)
    p.add_argument("--hf-prompts", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--gb-prompts", type=int, default=512)
    p.add_argument("--graphs", choices=["off", "on", "both"], default="both",
                   help="batchgen with CUDA-graph decode (enforce_eager=False), eager, or both")
    p.add_argument("--probe-batch", type=int, default=128)
    p.add_argument("--probe-len", type=int, default=512)
    p.add_argument("--probe-steps", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-generate-batch", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.min_prompt_len, args.max_prompt_len = 6, 4, 24
        args.min_output_len, args.max_output_len = 2, 6
        args.hf_prompts = args.gb_prompts = 4
        args.hf_batch_size, args.probe_batch, args.probe_len, args.probe_steps = 2, 4, 16, 4
    return args


def make_model_dir(out: Path, args: argparse.Namespace) -> int:
    """A random-weight Llama folder in bf16 (initialised on the device: fast on a GPU)."""
    from transformers import AutoModelForCausalLM

    from batchgen.tools.make_tiny_model import make_config

    shape = QUICK if args.quick else LLAMA_1B
    max_len = args.max_prompt_len + args.max_output_len + args.probe_len + args.probe_steps
    config = make_config("llama", **shape, max_position_embeddings=max(2048, max_len),
                         dtype=torch.bfloat16)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    del model
    return n


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_prompt_len,
                                                                    args.max_prompt_len))]
               for _ in range(args.num_prompts)]
    outs = [rng.randint(args.min_output_len, args.max_output_len) for _ in prompts]
    return prompts, outs


def timed(fn, device: str) -> tuple[Any, float]:
    sync(device)
    t0 = time.perf_counter()
    res = fn()
    sync(device)
    return res, time.perf_counter() - t0


def run_batchgen(model_dir: Path, prompts: list[list[int]], lens: list[int], device: str,
                 eager: bool) -> tuple[float, str, Any]:
    from batchgen import LLM, SamplingParams

    llm = LLM(str(model_dir), device=device, enforce_eager=eager, enable_prefix_caching=False)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    llm.generate(reqs[:8], params[:8], use_tqdm=False)  # warm-up: kernels built, graphs hot
    outs, wall = timed(lambda: llm.generate(reqs, params, use_tqdm=False), device)
    assert [len(o.outputs[0].token_ids) for o in outs] == lens
    mode = "eager" if eager or llm.engine.runner.graphs is None else "CUDA-graph decode"
    return wall, f"{llm.attention_backend}, {mode}, block 16", llm


def run_hf_generate(model, prompts: list[list[int]], lens: list[int], batch: int,
                    device: str) -> float:
    def go() -> None:
        for i in range(0, len(prompts), batch):
            ids, mask = left_pad(prompts[i:i + batch], PAD_ID, device)
            n = max(lens[i:i + batch])
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=PAD_ID)
    with torch.inference_mode():
        ids, mask = left_pad(prompts[:2], PAD_ID, device)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                       pad_token_id=PAD_ID)
        return timed(go, device)[1]


def run_generate_batch(model, prompts: list[list[int]], lens: list[int], device: str) -> float:
    """transformers' continuous batching, each request with its own max_new_tokens. The
    manager (its cache sized for the whole workload, its CUDA graphs) is built and warmed up by
    an untimed run first, as batchgen's engine is."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=PAD_ID,
                           max_new_tokens=max(lens))
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)),
                          max_generated_length=max(lens), num_requests=len(prompts))

    def go(ps: list[list[int]], ls: list[int]) -> None:
        with model.continuous_batching_context_manager(
                generation_config=gen, block=True, timeout=5, persistent_manager=True,
                workload_hints=hints) as manager:
            ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(ps, ls)]
            done = 0
            while done < len(ids):
                r = manager.get_result(timeout=1)
                if r is not None and r.is_finished():
                    assert r.error is None, r.error
                    done += 1
    try:
        with torch.inference_mode():
            go(prompts[:2], [4, 4])
            return timed(lambda: go(prompts, lens), device)[1]
    finally:
        model.destroy_cached_continuous_batching_manager()


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes per second moved (read + written) by a large device-to-device copy."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    walls = [timed(lambda: y.copy_(x), device)[1] for _ in range(5)]
    return 2 * nbytes / min(walls)


def decode_probe(llm, args: argparse.Namespace, vocab: int, n_params: int) -> dict[str, float]:
    """Time decode steps at batch `probe_batch`: (T(1 + steps tokens) - T(1 token)) / steps."""
    from batchgen import SamplingParams

    rng = random.Random(args.seed + 1)
    reqs = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.probe_len)]}
            for _ in range(args.probe_batch)]

    def run(n: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return timed(lambda: llm.generate(reqs, sp, use_tqdm=False), args.device)[1]

    run(2)
    step = (min(run(1 + args.probe_steps) for _ in range(2)) - min(run(1) for _ in range(2)))
    step /= args.probe_steps
    beta = llm.cache_config.bytes_per_token
    mean_ctx = args.probe_len + args.probe_steps / 2
    read = 2 * n_params + args.probe_batch * mean_ctx * beta  # bf16 weights once + every K/V
    bw = copy_bandwidth(args.device, 1 << 30)
    return {"step_s": step, "bytes_per_step": read, "achieved_bytes_s": read / step,
            "copy_bytes_s": bw, "fraction_of_copy": read / step / bw}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    quiet_logging()
    info = machine_info(args.device)
    rows, payload = [], {"machine": info, "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="batchgen-gpu-bench-") as tmp:
        model_dir = Path(tmp)
        n_params = make_model_dir(model_dir, args)
        vocab = (QUICK if args.quick else LLAMA_1B)["vocab_size"]
        prompts, lens = workload(args, vocab)
        print(f"model: random Llama, {n_params / 1e9:.2f}B params, bf16; workload: "
              f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
              f"{sum(lens)} output tokens", flush=True)
        modes = {"off": [True], "on": [False], "both": [True, False]}[args.graphs]
        results: dict[str, float] = {}
        llm = None
        for eager in modes:
            wall, config, llm = run_batchgen(model_dir, prompts, lens, args.device, eager)
            results[config] = sum(lens) / wall
            rows.append(["batchgen", config, f"{wall:.2f}", f"{results[config]:.0f}"])
            print(f"  batchgen {config}: {wall:.2f} s", flush=True)
        best = max(results.values())
        hf = None
        if not (args.skip_hf and args.skip_generate_batch):
            from benchmarks.common import load_hf_model

            hf = load_hf_model(model_dir, torch.bfloat16, args.device, "sdpa")
        if not args.skip_hf:
            k = args.hf_prompts
            wall = run_hf_generate(hf, prompts[:k], lens[:k], args.hf_batch_size, args.device)
            results["hf_generate"] = sum(lens[:k]) / wall
            rows.append(["HF generate", f"sdpa, batch {args.hf_batch_size}, first {k} prompts",
                         f"{wall:.2f}", f"{results['hf_generate']:.0f}"])
        if not args.skip_generate_batch:
            k = args.gb_prompts
            wall = run_generate_batch(hf, prompts[:k], lens[:k], args.device)
            results["hf_generate_batch"] = sum(lens[:k]) / wall
            rows.append(["HF generate_batch", f"first {k} prompts", f"{wall:.2f}",
                         f"{results['hf_generate_batch']:.0f}"])
        del hf
        probe = decode_probe(llm, args, vocab, n_params)
    print()
    print(markdown_table(["system", "config", "wall s", "output tok/s"], rows))
    bars = []
    for name, key, bar in (("HF generate", "hf_generate", 10.0),
                           ("HF generate_batch", "hf_generate_batch", 2.0)):
        if key in results:
            ratio = best / results[key]
            bars.append([f"batchgen / {name}", f"{ratio:.2f}x", f">= {bar:g}x",
                         "pass" if ratio >= bar else "FAIL"])
    frac = probe["fraction_of_copy"]
    bars.append([f"decode at batch {args.probe_batch}: bytes read / step time",
                 f"{probe['achieved_bytes_s'] / 1e9:.0f} GB/s = {100 * frac:.0f}% of copy "
                 f"({probe['copy_bytes_s'] / 1e9:.0f} GB/s)", ">= 60%",
                 "pass" if frac >= 0.6 else "FAIL"])
    print()
    print(markdown_table(["measure", "value", "bar", ""], bars))
    print(machine_line(info))
    payload.update(results=results, probe=probe, bars=bars, n_params=n_params)
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
