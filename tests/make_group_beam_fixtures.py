"""Write tests/fixtures/group_beam_search.json: transformers 4.55.4's diverse (group) beam search
on the test suite's tiny models, the oracle of tests/test_group_beam_search.py.

transformers 5 removed ``num_beam_groups`` / ``diversity_penalty`` from ``generate``, so the
reference outputs come from transformers 4.55.4 run once in a side virtual environment. The
script runs in two stages:

1. in the project's environment (transformers 5): build each tiny model exactly as the test does
   (``make_tiny_model(dir, family, eos_boost=EOS_BOOST)``, deterministic) and the prompts
   (``make_prompt_token_ids`` with the test's seed), into a temporary folder;
2. in the side environment (``--python``, transformers 4.55.4): load those folders and run
   ``generate(num_beams=W, num_beam_groups=G, diversity_penalty=d, ...)`` for every case, and
   write the hypotheses' generated token ids (EOS kept), ``sequences_scores``, and each prompt's
   first-step top log-probs (the test recomputes them under transformers 5, proving that both
   saw the same weights).

Regenerate (a few minutes on a CPU; torch's CPU wheel is installed from /opt/wheels here)::

    python -m venv /tmp/tf455
    /tmp/tf455/bin/pip install torch==2.13.0 transformers==4.55.4 safetensors
    source .venv/bin/activate
    python tests/make_group_beam_fixtures.py --python /tmp/tf455/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "group_beam_search.json"
FAMILIES = ["llama", "qwen3", "gemma2"]
EOS_BOOST = 0.2
PROMPTS = dict(n=3, min_len=2, max_len=20, vocab_size=512, seed=7, include_lengths=(16,))
MAX_TOKENS = 8
# name -> BeamSearchParams fields (HF: num_beams, length_penalty, early_stopping, ...)
CASES: dict[str, dict[str, Any]] = {
    "w4g2": dict(beam_width=4, num_beam_groups=2, diversity_penalty=1.0),
    "w6g3-lp2-es": dict(beam_width=6, num_beam_groups=3, diversity_penalty=0.5,
                        length_penalty=2.0, early_stopping=True, num_return_sequences=4),
    "w4g4-never": dict(beam_width=4, num_beam_groups=4, diversity_penalty=2.0,
                       early_stopping="never"),
    "w4g2-controls": dict(beam_width=4, num_beam_groups=2, diversity_penalty=0.7,
                          no_repeat_ngram_size=2, repetition_penalty=1.3, min_tokens=3),
}
_HF_NAMES = {"beam_width": "num_beams", "min_tokens": "min_new_tokens"}


def build(work: Path) -> dict[str, Any]:
    """Stage 1 (transformers 5): the model folders and the prompts."""
    sys.path.insert(0, str(ROOT))
    from batchgen.tools.make_tiny_model import make_tiny_model
    from tests.helpers import make_prompt_token_ids

    models = {f: str(make_tiny_model(work / f, family=f, eos_boost=EOS_BOOST)) for f in FAMILIES}
    return {"models": models, "prompts": make_prompt_token_ids(**PROMPTS)}


def oracle(spec: dict[str, Any]) -> dict[str, Any]:
    """Stage 2 (transformers 4.55.4): every case on every family and prompt."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    assert transformers.__version__ == "4.55.4", transformers.__version__
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for fam, path in spec["models"].items():
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32,
                                                     attn_implementation="eager").eval()
        results[fam] = {"first_step_top": [_top(model, p) for p in spec["prompts"]],
                        "cases": {name: [_run(model, p, case) for p in spec["prompts"]]
                                  for name, case in CASES.items()}}
    return results


def _top(model: Any, prompt: list[int]) -> list[list[float]]:
    """The prompt's 5 most likely next tokens and their log-probs."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    v, i = torch.log_softmax(logits, -1).topk(5)
    return [i.tolist(), v.tolist()]


def _run(model: Any, prompt: list[int], case: dict[str, Any]) -> dict[str, Any]:
    """HF group beam search: hypotheses (generated ids, EOS kept) and sequences_scores."""
    import torch

    kw = {_HF_NAMES.get(k, k): v for k, v in case.items()}
    kw.setdefault("num_return_sequences", kw["num_beams"])
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             eos_token_id=2, pad_token_id=0, **kw)
    seqs = []
    for row in out.sequences[:, len(prompt):].tolist():
        seqs.append(row[:row.index(2) + 1] if 2 in row else row)
    return {"token_ids": seqs, "scores": out.sequences_scores.tolist()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", default="/tmp/tf455/bin/python",
                   help="the side environment's python (transformers 4.55.4)")
    p.add_argument("--oracle", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.oracle:  # stage 2, inside the side environment
        spec = json.loads(Path(args.oracle[0]).read_text())
        Path(args.oracle[1]).write_text(json.dumps(oracle(spec)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        spec = build(work)
        (work / "spec.json").write_text(json.dumps(spec))
        subprocess.run([args.python, __file__, "--oracle", str(work / "spec.json"),
                        str(work / "out.json")], check=True)
        results = json.loads((work / "out.json").read_text())
    fixture = {"transformers": "4.55.4", "families": FAMILIES, "eos_boost": EOS_BOOST,
               "prompts": spec["prompts"], "prompt_args": {**PROMPTS, "include_lengths":
                                                            list(PROMPTS["include_lengths"])},
               "max_tokens": MAX_TOKENS, "cases": CASES, "results": results}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
