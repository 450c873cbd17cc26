"""LoRA adapters per prompt (issue 43): tokens/s with 0, 1, 4 and 16 adapters against the base
model alone, and against PEFT's mixed-batch `generate(adapter_names=...)` on the same workload;
and the per-step host cost of the adapter sort (`LoRALayers.begin_step`).

Run from the repository root: ``PYTHONPATH=. python benchmarks/lora.py [--prompts 32]``.
Random-weight Llama, rank-8 adapters on every attention and MLP projection (made with peft),
equal-length prompts (no padding for PEFT), EOS ignored so every system makes the same tokens.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def _adapters(model_dir: Path, root: Path, count: int) -> list[Path]:
    import peft
    from transformers import AutoModelForCausalLM

    out = []
    for i in range(count):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        cfg = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        peft.get_peft_model(base, cfg).save_pretrained(root / f"a{i}")
        out.append(root / f"a{i}")
    return out


def _batchgen(model_dir: Path, prompts: list, folders: list[Path], k: int, new: int,
              enable: bool) -> tuple[float, float, int]:
    from batchgen import LLM, SamplingParams
    from batchgen.lora import LoRARequest

    llm = LLM(str(model_dir), enable_lora=enable, max_loras=16, max_lora_rank=8)
    reqs = [LoRARequest(f"a{i}", i + 1, str(f)) for i, f in enumerate(folders[:k])]
    per = [reqs[i % k] if k else None for i in range(len(prompts))] if enable else None
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    sort = [0.0, 0]
    if enable:
        layers = llm.engine.runner.lora
        begin = layers.begin_step

        def timed_begin(rows, batch):
            t = time.perf_counter()
            begin(rows, batch)
            sort[0] += time.perf_counter() - t
            sort[1] += 1
        layers.begin_step = timed_begin
    ids = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(ids[:2], params, lora_request=per[:2] if per else None, use_tqdm=False)
    sort[:] = [0.0, 0]
    t = time.perf_counter()
    outs = llm.generate(ids, params, lora_request=per, use_tqdm=False)
    wall = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new for o in outs)
    return len(prompts) * new / wall, sort[0] / max(sort[1], 1) * 1e6, sort[1]


def _peft(model_dir: Path, prompts: list, folders: list[Path], k: int, new: int) -> float:
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if k == 0:
        model, names = base, None
    else:
        model = peft.PeftModel.from_pretrained(base, folders[0], adapter_name="a0").eval()
        for i in range(1, k):
            model.load_adapter(folders[i], adapter_name=f"a{i}")
        names = [f"a{i % k}" for i in range(len(prompts))]
    ids = torch.tensor(prompts)
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    if names:
        kw["adapter_names"] = names
    with torch.no_grad():
        model.generate(ids[:2], **(kw | ({"adapter_names": names[:2]} if names else {})))
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        wall = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + new
    return len(prompts) * new / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--adapters", default="0,1,4,16")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    from batchgen.tools.make_tiny_model import make_tiny_model

    root = Path(tempfile.mkdtemp())
    model_dir = make_tiny_model(root / "m", family="llama", vocab_size=4096,
                                hidden_size=args.hidden_size,
                                num_hidden_layers=4, num_attention_heads=8,
                                num_key_value_heads=2, intermediate_size=688)
    counts = [int(x) for x in args.adapters.split(",")]
    folders = _adapters(model_dir, root, max(counts))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 4096, (args.prompts, args.prompt_len), generator=g).tolist()
    base_bg, _, _ = _batchgen(model_dir, prompts, folders, 0, args.new, False)
    base_hf = _peft(model_dir, prompts, folders, 0, args.new)
    print(f"base model alone: batchgen {base_bg:.0f} tok/s, HF generate {base_hf:.0f} tok/s")
    rows = []
    print("| adapters | batchgen tok/s | vs base alone | PEFT mixed-batch tok/s | batchgen / PEFT "
          "| sort per step (us) | steps |")
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for k in counts:
        bg, sort_us, steps = _batchgen(model_dir, prompts, folders, k, args.new, True)
        pf = _peft(model_dir, prompts, folders, k, args.new)
        print(f"| {k} | {bg:.0f} | {bg / base_bg:.2f}x | {pf:.0f} | {bg / pf:.2f}x "
              f"| {sort_us:.0f} | {steps} |")
        rows.append({"adapters": k, "batchgen_tok_s": bg, "peft_tok_s": pf, "sort_us": sort_us})
    if args.json:
        args.json.write_text(json.dumps({"base": {"batchgen_tok_s": base_bg,
                                                  "hf_tok_s": base_hf}, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
