"""Structured outputs: what constraints cost, and whether they hold on a real model.

1. **Throughput**: the same job (``--num-prompts`` chat prompts asking for a JSON object,
   ``n=--n`` samples at temperature 0.7, ``--bench-tokens`` tokens, short enough that nearly
   every sample of both runs reaches it, so both run the same steps over the same rows) run
   unconstrained and under a JSON schema, alternately ``--repeats`` times, the fastest of each
   kept. Output tokens/s of each, their ratio, and the grammar's time per step: filling the
   bitmask of the step's constrained rows and applying it (``Grammars.mask_seconds /
   mask_steps``), against the step's whole time.
2. **Check** (``--check``): a JSON schema, a regex and a choice, each over ``--num-prompts``
   prompts, ``n=4`` samples at temperature 0.7 and a width-4 beam search: every finished
   output must satisfy its constraint (parsed and validated against the schema, matched in
   full by the regex, one of the choices). The finish rate (``"stop"`` vs ``max_tokens``) is
   reported; a violation is a failure (exit code 1).

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/structured.py --model smollm2 --check
    PYTHONPATH=. python benchmarks/structured.py --model tiny --num-prompts 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    machine_info,
    machine_line,
    markdown_table,
    quiet_logging,
    resolve_model,
    write_json,
)

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"type": "string"}}, "required": ["name", "age", "city"]}
REGEX = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
CHOICES = ["yes", "no"]
PEOPLE = ["Ada Lovelace", "Alan Turing", "Marie Curie", "Isaac Newton", "Grace Hopper",
          "Albert Einstein", "Charles Darwin", "Nikola Tesla", "Rosalind Franklin",
          "Galileo Galilei", "Leonardo da Vinci", "Jane Austen"]
THINGS = ["an apple", "a carrot", "a banana", "a rock", "a cherry", "a potato", "a lemon",
          "a car", "a grape", "a chair", "a mango", "a spoon"]


def questions(kind: str, count: int) -> list[str]:
    """`count` user messages asking for the constraint's kind of answer."""
    if kind == "json":
        ask = "Describe {} as a JSON object with the keys name, age and city."
        return [ask.format(PEOPLE[i % len(PEOPLE)]) + ("" if i < len(PEOPLE) else f" ({i})")
                for i in range(count)]
    if kind == "regex":
        ask = "On which date (YYYY-MM-DD) was {} born?"
        return [ask.format(PEOPLE[i % len(PEOPLE)]) + ("" if i < len(PEOPLE) else f" ({i})")
                for i in range(count)]
    ask = "Is {} a fruit? Answer yes or no."
    return [ask.format(THINGS[i % len(THINGS)]) + ("" if i < len(THINGS) else f" ({i})")
            for i in range(count)]


