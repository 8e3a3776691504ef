"""Digest state of each rollout's latest calls, so a continuation hashes only its new tokens.

A token digest is SHA-256 over a domain tag and the packed ids, with no length header, so the
state after a parent's cumulative tokens, ``.copy()``'d, extends to the digest of any sequence
that starts with them.  The ledger keeps, per rollout, the packed cumulative tokens and that state
for its few most recent captured calls (bounded in bytes); a new prompt that starts with one of
them (a ``bytes.startswith``: one memcmp) hashes only its suffix.  The cache is a hint: the parent
is still proven in SQL against the stored (length, digest) of every candidate, and a miss only
costs the full hash.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ledger import codec
from ledger.span import Span

__all__ = ["Heads", "PrefixHasher", "Tip", "TipCache"]


@dataclass(frozen=True, slots=True)
class Tip:
    """A committed call's cumulative tokens (prompt + generation, packed) and the digest state
    after.  Both byte runs are spans (``ledger.span``): a continuation's tip extends its
    parent's buffer instead of copying it."""

    pk: int
    model_call_id: str
    cumulative: Span
    state: Any  # hashlib object positioned after ``cumulative``
    digest: str
    # ``cumulative`` widened as NeMo Gym's digest hashes it (``ledger.records.gym_widen``), kept
    # when a Gym delta record's check made it, so its child widens only its own new tokens.
    gym_wide: Span | None = None

    @property
    def size(self) -> int:
        """Bytes this tip reads (what the cache's bound counts; tips of one chain share their
        buffers, so the bound over-counts them)."""
        return len(self.cumulative) + (len(self.gym_wide) if self.gym_wide is not None else 0)

    @property
    def cumulative_len(self) -> int:
        return len(self.cumulative) // 4


class TipCache:
    """Per rollout, the last ``per_rollout`` tips; least recently used rollouts go first."""

    def __init__(self, *, max_bytes: int = 64 << 20, per_rollout: int = 4) -> None:
        self.max_bytes = max_bytes
        self.per_rollout = per_rollout
        self._tips: OrderedDict[str, list[Tip]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def base_for(self, rollout_id: str, packed_prompt: bytes) -> Tip | None:
        """The longest remembered tip the prompt starts with (None: hash from scratch)."""
        with self._lock:
            tips = self._tips.get(rollout_id)
            if not tips:
                return None
            self._tips.move_to_end(rollout_id)
            best: Tip | None = None
            for tip in tips:
                if (best is None or len(tip.cumulative) > len(best.cumulative)) and (
                    packed_prompt.startswith(tip.cumulative.view())
                ):
                    best = tip
            return best

    def of_call(self, rollout_id: str, model_call_id: str) -> Tip | None:
        """The remembered tip of that call (a delta record's parent), if any."""
        with self._lock:
            for tip in reversed(self._tips.get(rollout_id, ())):
                if tip.model_call_id == model_call_id:
                    self._tips.move_to_end(rollout_id)
                    return tip
            return None

    def remember(self, rollout_id: str, tip: Tip) -> None:
        if tip.size > self.max_bytes // 4:
            return
        with self._lock:
            tips = self._tips.setdefault(rollout_id, [])
            self._tips.move_to_end(rollout_id)
            tips.append(tip)
            self._bytes += tip.size
            while len(tips) > self.per_rollout:
                self._bytes -= tips.pop(0).size
            while self._bytes > self.max_bytes and self._tips:
                _rid, dropped = self._tips.popitem(last=False)
                self._bytes -= sum(t.size for t in dropped)

    def forget(self, rollout_id: str) -> None:
        with self._lock:
            dropped = self._tips.pop(rollout_id, [])
            self._bytes -= sum(t.size for t in dropped)


class PrefixHasher:
    """Digests of a packed prompt's prefixes, extending a known prefix's state where it can.

    ``base`` (a :class:`Tip` the prompt starts with) makes every prefix at least as long as the
    tip cost only the tokens beyond it; shorter prefixes (a parent older than the tip) are hashed
    from the start, all of them in one pass (:meth:`prime`).
    """

    def __init__(self, packed: bytes, base: Tip | None = None) -> None:
        self.packed = packed
        self.base = base
        self.base_len = base.cumulative_len if base is not None else 0
        self._base_state: Any = base.state if base is not None else codec.digest_state()
        self._memo: dict[int, str] = {}
        if base is not None:
            self._memo[self.base_len] = base.digest

    def state_at(self, n: int) -> Any:
        """A fresh hashlib state after the first ``n`` tokens (``n`` >= the base length)."""
        if n < self.base_len:
            h = codec.digest_state()
            h.update(memoryview(self.packed)[: n * 4])
            return h
        h = self._base_state.copy()
        if n > self.base_len:
            h.update(memoryview(self.packed)[self.base_len * 4 : n * 4])
        return h

    def note(self, n: int, digest: str) -> None:
        """Remember a digest computed elsewhere (the whole prompt's, by ``prepare``)."""
        self._memo[n] = digest

    def digest_at(self, n: int) -> str:
        digest = self._memo.get(n)
        if digest is None:
            digest = self._memo[n] = self.state_at(n).hexdigest()
        return digest

    def prime(self, lengths: list[int]) -> None:
        """Compute the digests of every prefix in ``lengths`` below the base in one pass."""
        todo = sorted({n for n in lengths if n < self.base_len and n not in self._memo})
        if not todo:
            return
        h = codec.digest_state()
        done = 0
        view = memoryview(self.packed)
        for n in todo:
            h.update(view[done * 4 : n * 4])
            done = n
            self._memo[n] = h.copy().hexdigest()


class Heads:
    """Postgres's optimistic record without its read: per rollout, the version and creation
    time this ledger's last guarded write left it at, and the ids of the intents it registered.

    A hint like the tips: the record's write is guarded by exactly these values (see
    ``ledger.storage.ingest.put_steps``), so a stale entry only costs the write that finds it
    stale and the read that follows.  Used on the event loop only; bounded, oldest first out.
    """

    def __init__(self, *, max_rollouts: int = 65536, max_intents: int = 65536) -> None:
        self.max_rollouts = max_rollouts
        self.max_intents = max_intents
        self._heads: OrderedDict[str, tuple[int, Any]] = OrderedDict()
        self._intents: OrderedDict[tuple[str, str], int] = OrderedDict()

    def get(self, rollout_id: str) -> tuple[int, Any] | None:
        return self._heads.get(rollout_id)

    def note(self, rollout_id: str, version: int, created_at: Any) -> None:
        self._heads[rollout_id] = (version, created_at)
        self._heads.move_to_end(rollout_id)
        if len(self._heads) > self.max_rollouts:
            self._heads.popitem(last=False)

    def note_intent(self, rollout_id: str, model_call_id: str, pk: int) -> None:
        self._intents[(rollout_id, model_call_id)] = pk
        if len(self._intents) > self.max_intents:
            self._intents.popitem(last=False)

    def pop_intent(self, rollout_id: str, model_call_id: str) -> int | None:
        return self._intents.pop((rollout_id, model_call_id), None)

    def forget(self, rollout_id: str) -> None:
        self._heads.pop(rollout_id, None)
