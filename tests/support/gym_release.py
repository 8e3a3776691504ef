"""Run the released NeMo Gym 0.7.0 capture path and the ledger side by side.

The wheel's ``nemo_gym.token_id_capture`` package is pure Python; :func:`load_release` puts the
cached, unpacked wheel on ``sys.path`` (``$ROLLOUT_LEDGER_CACHE/nemo-gym-wheel/extracted``) and
returns its modules, or skips the test with the reason when it is not cached.

:class:`Harness` plays an agent harness and Gym's model server at once: every model call goes
through the release's own serving path (``CaptureContext``, ``resolve_parent``,
``capture_tokens``, ``commit_entry``) twice, once into the release's ``TokenCaptureStore`` with
its ``FileLineageStore`` and once into the ledger's ``CaptureSink``, with the parent decision the
release's resolver made (``ReplayResolver``), so both ends hold what one model server would have
written.  Token ids come from a toy chat template: every message renders to its own tokens and an
assistant message in the history renders to exactly the tokens that were sampled for it, as a
well-behaved template does; rewriting a message re-renders it.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

BOS, HEADER, END, SYS, USR, TOOL, ENV = 1, 2, 3, 4, 5, 6, 7


def release_dir() -> Path | None:
    """The unpacked nemo-gym 0.7.0 wheel, or ``None`` when it is not cached."""
    cache = os.environ.get("ROLLOUT_LEDGER_CACHE") or str(Path.home() / ".cache/rollout-ledger")
    path = Path(cache) / "nemo-gym-wheel" / "extracted"
    return path if (path / "nemo_gym" / "token_id_capture" / "builder.py").is_file() else None


def load_release() -> SimpleNamespace:
    """The release's capture modules; skips the test when the wheel is not cached."""
    path = release_dir()
    if path is None:
        pytest.skip(
            "the nemo-gym 0.7.0 wheel is not cached under $ROLLOUT_LEDGER_CACHE/nemo-gym-wheel/"
            "extracted (pip download nemo-gym==0.7.0 --no-deps --python-version 3.13.14 "
            "--only-binary=:all: and unzip it there)"
        )
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    names = ("sink", "store", "lineage", "consumer", "records", "protocols", "builder")
    return SimpleNamespace(
        **{n: importlib.import_module(f"nemo_gym.token_id_capture.{n}") for n in names}
    )


class ReplayResolver:
    """A lineage resolver that answers with the decision the release's resolver made for the
    same call: both ends then hold records with the same recorded parent decisions.

    TODO(lead): once ``CaptureLineageStore.resolve(rollout_id, request_items)`` lands (issue 10
    point 2), add a variant that resolves the ledger's side through it instead.
    """

    def __init__(self) -> None:
        self.next: Any = None

    async def resolve(self, rollout_id: str, request_items: list[dict[str, Any]]) -> Any:
        return self.next

    def is_process_shared(self) -> bool:
        return True

    async def close(self) -> None:
        return None


class DictSink:
    """The ledger's sink, fed the release's ``TokenEntry`` as a dict.

    TODO(lead): drop this wrapper once ``CaptureSink.put`` accepts the release's ``TokenEntry``
    objects (issue 10 point 1).
    """

    def __init__(self, sink: Any) -> None:
        self.sink = sink

    async def put(self, entry: Any) -> None:
        await self.sink.put(
            entry.model_dump(mode="json") if hasattr(entry, "model_dump") else entry
        )

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        await self.sink.mark_incomplete(rollout_id, model_call_id)

    async def close(self) -> None:
        return None


@dataclass
class Message:
    item: dict[str, Any]
    tokens: list[int]


@dataclass
class Call:
    call_id: str
    response_id: str
    request: list[dict[str, Any]]
    prompt: list[int]
    generation: list[int]
    log_probs: list[float]
    output: dict[str, Any]
    captured: bool = True


