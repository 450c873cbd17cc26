"""Structured outputs: a JSON schema over a small dataset (n=4 samples per row) and a beam
search under a regex (needs the `batchgen[structured]` extra: xgrammar).

Every finished sample is a JSON object valid under the schema (the `valid` flag of each output
says so: it finished and its text parses); every returned beam matches the regex in full.

    python examples/structured_outputs.py [MODEL_DIR]

Without MODEL_DIR it uses SmolLM2-135M-Instruct when it is there (or can be made), else a tiny
random model, whose JSON is well formed but meaningless.
"""

from __future__ import annotations

import json
import re
import sys

import datasets

from batchgen import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from batchgen.data import generate_dataset
from batchgen.tools.demo_model import demo_model

NAME = {"type": "string", "pattern": "^[A-Za-z .'-]{1,30}$"}  # bounded: a small model stops
SCHEMA = {"type": "object",
          "properties": {"city": NAME, "country": NAME, "population_millions": {"type": "number"}},
          "required": ["city", "country", "population_millions"]}
CITIES = ["Paris", "Tokyo", "Nairobi", "Lima", "Oslo", "Cairo"]
DATE = r"(1[0-9]|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
EVENTS = ["the first Moon landing", "the fall of the Berlin Wall", "the founding of the UN"]


def chat_ids(llm: LLM, question: str) -> list[int]:
    """The question through the model's chat template, as token ids."""
    return list(llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True,
        return_dict=False))


def json_over_dataset(llm: LLM) -> None:
    """n=4 JSON samples per row; every finished one is valid under SCHEMA."""
    rows = [{"city": c, "prompt_token_ids": chat_ids(
        llm, f"Give {c}'s city name, country and population in millions as JSON.")}
        for c in CITIES]
    params = SamplingParams(n=4, temperature=0.7, max_tokens=120, seed=0,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    ds = generate_dataset(llm, datasets.Dataset.from_list(rows), params,
                          prompt_column="prompt_token_ids", use_tqdm=False)
    outs = [o for row in ds["outputs"] for o in row]
    valid = [o for o in outs if o["valid"]]
    print(f"JSON schema: {len(ds)} rows x n=4 samples, {len(valid)}/{len(outs)} finished "
          f"and valid (the rest hit max_tokens)")
    for o in valid:
        value = json.loads(o["text"])
        assert set(SCHEMA["required"]) <= set(value), o["text"]
    for row, city in zip(ds["outputs"][:2], CITIES):
        print(f"  {city}: {row[0]['text']!r}")


def beams_under_regex(llm: LLM) -> None:
    """A width-4 beam search whose every returned beam is a date."""
    prompts = [{"prompt_token_ids": chat_ids(llm, f"On which date (YYYY-MM-DD) was {e}?")}
               for e in EVENTS]
    params = BeamSearchParams(beam_width=4, max_tokens=16,
                              structured_outputs=StructuredOutputsParams(regex=DATE))
    for event, out in zip(EVENTS, llm.beam_search(prompts, params, use_tqdm=False)):
        for s in out.sequences:
            assert s.finish_reason == "length" or re.fullmatch(DATE, s.text), s.text
        print(f"beam search under a regex, {event}: "
              + ", ".join(f"{s.text} ({s.score:.2f})" for s in out.sequences))
    print("every returned beam matches the regex")


def main(model: str | None = None) -> None:
    llm = LLM(demo_model(model), max_num_seqs=64)
    json_over_dataset(llm)
    beams_under_regex(llm)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
