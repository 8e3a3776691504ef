"""Rollouts for the audit page's tests, written through real ledger operations.

``seed_masked_drift`` writes what a harness that re-serialises history produces: a first call,
then a second whose conversation continues the first (its request fingerprint is the first
call's continuation fingerprint) but whose prompt tokens leave the first call's tokens two
tokens into its generation.  The ledger stores that as a drifted edge; an upstream error on a
third call marks the rollout incomplete, and finalizing masks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledger.delivery import finalize_rollout_token_capture, retire_rollout_token_capture
from ledger.store import Ledger

SYSTEM = list(range(1000, 1030))


@dataclass(frozen=True)
class Seeded:
    rollout_id: str
    calls: list[str]
    drift_position: int
    parent_sequence: list[int]  # the first call's prompt + generation
    child_prompt: list[int]
    build: dict[str, Any]


def record(
    rollout_id: str, call_id: str, prompt: list[int], gen: list[int], t: float
) -> dict[str, Any]:
    return {
        "rollout_id": rollout_id,
        "model_call_id": call_id,
        "model": "smol",
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": [-0.25 - 0.125 * (i % 5) for i in range(len(gen))],
        "output_items": [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": f"answer {call_id}"}],
            }
        ],
        "token_item_index": 0,
        "created_at": t,
        "response_id": f"chatcmpl-{call_id}",
    }


def first_mismatch(a: list[int], b: list[int]) -> int:
    """Computed here, independently of the ledger's own diagnosis."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


async def seed_masked_drift(
    ledger: Ledger, rollout_id: str, *, consumer: str = "trainer-ui"
) -> Seeded:
    first, second, third = "call-1-tool", "call-2-reserialised", "call-3-failed"
    gen1 = [2001, 2002, 2003, 2004, 2005, 2006]
    await ledger.begin_call(rollout_id, first, route="POST /v1/chat/completions", model="smol")
    await ledger.put(
        record(rollout_id, first, SYSTEM, gen1, 1.0),
        route="POST /v1/chat/completions",
        continuation_fingerprint="fp-after-first",
    )
    # The harness wrote the tool call back with other bytes: same conversation, other tokens.
    prompt2 = [*SYSTEM, *gen1[:2], 2903, 2904, 2905, 3001, 3002]
    await ledger.begin_call(rollout_id, second, route="POST /v1/chat/completions", model="smol")
    await ledger.put(
        record(rollout_id, second, prompt2, [2101, 2102, 2103], 2.0),
        route="POST /v1/chat/completions",
        request_fingerprint="fp-after-first",
    )
    await ledger.begin_call(rollout_id, third, route="POST /v1/chat/completions", model="smol")
    # What the proxy does when the upstream fails: close the intent, record the cause.
    await ledger.cancel_call(rollout_id, third)
    await ledger.mark_incomplete(
        rollout_id, third, reason="upstream_error", detail="upstream answered 500"
    )
    result: dict[str, Any] = {
        "_ng_rollout_id": rollout_id,
        "reward": 0.0,
        "response": {"id": "resp-final", "output": []},
    }
    build = await finalize_rollout_token_capture(result, ledger, consumer=consumer)
    assert build is not None
    parent_sequence = [*SYSTEM, *gen1]
    return Seeded(
        rollout_id,
        [first, second, third],
        first_mismatch(parent_sequence, prompt2),
        parent_sequence,
        prompt2,
        build,
    )


async def seed_delivered(ledger: Ledger, rollout_id: str, *, consumer: str = "trainer-ui") -> None:
    """A two-call tool loop whose second prompt extends the first, after an abandoned retry of
    the first call (quarantined as ``retry_not_kept``): delivered, acknowledged durable and
    retired, so its delivery carries every receipt."""
    gen1 = [2201, 2202, 2203]
    await ledger.begin_call(rollout_id, "c0-abandoned")
    await ledger.put(record(rollout_id, "c0-abandoned", SYSTEM, [2251, 2252], 0.5))
    await ledger.begin_call(rollout_id, "c0")
    await ledger.put(record(rollout_id, "c0", SYSTEM, gen1, 1.0))
    await ledger.begin_call(rollout_id, "c1")
    await ledger.put(record(rollout_id, "c1", [*SYSTEM, *gen1, 3100, 3101], [2301, 2302], 2.0))
    result: dict[str, Any] = {
        "_ng_rollout_id": rollout_id,
        "reward": 1.0,
        "response": {"id": "chatcmpl-c1", "output": []},
    }
    build = await finalize_rollout_token_capture(result, ledger, consumer=consumer)
    assert build is not None and build["outcome"] == "delivered", build
    assert await retire_rollout_token_capture(rollout_id, ledger, build)
