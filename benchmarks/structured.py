"""Structured outputs: what constraints cost, and whether they hold on a real model.

The same JSON job unconstrained and under a schema in interleaved rounds (tok/s, the mask's time
per step); ``--check``: every finished sample and beam under a JSON schema, a regex and a choice
must satisfy it (else exit 1).

    PYTHONPATH=. python benchmarks/structured.py --model smollm2 --check
"""

import json
import re
import sys

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen import StructuredOutputsParams as S
from benchmarks import common as h

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
ASK = {"json": ("Describe {} as a JSON object with the keys name, age and city.", PEOPLE),
       "regex": ("On which date (YYYY-MM-DD) was {} born?", PEOPLE),
       "choice": ("Is {} a fruit? Answer yes or no.", THINGS)}


def prompts(llm, kind: str, count: int) -> list[dict[str, list[int]]]:
    ask, names = ASK[kind]
    texts = [ask.format(names[i % len(names)]) + ("" if i < len(names) else f" ({i})")
             for i in range(count)]
    return h.token_prompts(h.chat_prompts(llm.get_tokenizer(), texts))


def constraint(kind: str, max_whitespace: int):
    if kind == "json":
        return S(json=SCHEMA, max_whitespace=max_whitespace)
    return S(regex=REGEX) if kind == "regex" else S(choice=CHOICES)


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return bool(re.fullmatch(REGEX, text)) if kind == "regex" else text in CHOICES


def throughput(llm, args) -> dict:
    """The same job unconstrained and under the schema: tok/s and mask ms per step."""
    ps, masks = prompts(llm, "json", args.num_prompts), {}

    def job(name: str, so) -> h.Contender:
        sp = SamplingParams(n=args.n, temperature=0.7, max_tokens=args.bench_tokens, seed=0,
                            structured_outputs=so)

        def run() -> int:
            before = h.grammar_timers(llm)
            outs = llm.generate(ps, sp, use_tqdm=False)
            masks.setdefault(name, []).append([b - a for a, b in zip(before,
                                                                      h.grammar_timers(llm))])
            return sum(len(c.token_ids) for o in outs for c in o.outputs)
        return h.Contender(name, run)

    jobs = [job("unconstrained", None), job("json schema", constraint("json",
                                                                       args.max_whitespace))]
    best = {}
    for c, (tokens, walls) in zip(jobs, h.interleaved_repeats(jobs, args.repeats)):
        i = walls.index(min(walls))
        secs, steps = masks[c.system][i]
        best[c.system] = {"seconds": walls[i], "tokens": tokens, "tok_s": tokens / walls[i],
                          "mask_ms_per_step": 1e3 * secs / max(steps, 1), "masked_steps": steps,
                          "ms_per_step": 1e3 * walls[i] / (args.bench_tokens + 1)}
    best["ratio"] = {"constrained_over_unconstrained":
                     best["json schema"]["tok_s"] / best["unconstrained"]["tok_s"]}
    return best


def check(llm, args) -> dict:
    report = {}
    for kind in ASK:
        ps, so = prompts(llm, kind, args.num_prompts), constraint(kind, args.max_whitespace)
        sp = SamplingParams(n=4, temperature=0.7, max_tokens=args.max_tokens, seed=1,
                            structured_outputs=so)
        samples = [c for o in llm.generate(ps, sp, use_tqdm=False) for c in o.outputs]
        bp = BeamSearchParams(beam_width=4, max_tokens=args.max_tokens, structured_outputs=so)
        beams = [s for o in llm.beam_search(ps, bp, use_tqdm=False) for s in o.sequences]
        for name, outs in (("samples n=4", samples), ("beams w=4", beams)):
            done = [c for c in outs if c.finish_reason == "stop"]
            bad = [c.text for c in done if not valid(kind, c.text)]
            report[f"{kind} / {name}"] = {
                "outputs": len(outs), "finished": len(done),
                "finish_rate": len(done) / max(len(outs), 1), "violations": len(bad),
                "violating": bad[:3], "examples": [c.text for c in done[:2]]}
    return report


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, run={"repeats": 2, "device": None})
    p.add_argument("--model", default="smollm2", help="a folder, 'smollm2' or 'tiny'")
    h.add_ints(p, num_prompts=36, n=4, max_tokens=96, bench_tokens=24, max_whitespace=16)
    p.add_argument("--check", action="store_true", help="also check every constraint holds")
    args = h.check_args(p, p.parse_args(argv))
    info = h.start(args)
    llm = LLM(h.resolve_model(args.model), max_num_seqs=256)
    result, ok = {}, True
    t = result["throughput"] = throughput(llm, args)
    h.table(["job", "output tokens", "s", "tok/s", "ms / step (approx.)", "mask ms / step"],
            [[name, r["tokens"], f"{r['seconds']:.2f}", f"{r['tok_s']:.1f}",
              f"{r['ms_per_step']:.1f}", f"{r['mask_ms_per_step']:.3f}" if r["masked_steps"]
              else "-"] for name, r in t.items() if name != "ratio"])
    print(f"constrained / unconstrained tok/s: {t['ratio']['constrained_over_unconstrained']:.2f}x")
    if args.check:
        c = result["check"] = check(llm, args)
        h.table(["constraint / outputs", "outputs", "finished", "finish rate", "violations"],
                [[name, r["outputs"], r["finished"], f"{100 * r['finish_rate']:.0f}%",
                  r["violations"]] for name, r in c.items()])
        for name, r in c.items():
            print(f"{name}: e.g. {r['examples'][:1]}"
                  + (f"; VIOLATING {r['violating']}" if r["violations"] else ""))
        ok = all(r["violations"] == 0 for r in c.values())
    h.finish(args, info, result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
