"""Ray Data scale-out: the same dataset job locally (`generate_dataset`) and on a local Ray with
1 and 2 actors (`batchgen.ray`, 1 CPU each; start-up counted): outputs identical (else exit 1),
and issue 12's bar, 2 actors not slower than 1 by more than the Ray overhead.

    PYTHONPATH=. python benchmarks/ray_scaling.py --json /tmp/ray_scaling.json
"""

import os
import sys
import time
from pathlib import Path

from benchmarks import common as h


def run_ray(model: str, data, params, actors: int, args) -> tuple[float, float, list[dict]]:
    import ray

    from batchgen.ray import BatchgenProcessorConfig, build_processor, numbered_blocks

    t0 = time.perf_counter()
    cpus = max(os.cpu_count() or 1, actors + 1)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        t1 = time.perf_counter()
        config = BatchgenProcessorConfig(model, params, engine_kwargs={"device": "cpu"},
                                         seed=0, batch_size=args.batch_size, concurrency=actors,
                                         num_cpus=1)
        ds = build_processor(config)(ray.data.from_arrow(numbered_blocks(data, args.batch_size)))
        out = sorted(ds.take_all(), key=lambda r: r["row_id"])
        return time.perf_counter() - t1, t1 - t0, out
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> dict:
    import datasets

    from batchgen import LLM, SamplingParams
    from batchgen.cli.bench import RANDOM_MODEL, RANDOM_VOCAB
    from batchgen.data import generate_dataset
    from batchgen.tools.make_tiny_model import make_tiny_model

    p = h.parser(__doc__, run={"repeats": None, "device": None})
    h.add_ints(p, rows=2000, n=4, max_tokens=16, batch_size=50)  # batch: rows per actor call
    p.add_argument("--actors", type=h.int_list, default="1,2", help="actor counts to run")
    p.add_argument("--model-size", choices=["bench", "tiny"], default="bench",
                   help="bench: the benchmarks' shape (hidden 256, 4 layers, vocab 4096); "
                        "tiny: the test models' (fast)")
    args = h.check_args(p, p.parse_args(argv))
    args.threads = args.threads or 1  # an actor's
    info = h.start(args)
    model = str(make_tiny_model(
        Path(os.environ.get("TMPDIR", "/tmp")) / f"batchgen-ray-bench-{args.model_size}",
        eos_boost=0.06, **({} if args.model_size == "tiny" else {
            **RANDOM_MODEL, "vocab_size": RANDOM_VOCAB})))
    data = datasets.Dataset.from_list([{"prompt": s, "k": i} for i, s in enumerate(
        h.sentences(args.rows, 4, 16, seed=0))])
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    llm = LLM(model, device="cpu")
    local_load_s, t0 = time.perf_counter() - t0, time.perf_counter()
    local = generate_dataset(llm, data, params, seed=0, use_tqdm=False).to_list()
    local_s = time.perf_counter() - t0
    tokens = sum(len(s["token_ids"]) for r in local for s in r["outputs"])
    results = [{"system": "local generate_dataset", "actors": 0, "wall_s": local_s,
                "startup_s": local_load_s, "identical": True}]
    for actors in args.actors:
        wall, init_s, out = run_ray(model, data, params, actors, args)
        results.append({"system": f"Ray Data, {actors} actor{'s' * (actors > 1)}",
                        "actors": actors, "wall_s": wall, "startup_s": init_s,
                        "identical": out == local})
    by_actors = {r["actors"]: r["wall_s"] for r in results}
    overhead = by_actors[1] - local_s if 1 in by_actors else None
    print(f"{args.rows} rows, n={args.n}, max_tokens {args.max_tokens}, {tokens} output tokens")
    print(h.markdown_table(
        ["system", "wall s (job)", "output tok/s", "start-up s (load / ray.init)",
         "rows identical to local"],
        [[r["system"], f"{r['wall_s']:.2f}", f"{tokens / r['wall_s']:,.0f}",
          f"{r['startup_s']:.2f}", "yes" if r["identical"] else "NO"] for r in results]))
    if overhead is not None and 2 in by_actors:
        extra = by_actors[2] - by_actors[1]
        print(f"Ray overhead (1 actor - local): {overhead:.2f} s; 2 actors - 1 actor: "
              f"{extra:+.2f} s; bar (2 actors not slower than 1 by more than the overhead): "
              f"{'met' if extra <= overhead else 'NOT met'}")
    payload = h.finish(args, info, {"output_tokens": tokens, "results": results,
                                    "ray_overhead_s": overhead})
    if not all(r["identical"] for r in results):
        print("ERROR: Ray outputs differ from the local runner's", file=sys.stderr)
        sys.exit(1)
    return payload


if __name__ == "__main__":
    main()
