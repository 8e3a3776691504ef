"""Optional token decoding for the audit page: a Hugging Face ``tokenizer.json`` read with the
``tokenizers`` package (``pip install 'rollout-ledger[ui]'``).  Without one the page shows ids.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

TOKENIZER_ENV = "ROLLOUT_LEDGER_TOKENIZER"


class TokenizerError(ValueError):
    """The tokenizer file cannot be used; the message says what to do."""


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...

    def piece(self, token_id: int) -> str: ...


class HFDecoder:
    """Decodes with a ``tokenizers.Tokenizer`` loaded from a ``tokenizer.json``."""

    def __init__(self, tokenizer: Any, source: str) -> None:
        self._tok = tokenizer
        self.source = source
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        known = [i for i in ids if 0 <= i < self.vocab_size]
        if len(known) != len(ids):
            return "".join(self.piece(i) for i in ids)
        text: str = self._tok.decode(list(ids), skip_special_tokens=False)
        return text

    def piece(self, token_id: int) -> str:
        """One token as text (a lone part of a multi-byte character shows as U+FFFD)."""
        if not 0 <= token_id < self.vocab_size:
            return f"<id {token_id} outside the vocabulary>"
        text: str = self._tok.decode([token_id], skip_special_tokens=False)
        return text


def load_tokenizer(path: str | Path) -> HFDecoder:
    """Load ``tokenizer.json`` (a file, or a directory that holds one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise TokenizerError(
            f"no tokenizer file at {p}: pass the path of a Hugging Face tokenizer.json"
        )
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(
            "decoding tokens needs the 'tokenizers' package: pip install 'rollout-ledger[ui]'"
        ) from None
    try:
        tok = tokenizers.Tokenizer.from_file(str(p))
    except Exception as exc:
        raise TokenizerError(
            f"{p} is not a tokenizer.json the tokenizers package reads: {exc}"
        ) from None
    return HFDecoder(tok, str(p))


def tokenizer_from_env() -> HFDecoder | None:
    """The tokenizer named by ``ROLLOUT_LEDGER_TOKENIZER``, or None when unset."""
    path = os.environ.get(TOKENIZER_ENV, "").strip()
    return load_tokenizer(path) if path else None
