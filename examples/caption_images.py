"""Caption a folder of images to Parquet with a vision-language model: one prompt per image,
streamed (the processor runs as the batch needs prompts), written as rows of (path, caption,
tokens). Arguments: an image folder and a model folder; without them, 12 random PNGs and a
tiny random Qwen2.5-VL are made here (the captions are then noise, the mechanics are real).
A second pass with the same images and another question shows the prefix cache keying blocks
by image: the image blocks are hit, and the outputs are those of a cold run."""

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from batchgen import LLM, SamplingParams
from batchgen.tools.make_tiny_vlm import IMAGE_PLACEHOLDER, make_tiny_vlm

IMAGE = IMAGE_PLACEHOLDER["qwen2_5_vl"]  # the model's own placeholder text for one image


def sample_images(folder: Path, n: int = 12) -> Path:
    """n random RGB PNGs of a few sizes (a stand-in for a real folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        h, w = (16, 16) if i % 3 else (24, 32)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
            folder / f"img_{i:02d}.png")
    return folder


def caption(llm: LLM, paths: list[Path], question: str, out: Path) -> list[list[int]]:
    """Caption every image (streamed: outputs arrive as requests finish) into `out`."""
    prompts = ({"prompt": f"{IMAGE}{question}", "multi_modal_data": {"image": str(p)},
                "multi_modal_uuids": {"image": str(p.resolve())}} for p in paths)
    rows: dict[int, dict] = {}
    for i, o in llm.generate_stream(prompts, SamplingParams(temperature=0, max_tokens=24),
                                    use_tqdm=False):
        rows[i] = {"path": str(paths[i]), "caption": o.outputs[0].text,
                   "num_prompt_tokens": len(o.prompt_token_ids),
                   "token_ids": o.outputs[0].token_ids}
    table = pa.Table.from_pylist([rows[i] for i in range(len(paths))])
    pq.write_table(table, out)
    return [rows[i]["token_ids"] for i in range(len(paths))]


def main(images: Path, model: str) -> None:
    paths = sorted(p for p in images.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    llm = LLM(model, block_size=4, max_num_seqs=8)
    first = caption(llm, paths, " Describe the image.", Path("captions.parquet"))
    table = pq.read_table("captions.parquet")
    print(f"captioned {table.num_rows} images -> captions.parquet "
          f"({sum(table['num_prompt_tokens'].to_pylist())} prompt tokens)")
    print(f"first: {table['path'][0].as_py()} -> {table['caption'][0].as_py()!r}")
    again = caption(llm, paths, " What colours are there?", Path("colours.parquet"))
    hits = llm.kv_stats().prefix_hit_tokens
    cold = LLM(model, block_size=4, max_num_seqs=8, enable_prefix_caching=False)
    same = caption(cold, paths, " What colours are there?", Path("colours_cold.parquet"))
    print(f"second question: {hits} prompt tokens from the prefix cache (the images' blocks)")
    print(f"outputs equal a run without the cache: {again == same}")
    print(f"first pass and second differ: {first != again}")


if __name__ == "__main__":
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else sample_images(Path("images"))
    model_dir = sys.argv[2] if len(sys.argv) > 2 else str(make_tiny_vlm("tiny-qwen2_5_vl",
                                                                        "qwen2_5_vl"))
    main(folder, model_dir)
