"""Workload generator: agent rollouts as sequences of model calls.

A rollout is a system prompt and a task, then ``turns`` model calls; each call after the first
extends the previous call's prompt + generation by a tool output (an agent loop whose chat
template re-renders history onto the sampled tokens, so every turn is a verified token-prefix
child of the one before and, with delta records, stores only its suffix).  Optional extras:

* ``retry_every=N``: every N-th turn is first sent once and abandoned, then re-sent with the same
  prompt (an identical-prompt retry sibling; the next turn extends the second one);
* ``side_call_every=N``: every N-th turn is followed by a side call (a fresh root: the system
  prompt plus a short request, e.g. title generation) that nothing extends.

Two renderings of the same shape: :func:`direct_calls` yields ``TokenEntry`` dicts for the
in-process Ledger API (token ids drawn from a 151k vocabulary, float32-exact log-probs), and
:class:`ChatRollout` drives chat-completions requests against the simulated engine, whose byte
tokenizer makes one ASCII character one token.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ChatRollout", "DirectCall", "Workload", "direct_calls", "distinct_token_stats", "text"]

# Chat-template glue around one message in the direct workload (<|im_start|>role\n … <|im_end|>\n
# is ~5 tokens with a BPE tokenizer); the proxy workload gets the simulated template's real glue.
GLUE_TOKENS = 5


@dataclass(frozen=True)
class Workload:
    rollouts: int = 8
    turns: int = 50
    system_tokens: int = 2000
    task_tokens: int = 100
    tool_tokens: int = 200
    gen_tokens: int = 300
    retry_every: int = 0
    side_call_every: int = 0
    side_gen_tokens: int = 20
    vocab: int = 151_000
    seed: int = 5

    def describe(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DirectCall:
    kind: str  # turn | retry | side
    turn: int  # 1-based turn number this call belongs to
    entry: dict[str, Any]
    # Distinct tokens this call adds to the rollout (those not shared with an earlier call).
    new_distinct: int = 0
    new_generated: int = 0


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(16, vocab) for _ in range(n)]


def _log_probs(rng: random.Random, n: int) -> list[float]:
    # float32-exact values, as vLLM's samplers produce (stored as 4 bytes each).
    return array("f", [-rng.expovariate(1.5) for _ in range(n)]).tolist()


def _output_items(rid: str, k: str, n_chars: int) -> list[dict[str, Any]]:
    """A Responses message item of about ``n_chars`` characters (the proxy records this shape)."""
    return [
        {
            "id": f"msg_chatcmpl-{rid}-{k}",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "x" * n_chars, "annotations": []}],
        }
    ]


def direct_calls(w: Workload, r: int, *, prefix: str = "r") -> Iterator[DirectCall]:
    """The calls of rollout ``r`` in send order (built lazily: prompts share int objects)."""
    rng = random.Random(w.seed * 1_000_003 + r)
    rid = f"{prefix}{r:04d}"
    system = _ids(rng, w.system_tokens + GLUE_TOKENS, w.vocab)
    cum: list[int] = system + _ids(rng, w.task_tokens + GLUE_TOKENS, w.vocab)
    new_prompt = len(cum)
    n = 0

    def entry(prompt: list[int], gen_len: int) -> dict[str, Any]:
        nonlocal n
        n += 1
        cid = f"{rid}-c{n:04d}"
        gen = _ids(rng, gen_len, w.vocab)
        return {
            "schema_version": 1,
            "rollout_id": rid,
            "model_call_id": cid,
            "model": "policy",
            "prompt_token_ids": prompt,
            "generation_token_ids": gen,
            "generation_log_probs": _log_probs(rng, gen_len),
            "output_items": _output_items(rid, f"{n:04d}", gen_len),
            "token_item_index": 0,
            "created_at": 1_700_000_000.0 + n,
            "response_id": f"chatcmpl-{cid}",
        }

    for t in range(1, w.turns + 1):
        if t > 1:
            add = _ids(rng, GLUE_TOKENS + w.tool_tokens + 2 * GLUE_TOKENS, w.vocab)
            cum = cum + add
            new_prompt = len(add)
        if w.retry_every and t % w.retry_every == 0:
            e = entry(cum, w.gen_tokens)
            yield DirectCall("retry", t, e, new_prompt + w.gen_tokens, w.gen_tokens)
            new_prompt = 0  # the retry already brought this turn's prompt tokens
        e = entry(cum, w.gen_tokens)
        yield DirectCall("turn", t, e, new_prompt + w.gen_tokens, w.gen_tokens)
        cum = cum + e["generation_token_ids"]
        if w.side_call_every and t % w.side_call_every == 0:
            side_req = _ids(rng, 40, w.vocab)
            s = entry(system + side_req, w.side_gen_tokens)
            yield DirectCall("side", t, s, len(side_req) + w.side_gen_tokens, w.side_gen_tokens)


def distinct_token_stats(calls: list[DirectCall]) -> dict[str, int]:
    """Distinct token positions of a rollout (a prefix tree over every call's prompt+generation)
    and its raw size: 4 bytes per id, plus 4 bytes per generated token's float32 log-prob."""
    distinct = sum(c.new_distinct for c in calls)
    generated = sum(c.new_generated for c in calls)
    return {
        "distinct_tokens": distinct,
        "generated_tokens": generated,
        "raw_bytes": 4 * distinct + 4 * generated,
    }


# --------------------------------------------------------------------------- chat (proxy)

_VOCAB = (
    "alpha beta gamma delta file line test build error value path output check result module "
    "config return status token write read open close patch diff commit run"
)
_WORDS = tuple(_VOCAB.split())


def text(rng: random.Random, n_chars: int) -> str:
    """ASCII filler of exactly ``n_chars`` characters (``n_chars`` byte tokens)."""
    out: list[str] = []
    size = 0
    while size <= n_chars:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:n_chars]


@dataclass
class ChatRollout:
    """One rollout's chat history for the proxy workload (plain text turns, tool outputs)."""

    w: Workload
    r: int
    prefix: str = "p"
    messages: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.w.seed * 7_000_003 + self.r)
        self.rollout_id = f"{self.prefix}{self.r:04d}"
        self.messages = [
            {"role": "system", "content": text(self.rng, self.w.system_tokens)},
            {"role": "user", "content": text(self.rng, self.w.task_tokens)},
        ]

    def body(self) -> dict[str, Any]:
        return {
            "model": "smol",
            "messages": list(self.messages),
            "max_tokens": self.w.gen_tokens + 50,
            "temperature": 1.0,
        }

    def add_turn(self, answer: dict[str, Any]) -> None:
        """Echo the assistant message and append the next tool output."""
        message = answer["choices"][0]["message"]
        self.messages.append({"role": "assistant", "content": message.get("content") or ""})
        self.messages.append({"role": "user", "content": text(self.rng, self.w.tool_tokens)})
