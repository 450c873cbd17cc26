"""GPU throughput and decode bandwidth: batchgen vs HF ``generate`` vs HF ``generate_batch``.

Issue 9's bars on a random Llama-3.2-1B-shaped model in bf16 (greedy, EOS ignored, output
lengths in [``--min-output-len``, ``--max-output-len``]), and a decode probe: bytes a step must
read (weights, every row's K/V) over the step time, against a large device copy's rate.

    PYTHONPATH=. python benchmarks/gpu_bench.py --json $OUT/gpu_bench.json   # gpu_check.sh
    PYTHONPATH=. python benchmarks/gpu_bench.py --device cpu --quick   # the code path, tiny
"""

import random
from pathlib import Path

import torch

from batchgen import LLM
from benchmarks import common as h

LLAMA_1B = dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                intermediate_size=8192, vocab_size=128256)
BARS = {"HF generate": 10.0, "HF generate_batch": 2.0}  # batchgen's output tok/s over theirs
QUICK = dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256,
             vocab_size=1024, num_prompts=6, min_prompt_len=4, max_prompt_len=24,
             min_output_len=2, max_output_len=6, hf_prompts=4, gb_prompts=4, hf_batch_size=2,
             probe_batch=4, probe_len=16, probe_steps=4)


def run_batchgen(model_dir: Path, prompts: list[list[int]], lens: list[int], args, eager: bool):
    llm = LLM(str(model_dir), device=args.device, enforce_eager=eager, enable_prefix_caching=False)
    reqs, params = h.token_prompts(prompts), [h.greedy(n) for n in lens]
    llm.generate(reqs[:8], params[:8], use_tqdm=False)  # warm-up: kernels built, graphs hot
    outs, wall = h.timed(lambda: llm.generate(reqs, params, use_tqdm=False), args.device)
    h.check_lengths("batchgen", [o.outputs[0].token_ids for o in outs], len(lens), lens)
    facts = h.engine_facts(llm)
    mode = "CUDA-graph decode" if facts["cuda_graphs"] else "eager"
    return wall, f"{facts['attention_backend']}, {mode}, block 16", llm


def run_hf_generate(model, prompts: list[list[int]], lens: list[int], args) -> float:
    """Static batches, each generating its longest output."""
    bs = args.hf_batch_size

    def go() -> None:
        for i in range(0, len(prompts), bs):
            h.hf_generate_all(model, prompts[i:i + bs], bs, max(lens[i:i + bs]), args.device,
                              do_sample=False)

    h.warm_up(lambda ps, k: h.hf_generate_all(model, ps, len(ps), k, args.device,
                                              do_sample=False), prompts, 4)
    return h.timed(go, args.device)[1]


def run_generate_batch(model, prompts: list[list[int]], lens: list[int], device: str) -> float:
    """Continuous batching, per-request lengths; manager built by an untimed run."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=h.PAD_ID,
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
        h.warm_up(lambda ps, k: go(ps, [k] * len(ps)), prompts, 4)
        return h.timed(lambda: go(prompts, lens), device)[1]
    finally:
        model.destroy_cached_continuous_batching_manager()


def decode_probe(llm, args, n_params: int) -> dict[str, float]:
    """Decode step time at ``--probe-batch`` against the bytes a step reads and a copy's rate."""
    prompts = h.make_prompts(args.probe_batch, args.probe_len, args.probe_len, args.vocab_size,
                             args.seed + 1)

    def run(n: int) -> float:
        return min(h.timed(lambda: h.bg_tokens(llm, prompts, h.greedy(n)), args.device)[1]
                   for _ in range(2))

    run(2)
    step = (run(1 + args.probe_steps) - run(1)) / args.probe_steps
    mean_ctx = args.probe_len + args.probe_steps / 2
    read = 2 * n_params + args.probe_batch * mean_ctx * h.kv_bytes_per_token(llm)
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device=args.device)  # 1 GiB
    y = torch.empty_like(x)
    y.copy_(x)
    bw = 2 * x.nbytes / min(h.timed(lambda: y.copy_(x), args.device)[1] for _ in range(5))
    return {"step_s": step, "bytes_per_step": read, "achieved_bytes_s": read / step,
            "copy_bytes_s": bw, "fraction_of_copy": read / step / bw}


