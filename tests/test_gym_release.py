"""The ledger against the released nemo-gym 0.7.0 (issue #10 points 1 to 4 and 6).

Everything here runs the release's own code (``tests/support/nemo_gym_release.py`` finds the
cached wheel): its conformance kit against ``ledger.gym`` over SQLite, Postgres and HTTP, its
``TokenEntry`` through put and freeze, its serving path (``resolve_parent`` /
``capture_tokens`` / ``commit_entry``, with and without ``delta_records``) writing into the
ledger and resolving through ``CaptureLineageStore``, its builder reading what the ledger froze,
its ``InMemoryLineageStore`` as the oracle for request-time resolution, and its file store as a
``TokenSource`` that ``finalize_rollout_token_capture`` rebuilds from.
"""

from __future__ import annotations

import contextlib
import random
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from ledger import gym_fingerprint as ours
from ledger.delivery import finalize_rollout_token_capture, retire_rollout_token_capture
from ledger.gym import CaptureLineageStore, CaptureSink, CaptureSource
from ledger.gym_lineage import stamp_continuation
from ledger.records import TokenEntry, coerce_entry, gym_token_digest
from tests.support import nemo_gym_release
from tests.test_remote import Service, _serve

Rid = Callable[[str], str]
ALL_CHECKS = [
    "put_then_freeze_visibility",
    "idempotent_reput",
    "conflicting_reput",
    "mark_incomplete_durability",
    "freeze_idempotency",
    "post_freeze_write_safety",
    "conditional_retirement",
    "lineage_visibility",
    "fresh_client_lineage_visibility",
    "begin_call_custody",
]


@pytest.fixture(scope="session")
def release() -> SimpleNamespace:
    gym = nemo_gym_release.load()
    if gym is None:
        if nemo_gym_release.REQUIRED:
            pytest.fail(nemo_gym_release.missing_reason() + " (ROLLOUT_LEDGER_REQUIRE_GYM=1)")
        pytest.skip(nemo_gym_release.missing_reason())
    return gym


@pytest.fixture
def service(db_url: str) -> Iterator[Service]:
    yield from _serve(db_url)


@contextlib.contextmanager
def _serving(db_url: str) -> Iterator[str]:
    for svc in _serve(db_url):
        yield svc.url


# --------------------------------------------------------------------------- the release's kit


@pytest.mark.parametrize("with_lineage", [True, False], ids=["lineage", "no-lineage"])
async def test_release_conformance_passes_over_sql(
    release: SimpleNamespace, db_url: str, rid: Rid, with_lineage: bool
) -> None:
    passed = await release.conformance.run_conformance(
        lambda: CaptureSink(url=db_url),
        lambda: CaptureSource(url=db_url),
        (lambda: CaptureLineageStore(url=db_url)) if with_lineage else None,
        rollout_id=rid("kit"),
    )
    expected = ALL_CHECKS if with_lineage else [c for c in ALL_CHECKS if "lineage" not in c]
    assert passed == expected


@pytest.mark.parametrize("encoding", ["json", "packed-v1"])
@pytest.mark.parametrize("with_lineage", [True, False], ids=["lineage", "no-lineage"])
async def test_release_conformance_passes_over_http(
    release: SimpleNamespace, service: Service, rid: Rid, encoding: str, with_lineage: bool
) -> None:
    kw: dict[str, Any] = {"url": service.url, "token_encoding": encoding}
    passed = await release.conformance.run_conformance(
        lambda: CaptureSink(token="w-tok", **kw),
        lambda: CaptureSource(token="t-tok", **kw),
        (lambda: CaptureLineageStore(token="w-tok", **kw)) if with_lineage else None,
        rollout_id=rid("kit"),
    )
    expected = ALL_CHECKS if with_lineage else [c for c in ALL_CHECKS if "lineage" not in c]
    assert passed == expected


