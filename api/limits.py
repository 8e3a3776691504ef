"""Bounds on what one request may cost (issue 13, points 3 and 8).

* JSON bodies of the ledger API are parsed by :class:`BoundedJsonRoute`: bodies over
  ``OFFLOAD_BYTES`` are parsed in a worker thread (the event loop keeps serving), and every
  body is checked for nesting deeper than ``MAX_DEPTH`` and for text no database can store (a
  lone UTF-16 surrogate, in a key or a value), which are refused with a 422 naming the place
  instead of failing later with a 500.
* :func:`check_record_tokens` caps prompt + generation tokens per record at the service's
  ``max_record_tokens``: the configured value, else the model's context length the upstream
  reports (vLLM's ``max_model_len``), else ``DEFAULT_RECORD_TOKENS``.  A call can never hold
  more tokens than its model's context, so a bigger record is refused with a 413.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import httpx
from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

from ledger import jsonio
from ledger.config import Settings
from ledger.records import TokenEntry
from ledger.wire import TokenEncoding, encode_entry

__all__ = [
    "DEFAULT_RECORD_TOKENS",
    "MAX_DEPTH",
    "OFFLOAD_BYTES",
    "BoundedJsonRoute",
    "check_json_value",
    "check_record_tokens",
    "discover_context_length",
    "encode_entries_off_loop",
    "parse_json_body",
    "record_token_cap",
]

log = logging.getLogger("rollout_ledger.api")

OFFLOAD_BYTES = 256 * 1024
OFFLOAD_TOKENS = 50_000
MAX_DEPTH = 64
DEFAULT_RECORD_TOKENS = 262_144
_SCALARS = frozenset({int, float, bool, type(None)})


class JsonProblem(ValueError):
    """A parsed body the service refuses (too deep, or text no database can hold)."""


def _text_ok(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_json_value(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Raise :class:`JsonProblem` for nesting beyond ``max_depth`` or a lone surrogate."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "body")]
    while stack:
        item, depth, where = stack.pop()
        if isinstance(item, dict):
            if depth > max_depth:
                raise JsonProblem(f"{where}: nested deeper than {max_depth} levels")
            for key, sub in item.items():
                if not _text_ok(key):
                    raise JsonProblem(f"{where}: a key holds a lone surrogate, not valid Unicode")
                if type(sub) not in _SCALARS:
                    stack.append((sub, depth + 1, f"{where}.{key}"))
        elif isinstance(item, list):
            if depth > max_depth:
                raise JsonProblem(f"{where}: nested deeper than {max_depth} levels")
            # Token arrays: one C-speed pass over the element types, no per-item Python.
            if set(map(type, item)) <= _SCALARS:
                continue
            for index, sub in enumerate(item):
                if type(sub) not in _SCALARS:
                    stack.append((sub, depth + 1, f"{where}.{index}"))
        elif isinstance(item, str) and not _text_ok(item):
            raise JsonProblem(f"{where}: holds a lone surrogate, not valid Unicode text")


def _parse(raw: bytes) -> Any:
    value = jsonio.loads(raw)  # accepts what Python's parser accepts; the checks below decide
    check_json_value(value)
    return value


async def parse_json_body(raw: bytes) -> Any:
    """``json.loads`` + :func:`check_json_value`, in a worker thread for large bodies.

    Raises ``ValueError`` (``json.JSONDecodeError`` or :class:`JsonProblem`) or
    ``RecursionError`` for a body nested beyond the parser's own limit.
    """
    if len(raw) > OFFLOAD_BYTES:
        return await asyncio.to_thread(_parse, raw)
    return _parse(raw)


class _BoundedJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            raw = await self.body()
            try:
                self._json = await parse_json_body(raw)
            except JsonProblem as exc:
                raise HTTPException(422, detail=f"invalid JSON body: {exc}") from None
            except RecursionError:
                raise HTTPException(
                    422, detail=f"invalid JSON body: nested deeper than {MAX_DEPTH} levels"
                ) from None
        return self._json


class BoundedJsonRoute(APIRoute):
    """An ``APIRoute`` whose JSON bodies go through :func:`parse_json_body`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            return await handler(_BoundedJsonRequest(request.scope, request.receive))

        return bounded


# --------------------------------------------------------------------------- tokens per record


def record_token_cap(settings: Settings, discovered: int | None) -> int:
    if settings.max_record_tokens is not None:
        return settings.max_record_tokens
    return discovered or DEFAULT_RECORD_TOKENS


def check_record_tokens(request: Request, record: dict[str, Any]) -> None:
    """413 when a record (token arrays decoded to lists) holds more prompt + generation
    tokens than the service allows."""
    cap: int = getattr(request.app.state, "max_record_tokens", DEFAULT_RECORD_TOKENS)
    total = sum(
        len(v)
        for v in (record.get("prompt_token_ids"), record.get("generation_token_ids"))
        if isinstance(v, list)
    )
    if total > cap:
        raise HTTPException(
            413,
            detail=f"the record holds {total} prompt + generation tokens, over this service's "
            f"limit of {cap} (max_record_tokens; by default the model's context length)",
        )


async def discover_context_length(client: httpx.AsyncClient, headers: dict[str, str]) -> int | None:
    """The largest ``max_model_len`` the upstream's ``/v1/models`` reports, or ``None``."""
    try:
        resp = await client.get("/v1/models", headers=headers, timeout=5.0)
        models = resp.json().get("data") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        log.info("context length not discovered from the upstream: %s", type(exc).__name__)
        return None
    lengths = [
        m["max_model_len"]
        for m in models or []
        if isinstance(m, dict)
        and isinstance(m.get("max_model_len"), int)
        and not isinstance(m.get("max_model_len"), bool)
        and m["max_model_len"] > 0
    ]
    return max(lengths) if lengths else None


async def encode_entries_off_loop(
    entries: Sequence[TokenEntry], encoding: TokenEncoding
) -> list[dict[str, Any]]:
    """Snapshot entries for the wire; a large snapshot is encoded in a worker thread (writing
    millions of log-probs as JSON numbers would otherwise hold the event loop for seconds)."""
    tokens = sum(len(e.prompt_token_ids) + len(e.generation_token_ids) for e in entries)
    if tokens <= OFFLOAD_TOKENS:
        return [encode_entry(e, encoding) for e in entries]
    return await asyncio.to_thread(lambda: [encode_entry(e, encoding) for e in entries])
