"""A ledger client in its own OS process, driven by ``tests/test_concurrency.py``.

Run from the repository root as ``python -m tests.helpers.writer SPEC``, SPEC being JSON::

    {"db": URL, "mode": "put" | "retire", "wait_go": false, ...}

``put``: ``"streams": [{"rollout_id", "name", "seed", "calls", "intents"?}, ...]``.  One asyncio
task per stream puts calls ``0 .. calls-1`` of that stream in order (for a stream with a true
``intents``, each preceded by ``begin_call``), stopping at the first ``RolloutFrozen``.

``retire``: ``"targets": [{"rollout_id", "snapshot_id", "version"}, ...]``, all retired at once.

Protocol, one flushed stdout line each:

    ready                                  the Ledger is connected (then, with ``wait_go``, the
                                           process waits for a ``go`` line on stdin)
    ack ROLLOUT CALL STATUS VERSION        printed only after ``put`` returned
    frozen ROLLOUT CALL                    ``put`` raised ``RolloutFrozen``; the stream stopped
    retired ROLLOUT STATUS                 ``retire_outcome``'s status (retired, repeat, …)
    done                                   everything finished

Any other exception propagates: a traceback on stderr and exit status 1.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import sqlalchemy as sa

from ledger.errors import RolloutFrozen
from ledger.store import Ledger

Stream = dict[str, Any]


def call_id(stream: Stream, k: int) -> str:
    return f"{stream['name']}-c{k:03d}"


def _generation(base: int, j: int) -> list[int]:
    return [base + 100 + 3 * j + i for i in range(3)]


def stream_record(stream: Stream, k: int) -> dict[str, Any]:
    """Call ``k`` of a stream: a deterministic record whose prompt extends call ``k-1``.

    Every stream owns the token range ``seed * 10_000 …`` so no two streams share a prefix; the
    chain makes the ledger prove a parent (and store a delta prompt) for every call after the
    first.  Odd calls carry float32-exact log-probs, even calls need float64, so both codecs are
    exercised.
    """
    base = int(stream["seed"]) * 10_000
    if not 0 < base < 2**31 - 10_000 or k >= 1000:
        raise ValueError(f"stream seed {stream['seed']} or call index {k} out of range")
    prompt = [base + i for i in range(4)]
    for j in range(k):
        prompt += [*_generation(base, j), base + 5000 + 2 * j, base + 5001 + 2 * j]
    gen = _generation(base, k)
    if k % 2:
        log_probs = [-0.5 - 0.25 * i for i in range(len(gen))]
    else:
        log_probs = [-(k + 1) / 7 - i / 3 for i in range(len(gen))]
    return {
        "rollout_id": stream["rollout_id"],
        "model_call_id": call_id(stream, k),
        "model": "policy-v1",
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": log_probs,
        "output_items": [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": f"{stream['name']} turn {k} ✓"}],
            }
        ],
        "token_item_index": 0,
        "created_at": 1_700_000_000.0 + k + int(stream["seed"]) / 1000,
        "response_id": f"resp-{call_id(stream, k)}",
        "sampling": {"temperature": 0.7, "seed": stream["seed"]},
    }


def say(line: str) -> None:
    print(line, flush=True)


async def _put_stream(led: Ledger, stream: Stream) -> None:
    intents = bool(stream.get("intents"))
    for k in range(int(stream["calls"])):
        rid, cid = stream["rollout_id"], call_id(stream, k)
        try:
            if intents:
                await led.begin_call(rid, cid, route="POST /v1/chat/completions")
            res = await led.put(stream_record(stream, k))
        except RolloutFrozen:
            say(f"frozen {rid} {cid}")
            return
        say(f"ack {rid} {cid} {res.status} {res.version}")


async def _retire(led: Ledger, target: dict[str, Any]) -> None:
    outcome = await led.retire_outcome(
        target["rollout_id"], snapshot_id=target["snapshot_id"], version=int(target["version"])
    )
    say(f"retired {target['rollout_id']} {outcome.status}")


async def main(spec: dict[str, Any]) -> None:
    led = Ledger(spec["db"])
    try:
        # Open a pooled connection before announcing readiness, so "go" starts work, not connects.
        async with led.engine.connect() as conn:
            await conn.execute(sa.text("SELECT 1"))
        say("ready")
        if spec.get("wait_go"):
            line = await asyncio.to_thread(sys.stdin.readline)
            if line.strip() != "go":
                raise SystemExit(f"writer expected 'go' on stdin, got {line!r}")
        if spec["mode"] == "put":
            await asyncio.gather(*(_put_stream(led, s) for s in spec["streams"]))
        elif spec["mode"] == "retire":
            await asyncio.gather(*(_retire(led, t) for t in spec["targets"]))
        else:
            raise SystemExit(f"unknown writer mode {spec['mode']!r}")
        say("done")
    finally:
        await led.close()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
