"""Images in, text out: batchgen against HF `generate` (batched, left-padded, the same
processor) on a tiny random vision-language model (transformers' own classes, both towers
tiny). Reports images/s and output tok/s end to end, the HF processor's time separately
(in `generate`, every prompt is processed, in the worker threads, before the first step:
bad input is refused before any work), and the greedy agreement of the two systems (EOS
ignored by both, so every row has the same length). Then the overlap: `generate_stream` with
each forward followed by a stand-in device time (`--standin-ms`, a sleep: the GIL is free),
the device's idle share with the processor run ahead in the workers and without (each chunk
processed when the engine pulls it).

    PYTHONPATH=. python benchmarks/vlm.py --family qwen2_5_vl --images 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchgen import LLM, SamplingParams
from batchgen import requests as bg_requests
from batchgen.multimodal import prompt as mm_prompt
from batchgen.multimodal.processor import load_processor
from batchgen.tools.make_tiny_vlm import FAMILIES, IMAGE_PLACEHOLDER, make_tiny_vlm


def images(n: int, seed: int) -> list[Any]:
    """n random RGB images of three sizes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(16, 16), (32, 24), (24, 32)]
    return [Image.fromarray(rng.integers(0, 256, (*sizes[i % 3], 3), dtype=np.uint8))
            for i in range(n)]


def batchgen_run(folder: Path, prompts: list[tuple[str, Any]], max_tokens: int
                 ) -> tuple[list[list[int]], float, float]:
    """(tokens, wall s, of which in the HF processor s) for one generate call."""
    llm = LLM(folder, max_num_seqs=64, block_size=16, num_kv_blocks=4096)
    spent = [0.0]
    process = mm_prompt.ImagePrompts.process

    def timed(self: Any, *args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return process(self, *args, **kw)
        finally:
            spent[0] += time.perf_counter() - t

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in prompts]
    llm.generate(requests[:2], params, use_tqdm=False)  # warm-up
    mm_prompt.ImagePrompts.process = timed
    try:
        t0 = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        mm_prompt.ImagePrompts.process = process
    return [o.outputs[0].token_ids for o in outs], wall, spent[0]


def overlap_run(folder: Path, prompts: list[tuple[str, Any]], max_tokens: int,
                standin_ms: float, ahead: bool) -> tuple[float, float]:
    """(wall s, device-busy s) of a `generate_stream` whose forwards each take `standin_ms`
    more (a device's time); `ahead` False: each chunk processed only when it is pulled."""
    llm = LLM(folder, max_num_seqs=8, block_size=16, num_kv_blocks=4096)
    runner, busy = llm.engine.runner, [0.0]
    execute = runner.execute

    def device(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        out = execute(*a, **kw)
        time.sleep(standin_ms / 1e3)
        busy[0] += time.perf_counter() - t
        return out

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [{"prompt": t, "multi_modal_data": {"image": im}} for t, im in prompts]
    list(llm.generate_stream(iter(requests[:2]), params, use_tqdm=False))  # warm-up
    read_ahead = bg_requests.RequestBuilder._read_ahead
    runner.execute = device
    if not ahead:
        bg_requests.RequestBuilder._read_ahead = lambda self, batches: (
            (b, {}) for b in batches)
    try:
        t0 = time.perf_counter()
        for _ in llm.generate_stream(iter(requests), params, use_tqdm=False):
            pass
        return time.perf_counter() - t0, busy[0]
    finally:
        bg_requests.RequestBuilder._read_ahead = read_ahead


def hf_run(folder: Path, prompts: list[tuple[str, Any]], max_tokens: int, batch: int
           ) -> tuple[list[list[int]], float, float]:
    """(tokens, wall s, processor s): HF generate over left-padded batches."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    model.generation_config.eos_token_id = None  # every row runs max_tokens
    processor = load_processor(folder)
    processor.tokenizer.padding_side = "left"
    out, spent = [], 0.0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        t = time.perf_counter()
        inputs = processor(text=[p for p, _ in chunk], images=[[im] for _, im in chunk],
                           return_tensors="pt", padding=True)
        spent += time.perf_counter() - t
        with torch.inference_mode():
            ids = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=0)
        out += ids[:, inputs["input_ids"].shape[1]:].tolist()
    return out, time.perf_counter() - t0, spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen2_5_vl", choices=FAMILIES)
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--standin-ms", type=float, default=5.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ph = IMAGE_PLACEHOLDER[args.family]
    prompts = [(f"{ph} Describe image {i}.", im) for i, im in enumerate(images(args.images, 0))]
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_vlm(Path(tmp) / args.family, args.family)
        bg, bg_wall, bg_proc = batchgen_run(folder, prompts, args.max_tokens)
        hf, hf_wall, hf_proc = hf_run(folder, prompts, args.max_tokens, args.hf_batch_size)
        overlap = {ahead: overlap_run(folder, prompts, args.max_tokens, args.standin_ms, ahead)
                   for ahead in (True, False)}
    n, toks = len(prompts), len(prompts) * args.max_tokens
    agree = sum(a == b for a, b in zip(bg, hf))
    rows = [("batchgen", bg_wall, bg_proc), (f"HF generate, batch {args.hf_batch_size}",
                                              hf_wall, hf_proc)]
    print(f"{args.family}, tiny random (hidden 64, 2+2 layers), {n} images, "
          f"{args.max_tokens} new tokens each, {args.threads} threads")
    print("| system | wall s | images/s | output tok/s | processor s | processor share |")
    print("|---|---|---|---|---|---|")
    for name, wall, proc in rows:
        print(f"| {name} | {wall:.2f} | {n / wall:.1f} | {toks / wall:.0f} | {proc:.2f} | "
              f"{proc / wall:.0%} |")
    print(f"greedy agreement batchgen vs HF generate (batched): {agree}/{n} prompts")
    print(f"stand-in device, {args.standin_ms:g} ms per forward, generate_stream, "
          "max_num_seqs 8:")
    print("| processor | wall s | device busy s | device idle share |")
    print("|---|---|---|---|")
    for ahead, (wall, busy) in overlap.items():
        name = "ahead, in the workers" if ahead else "when each chunk is pulled"
        print(f"| {name} | {wall:.2f} | {busy:.2f} | {1 - busy / wall:.0%} |")
    if args.json:
        args.json.write_text(json.dumps({
            "family": args.family, "images": n, "agreement": agree,
            "rows": [dict(system=r[0], wall_s=r[1], processor_s=r[2]) for r in rows],
            "overlap": [dict(ahead=a, wall_s=w, busy_s=b) for a, (w, b) in overlap.items()]}))


if __name__ == "__main__":
    main()
