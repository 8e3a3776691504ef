#!/usr/bin/env bash
# Fetch the released nemo-gym 0.7.0 wheel that tests/test_gym_release*.py run against, into
# ${ROLLOUT_LEDGER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-ledger}/nemo-gym-wheel
# (outside the clone), check its SHA-256 and unpack it under extracted/.  The wheel requires
# Python >= 3.13.14 to install; it is never installed: its nemo_gym.token_id_capture package is
# pure Python and the tests import it from extracted/.  A warm cache is reused (no network).
# Exit status 0 when the release is ready, non-zero when it cannot be fetched.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3

CACHE="${ROLLOUT_LEDGER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-ledger}"
DIR="$CACHE/nemo-gym-wheel"
WHEEL="$DIR/nemo_gym-0.7.0-py3-none-any.whl"
SHA256=cce78fc3fd048f36b4c465fe8e9fe3cc5e7afb6f6e287bfe831f156988508a70
mkdir -p "$DIR"

if [ ! -f "$WHEEL" ]; then
  echo "==> downloading nemo-gym 0.7.0 into $DIR"
  "$python" -m pip download nemo-gym==0.7.0 --no-deps --python-version 3.13.14 \
    --only-binary=:all: -d "$DIR" -q --disable-pip-version-check
fi
echo "$SHA256  $WHEEL" | sha256sum -c --quiet - || {
  echo "FAIL: $WHEEL is not the published nemo-gym 0.7.0 wheel (SHA-256 mismatch)" >&2
  exit 1
}
"$python" - "$WHEEL" "$DIR/extracted" <<'PY'
import os, sys, zipfile
from pathlib import Path

wheel, target = Path(sys.argv[1]), Path(sys.argv[2])
if not (target / "nemo_gym" / "token_id_capture" / "__init__.py").is_file():
    partial = target.with_name(f"extracted.partial-{os.getpid()}")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(partial)
    try:
        partial.rename(target)
    except OSError:  # another run unpacked it first
        pass
print(f"nemo-gym 0.7.0 ready in {target}")
PY