async def test_release_kit_still_catches_a_resolver_that_guesses(
    release: SimpleNamespace, db_url: str, rid: Rid
) -> None:
    """The kit is a real check of our classes: a resolver that answers every continuation with
    the latest call (a guess) fails ``lineage_visibility`` on the rewritten context."""

    class GuessingStore(CaptureLineageStore):
        async def resolve(self, rollout_id: str, request_items: Any) -> Any:
            res = await super().resolve(rollout_id, request_items)
            if res.status != "unresolved":
                return res
            # Guess: pretend the first turn was the one the parent saw.
            first = {"role": "user", "content": "What is the weather in Paris?"}
            return await super().resolve(rollout_id, [first, *request_items[1:]])

    with pytest.raises(release.conformance.ConformanceError) as info:
        await release.conformance.run_conformance(
            lambda: CaptureSink(url=db_url),
            lambda: CaptureSource(url=db_url),
            lambda: GuessingStore(url=db_url),
            rollout_id=rid("kit"),
        )
    assert info.value.check_name == "lineage_visibility"


def test_classes_satisfy_the_release_protocols(release: SimpleNamespace, tmp_path: Any) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'p.db'}"
    p = release.protocols
    sink, source, lineage = (
        CaptureSink(url=url),
        CaptureSource(url=url),
        CaptureLineageStore(url=url),
    )
    assert isinstance(sink, p.TokenSink)
    assert isinstance(source, p.TokenSource)
    assert isinstance(lineage, p.LineageResolver) and lineage.is_process_shared()
    assert isinstance(lineage, p.CaptureLedger)  # external staging (docs/gym-compatibility.md §6)
    p.install_token_sink(sink)  # Gym's own check of put/mark_incomplete/close
    p.install_token_sink(None)


# --------------------------------------------------------------------------- records


def _release_entry(release: SimpleNamespace, rollout_id: str, call_id: str, **over: Any) -> Any:
    data: dict[str, Any] = {
        "rollout_id": rollout_id,
        "model_call_id": call_id,
        "model": "Qwen/Qwen3-4B",
        "prompt_token_ids": [151644, 872, 198, 3838],
        "generation_token_ids": [40, 1079, 151645],
        "generation_log_probs": [-0.25, float("-inf"), -1e-9],
        "routed_experts": [[1, 2], [3, 4], [5, 6]],
        "output_items": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "I"}],
            },
        ],
        "token_item_index": 1,
        "response_id": "chatcmpl-1",
        "created_at": 1767225600.125,
        "prefix_requested": True,
        "prefix_supplied": True,
        "harness": {"name": "codex", "turn": 3},
    }
    data.update(over)
    entry = release.records.TokenEntry(**data)
    release.lineage.stamp_continuation(entry, [{"role": "user", "content": "hi"}])
    release.records.stamp_lineage(
        entry, None, parent_resolution=release.records.ParentResolutionStatus.UNRESOLVED
    )
    entry.parent_resolution_reason = "no_match"
    return entry


async def test_release_entries_round_trip_through_put_and_freeze(
    release: SimpleNamespace, db_url: str, rid: Rid
) -> None:
    r = rid("entry")
    entry = _release_entry(release, r, uuid.uuid4().hex)
    sink, source = CaptureSink(url=db_url), CaptureSource(url=db_url)
    try:
        await sink.put(entry)
        await sink.put(entry.model_dump())  # the same payload as a dict: a no-op
        rebuilt = _release_entry(release, r, entry.model_call_id, created_at=1767225600.5)
        with pytest.raises(Exception, match="different payload"):
            await sink.put(rebuilt)  # a rebuilt entry with other bytes is a conflict
        snap = await source.freeze(r)
    finally:
        await sink.close()
        await source.close()
    assert snap.incomplete  # the conflict marked it
    (frozen,) = snap.entries
    assert frozen.model_dump(mode="json") == entry.model_dump(mode="json")
    again = release.records.TokenEntry.model_validate(frozen.model_dump())
    assert again.model_dump(mode="json") == entry.model_dump(mode="json")
    assert frozen.generation_log_probs[1] == float("-inf")


def test_records_follow_the_release_validation_rules(release: SimpleNamespace) -> None:
    base = _release_entry(release, "r-1", "c1").model_dump()
    bad = [
        {"parent_resolution": "resolved", "parent_call_id": None},
        {"parent_resolution": "root", "parent_call_id": "c0"},
        {"prompt_is_delta": True},
        {"schema_version": 2},
        {"token_item_index": 5},
    ]
    for over in bad:
        with pytest.raises(ValueError):
            release.records.TokenEntry.model_validate({**base, **over})
        with pytest.raises(ValueError):
            coerce_entry({**base, **over})