def chat(tokenizer: Any, texts: list[str]) -> list[dict[str, Any]]:
    """Each question through the chat template, as token-id prompts."""
    return [{"prompt_token_ids": list(tokenizer.apply_chat_template(
        [{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True,
        return_dict=False))} for t in texts]


def constraint(kind: str, max_whitespace: int | None) -> Any:
    from batchgen import StructuredOutputsParams as S

    if kind == "json":
        return S(json=SCHEMA, max_whitespace=max_whitespace)
    return S(regex=REGEX) if kind == "regex" else S(choice=CHOICES)


def valid(kind: str, text: str) -> bool:
    """Whether a finished output satisfies its constraint."""
    if kind == "json":
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return bool(re.fullmatch(REGEX, text)) if kind == "regex" else text in CHOICES


def throughput(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Output tok/s of the same job unconstrained and under the JSON schema."""
    from batchgen import SamplingParams

    prompts = chat(llm.get_tokenizer(), questions("json", args.num_prompts))
    grammars = llm.requests.grammars
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.repeats):
        for name, so in (("unconstrained", None),
                         ("json schema", constraint("json", args.max_whitespace))):
            sp = SamplingParams(n=args.n, temperature=0.7, max_tokens=args.bench_tokens,
                                seed=0, structured_outputs=so)
            secs0, steps0 = grammars.mask_seconds, grammars.mask_steps
            start = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            el = time.perf_counter() - start
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            steps = grammars.mask_steps - steps0
            row = {"seconds": el, "tokens": tokens, "tok_s": tokens / el,
                   "mask_ms_per_step": 1e3 * (grammars.mask_seconds - secs0) / max(steps, 1),
                   "masked_steps": steps, "ms_per_step": 1e3 * el / (args.bench_tokens + 1)}
            if name not in best or row["tok_s"] > best[name]["tok_s"]:
                best[name] = row
    best["ratio"] = {"constrained_over_unconstrained":
                     best["json schema"]["tok_s"] / best["unconstrained"]["tok_s"]}
    return best


def check(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Every finished sample and beam of each constraint satisfies it; finish rates."""
    from batchgen import BeamSearchParams, SamplingParams

    tok, report = llm.get_tokenizer(), {}
    for kind in ("json", "regex", "choice"):
        prompts = chat(tok, questions(kind, args.num_prompts))
        so = constraint(kind, args.max_whitespace)
        sp = SamplingParams(n=4, temperature=0.7, max_tokens=args.max_tokens, seed=1,
                            structured_outputs=so)
        samples = [c for o in llm.generate(prompts, sp, use_tqdm=False) for c in o.outputs]
        bp = BeamSearchParams(beam_width=4, max_tokens=args.max_tokens, structured_outputs=so)
        beams = [s for o in llm.beam_search(prompts, bp, use_tqdm=False) for s in o.sequences]
        for name, outs in (("samples n=4", samples), ("beams w=4", beams)):
            done = [c for c in outs if c.finish_reason == "stop"]
            bad = [c.text for c in done if not valid(kind, c.text)]
            report[f"{kind} / {name}"] = {
                "outputs": len(outs), "finished": len(done),
                "finish_rate": len(done) / max(len(outs), 1), "violations": len(bad),
                "violating": bad[:3], "examples": [c.text for c in done[:2]]}
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a folder, 'smollm2' or 'tiny'")
    p.add_argument("--num-prompts", type=int, default=36)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96, help="the check's limit")
    p.add_argument("--bench-tokens", type=int, default=24, help="the throughput job's tokens")
    p.add_argument("--max-whitespace", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--check", action="store_true", help="also check every constraint holds")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_logging()
    from batchgen import LLM

    llm = LLM(resolve_model(args.model), max_num_seqs=256)
    info = machine_info("cpu")
    print(machine_line(info))
    result: dict[str, Any] = {"args": vars(args) | {"json": None}, "machine": info}
    if not args.skip_throughput:
        result["throughput"] = throughput(llm, args)
        print_throughput(result["throughput"])
    ok = True
    if args.check:
        result["check"] = check(llm, args)
        ok = print_check(result["check"])
    if args.json:
        write_json(args.json, result)
    return 0 if ok else 1


def print_throughput(t: dict[str, Any]) -> None:
    rows = [[name, f"{r['tokens']}", f"{r['seconds']:.2f}", f"{r['tok_s']:.1f}",
             f"{r['ms_per_step']:.1f}",
             f"{r['mask_ms_per_step']:.3f}" if r["masked_steps"] else "-"]
            for name, r in t.items() if name != "ratio"]
    print(markdown_table(["job", "output tokens", "s", "tok/s", "ms / step (approx.)",
                          "mask ms / step"], rows))
    print(f"constrained / unconstrained tok/s: "
          f"{t['ratio']['constrained_over_unconstrained']:.2f}x")


def print_check(c: dict[str, Any]) -> bool:
    rows = [[name, r["outputs"], r["finished"], f"{100 * r['finish_rate']:.0f}%",
             r["violations"]] for name, r in c.items()]
    print(markdown_table(["constraint / outputs", "outputs", "finished", "finish rate",
                          "violations"], rows))
    for name, r in c.items():
        print(f"{name}: e.g. {r['examples'][:1]}" + (f"; VIOLATING {r['violating']}"
                                                      if r["violations"] else ""))
    return all(r["violations"] == 0 for r in c.values())


if __name__ == "__main__":
    sys.exit(main())
