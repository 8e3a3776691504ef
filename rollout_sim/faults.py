"""Faults the simulated engine can be told to commit, one request at a time."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Literal

from rollout_sim.params import GENERATING_ROUTES

FaultKind = Literal["http_500", "hang", "drop", "stream_error", "no_token_ids", "malformed_tokens"]


@dataclass(frozen=True)
class Fault:
    """One queued fault.

    - `http_500`: answer 500 with vLLM's error envelope.
    - `hang`: never answer; ends when the client disconnects or the request is cancelled.
    - `drop`: a stream closes the connection after `after_chunks` SSE events
      (non-streaming: before any byte). Under uvicorn the client sees a broken
      connection; under `httpx.ASGITransport(raise_app_exceptions=False)` a cut body.
    - `stream_error`: after `after_chunks` events, `data: {"error": …}` then `[DONE]`.
    - `no_token_ids`: no `prompt_token_ids`/`token_ids` (and no logprobs unless
      `keep_logprobs`).
    - `malformed_tokens`: `variant` "length" (one logprob entry fewer than ids),
      "mismatch" (the last inline id differs from its `token_id:N` logprob) or
      "usage" (`completion_tokens` one too many).
    """

    kind: FaultKind
    route: str | None = None  # None: the next generating request
    after_chunks: int = 2
    keep_logprobs: bool = False
    variant: Literal["length", "mismatch", "usage"] = "length"


class SimulatedDisconnect(ConnectionError):
    """Raised inside a stream to make the server drop the connection (fault `drop`)."""


class Faults:
    """Queue of one-shot faults; thread-safe so tests can drive a threaded server."""

    def __init__(self) -> None:
        self._queue: deque[Fault] = deque()
        self._lock = threading.Lock()
        self.hanging = 0  # requests currently held by a `hang` fault

    def next(
        self,
        kind: FaultKind,
        *,
        route: str | None = None,
        after_chunks: int = 2,
        keep_logprobs: bool = False,
        variant: Literal["length", "mismatch", "usage"] = "length",
    ) -> None:
        """Make the next matching request fail this way (faults fire in queue order)."""
        with self._lock:
            self._queue.append(Fault(kind, route, after_chunks, keep_logprobs, variant))

    @property
    def pending(self) -> int:
        return len(self._queue)

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()

    def take(self, path: str) -> Fault | None:
        with self._lock:
            for fault in self._queue:
                if fault.route == path or (fault.route is None and path in GENERATING_ROUTES):
                    self._queue.remove(fault)
                    return fault
        return None