@pytest.mark.parametrize("n", [0, 1, 7, 300])
def test_token_digest_matches_the_release(release: SimpleNamespace, n: int) -> None:
    rng = random.Random(n)
    ids = [rng.randrange(0, 2**31) for _ in range(n)]
    assert gym_token_digest(ids) == release.records.compute_digest(ids)


# --------------------------------------------------------------------------- fingerprints


def _random_conversation(rng: random.Random) -> list[Any]:
    texts = ["", "hi", " spaced ", "日本語", "a\nb", '{"x": 1}']
    args = ['{"b": 2, "a": 1}', '{"a":1,"b":2}', "not json ", None, {"k": [1, 2]}, ""]

    def content() -> Any:
        kind = rng.randrange(6)
        if kind == 0:
            return rng.choice(texts)
        if kind == 1:
            return None
        blocks: list[Any] = []
        for _ in range(rng.randrange(4)):
            pick = rng.randrange(8)
            if pick == 0:
                blocks.append(rng.choice(texts))
            elif pick == 1:
                blocks.append(
                    {
                        "type": rng.choice(["text", "output_text", "input_text"]),
                        "text": rng.choice(texts),
                    }
                )
            elif pick == 2:
                blocks.append({"text": rng.choice(texts)})
            elif pick == 3:
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": f"tu{rng.randrange(3)}",
                        "name": "f",
                        "input": rng.choice(args),
                    }
                )
            elif pick == 4:
                blocks.append(
                    {
                        "type": "tool_result",
                        "tool_use_id": "tu1",
                        "content": rng.choice([*texts, [{"type": "text", "text": "r"}]]),
                    }
                )
            elif pick == 5:
                blocks.append({"type": "image", "source": {"data": "QUJD", "type": "base64"}})
            elif pick == 6:
                blocks.append({"type": "thinking", "thinking": rng.choice(texts)})
            else:
                blocks.append({"type": "refusal", "refusal": "no"})
        return blocks

    items: list[Any] = []
    for _ in range(rng.randrange(1, 7)):
        pick = rng.randrange(9)
        if pick in (0, 1):
            items.append({"role": "user", "content": content()})
        elif pick in (2, 3):
            item: dict[str, Any] = {"role": "assistant", "content": content()}
            if rng.random() < 0.4:
                item["tool_calls"] = [
                    {
                        "id": f"call_{k}",
                        "type": "function",
                        "function": {"name": "get", "arguments": rng.choice(args)},
                    }
                    for k in range(rng.randrange(1, 3))
                ]
            if rng.random() < 0.3:
                item["type"] = "message"
            items.append(item)
        elif pick == 4:
            fc: dict[str, Any] = {
                "type": "function_call",
                "call_id": f"fc{rng.randrange(3)}",
                "name": "run",
                "arguments": rng.choice(args),
            }
            if rng.random() < 0.3:
                fc["namespace"] = "shell"
            items.append(fc)
        elif pick == 5:
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": "fc1",
                    "output": rng.choice([*texts, {"ok": True}]),
                }
            )
        elif pick == 6:
            items.append({"role": "tool", "tool_call_id": "call_0", "content": rng.choice(texts)})
        elif pick == 7:
            items.append({"role": "system", "content": content()})
        else:
            items.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]})
    return items


def _outcome(fn: Callable[[Any], str], items: Any) -> str:
    try:
        return fn(items)
    except (ValueError, TypeError, AttributeError) as exc:
        return f"raised {type(exc).__name__}"


@pytest.mark.parametrize("seed", range(4))
def test_fingerprint_and_context_digest_agree_with_the_release(
    release: SimpleNamespace, seed: int
) -> None:
    rng = random.Random(seed)
    theirs = release.fingerprint
    agreed = 0
    for _ in range(500):
        items = _random_conversation(rng)
        assert _outcome(ours.assistant_fingerprint, items) == _outcome(
            theirs.assistant_fingerprint, items
        ), items
        assert _outcome(ours.conversation_digest, items) == _outcome(
            theirs.conversation_digest, items
        ), items
        agreed += 1
    for value in ['{"b": 2, "a": 1}', " x ", None, {"z": 1, "a": [1.5]}, "[1, 2]", 3]:
        assert ours.canonicalize_tool_arguments(value) == theirs.canonicalize_tool_arguments(value)
    assert ours.FINGERPRINT_VERSION == theirs.FINGERPRINT_VERSION
    assert agreed == 500
    for bad in ([1], [{"role": "assistant", "content": 5}], [{"role": "user", "content": [{}]}]):
        assert _outcome(ours.conversation_digest, bad) == _outcome(theirs.conversation_digest, bad)


