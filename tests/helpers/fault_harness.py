"""Multi-turn harness sessions for the fault and soak tests, and the checks run after them.

A :class:`Session` is one rollout driven by one harness speaking one dialect (chat
completions, Anthropic Messages or Responses) to the capture proxy: each turn sends the whole
conversation, and an acknowledged answer (HTTP 200) extends it.  After a run,
:func:`check_acks_byte_for_byte` proves every acknowledged call is in the ledger exactly as the
upstream sampled it and as the harness saw it, and :func:`expected_chain` gives the token chain
a delivered rebuild must equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ledger.delivery import finalize_rollout_token_capture
from ledger.store import Ledger
from tests.helpers.fault_support import run_async, same_floats, sampled_tokens

TOKEN_FIELDS = ("prompt_token_ids", "token_ids", "generation_token_ids", "generation_log_probs")
PATHS = {
    "chat": "/v1/chat/completions",
    "anthropic": "/v1/messages",
    "responses": "/v1/responses",
}


@dataclass
class Ack:
    """One call a harness got a 200 for: the response id and the text it saw."""

    response_id: str
    content: str
    body: dict[str, Any]


@dataclass
class Session:
    rollout_id: str
    topic: str
    dialect: str = "chat"
    acks: list[Ack] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    turns: list[tuple[str, str]] = field(default_factory=list)  # (role, text), harness view

    def __post_init__(self) -> None:
        self.turns = [("user", f"Let us talk about {self.topic}.")]

    @property
    def path(self) -> str:
        return PATHS[self.dialect]

    def body(self) -> dict[str, Any]:
        if self.dialect == "anthropic":
            return {
                "model": "smol",
                "max_tokens": 256,
                "messages": [{"role": r, "content": t} for r, t in self.turns],
            }
        if self.dialect == "responses":
            return {
                "model": "smol",
                "input": [
                    {
                        "type": "message",
                        "role": r,
                        "content": [
                            {"type": "output_text" if r == "assistant" else "input_text", "text": t}
                        ],
                    }
                    for r, t in self.turns
                ],
            }
        return {"model": "smol", "messages": [{"role": r, "content": t} for r, t in self.turns]}

    def accept(self, answer: dict[str, Any]) -> None:
        """Take a 200 answer: check no token arrays leaked, extend the conversation."""
        _no_token_fields(answer)
        if self.dialect == "anthropic":
            content = "".join(b["text"] for b in answer["content"] if b["type"] == "text")
        elif self.dialect == "responses":
            content = "".join(
                part["text"]
                for item in answer["output"]
                if item["type"] == "message"
                for part in item["content"]
            )
        else:
            content = answer["choices"][0]["message"]["content"]
        self.acks.append(Ack(str(answer["id"]), content, answer))
        self.turns = [*self.turns, ("assistant", content), ("user", f"Go on ({len(self.acks)}).")]


def _no_token_fields(value: Any) -> None:
    if isinstance(value, dict):
        for name in TOKEN_FIELDS:
            assert name not in value, f"the harness saw {name}"
        for v in value.values():
            _no_token_fields(v)
    elif isinstance(value, list):
        for v in value:
            _no_token_fields(v)


def expected_chain(
    answers: dict[str, dict[str, Any]], acks: list[Ack]
) -> tuple[list[int], list[int], list[float]]:
    """Last prompt, all generated ids and all log-probs of the acknowledged calls, as sampled."""
    gen: list[int] = []
    lps: list[float] = []
    for ack in acks:
        _, g, lp = sampled_tokens(answers[ack.response_id])
        gen += g
        lps += lp
    prompt, _, _ = sampled_tokens(answers[acks[-1].response_id])
    return prompt, gen, lps


def _recorded_text(items: list[dict[str, Any]]) -> str:
    out = []
    for item in items:
        if item.get("type") != "message":
            continue
        content = item.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [p.get("text", "") for p in content if isinstance(p, dict)]
    return "".join(out)


def check_acks_byte_for_byte(
    db_url: str, answers: dict[str, dict[str, Any]], sessions: list[Session]
) -> dict[str, int]:
    """Each acknowledged call is in its frozen snapshot with exactly the sampled prompt ids,
    generated ids and log-probs, and records the text the harness saw.  Freezes the rollouts.

    Returns the number of captured entries per rollout."""

    async def snapshots(led: Ledger) -> dict[str, Any]:
        return {s.rollout_id: await led.freeze(s.rollout_id) for s in sessions}

    snaps = run_async(snapshots, db_url)
    counts: dict[str, int] = {}
    for s in sessions:
        snap = snaps[s.rollout_id]
        counts[s.rollout_id] = len(snap.entries)
        by_response = {e.response_id: e for e in snap.entries}
        assert len(by_response) == len(snap.entries), "two entries share a response id"
        for ack in s.acks:
            entry = by_response.get(ack.response_id)
            assert entry is not None, f"{s.rollout_id}: acknowledged {ack.response_id} lost"
            prompt, gen, lps = sampled_tokens(answers[ack.response_id])
            assert entry.prompt_token_ids == prompt, s.rollout_id
            assert entry.generation_token_ids == gen, s.rollout_id
            assert same_floats(entry.generation_log_probs, lps), s.rollout_id
            assert _recorded_text(entry.output_items) == ack.content, (entry.output_items, ack)
            assert answers[ack.response_id]["choices"][0]["message"]["content"] == ack.content
    return counts


def finalize(db_url: str, rollout_id: str, response_id: str | None) -> tuple[dict[str, Any], Any]:
    result: dict[str, Any] = {
        "_ng_rollout_id": rollout_id,
        "response": {"id": response_id or "none", "output": []},
    }

    async def run(led: Ledger) -> Any:
        return await finalize_rollout_token_capture(result, led)

    return result, run_async(run, db_url)
