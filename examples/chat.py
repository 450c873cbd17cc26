"""A short multi-turn chat through `llm.chat`: three greedy turns that keep the conversation, then
three seeded samples for one more question. Argument: a model folder; without one, the demo
model (SmolLM2-135M-Instruct, made once; else a tiny random model)."""

import sys

from batchgen import LLM, SamplingParams
from batchgen.tools.demo_model import demo_model

QUESTIONS = ["What is the capital of France?", "What is 2+2?", "Write a haiku about the sea."]


def main(model_dir: str) -> None:
    llm = LLM(model_dir, kv_cache_memory=256 << 20)  # a small pool: starts in a second
    greedy = SamplingParams(temperature=0, max_tokens=48)
    conversation = []
    for question in QUESTIONS:
        conversation.append({"role": "user", "content": question})
        answer = llm.chat(conversation, greedy, use_tqdm=False)[0].outputs[0].text.strip()
        conversation.append({"role": "assistant", "content": answer})
        print(f"user:      {question}")
        print("assistant: " + answer.replace("\n", "\n           ") + "\n")

    question = "Give me a name for a pet goldfish."
    samples = llm.chat([{"role": "user", "content": question}],
                       SamplingParams(n=3, temperature=0.8, max_tokens=24, seed=0),
                       use_tqdm=False)[0].outputs
    print(f"user:      {question}   (3 samples, temperature 0.8, seed 0)")
    for c in samples:
        print(f"sample {c.index}:  " + c.text.strip().replace("\n", " "))


if __name__ == "__main__":
    main(demo_model(sys.argv[1] if len(sys.argv) > 1 else None))
