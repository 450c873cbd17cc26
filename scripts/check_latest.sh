#!/usr/bin/env bash
# Tries tomorrow's transformers on purpose, outside the pins: a side venv (.venv-latest) with
# everything else as CI has it (scripts/constraints.txt) but the newest transformers (or
# TRANSFORMERS_SPEC, e.g. "transformers==5.26.0"), then the family matrix and the HF-parity
# tests, state mixers allowed (BATCHGEN_UNVERIFIED_TRANSFORMERS=1). Prints which families are
# new to the matrix, which pass and which fail, as a markdown block; `--record` also writes it
# into docs/families.md (between its check_latest markers). .venv is not touched.
#
#   bash scripts/check_latest.sh            # ~10 minutes on 2 cores
#   TRANSFORMERS_SPEC=transformers==5.25.0 bash scripts/check_latest.sh --record
#
# A clean run is what allows raising the verified range (batchgen/model/versions.py VERIFIED,
# pyproject.toml's bound) and the pin; then run the whole suite under the new pins.
set -uo pipefail
cd "$(dirname "$0")/.."
venv=${LATEST_VENV:-.venv-latest}
spec=${TRANSFORMERS_SPEC:-transformers}
out=$(mktemp -d)
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
# the pins, less transformers and what moves with it
grep -v -i -E '^(transformers|huggingface[-_]hub|tokenizers|safetensors|kernels|hf-xet)==' \
  scripts/constraints.txt > "$out/pins.txt"
python -m pip install -q -c "$out/pins.txt" -e ".[test-core]" || exit 1
# past pyproject's bound on purpose: pip's conflict warning is expected here
python -m pip install -q --upgrade "$spec" 2>&1 | grep -v -i "incompatible\|requires transformers"
version=$(python -c "import transformers; print(transformers.__version__)")
echo "check_latest: transformers $version in $venv"
export HF_HUB_OFFLINE=1 BATCHGEN_UNVERIFIED_TRANSFORMERS=1
tests=(tests/test_families.py tests/test_hybrid_models.py tests/test_generate_hf.py
       tests/test_beam_search.py tests/test_beam_controls.py tests/test_group_beam_search.py)
python -m pytest -q -p no:cacheprovider --junitxml="$out/junit.xml" "${tests[@]}" \
  > "$out/pytest.log" 2>&1
rc=$?
tail -3 "$out/pytest.log"
python scripts/check_latest_report.py "$out/junit.xml" "$version" "$@"
exit "$rc"
