"""Token arrays over the ledger's HTTP API: JSON lists against ``packed-v1`` (issue #4 point 5).

A ledger service (the real app, SQLite in a temp dir) runs on a loopback port; ``RemoteLedger``
puts root records with large prompts and freezes them, in each encoding.  Reported per prompt
size: request body bytes of a put, put latency p50, freeze response bytes and latency p50.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx

from api.app import create_app
from ledger import wire
from ledger.client import RemoteLedger
from ledger.config import load_settings
from ledger.records import TokenEntry
from rollout_sim import ThreadedServer

GEN_TOKENS = 300


def _entry(rollout_id: str, prompt_tokens: int, seed: int) -> TokenEntry:
    rng = random.Random(seed)
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id="c0",
        model="bench",
        prompt_token_ids=[rng.randrange(151_000) for _ in range(prompt_tokens)],
        generation_token_ids=[rng.randrange(151_000) for _ in range(GEN_TOKENS)],
        generation_log_probs=[-rng.random() * 8 for _ in range(GEN_TOKENS)],
        created_at=1700000000.0,
    )


def _p50(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


async def _measure_one(
    url: str, encoding: wire.TokenEncoding, size: int, samples: int
) -> dict[str, Any]:
    client = RemoteLedger(url, token_encoding=encoding)
    put_ms: list[float] = []
    freeze_ms: list[float] = []
    freeze_bytes = 0
    body_bytes = 0
    try:
        for i in range(samples):
            entry = _entry(f"wire-{encoding}-{size}-{i}", size, seed=i)
            record = {"record": wire.encode_entry(entry, encoding)}
            body_bytes = len(json.dumps(record, separators=(",", ":")))  # as httpx sends it
            t0 = time.perf_counter()
            await client.put(entry)
            put_ms.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            snap = await client.freeze(entry.rollout_id)
            freeze_ms.append((time.perf_counter() - t0) * 1000)
            assert snap.entries[0].prompt_token_ids == entry.prompt_token_ids
        async with httpx.AsyncClient(base_url=url) as raw:
            resp = await raw.post(
                f"/ledger/v1/rollouts/wire-{encoding}-{size}-0/freeze",
                params={"token_encoding": encoding},
            )
            freeze_bytes = len(resp.content)
    finally:
        await client.close()
    return {
        "encoding": encoding,
        "prompt_tokens": size,
        "put_body_bytes": body_bytes,
        "put_p50_ms": _p50(put_ms),
        "freeze_body_bytes": freeze_bytes,
        "freeze_p50_ms": _p50(freeze_ms),
        "samples": samples,
    }


async def measure(workdir: Path, *, quick: bool = False) -> dict[str, Any]:
    sizes = (16_000,) if quick else (16_000, 64_000, 128_000)
    samples = 3 if quick else 7
    db = f"sqlite+aiosqlite:///{workdir / 'wire.db'}"
    settings = load_settings(db=db, max_body_bytes=256 * 1024 * 1024)
    rows: list[dict[str, Any]] = []
    with ThreadedServer(create_app(settings), lifespan="on", startup_timeout=60) as server:
        for size in sizes:
            for encoding in ("json", "packed-v1"):
                rows.append(await _measure_one(server.url, encoding, size, samples))
    return {"rows": rows, "gen_tokens": GEN_TOKENS}


if __name__ == "__main__":  # pragma: no cover - manual run
    import tempfile

    print(json.dumps(asyncio.run(measure(Path(tempfile.mkdtemp()))), indent=2))