def test_stamp_continuation_matches_the_release(release: SimpleNamespace) -> None:
    rng = random.Random(7)
    for _ in range(200):
        items = [
            i
            for i in _random_conversation(rng)
            if _outcome(ours.conversation_digest, [i]).isalnum()
        ]
        output = [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "ok"}],
            }
        ]
        mine = TokenEntry(
            rollout_id="r",
            model_call_id="c",
            prompt_token_ids=[1],
            generation_token_ids=[2],
            generation_log_probs=[-1.0],
            output_items=output,
        )
        theirs = release.records.TokenEntry(**mine.model_dump())
        stamp_continuation(mine, items)
        release.lineage.stamp_continuation(theirs, items)
        assert mine.model_dump(mode="json") == theirs.model_dump(mode="json")


# --------------------------------------------------------------------------- the serving path


def _chat_response(call_id: str, text: str, prompt: list[int], gen: list[int]) -> dict[str, Any]:
    """A vLLM chat completion as Gym's model server hands it to ``capture_tokens``."""
    return {
        "id": f"chatcmpl-{call_id[:12]}",
        "object": "chat.completion",
        "model": "policy",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {
                    "role": "assistant",
                    "content": text,
                    "prompt_token_ids": prompt,
                    "generation_token_ids": gen,
                    "generation_log_probs": [-0.5 - k / 16 for k in range(len(gen))],
                },
            }
        ],
    }


async def _serve_call(
    release: SimpleNamespace,
    sink: Any,
    lineage: Any,
    rollout_id: str,
    items: list[dict[str, Any]],
    prompt: list[int],
    gen: list[int],
    text: str,
    *,
    delta: bool,
) -> Any:
    """One captured call through the release's serving path; returns its capture context."""
    s = release.sink
    context = s.CaptureContext(
        rollout_id=rollout_id,
        model_call_id=uuid.uuid4().hex,
        token_sink=sink,
        lineage_store=lineage,
        model="policy",
        delta_records=delta,
    )
    token = s.set_token_sink(context)
    try:
        await s.resolve_parent(items)
        await s.register_call_intent()
        await s.capture_tokens(_chat_response(context.model_call_id, text, prompt, gen), items)
    finally:
        s.reset_token_sink(token)
    return context


async def _three_turns(
    release: SimpleNamespace, sink: Any, lineage: Any, rollout_id: str, *, delta: bool
) -> tuple[list[Any], list[int]]:
    """A three-turn chat: each prompt is the previous prompt + generation + the new user turn."""
    items: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    tokens: list[int] = [1, 9690, 198]
    contexts = []
    for turn in range(3):
        items.append({"role": "user", "content": f"question {turn}"})
        tokens += [4093, 198, 100 + turn]
        gen = [200 + turn, 201 + turn, 2]
        text = f"answer {turn}"
        contexts.append(
            await _serve_call(
                release,
                sink,
                lineage,
                rollout_id,
                list(items),
                list(tokens),
                gen,
                text,
                delta=delta,
            )
        )
        items.append({"role": "assistant", "content": text})
        tokens += gen
    return contexts, tokens