@dataclass
class Conversation:
    system: str
    tools: list[dict[str, Any]] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)

    def copy(self) -> Conversation:
        return Conversation(self.system, copy.deepcopy(self.tools), copy.deepcopy(self.messages))

    def request_items(self) -> list[dict[str, Any]]:
        items = [{"role": "system", "content": self.system}]
        items += [copy.deepcopy(m.item) for m in self.messages]
        if self.tools:  # Gym's request envelope pseudo-item
            envelope = json.dumps({"tools": self.tools}, sort_keys=True)
            items.insert(0, {"role": "_ng_request_envelope", "content": envelope})
        return items

    def prompt(self) -> list[int]:
        out = [BOS, *text_tokens(SYS, self.system)]
        if self.tools:
            out += text_tokens(ENV, json.dumps(self.tools, sort_keys=True))
        for m in self.messages:
            out += m.tokens
        return [*out, HEADER]


def text_tokens(role: int, text: str) -> list[int]:
    rng = random.Random(f"{role}:{text}")
    return [role, *(rng.randrange(100, 50_000) for _ in range(2 + len(text) % 5)), END]


class Harness:
    """One rollout, captured by the release and by the ledger in lockstep."""

    def __init__(
        self,
        gym: SimpleNamespace,
        rng: random.Random,
        rollout_id: str,
        *,
        release_store: Any,
        release_lineage: Any,
        ledger_sink: Any,
        delta_records: bool,
    ) -> None:
        self.gym, self.rng, self.rollout_id = gym, rng, rollout_id
        self.release_store, self.release_lineage = release_store, release_lineage
        self.ledger_sink = DictSink(ledger_sink)
        self.replay = ReplayResolver()
        self.delta_records = delta_records
        self.calls: list[Call] = []
        self.features: set[str] = set()
        self._n = 0

    # ------------------------------------------------------------------ one model call

    def sample(self, conv: Conversation, *, tool: bool, empty: bool = False) -> Call:
        self._n += 1
        call_id = f"{self.rng.getrandbits(64):016x}{self._n:04d}"
        if empty:
            generation: list[int] = []
            text, tool_calls = "", None
        else:
            body = [self.rng.randrange(100, 50_000) for _ in range(self.rng.randrange(1, 6))]
            generation = [*body, END]
            text = "answer " + "-".join(map(str, body))
            tool_calls = (
                [
                    {
                        "id": f"tc{self._n}",
                        "type": "function",
                        "function": {"name": "search", "arguments": json.dumps({"q": body[0]})},
                    }
                ]
                if tool
                else None
            )
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        log_probs = [round(-self.rng.random() * 3, 4) for _ in generation]
        return Call(
            call_id,
            f"chatcmpl-{call_id}",
            conv.request_items(),
            conv.prompt(),
            generation,
            log_probs,
            message,
        )

    def same_again(self, call: Call, *, identical: bool) -> Call:
        """A retry of ``call``'s request: the same tokens again, or a different sample."""
        self._n += 1
        call_id = f"{self.rng.getrandbits(64):016x}{self._n:04d}"
        if identical:
            log_probs = [round(lp + self.rng.choice([0.0, 0.01]), 4) for lp in call.log_probs]
            return Call(
                call_id,
                f"chatcmpl-{call_id}",
                call.request,
                call.prompt,
                list(call.generation),
                log_probs,
                copy.deepcopy(call.output),
            )
        conv_like = Conversation("")
        fresh = self.sample(conv_like, tool="tool_calls" in call.output)
        return Call(
            fresh.call_id,
            fresh.response_id,
            call.request,
            call.prompt,
            fresh.generation,
            fresh.log_probs,
            fresh.output,
        )

    def response(self, call: Call, *, token_ids: bool = True) -> dict[str, Any]:
        message = dict(call.output)
        if token_ids:
            message["prompt_token_ids"] = list(call.prompt)
            message["generation_token_ids"] = list(call.generation)
            message["generation_log_probs"] = list(call.log_probs)
        return {
            "id": call.response_id,
            "object": "chat.completion",
            "model": "policy",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        }

    async def serve(self, call: Call, *, capture: bool = True, **faults: Any) -> None:
        """Both model servers serve ``call``: resolve, then capture, exactly as Gym's does."""
        self.calls.append(call)
        call.captured = capture
        if not capture:
            self.features.add("uncaptured_call")
            return
        payload = self.response(call, token_ids=not faults.get("no_token_ids"))
        message = payload["choices"][0]["message"]
        if faults.get("bad_log_probs"):
            message["generation_log_probs"] = call.log_probs[:-1]
        if faults.get("nan_log_prob"):
            message["generation_log_probs"] = [float("nan"), *call.log_probs[1:]]
        if faults.get("odd_call_id"):
            # A framework's own call id: the release stores it, the ledger's put refuses it.
            self.features.add("odd_call_id")
            call.call_id = f"run:{self._n}:turn:{len(self.calls)}"
        sink = self.gym.sink
        release_context = sink.CaptureContext(
            rollout_id=self.rollout_id,
            model_call_id=call.call_id,
            token_sink=self.release_store,
            lineage_store=self.release_lineage,
            delta_records=self.delta_records,
        )
        token = sink.set_token_sink(release_context)
        try:
            await sink.resolve_parent(call.request)
            await sink.capture_tokens(copy.deepcopy(payload), call.request)
        finally:
            sink.reset_token_sink(token)
        self.replay.next = release_context.parent_resolution
        ledger_context = sink.CaptureContext(
            rollout_id=self.rollout_id,
            model_call_id=call.call_id,
            token_sink=self.ledger_sink,
            lineage_store=self.replay,
            delta_records=self.delta_records,
        )
        token = sink.set_token_sink(ledger_context)
        try:
            await sink.resolve_parent(call.request)
            await sink.capture_tokens(copy.deepcopy(payload), call.request)
        finally:
            sink.reset_token_sink(token)

    # ------------------------------------------------------------------ harness moves

    def keep(self, conv: Conversation, call: Call) -> None:
        # The prompt ends with the assistant header; the sampled tokens follow it.
        conv.messages.append(Message(copy.deepcopy(call.output), [HEADER, *call.generation]))

    def tool_result(self, conv: Conversation, call: Call) -> None:
        tc = call.output.get("tool_calls")
        text = f"result {self.rng.randrange(10**6)}"
        if tc:
            item = {"role": "tool", "tool_call_id": tc[0]["id"], "content": text}
        else:
            item = {"role": "user", "content": text}
        conv.messages.append(Message(item, text_tokens(TOOL, text)))


