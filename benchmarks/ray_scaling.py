"""Ray Data scale-out: the same dataset job locally (`generate_dataset`, one process) and on a
local Ray with 1 and 2 actors (`batchgen.ray`), on the same rows, in one run.

Every Ray run starts from a fresh Ray (`ray.init` ... `ray.shutdown`) and is timed from handing
the dataset to the processor until every output row is back on the driver: actor start-up
(each actor loads its own `LLM`) is part of the Ray figures, since a Ray job pays it. The Ray
overhead is (1 actor) - (local) wall time; the bar of issue 12 is that 2 actors are not slower
than 1 by more than that overhead. Outputs must be identical across the three (same row seeds).

Each Ray actor gets `--cpus-per-actor` logical CPUs, and Ray sets its torch/OpenMP threads to
that; the local run is given the same number of torch threads, so "local" vs "1 actor" is the
same compute with and without Ray, and outputs compare bit for bit (a different thread count
changes logprobs' last bits, never tokens). Model load is excluded from the local figure and
included in the Ray ones (an actor loads its model inside the job); both are reported.

    PYTHONPATH=. python benchmarks/ray_scaling.py --json /tmp/ray_scaling.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import datasets  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import machine_info, machine_line, markdown_table, write_json  # noqa: E402

WORDS = "the a cat dog runs jumps over under blue red green house tree river".split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=50, help="rows per actor call")
    p.add_argument("--actors", default="1,2", help="actor counts to run")
    p.add_argument("--cpus-per-actor", type=float, default=1.0)
    p.add_argument("--model", default=None,
                   help="model folder (default: a random Llama of --model-size)")
    p.add_argument("--model-size", choices=["bench", "tiny"], default="bench",
                   help="bench: the benchmarks' shape (hidden 256, 4 layers, vocab 4096); "
                        "tiny: the test models' (fast)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def make_rows(count: int) -> datasets.Dataset:
    return datasets.Dataset.from_list([
        {"prompt": " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(4 + i % 12)),
         "k": i} for i in range(count)])


def run_local(model: str, data: datasets.Dataset, params) -> tuple[float, float, list[dict]]:
    from batchgen import LLM
    from batchgen.data import generate_dataset

    t0 = time.perf_counter()
    llm = LLM(model, device="cpu")
    t1 = time.perf_counter()  # (torch threads: set by main to the actors' count)
    out = generate_dataset(llm, data, params, seed=0, use_tqdm=False).to_list()
    return time.perf_counter() - t1, t1 - t0, out


def run_ray(model: str, data: datasets.Dataset, params, actors: int, args
            ) -> tuple[float, float, list[dict]]:
    import ray

    from batchgen.ray import BatchgenProcessorConfig, build_processor, numbered_blocks

    t0 = time.perf_counter()
    cpus = max(os.cpu_count() or 1, int(actors * args.cpus_per_actor) + 1)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        t1 = time.perf_counter()
        config = BatchgenProcessorConfig(model, params, engine_kwargs={"device": "cpu"},
                                         seed=0, batch_size=args.batch_size, concurrency=actors,
                                         num_cpus=args.cpus_per_actor)
        blocks = numbered_blocks(data, args.batch_size)
        ds = build_processor(config)(ray.data.from_arrow(blocks))
        out = sorted(ds.take_all(), key=lambda r: r["row_id"])
        return time.perf_counter() - t1, t1 - t0, out
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from batchgen import SamplingParams
    from batchgen.tools.make_tiny_model import make_tiny_model
    from benchmarks.common import quiet_logging

    quiet_logging()
    model = args.model
    if model is None:
        from batchgen.cli.bench import RANDOM_MODEL, RANDOM_VOCAB

        model = str(make_tiny_model(
            Path(os.environ.get("TMPDIR", "/tmp")) / f"batchgen-ray-bench-{args.model_size}",
            eos_boost=0.06, **({} if args.model_size == "tiny" else {
                **RANDOM_MODEL, "vocab_size": RANDOM_VOCAB})))
    data = make_rows(args.rows)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens)
    # The local run gets an actor's threads: the same arithmetic (GEMM reductions split by
    # thread count change logprobs' last bits, never tokens) and the same compute as 1 actor.
    torch.set_num_threads(max(1, int(args.cpus_per_actor)))
    local_s, local_load_s, local = run_local(model, data, params)
    tokens = sum(len(s["token_ids"]) for r in local for s in r["outputs"])
    results = [{"system": "local generate_dataset", "actors": 0, "wall_s": local_s,
                "startup_s": local_load_s, "identical": True}]
    for actors in [int(a) for a in args.actors.split(",")]:
        wall, init_s, out = run_ray(model, data, params, actors, args)
        results.append({"system": f"Ray Data, {actors} actor{'s' * (actors > 1)}",
                        "actors": actors, "wall_s": wall, "startup_s": init_s,
                        "identical": out == local})
    one = next((r for r in results if r["actors"] == 1), None)
    overhead = one["wall_s"] - local_s if one else None
    rows = [[r["system"], f"{r['wall_s']:.2f}", f"{tokens / r['wall_s']:,.0f}",
             f"{r['startup_s']:.2f}", "yes" if r["identical"] else "NO"] for r in results]
    print(f"{args.rows} rows, n={args.n}, max_tokens {args.max_tokens}, {tokens} output tokens")
    print(markdown_table(["system", "wall s (job)", "output tok/s", "start-up s (load / "
                          "ray.init)", "rows identical to local"], rows))
    two = next((r for r in results if r["actors"] == 2), None)
    if one and two:
        print(f"Ray overhead (1 actor - local): {overhead:.2f} s; 2 actors - 1 actor: "
              f"{two['wall_s'] - one['wall_s']:+.2f} s; bar (2 actors not slower than 1 by "
              f"more than the overhead): {'met' if two['wall_s'] - one['wall_s'] <= overhead else 'NOT met'}")
    info = machine_info("cpu")
    print(machine_line(info))
    payload = {"machine": info, "args": vars(args), "output_tokens": tokens,
               "results": results, "ray_overhead_s": overhead}
    if args.json:
        write_json(args.json, payload)
    if not all(r["identical"] for r in results):
        print("ERROR: Ray outputs differ from the local runner's", file=sys.stderr)
        sys.exit(1)
    return payload


if __name__ == "__main__":
    main()