def _token_view(response: dict[str, Any]) -> list[tuple[list[int], list[int], list[float]]]:
    return [
        (item["prompt_token_ids"], item["generation_token_ids"], item["generation_log_probs"])
        for item in response["output"]
        if item.get("generation_token_ids")
    ]


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
async def test_release_serving_path_writes_resolves_and_builds_through_the_ledger(
    release: SimpleNamespace, db_url: str, rid: Rid, delta: bool
) -> None:
    r = rid("serve")
    sink, lineage, source = (
        CaptureSink(url=db_url),
        CaptureLineageStore(url=db_url),
        CaptureSource(url=db_url),
    )
    try:
        contexts, final = await _three_turns(release, sink, lineage, r, delta=delta)
        statuses = [c.parent_resolution.status.value for c in contexts]
        assert statuses == ["root", "resolved", "resolved"]
        assert [c.parent_call_id for c in contexts] == [
            None,
            *(c.model_call_id for c in contexts[:2]),
        ]
        assert all(c.committed for c in contexts)
        snap = await source.freeze(r)
        assert not snap.incomplete and len(snap.entries) == 3
        assert sorted(e.prompt_is_delta for e in snap.entries) == [False, delta, delta]
        result = {
            "_ng_rollout_id": r,
            "response": {
                "id": "resp-final",
                "output": [
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": "answer 2"}],
                    }
                ],
            },
        }
        # The release's consumer and builder over the ledger's snapshot...
        theirs = await release.consumer.trajectories_from_source(
            r,
            source,
            builder="prefix_merging",
            model="policy",
            verified_response=result["response"],
        )
        assert theirs["mask_sample"] is False, theirs["metrics"]
        assert theirs["metrics"]["chains"] == 1
        # ...and the ledger's own build deliver the same tokens.
        built = await finalize_rollout_token_capture(result, source)
        assert built is not None and not built["mask_sample"], built["metrics"]
        assert _token_view(result["response"]) == _token_view(theirs["rebuilt_response"])
        last_prompt, last_gen, _ = _token_view(result["response"])[-1]
        assert [*last_prompt, *last_gen] == final
    finally:
        for client in (sink, lineage, source):
            await client.close()


async def test_release_serving_path_over_http_with_delta_records(
    release: SimpleNamespace, service: Service, rid: Rid
) -> None:
    """The same through a running ledger service: delta records resolve, freeze as put and
    build with the release's consumer."""
    r = rid("serve-http")
    kw: dict[str, Any] = {"url": service.url, "token_encoding": "packed-v1"}
    sink = CaptureSink(token="w-tok", **kw)
    lineage = CaptureLineageStore(token="w-tok", **kw)
    source = CaptureSource(token="t-tok", **kw)
    try:
        contexts, final = await _three_turns(release, sink, lineage, r, delta=True)
        assert [c.parent_resolution.status.value for c in contexts] == [
            "root",
            "resolved",
            "resolved",
        ]
        snap = await source.freeze(r)
        assert sorted(e.prompt_is_delta for e in snap.entries) == [False, True, True]
        theirs = await release.consumer.trajectories_from_source(r, source, model="policy")
        assert theirs["mask_sample"] is False, theirs["metrics"]
        prompt, gen, _ = _token_view(theirs["rebuilt_response"])[-1]
        assert [*prompt, *gen] == final
    finally:
        for client in (sink, lineage, source):
            await client.close()


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
async def test_finalize_rebuilds_from_the_release_file_store(
    release: SimpleNamespace, tmp_path: Any, delta: bool
) -> None:
    """Any TokenSource: the release's own file store, written by its own serving path."""
    store = release.store.TokenCaptureStore(tmp_path / "capture")
    lineage = release.lineage.FileLineageStore(tmp_path / "capture")
    r = "7-0"
    _contexts, final = await _three_turns(release, store, lineage, r, delta=delta)
    result: dict[str, Any] = {
        "_ng_task_index": 7,
        "_ng_rollout_index": 0,
        "response": {
            "id": "resp-final",
            "output": [{"type": "message", "role": "assistant", "content": "answer 2"}],
        },
    }
    built = await finalize_rollout_token_capture(result, store)
    assert built is not None and not built["mask_sample"], built["metrics"]
    assert "mask_sample" not in result
    prompt, gen, _ = _token_view(result["response"])[-1]
    assert [*prompt, *gen] == final
    reference = release.consumer.trajectories_for_rollout(
        r, [tmp_path / "capture"], model="policy", verified_response=result["response"]
    )
    assert _token_view(result["response"]) == _token_view(reference["rebuilt_response"])
    assert built["_capture_snapshot"] == reference["_capture_snapshot"]
    assert await retire_rollout_token_capture(r, store, built)
    assert not store.path_for(r).exists()  # retired through the store's own drop


