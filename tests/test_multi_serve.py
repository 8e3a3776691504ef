"""Many workers, one database (issue #4 point 6).

Two real ``rollout-ledger serve`` OS processes share one database: Postgres, and for contrast a
SQLite file.  Concurrent writers go through both on the same rollouts; lineage is resolved
across processes, every freeze/retire promise holds, and nothing acknowledged is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.net import free_port as _free_port

TOKEN = "multi-serve-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
V1 = "/ledger/v1"
EXE = Path(sys.executable).with_name("rollout-ledger")
STARTUP_DEADLINE_S = 60.0


@dataclass
class Serve:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _start(db_url: str, log: Path) -> Serve:
    port = _free_port()
    env = {**os.environ, "ROLLOUT_LEDGER_TOKENS": f"{TOKEN}=ingest,trainer,audit,admin"}
    env.pop("ROLLOUT_LEDGER_UPSTREAM", None)
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [str(EXE), "serve", "--db", db_url, "--port", str(port), "--log-level", "warning"],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log.parent,
        )
    return Serve(proc, f"http://127.0.0.1:{port}", log)


def _wait_healthy(servers: list[Serve]) -> None:
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    pending = list(servers)
    while pending:
        s = pending[0]
        if s.proc.poll() is not None:
            raise AssertionError(f"serve exited with {s.proc.returncode}:\n{s.output()}")
        try:
            if httpx.get(s.url + "/healthz", timeout=2).status_code == 200:
                pending.pop(0)
                continue
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"serve not healthy within {STARTUP_DEADLINE_S} s:\n{s.output()}")
        # A bounded wait on the process itself (it may exit), not a blind sleep.
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.proc.wait(timeout=0.05)


def _stop(s: Serve) -> None:
    if s.proc.poll() is None:
        os.kill(s.proc.pid, signal.SIGTERM)
        try:
            s.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(s.proc.pid, signal.SIGKILL)
            s.proc.wait(timeout=15)


@pytest.fixture
def two_serves(db_url: str, tmp_path: Path) -> Iterator[tuple[Serve, Serve]]:
    servers = [_start(db_url, tmp_path / f"serve-{i}.log") for i in range(2)]
    try:
        _wait_healthy(servers)
        yield servers[0], servers[1]
    finally:
        for s in servers:
            _stop(s)


def rec(prompt: list[int], gen: list[int]) -> dict[str, Any]:
    return {
        "model": "smol",
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": [-0.5 - i / 16 for i in range(len(gen))],
        "created_at": 1700000000.0,
        "output_items": [{"type": "message", "role": "assistant", "content": []}],
        "token_item_index": 0,
    }


async def put(c: httpx.AsyncClient, r: str, call: str, record: dict[str, Any]) -> httpx.Response:
    return await c.put(f"{V1}/rollouts/{r}/calls/{call}", json={"record": record}, headers=AUTH)


async def freeze(c: httpx.AsyncClient, r: str) -> dict[str, Any]:
    resp = await c.post(f"{V1}/rollouts/{r}/freeze", headers=AUTH)
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    return data


async def test_two_serve_processes_share_one_database(
    two_serves: tuple[Serve, Serve], rid: Any, backend: str
) -> None:
    a_srv, b_srv = two_serves
    assert a_srv.proc.pid != b_srv.proc.pid
    for s in two_serves:
        assert "auth bearer tokens" in " ".join(s.output().split())
    limits = httpx.Limits(max_connections=16)
    async with (
        httpx.AsyncClient(base_url=a_srv.url, timeout=60, limits=limits) as a,
        httpx.AsyncClient(base_url=b_srv.url, timeout=60, limits=limits) as b,
    ):
        both = (a, b)

        # 1. Lineage across processes: the parent written through A is proven through B.
        r = rid("xlineage")
        sys_prompt = list(range(100, 140))
        first = await put(a, r, "c1", rec(sys_prompt, [1, 2, 3]))
        assert first.status_code == 201, first.text
        second = await put(b, r, "c2", rec([*sys_prompt, 1, 2, 3, 50, 51], [4, 5]))
        assert second.status_code == 201, second.text
        assert second.json()["parent_call_id"] == "c1"
        assert second.json()["prompt_is_delta"] is True
        look = await a.post(
            f"{V1}/rollouts/{r}/lineage/resolve",
            json={"prompt_token_ids": [*sys_prompt, 1, 2, 3, 50, 51, 4, 5, 60]},
            headers=AUTH,
        )
        assert look.json()["model_call_id"] == "c2"
        assert look.json()["cumulative_token_ids"] == [*sys_prompt, 1, 2, 3, 50, 51, 4, 5]

        # 2. Concurrent writers on shared rollouts: chains grow through alternating servers,
        #    and every record is also re-sent through the other server at the same moment.
        n_rollouts, depth = 6, 6
        chains = [rid(f"chain{i}") for i in range(n_rollouts)]

        async def grow(i: int, r: str) -> list[tuple[str, int, dict[str, Any]]]:
            ctx = [7000 + i, *range(200, 230)]
            out = []
            for k in range(depth):
                gen = [300 + 10 * k + j for j in range(3)]
                record = rec(ctx, gen)
                one, two = both[(i + k) % 2], both[(i + k + 1) % 2]
                r1, r2 = await asyncio.gather(
                    put(one, r, f"c{k}", record), put(two, r, f"c{k}", record)
                )
                statuses = sorted([r1.status_code, r2.status_code])
                assert statuses == [200, 201], (r1.text, r2.text)  # one created, one repeat
                out.append((f"c{k}", r1.json()["version"], r1.json()))
                ctx = [*ctx, *gen, 400 + k, 401 + k]
            return out

        grown = await asyncio.gather(*(grow(i, r) for i, r in enumerate(chains)))
        for i, r in enumerate(chains):
            snap = await freeze(both[i % 2], r)
            assert [e["model_call_id"] for e in snap["entries"]] == [f"c{k}" for k in range(depth)]
            assert not snap["incomplete"]
            detail = (await both[(i + 1) % 2].get(f"{V1}/rollouts/{r}", headers=AUTH)).json()
            edges = [(e["child"], e["parent"], e["status"]) for e in detail["edges"]]
            assert edges == [(f"c{k}", f"c{k - 1}", "verified") for k in range(1, depth)]
            # Each record bumped the version exactly once (the duplicate did not), then freeze.
            assert detail["rollout"]["version"] == depth + 1
            assert len(grown[i]) == depth

        # 3. Freeze through B while writers race through A and B: every acknowledged record is
        #    in the snapshot, every refused one is not, and both servers agree on the snapshot.
        r = rid("race")
        acked: set[str] = set()
        refused: set[str] = set()
        enough = asyncio.Event()

        async def writer(w: int) -> None:
            c = both[w % 2]
            for k in range(40):
                call = f"w{w}-{k}"
                resp = await put(c, r, call, rec([w, k, 9999], [1]))
                if resp.status_code in (200, 201):
                    acked.add(call)
                    if len(acked) >= 20:
                        enough.set()
                else:
                    assert resp.status_code == 409, resp.text
                    assert resp.json()["error"]["code"] == "rollout_frozen"
                    refused.add(call)

        async def freezer() -> dict[str, Any]:
            await asyncio.wait_for(enough.wait(), timeout=60)
            return await freeze(b, r)

        results = await asyncio.gather(*(writer(w) for w in range(4)), freezer())
        race_snap = results[-1]
        assert isinstance(race_snap, dict)
        assert refused, "the freeze landed after every writer finished; nothing was raced"
        in_snap = {e["model_call_id"] for e in race_snap["entries"]}
        assert in_snap == acked  # nothing acknowledged is lost, nothing refused slipped in
        assert not in_snap & refused
        again_a, again_b = await freeze(a, r), await freeze(b, r)
        assert again_a["snapshot_id"] == again_b["snapshot_id"] == race_snap["snapshot_id"]
        assert again_a["version"] == race_snap["version"]
        assert {e["model_call_id"] for e in again_a["entries"]} == acked

        # 4. Conditional retire across processes: a mark through A after the freeze makes the
        #    identity B holds stale; the fresh identity retires once; later writes get 410.
        mark = await a.post(
            f"{V1}/rollouts/{r}/incomplete", json={"reason": "capture_failed"}, headers=AUTH
        )
        assert mark.status_code == 200
        stale = await b.post(
            f"{V1}/rollouts/{r}/retire",
            json={"snapshot_id": race_snap["snapshot_id"], "version": race_snap["version"]},
            headers=AUTH,
        )
        assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_snapshot"
        fresh = await a.post(f"{V1}/rollouts/{r}/freeze", headers=AUTH)
        ident = {"snapshot_id": fresh.json()["snapshot_id"], "version": fresh.json()["version"]}
        assert fresh.json()["incomplete"] is True
        done = await asyncio.gather(
            a.post(f"{V1}/rollouts/{r}/retire", json=ident, headers=AUTH),
            b.post(f"{V1}/rollouts/{r}/retire", json=ident, headers=AUTH),
        )
        assert [d.status_code for d in done] == [200, 200]  # one retires, one is the repeat
        late = await put(a, r, "late", rec([1], [2]))
        assert late.status_code == 410
        late = await put(b, r, sorted(acked)[0], rec([0], [1]))
        assert late.status_code == 410

        # 5. Nothing lost overall: each server sees every call of every rollout.
        for c in both:
            for ch in chains:
                detail = (await c.get(f"{V1}/rollouts/{ch}", headers=AUTH)).json()
                assert [x["status"] for x in detail["calls"]] == ["captured"] * depth
                assert all(x["has_tokens"] for x in detail["calls"])
            race = (await c.get(f"{V1}/rollouts/{r}", headers=AUTH)).json()
            assert {x["model_call_id"] for x in race["calls"]} == acked
        for s in two_serves:
            assert s.proc.poll() is None, s.output()