async def play(h: Harness) -> dict[str, Any]:
    """A random agent rollout; returns the rollout result (the scored response included)."""
    rng = h.rng
    conv = Conversation(
        f"system {rng.randrange(5)}", tools=[{"name": "search"}] * rng.randint(0, 1)
    )
    conv.messages.append(Message({"role": "user", "content": "task"}, text_tokens(USR, "task")))
    turns = rng.randint(1, 5)
    final: Call | None = None
    hazard = rng.random() < 0.6  # the other rollouts are clean agent loops
    for turn in range(turns):
        last = turn == turns - 1
        event = rng.random() if hazard else 1.0
        call = h.sample(conv, tool=not last)
        if event < 0.05:
            h.features.add("empty_generation")
            await h.serve(h.sample(conv, tool=not last, empty=True))
        elif event < 0.13:
            identical = rng.random() < 0.5
            h.features.add("retry_identical" if identical else "retry")
            other = h.same_again(call, identical=identical)
            first, second = (call, other) if rng.random() < 0.5 else (other, call)
            await h.serve(first)
            await h.serve(second)
            call = rng.choice([call, other])
            if last:
                h.features.add("final_retry")
            if turn == 0:
                h.features.add("first_call_retry")
            final = call
            advance(h, conv, call, last)
            continue
        elif event < 0.17:
            await h.serve(call, capture=False)
            final = call
            advance(h, conv, call, last)
            continue
        elif event < 0.2:
            h.features.add("capture_missing")
            await h.serve(call, no_token_ids=True)
            final = call
            advance(h, conv, call, last)
            continue
        elif event < 0.23:
            h.features.add("malformed_entry")
            await h.serve(
                call, **{rng.choice(["bad_log_probs", "nan_log_prob", "odd_call_id"]): True}
            )
            final = call
            advance(h, conv, call, last)
            continue
        elif event < 0.29 and conv.messages:
            await rewrite(h, conv)
            call = h.sample(conv, tool=not last)
        elif event < 0.34:
            h.features.add("compaction")
            summary = f"summary {rng.randrange(10**6)}"
            conv.messages = [
                Message({"role": "user", "content": summary}, text_tokens(USR, summary))
            ]
            call = h.sample(conv, tool=not last)
        elif event < 0.41:
            await sub_agent(h, conv)
            call = h.sample(conv, tool=not last)
        elif event < 0.45 and not last:
            # A sub-agent forked from the main history samples the very same tokens as the main
            # agent's next call, then both conversations go on (issue 10, 5g).
            h.features.add("identical_fork")
            twin = h.same_again(call, identical=True)
            sub = conv.copy()
            await h.serve(call)
            await h.serve(twin)
            h.keep(sub, twin)
            sub.messages.append(
                Message({"role": "user", "content": "sub"}, text_tokens(USR, "sub"))
            )
            await h.serve(h.sample(sub, tool=False))
            final = call
            advance(h, conv, call, last)
            continue
        await h.serve(call)
        final = call
        advance(h, conv, call, last)
    assert final is not None
    return scored_result(h, final, conv)