async def test_finalize_masks_an_incomplete_foreign_snapshot(
    release: SimpleNamespace, tmp_path: Any
) -> None:
    store = release.store.TokenCaptureStore(tmp_path / "capture")
    lineage = release.lineage.FileLineageStore(tmp_path / "capture")
    await _three_turns(release, store, lineage, "8-0", delta=False)
    await store.mark_incomplete("8-0", "lost-call")
    result: dict[str, Any] = {"_ng_rollout_id": "8-0", "response": {"output": []}}
    built = await finalize_rollout_token_capture(result, store)
    assert built is not None and built["mask_sample"] and result["mask_sample"] is True
    assert not await retire_rollout_token_capture("8-0", store, built)
    assert store.path_for("8-0").exists()  # a masked build keeps its records


# --------------------------------------------------------------------------- resolution oracle


async def test_resolution_agrees_with_the_release_in_memory_store(
    release: SimpleNamespace, db_url: str, rid: Rid
) -> None:
    """The same committed entries in the ledger and in the release's ``InMemoryLineageStore``:
    every request resolves the same way (status, reason, parent, cumulative tokens)."""
    r = rid("oracle")
    oracle = release.lineage.InMemoryLineageStore()
    sink, lineage = CaptureSink(url=db_url), CaptureLineageStore(url=db_url)
    q = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    tools = {"role": "_ng_request_envelope", "content": '{"tools":[{"name":"t"}]}'}

    def entry(
        call_id: str, request: list[dict[str, Any]], text: str, prompt: list[int], gen: list[int]
    ) -> Any:
        e = release.records.TokenEntry(
            rollout_id=r,
            model_call_id=call_id,
            prompt_token_ids=prompt,
            generation_token_ids=gen,
            generation_log_probs=[-1.0] * len(gen),
            created_at=1.0,
            output_items=[{"type": "message", "role": "assistant", "content": text}],
        )
        release.lineage.stamp_continuation(e, request)
        release.records.stamp_lineage(
            e, None, parent_resolution=release.records.ParentResolutionStatus.ROOT
        )
        return e

    a1 = {"role": "assistant", "content": "A"}
    entries = [
        entry("c-a", q, "A", [1, 2], [3]),
        entry("c-b", q, "A", [1, 2], [3]),  # identical retry of c-a: collapses to c-a
        entry("c-c", [tools, *q], "B", [1, 5], [6]),
        entry("c-d", [tools, *q], "B", [1, 5], [7]),  # same text, other tokens: ambiguous
        entry("c-e", [*q, a1, {"role": "user", "content": "more"}], "", [1, 2, 3, 4], []),
    ]
    try:
        for e in entries:
            await sink.put(e)
            await oracle.put(e)
        requests = [
            [*q, a1, {"role": "user", "content": "next"}],
            [{"role": "system", "content": "changed"}, q[1], a1],
            [tools, *q, {"role": "assistant", "content": "B"}],
            [*q],
            [*q, a1, {"role": "user", "content": "more"}, {"role": "assistant", "content": ""}],
            [*q, {"role": "assistant", "content": "never said"}],
            [q[1], a1],
        ]
        for request in requests:
            mine = await lineage.resolve(r, request)
            theirs = await oracle.resolve(r, request)
            assert (mine.status.value, mine.reason) == (theirs.status.value, theirs.reason), request
            if theirs.match is not None:
                assert mine.match is not None
                assert mine.match.model_call_id == theirs.match.model_call_id
                assert mine.match.cumulative_token_ids == theirs.match.cumulative_token_ids
                assert mine.match.digest == theirs.match.digest
    finally:
        await sink.close()
        await lineage.close()


# --------------------------------------------------------------------------- CaptureLedger


def _hex(seed: str) -> str:
    import hashlib

    return hashlib.sha256(seed.encode()).hexdigest()


