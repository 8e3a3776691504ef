"""Byte runs shared along a chain of calls, extended in place.

A rollout's calls usually form one chain: each call's cumulative tokens (prompt + generation)
start with the previous call's.  The ledger keeps the latest calls' cumulative bytes (packed
ids, and their NeMo Gym widened form) so the next call hashes and packs only its new tokens;
copying the whole run into a new buffer at every call made each call O(context) again (a
100k-token context is 400 KB packed and 800 KB widened, copied several times per call).

A :class:`Span` is the first ``n`` bytes of a buffer.  :meth:`Span.extended` appends to the
buffer itself when the span ends where the buffer ends (the call continues the chain's latest
tip: amortized O(new bytes)), and copies otherwise (a retry or a sibling branching from an
older tip).  Bytes below any span's ``n`` never change, so every span reads as it did.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["Span"]

# Appends are rare and short (a call's new bytes); one lock for all buffers keeps the
# ends-where-the-buffer-ends test and the append one step.
_EXTEND = threading.Lock()


@dataclass(frozen=True, slots=True)
class Span:
    """The first ``n`` bytes of ``buf`` (see the module docstring)."""

    buf: bytearray
    n: int

    @classmethod
    def of(cls, data: bytes | bytearray | memoryview) -> Span:
        """A span over a fresh buffer holding ``data``."""
        buf = bytearray(data)
        return cls(buf, len(buf))

    def __len__(self) -> int:
        return self.n

    def view(self) -> memoryview:
        """The span's bytes without a copy.  Release it soon (use it in one expression, or in a
        ``with`` block): while a view is held the buffer cannot grow, so an extension copies."""
        return memoryview(self.buf)[: self.n]

    def extended(self, tail: bytes | bytearray | memoryview) -> Span:
        """This span followed by ``tail``: in the same buffer when this span ends where the
        buffer does and nobody holds a view of it, else in a copy."""
        with _EXTEND:
            buf = self.buf
            if len(buf) == self.n:
                try:
                    buf += tail
                except BufferError:  # a view is held (a worker thread reading it): copy
                    pass
                else:
                    return Span(buf, len(buf))
            buf = bytearray(self.view())
        buf += tail
        return Span(buf, len(buf))
