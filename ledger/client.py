"""``RemoteLedger``: the ledger API over HTTP, for workers and trainers on other nodes.

It offers the same operations as ``ledger.store.Ledger`` (what ``ledger.gym`` and
``ledger.delivery`` call), so ``CaptureSink(url="http://ledger:8080", token=...)`` works like a
direct database URL.  Transient failures (connection errors, timeouts, 502/503/504) are
retried with backoff.  Retrying a put is safe: a put that landed before its answer was lost
comes back as an idempotent repeat (200), so it is reconciled, never duplicated; a retire that
landed comes back as a repeat of the same snapshot identity (200).

JSON has no ``-inf``: with ``token_encoding="json"`` non-finite log-probs travel as the strings
``"-Infinity"``/``"Infinity"`` and are turned back into floats on the way in; ``packed-v1``
carries them as float64 bytes.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx

from ledger import wire
from ledger.errors import (
    AccessDenied,
    InvalidInput,
    LedgerError,
    NotFound,
    PayloadConflict,
    RolloutFrozen,
    RolloutRetired,
    StateConflict,
    Unavailable,
)
from ledger.gym_lineage import LineageResolution as GymResolution
from ledger.records import TokenEntry, coerce_entry
from ledger.storage.results import FrozenSnapshot, LineageResolution, PutResult
from ledger.types import Build

__all__ = ["RemoteLedger"]

_RETRY_STATUS = {502, 503, 504}
_CODES: dict[str, type[LedgerError]] = {
    "payload_conflict": PayloadConflict,
    "rollout_frozen": RolloutFrozen,
    "rollout_retired": RolloutRetired,
}


class RemoteLedger:
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        token_encoding: wire.TokenEncoding = "json",
        timeout_s: float = 60.0,
        retries: int = 5,
        backoff_s: float = 0.2,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if token_encoding not in ("json", "packed-v1"):
            raise ValueError("token_encoding must be 'json' or 'packed-v1'")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # The service refuses state-changing requests without it when it has no tokens (a
        # cross-site page cannot send it without a CORS preflight); harmless everywhere else.
        headers["Content-Type"] = "application/json"
        self.url = url.rstrip("/")
        self.token_encoding = token_encoding
        self.retries = retries
        self.backoff_s = backoff_s
        self._http = httpx.AsyncClient(
            base_url=self.url + "/ledger/v1",
            headers=headers,
            timeout=timeout_s,
            transport=transport,
        )

    async def close(self) -> None:
        await self._http.aclose()

    # ------------------------------------------------------------------ transport

    async def _call(
        self, method: str, path: str, *, ok: tuple[int, ...] = (200, 201), **kwargs: Any
    ) -> httpx.Response:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                resp = await self._http.request(method, path, **kwargs)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                if attempt == self.retries:
                    raise Unavailable(f"ledger service unreachable at {self.url}: {exc}") from exc
            else:
                if resp.status_code in ok:
                    return resp
                if resp.status_code not in _RETRY_STATUS or attempt == self.retries:
                    raise _error(resp)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)
        raise Unavailable(f"ledger service unreachable at {self.url}")  # pragma: no cover

    # ------------------------------------------------------------------ ingest

    async def begin_call(
        self, rollout_id: str, model_call_id: str, *, route: str | None = None, model: str = ""
    ) -> bool:
        resp = await self._call(
            "POST",
            f"/rollouts/{rollout_id}/calls/{model_call_id}/intent",
            json={"route": route, "model": model},
        )
        return bool(resp.json()["created"])

    async def cancel_call(self, rollout_id: str, model_call_id: str) -> bool:
        resp = await self._call("POST", f"/rollouts/{rollout_id}/calls/{model_call_id}/cancel")
        return bool(resp.json()["cancelled"])

    async def put(
        self,
        entry: Any,
        *,
        route: str | None = None,
        request_fingerprint: str = "",
        continuation_fingerprint: str = "",
    ) -> PutResult:
        e = coerce_entry(entry)
        record = wire.encode_entry(e, self.token_encoding)
        body = {
            "record": record,
            "token_encoding": self.token_encoding,
            "route": route,
            "request_fingerprint": request_fingerprint,
            "continuation_fingerprint": continuation_fingerprint,
        }
        resp = await self._call(
            "PUT", f"/rollouts/{e.rollout_id}/calls/{e.model_call_id}", json=body
        )
        data = resp.json()
        return PutResult(
            data["status"],
            data["version"],
            data["parent_call_id"],
            data["prompt_is_delta"],
            data["edge_method"],
        )

    async def mark_incomplete(
        self, rollout_id: str, model_call_id: str = "", *, reason: str, detail: str = ""
    ) -> int:
        resp = await self._call(
            "POST",
            f"/rollouts/{rollout_id}/incomplete",
            json={"model_call_id": model_call_id, "reason": reason, "detail": detail},
        )
        return int(resp.json()["version"])

    async def resolve(self, rollout_id: str, prompt_token_ids: list[int]) -> LineageResolution:
        if self.token_encoding == "packed-v1":
            body: dict[str, Any] = {
                "prompt_token_ids": wire.pack_b64_ids(prompt_token_ids),
                "token_encoding": "packed-v1",
            }
        else:
            body = {"prompt_token_ids": list(prompt_token_ids)}
        data = (
            await self._call("POST", f"/rollouts/{rollout_id}/lineage/resolve", json=body)
        ).json()
        cum = data["cumulative_token_ids"]
        if isinstance(cum, str):
            cum = wire.unpack_b64_ids(cum, "cumulative_token_ids")
        return LineageResolution(
            data["status"], data["model_call_id"], cum, data["digest"], data["reason"]
        )

    async def resolve_request(
        self, rollout_id: str, request_items: list[dict[str, Any]]
    ) -> GymResolution:
        """NeMo Gym 0.7.0's ``LineageResolver.resolve`` on the service (``ledger.gym_store``)."""
        body: dict[str, Any] = {"request_items": request_items, "token_encoding": "json"}
        if self.token_encoding == "packed-v1":
            body["token_encoding"] = "packed-v1"
        data = (
            await self._call("POST", f"/rollouts/{rollout_id}/lineage/resolve-request", json=body)
        ).json()
        match = data.get("match")
        if match is not None and isinstance(match.get("cumulative_token_ids"), str):
            match["cumulative_token_ids"] = wire.unpack_b64_ids(
                match["cumulative_token_ids"], "cumulative_token_ids"
            )
        return GymResolution.from_json(data)

    async def custody_record(self, commit: Any) -> bool:
        """NeMo Gym 0.7.0 ``CaptureLedger.record`` on the service (``ledger.custody``)."""
        dump = getattr(commit, "model_dump", None)
        data = dump(mode="json") if callable(dump) else dict(commit)
        if not isinstance(data.get("rollout_id"), str) or not data["rollout_id"]:
            raise InvalidInput("a capture-ledger commit needs its rollout_id")
        resp = await self._call(
            "POST", f"/rollouts/{data.get('rollout_id')}/custody/records", json={"commit": data}
        )
        return bool(resp.json()["created"])

    async def custody_record_failure(
        self, rollout_id: str, model_call_id: str, reason: str
    ) -> None:
        await self._call(
            "POST",
            f"/rollouts/{rollout_id}/custody/failures",
            json={"model_call_id": model_call_id, "reason": reason},
            ok=(204,),
        )

    async def custody_manifest(self, rollout_id: str) -> dict[str, Any]:
        data: dict[str, Any] = (
            await self._call("GET", f"/rollouts/{rollout_id}/custody/manifest")
        ).json()
        return data

    async def custody_has_rows(self, rollout_id: str) -> bool:
        data = (await self._call("GET", f"/rollouts/{rollout_id}/custody/has-rows")).json()
        return bool(data["has_rows"])

    # ------------------------------------------------------------------ trainer

    async def freeze(self, rollout_id: str) -> FrozenSnapshot:
        data = (
            await self._call(
                "POST",
                f"/rollouts/{rollout_id}/freeze",
                params={"token_encoding": self.token_encoding},
            )
        ).json()
        entries = []
        for raw in data["entries"]:
            entries.append(
                TokenEntry.model_validate(wire.decode_record(raw, data["token_encoding"]))
            )
        return FrozenSnapshot(
            data["rollout_id"],
            tuple(entries),
            data["incomplete"],
            data["snapshot_id"],
            data["version"],
        )

    async def retire(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        try:
            await self._call(
                "POST",
                f"/rollouts/{rollout_id}/retire",
                json={"snapshot_id": snapshot_id, "version": version},
            )
        except (StateConflict, NotFound):
            return False  # as ``Ledger.retire``: not frozen at that identity, nothing retired
        return True

    async def finalize(
        self, result: dict[str, Any], *, deliver: str = "one", consumer: str = ""
    ) -> Build:
        """Build on the server; the rebuilt result is copied back into ``result`` in place
        (the build itself carries no rebuilt response: ``Build.remote``)."""
        data = (
            await self._call(
                "POST",
                "/finalize",
                json={"result": wire.finite_json(result), "deliver": deliver, "consumer": consumer},
            )
        ).json()
        build = Build.from_wire(data["build"], remote=True)
        rebuilt: dict[str, Any] = data["result"]
        response = rebuilt.get("response")
        output = response.get("output") if isinstance(response, dict) else None
        for item in output if isinstance(output, list) else ():
            lps = item.get("generation_log_probs") if isinstance(item, dict) else None
            if isinstance(lps, list):
                item["generation_log_probs"] = [float(x) if isinstance(x, str) else x for x in lps]
        result.clear()
        result.update(rebuilt)
        return build

    async def mark_delivery(
        self, delivery_id: int, *, handed_off: bool = False, durable: bool = False
    ) -> None:
        if durable:
            await self._call(
                "POST", f"/deliveries/{delivery_id}/ack", json={"durable": True}, ok=(204,)
            )

    async def delete_rollout(self, rollout_id: str) -> bool:
        return bool((await self._call("DELETE", f"/rollouts/{rollout_id}")).json()["deleted"])

    async def sweep(self, older_than_s: float) -> int:
        data = (
            await self._call("POST", "/admin/sweep", json={"older_than_s": older_than_s})
        ).json()
        return int(data["removed"])


def _error(resp: httpx.Response) -> LedgerError:
    try:
        err = resp.json().get("error", {})
    except ValueError:
        err = {}
    message = str(err.get("message") or resp.text[:500] or f"HTTP {resp.status_code}")
    code = str(err.get("code") or "")
    rid = err.get("rollout_id")
    status = resp.status_code
    if code in _CODES:
        return _CODES[code](message, rollout_id=rid)
    if status == 410:
        return RolloutRetired(message, rollout_id=rid)
    if status == 409:
        return StateConflict(message, rollout_id=rid)
    if status == 404:
        return NotFound(message, rollout_id=rid)
    if status in (401, 403):
        return AccessDenied(f"ledger service refused the API token: {message}")
    if status in (400, 413, 422):
        return InvalidInput(message, rollout_id=rid)
    return Unavailable(f"ledger service error {status}: {message}")
