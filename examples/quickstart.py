"""Quickstart: greedy generation, n samples per prompt, a stop string and a chat turn from a
local model. Argument: a model folder; without one, the demo model (SmolLM2-135M-Instruct, made
once; else a tiny random model)."""

import sys

from batchgen import LLM, SamplingParams
from batchgen.tools.demo_model import demo_model


def main(model_dir: str) -> None:
    llm = LLM(model_dir, block_size=16)
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]

    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    for out in greedy:
        c = out.outputs[0]
        print(f"{out.prompt!r} -> {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")

    samples = llm.generate(prompts[:1], SamplingParams(n=4, temperature=0.8, top_p=0.95,
                                                       max_tokens=16, seed=1))
    for c in samples[0].outputs:
        print(f"sample {c.index}: {c.text!r} logprob={c.cumulative_logprob:.2f}")

    stopped = llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=32, stop=["e"]))
    print(f"stop at 'e': {stopped[0].outputs[0].text!r} ({stopped[0].outputs[0].stop_reason!r})")
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=16, logprobs=1))
    first = chat[0].outputs[0].logprobs[0]
    print(f"chat: {chat[0].outputs[0].text!r}; first token {first}")
    print(llm.kv_stats())


if __name__ == "__main__":
    main(demo_model(sys.argv[1] if len(sys.argv) > 1 else None))