def main(argv: list[str] | None = None) -> dict:
    p = h.parser(__doc__, model={**LLAMA_1B, "dtype": "bfloat16"},
                 run={"repeats": None, "device": "cuda"}, workload={
                     "num_prompts": 1024, "min_prompt_len": 128, "max_prompt_len": 1024,
                     "output_len": None})
    p.add_argument("--quick", action="store_true", help="a tiny model and workload (CI)")
    h.add_ints(p, min_output_len=128, max_output_len=512, hf_prompts=128, hf_batch_size=64,
               gb_prompts=512, probe_batch=128, probe_len=512, probe_steps=64)
    args = h.check_args(p, p.parse_args(argv))
    if args.quick:
        vars(args).update(QUICK)
    info = h.start(args)
    max_len = args.max_prompt_len + args.max_output_len + args.probe_len + args.probe_steps
    rng, prompts = random.Random(args.seed), h.workload_prompts(args)
    lens = [rng.randint(args.min_output_len, args.max_output_len) for _ in prompts]
    systems = []  # (system, config, wall s, output tokens)
    with h.prepare_model_dir(args, max_len, init_device=args.device) as model_dir:
        n_params = h.count_params(model_dir)
        print(f"model: random Llama, {n_params / 1e9:.2f}B params, {args.dtype}; workload: "
              f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
              f"{sum(lens)} output tokens", flush=True)
        for eager in (True, False):  # eager, and with CUDA-graph decode where there is one
            wall, config, llm = run_batchgen(model_dir, prompts, lens, args, eager)
            systems.append(("batchgen", config, wall, sum(lens)))
            print(f"  batchgen {config}: {wall:.2f} s", flush=True)
        hf, k = h.load_hf_model(model_dir, h.DTYPES[args.dtype], args.device), args.hf_prompts
        systems.append(("HF generate", f"sdpa, batch {args.hf_batch_size}, first {k} prompts",
                        run_hf_generate(hf, prompts[:k], lens[:k], args), sum(lens[:k])))
        k = args.gb_prompts
        systems.append(("HF generate_batch", f"first {k} prompts",
                        run_generate_batch(hf, prompts[:k], lens[:k], args.device), sum(lens[:k])))
        hf = None
        probe = decode_probe(llm, args, n_params)
    h.table(["system", "config", "wall s", "output tok/s"],
            [[s, c, f"{w:.2f}", f"{n / w:.0f}"] for s, c, w, n in systems])
    best = max(n / w for s, _, w, n in systems if s == "batchgen")
    bars = [[f"batchgen / {s}", f"{best * w / n:.2f}x", f">= {bar:g}x",
             "pass" if best * w / n >= bar else "FAIL"]
            for s, _, w, n in systems for name, bar in BARS.items() if s == name]
    frac = probe["fraction_of_copy"]
    bars.append([f"decode at batch {args.probe_batch}: bytes read / step time",
                 f"{probe['achieved_bytes_s'] / 1e9:.0f} GB/s = {100 * frac:.0f}% of copy "
                 f"({probe['copy_bytes_s'] / 1e9:.0f} GB/s)", ">= 60%",
                 "pass" if frac >= 0.6 else "FAIL"])
    h.table(["measure", "value", "bar", ""], bars)
    results = [{"system": s, "config": c, "wall_s": w, "output_tokens": n, "output_tok_s": n / w}
               for s, c, w, n in systems]
    return h.finish(args, info, {"results": results, "probe": probe, "bars": bars,
                                 "n_params": n_params})


if __name__ == "__main__":
    main()
