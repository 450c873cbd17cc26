"""Builds the FlashInfer kernel modules that scripts/gpu_check.sh's tests and benchmarks use,
several at once, before they run.

FlashInfer JIT-compiles each kernel variant with nvcc on first use, one module after another
as the layers ask for them; on a fresh GPU host that serial compile is most of a device lease.
Here each variant (query dtype, pool dtype, head size, window, softcap, sinks; the MLA latent)
is built by batchgen's own backend constructors in its own process, `--jobs` at a time, into
the JIT cache the later runs load from. Prints one line per variant with its wall time.

    python scripts/gpu_warmup.py --jobs 6      # on a CUDA host with FlashInfer importable
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (name, head_dim, pool dtype, window, softcap, sinks) for FlashInferBackend; "mla" for the
# latent. The tests' models: head 128 (the backend-vs-torch test), head 64 (the families'
# greedy runs, graphs, fp8 pool, the 1B benchmark), GPT-OSS's sinks, DeepSeek-V3's latent.
VARIANTS: list[tuple[str, int, str, int | None, float | None, bool]] = [
    ("hd128", 128, "bfloat16", None, None, False),
    ("hd128-window", 128, "bfloat16", 24, None, False),
    ("hd128-softcap", 128, "bfloat16", None, 30.0, False),
    ("hd64", 64, "bfloat16", None, None, False),
    ("hd64-window-softcap", 64, "bfloat16", 24, 50.0, False),
    ("hd64-softcap", 64, "bfloat16", None, 50.0, False),
    ("hd64-sinks-window", 64, "bfloat16", 24, None, True),
    ("hd64-sinks", 64, "bfloat16", None, None, True),
    ("hd64-fp8-pool", 64, "float8_e4m3fn", None, None, False),
    ("mla-576", 576, "bfloat16", None, None, False),
]


def build(variant: tuple[str, int, str, int | None, float | None, bool],
          device: str = "cuda") -> tuple[str, float]:
    """Make the backend for one variant on a one-block pool (its constructor builds and runs
    every kernel module it needs); returns the variant's name and seconds taken."""
    import flashinfer
    import torch

    from batchgen.attention.flashinfer_backend import FlashInferBackend
    from batchgen.attention.flashinfer_mla import FlashInferMlaBackend
    from batchgen.attention.spec import AttentionSpec
    from batchgen.kv.cache import KVCache

    name, d, pool, window, softcap, sinks = variant
    t0 = time.perf_counter()
    dev = torch.device(device)
    if name.startswith("mla"):
        cache = KVCache(1, 4, 16, 1, d, torch.bfloat16, dev, head_dim_v=512, v_in_k=True)
        spec = AttentionSpec(16, 1, d, 512, 0.1, None, None, torch.bfloat16)
        FlashInferMlaBackend([spec], cache, 64, fi=flashinfer)
    else:
        cache = KVCache(1, 4, 16, 2, d, getattr(torch, pool), dev)
        spec = AttentionSpec(8, 2, d, d, d ** -0.5, window, softcap, torch.bfloat16,
                             sinks=torch.zeros(8, device=dev) if sinks else None)
        FlashInferBackend([spec], cache, 64, fi=flashinfer)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return name, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=6, help="variants built at once (processes)")
    args = p.parse_args()
    t0, failed = time.perf_counter(), 0
    ctx = multiprocessing.get_context("spawn")  # CUDA in every child, none in the parent
    with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        futures = {pool.submit(build, v): v[0] for v in VARIANTS}
        for f in as_completed(futures):
            try:
                name, s = f.result()
                print(f"gpu_warmup: {name}: built in {s:.1f} s", flush=True)
            except Exception as e:  # the test that needs it reports it again, in full
                failed += 1
                print(f"gpu_warmup: {futures[f]}: FAILED: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}", flush=True)
    print(f"gpu_warmup: {len(VARIANTS) - failed}/{len(VARIANTS)} variants in "
          f"{time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