def _commits(release: SimpleNamespace, rollout_id: str) -> list[Any]:
    """Two chained staged calls (a text root, a token_in child) and a rewritten-context call."""
    st = release.staging_records
    q = [{"role": "user", "content": "Plan the trip."}]
    a1 = [
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Day 1"}],
        }
    ]
    q2 = [*q, *a1, {"role": "user", "content": "And day 2?"}]
    a2 = [{"type": "function_call", "call_id": "fc1", "name": "book", "arguments": '{"day": 2}'}]

    def call(call_id: str, parent: str | None, prev: int, delta: int, fv: int) -> Any:
        return st.CallRecord(
            model_call_id=call_id,
            parent_call_id=parent,
            prev_len=prev,
            delta_len=delta,
            cum_len=prev + delta,
            weight_version=3,
            digest=_hex(f"d-{call_id}"),
            extras_digest=_hex("extras"),
            staging_key=f"{rollout_id}/{call_id}",
            mode="token_in" if parent else "text",
            chain_hash=_hex(f"chain-{call_id}"),
            cumulative_hash=_hex(f"cum-{call_id}"),
            response_id=f"resp-{call_id}",
            admitted_at=1767225600.0,
            fingerprint_version=fv,
        )

    return [
        st.CaptureLedgerCommit(
            rollout_id=rollout_id,
            record=call("c1", None, 0, 12, 2),
            request_items=q,
            response_items=a1,
        ),
        st.CaptureLedgerCommit(
            rollout_id=rollout_id,
            record=call("c2", "c1", 12, 5, 2),
            staging_chain=("c1",),
            request_items=q2,
            response_items=a2,
        ),
        st.CaptureLedgerCommit(  # fingerprint version 0: recorded, never resolvable (as 0.7.0)
            rollout_id=rollout_id,
            record=call("c3", None, 0, 4, 0),
            request_items=[{"role": "user", "content": "Other"}],
            response_items=a1,
        ),
    ]


async def _custody_script(release: SimpleNamespace, ledger: Any, rollout_id: str) -> dict[str, Any]:
    """Drive one CaptureLedger and report everything observable."""
    out: dict[str, Any] = {"has_rows_before": await ledger.has_rows(rollout_id)}
    commits = _commits(release, rollout_id)
    for commit in commits:
        await ledger.record(commit)
    await ledger.record(commits[0])  # an identical replay: a no-op
    changed = commits[1].model_copy(
        update={"record": commits[1].record.model_copy(update={"weight_version": 4})}
    )
    try:
        await ledger.record(changed)
        out["conflict"] = "accepted"
    except Exception:
        out["conflict"] = "refused"
    await ledger.record_failure(rollout_id, "c9", "worker_capture_failed")
    await ledger.record_failure(rollout_id, "c9", "worker_capture_failed")
    await ledger.record_failure(rollout_id, "c8", "unresolved_parent")
    out["has_rows"] = await ledger.has_rows(rollout_id)
    out["manifest"] = await ledger.manifest(rollout_id)
    c = commits
    requests = {
        "continues c1": [*c[1].request_items],
        "continues c2": [
            *c[1].request_items,
            *c[1].response_items,
            {"type": "function_call_output", "call_id": "fc1", "output": "ok"},
        ],
        "rewritten": [{"role": "user", "content": "Plan a trip."}, *c[0].response_items],
        "continues c3 (v0)": [*c[2].request_items, *c[2].response_items],
        "root": [{"role": "user", "content": "hi"}],
    }
    for name, items in requests.items():
        res = await ledger.resolve(rollout_id, items)
        m = res.match
        out[name] = (
            res.status.value,
            None
            if m is None
            else (
                m.model_call_id,
                tuple(m.cumulative_token_ids),
                m.digest,
                tuple(m.staging_chain),
                m.prev_len,
                m.chain_hash,
            ),
        )
    return out


@pytest.mark.parametrize("transport", ["sql", "http"])
async def test_capture_ledger_agrees_with_the_release_file_lineage_store(
    release: SimpleNamespace, db_url: str, tmp_path: Any, rid: Rid, transport: str
) -> None:
    r = rid("custody")
    reference = release.lineage.FileLineageStore(tmp_path / "capture")
    expected = await _custody_script(release, reference, r)
    if transport == "sql":
        ours = await _custody_script(release, CaptureLineageStore(url=db_url), r)
    else:
        with _serving(db_url) as url:
            store = CaptureLineageStore(url=url, token="w-tok")
            try:
                ours = await _custody_script(release, store, r)
            finally:
                await store.close()
    assert ours == expected
    assert expected["continues c2"][0] == "resolved" and expected["conflict"] == "refused"
    manifest = release.staging_records.RolloutManifest.model_validate(ours["manifest"])
    assert [x.model_call_id for x in manifest.records] == ["c1", "c2", "c3"]
    assert [(f.model_call_id, f.reason) for f in manifest.failures] == [
        ("c9", "worker_capture_failed"),
        ("c8", "unresolved_parent"),
    ]