def advance(h: Harness, conv: Conversation, call: Call, last: bool) -> None:
    h.keep(conv, call)
    if not last:
        h.tool_result(conv, call)


async def rewrite(h: Harness, conv: Conversation) -> None:
    """The harness rewrites history: an assistant turn, the system prompt or the tool list."""
    rng = h.rng
    kind = rng.choice(["assistant", "system", "tools"])
    assistant = [m for m in conv.messages if m.item.get("role") == "assistant"]
    if kind == "assistant" and assistant:
        h.features.add("rewritten_history")
        m = rng.choice(assistant)
        m.item["content"] = str(m.item.get("content")) + " (edited)"
        m.tokens = [HEADER, *text_tokens(USR + 20, m.item["content"])]
    elif kind == "tools":
        h.features.add("changed_tools")
        conv.tools = [{"name": "search"}, {"name": "fetch"}] if conv.tools else [{"name": "fetch"}]
    else:
        h.features.add("changed_system_prompt")
        conv.system += " v2"


async def sub_agent(h: Harness, conv: Conversation) -> None:
    """A sub-agent: a fork of the main history, or a fresh conversation; its answer comes back
    to the main agent as a user turn."""
    rng = h.rng
    if rng.random() < 0.5:
        h.features.add("fork")
        sub = conv.copy()
        sub.messages.append(Message({"role": "user", "content": "sub"}, text_tokens(USR, "sub")))
    else:
        h.features.add("fresh_sub_agent")
        sub = Conversation("sub-agent system")
        sub.messages.append(Message({"role": "user", "content": "sub"}, text_tokens(USR, "sub")))
    answer: Call | None = None
    for _ in range(rng.randint(1, 2)):
        answer = h.sample(sub, tool=False)
        await h.serve(answer)
        h.keep(sub, answer)
        sub.messages.append(Message({"role": "user", "content": "go"}, text_tokens(USR, "go")))
    assert answer is not None
    text = f"sub-agent said {answer.output['content']}"
    conv.messages.append(Message({"role": "user", "content": text}, text_tokens(USR, text)))


def scored_result(h: Harness, final: Call, conv: Conversation) -> dict[str, Any]:
    rng = h.rng
    mode = rng.choice(
        ["final_output", "final_output", "transcript", "none", "explicit", "declared"]
    )
    response: dict[str, Any] = {"model": "policy", "output": []}
    result: dict[str, Any] = {"_ng_rollout_id": h.rollout_id, "reward": 1.0}
    if mode in ("final_output", "explicit", "declared"):
        response["output"] = [copy.deepcopy(final.output)]
        if rng.random() < 0.5:
            response["id"] = final.response_id
    elif mode == "transcript":
        response["output"] = [copy.deepcopy(m.item) for m in conv.messages]
    if mode == "explicit":
        result["_ng_terminal_model_call_id"] = final.call_id
    if mode == "declared":
        result["terminal_response_id"] = final.response_id
    if rng.random() < 0.05:
        h.features.add("environment_mask")
        result["mask_sample"] = True
    result["response"] = response
    h.features.add(f"attribution_{mode}")
    return result
