"""A continuation's prompt ids parsed only beyond its rollout's last prompt (issue 12).

The engine's answer carries every prompt id. Parsing them (orjson makes a Python int of each)
and packing them again for the record made each proxied call cost O(context): ~0.3 ms at 16k
prompt tokens, ~2 ms at 100k. A rollout's next prompt almost always starts with its last one,
and the engine writes the same ids as the same text, so when the text of the new prompt ids
starts with the text of the rollout's last prompt ids (up to a comma), those ids are that
prompt's, already parsed and packed: only the rest is parsed.

The cache only saves work; it never decides an id. The answer's other parts are parsed as
before; the resulting ids go through the same extraction and checks; anything the fast path
does not recognise (the key absent or present more than once, a prompt that does not extend
the last one, no last one) parses the answer whole.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from ledger import codec
from ledger.errors import InvalidRecord

__all__ = ["KnownPrompts", "Parsed"]

# Where the engine writes a chat answer's prompt ids (vLLM: the top level of the answer).
_KEY = b'"prompt_token_ids":['
# A Python int per id, its list slot and its packed form, rounded up (the engine's text of the
# ids is counted as it is): what a remembered id costs.
_BYTES_PER_ID = 48


@dataclass(frozen=True, slots=True)
class _Prompt:
    text: bytes  # the engine's text of the ids, between the brackets
    # A tuple, not a list: the collector stops tracking a tuple of ints after its first look,
    # so a full collection does not walk every remembered id (up to ~1.4M of them).
    ids: tuple[int, ...]
    packed: bytes


@dataclass(frozen=True, slots=True)
class Parsed:
    """An answer whose leading prompt ids came from the rollout's last prompt."""

    answer: dict[str, Any]
    reused: int  # how many leading ids came from the rollout's last prompt
    packed_prefix: bytes  # those ids, packed


class KnownPrompts:
    """Per rollout, the last captured call's prompt ids as the engine wrote them, parsed and
    packed; least recently used rollouts go first past ``max_bytes``."""

    def __init__(self, *, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._prompts: OrderedDict[str, _Prompt] = OrderedDict()
        self._bytes = 0

    def locate(self, raw: bytes) -> tuple[int, int] | None:
        """Where the text of ``raw``'s prompt ids lies (between the brackets), when the key
        occurs exactly once; None otherwise."""
        start = raw.find(_KEY)
        if start < 0 or raw.find(_KEY, start + 1) >= 0:
            return None
        first = start + len(_KEY)
        end = raw.find(b"]", first)
        return (first, end) if end >= 0 else None

    def parse(
        self, rollout_id: str, raw: bytes, where: tuple[int, int], text: bytes
    ) -> Parsed | None:
        """``raw`` parsed with its prompt ids (``text``, at ``where``, from :meth:`locate`)
        taken from the rollout's last prompt where they extend it; None when they do not, or
        when the answer does not carry them at its top level (the caller parses ``raw``
        whole)."""
        known = self._prompts.get(rollout_id)
        if known is None:
            return None
        first, end = where
        if not text.startswith(known.text):
            return None
        rest = text[len(known.text) :]
        if rest[:1] == b",":
            rest = rest[1:]
        elif rest:  # the last id goes on (a longer number): not the same ids
            return None
        try:
            answer = orjson.loads(raw[:first] + rest + raw[end:])
        except orjson.JSONDecodeError:
            return None
        suffix = answer.get("prompt_token_ids") if isinstance(answer, dict) else None
        if not isinstance(suffix, list):
            return None
        self._prompts.move_to_end(rollout_id)
        answer["prompt_token_ids"] = [*known.ids, *suffix]
        return Parsed(answer, len(known.ids), known.packed)

    def packed(self, ids: list[int], parsed: Parsed | None) -> bytes | None:
        """``ids`` (the record's prompt, as extraction returned it) packed, reusing the packed
        prefix the parse took from the cache; None if they cannot be packed (the ledger then
        refuses the record with its own message)."""
        reused = parsed.reused if parsed is not None else 0
        try:
            tail = codec.pack_ids(ids[reused:] if reused else ids)
        except InvalidRecord:
            return None
        return parsed.packed_prefix + tail if parsed is not None and reused else tail

    def remember(self, rollout_id: str, text: bytes, ids: list[int], packed: bytes) -> None:
        """Keep this call's prompt ids (checked by extraction) for the rollout's next call."""
        old = self._prompts.pop(rollout_id, None)
        if old is not None:
            self._bytes -= _size(old)
        prompt = _Prompt(text, tuple(ids), packed)
        if _size(prompt) > self.max_bytes // 4:
            return
        self._prompts[rollout_id] = prompt
        self._bytes += _size(prompt)
        while self._bytes > self.max_bytes and self._prompts:
            _rid, dropped = self._prompts.popitem(last=False)
            self._bytes -= _size(dropped)


def _size(prompt: _Prompt) -> int:
    return len(prompt.text) + _BYTES_PER_ID * len(prompt.ids)
