"""The released nemo-gym 0.7.0, for the tests that run it (``tests/test_gym_release*.py``).

``scripts/fetch-nemo-gym.sh`` downloads the wheel once with
``pip download nemo-gym==0.7.0 --no-deps --python-version 3.13.14 --only-binary=:all:`` (the
wheel requires Python >= 3.13.14 to *install*; it is never installed) into
``$ROLLOUT_LEDGER_CACHE/nemo-gym-wheel`` (default ``~/.cache/rollout-ledger``), outside the
clone, checks its SHA-256 and unpacks it under ``extracted/``.  Its
``nemo_gym.token_id_capture`` package is pure Python and imports on our Python with pydantic and
orjson; ``load()`` puts ``extracted/`` at the end of ``sys.path`` (installed packages win) and
imports it.

Without the wheel the release tests skip, unless ``ROLLOUT_LEDGER_REQUIRE_GYM=1`` (CI), where
they fail.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import os
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

WHEEL_NAME = "nemo_gym-0.7.0-py3-none-any.whl"
WHEEL_SHA256 = "cce78fc3fd048f36b4c465fe8e9fe3cc5e7afb6f6e287bfe831f156988508a70"
REQUIRED = os.environ.get("ROLLOUT_LEDGER_REQUIRE_GYM") == "1"
_MODULES = (
    "records",
    "protocols",
    "fingerprint",
    "lineage",
    "store",
    "builder",
    "sink",
    "terminal",
    "consumer",
    "conformance",
)


def cache_dir() -> Path:
    base = os.environ.get("ROLLOUT_LEDGER_CACHE")
    if base:
        return Path(base) / "nemo-gym-wheel"
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = Path(xdg) if xdg else Path.home() / ".cache"
    return root / "rollout-ledger" / "nemo-gym-wheel"


def _extracted() -> Path | None:
    """The unpacked release (unpacking a cached, checked wheel if needed), or None."""
    directory = cache_dir()
    target = directory / "extracted"
    if (target / "nemo_gym" / "token_id_capture" / "__init__.py").is_file():
        return target
    wheel = directory / WHEEL_NAME
    if not wheel.is_file():
        return None
    if hashlib.sha256(wheel.read_bytes()).hexdigest() != WHEEL_SHA256:
        raise RuntimeError(f"{wheel} does not have the SHA-256 of the published 0.7.0 wheel")
    partial = directory / f"extracted.partial-{os.getpid()}"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(partial)
    with contextlib.suppress(OSError):  # another process unpacked it first
        partial.rename(target)
    return target


@functools.cache
def load() -> SimpleNamespace | None:
    """The release's ``token_id_capture`` modules by short name, or None when not cached."""
    root = _extracted()
    if root is None:
        return None
    if str(root) not in sys.path:
        sys.path.append(str(root))
    modules = {
        name: importlib.import_module(f"nemo_gym.token_id_capture.{name}") for name in _MODULES
    }
    modules["staging_records"] = importlib.import_module(
        "nemo_gym.token_id_capture.staging.records"
    )
    return SimpleNamespace(**modules)


def missing_reason() -> str:
    return f"the nemo-gym 0.7.0 wheel is not cached in {cache_dir()}: run scripts/fetch-nemo-gym.sh"
