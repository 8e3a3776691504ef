"""The rebuild planner (``ledger.builder``), driven by rollouts built the way ingest sees them.

``Rollout`` below plays the storage layer's part: it keeps the real token lists of each call,
proves every parent the way ingest does (the earlier call whose cumulative tokens are the
longest prefix of the new prompt, identical candidates collapsed to the smallest call id) and
hands the builder only ``CallView`` metadata.  Scenarios follow what harnesses really do:
tool loops, retries, compaction, title generation, sub-agents, template drift.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import time
from array import array
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.builder import MASK_REASONS, BuildInputError, failed_plan, plan_build
from ledger.model import BuildPlan, CallView, ChainLinkTokens
from ledger.projection import assert_prefix_contiguous, project_chain

IM_START, IM_END, NEWLINE = 151644, 151645, 198
SYSTEM, USER, ASSISTANT, TOOL = 8948, 872, 77091, 14172
METRIC_KEYS = {
    "n_calls",
    "chains",
    "roots",
    "delivered_fraction",
    "quarantined_calls",
    "empty_generation_calls",
    "unresolved_parent_calls",
    "terminal_attribution",
    "capture_incomplete",
    "error",
    "generated_tokens_captured",
    "generated_tokens_delivered",
    "mask_reasons",
    "parent_link_failures",
    "quarantined_fraction",
}


def digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(array("q", tokens).tobytes()).hexdigest()


def text(seed: int, n: int) -> list[int]:
    """``n`` ordinary vocabulary ids, deterministic per seed."""
    rng = random.Random(seed)
    return [rng.randrange(200, 151_000) for _ in range(n)]


def turn(role: int, seed: int, n: int = 12) -> list[int]:
    return [IM_START, role, NEWLINE, *text(seed, n), IM_END, NEWLINE]


HEADER = [IM_START, ASSISTANT, NEWLINE]
SYSTEM_TURN = turn(SYSTEM, 1, 30)


def answer(seed: int, n: int = 9) -> list[int]:
    return [*text(seed, n), IM_END]


class Rollout:
    """Captured calls of one rollout, with the edges ingest would prove for them."""

    def __init__(self) -> None:
        self.views: dict[str, CallView] = {}
        self.prompts: dict[str, list[int]] = {}
        self.generations: dict[str, list[int]] = {}
        self.clock = 1_700_000_000.0

    def cumulative(self, call_id: str) -> list[int]:
        return self.prompts[call_id] + self.generations[call_id]

    def continue_(self, call_id: str, seed: int, role: int = TOOL) -> list[int]:
        """The prompt of a faithful next turn after ``call_id`` (a tool result by default)."""
        return [*self.cumulative(call_id), NEWLINE, *turn(role, seed), *HEADER]

    def add(
        self,
        call_id: str,
        prompt: list[int],
        generation: list[int],
        *,
        parent: str | None = None,
        status: str | None = None,
        response_id: str | None = None,
        output_items: list[dict[str, Any]] | None = None,
        token_item_index: int | None = 0,
        created_at: float | None = None,
    ) -> CallView:
        """Record a call; without ``parent``/``status`` its edge is proven from tokens."""
        if parent is None and status is None:
            parent = self._prove(prompt)
            status = "verified" if parent is not None else None
        elif status == "verified":
            assert parent is not None
            cumulative = self.cumulative(parent)
            assert prompt[: len(cumulative)] == cumulative, "a verified parent must be a prefix"
        if created_at is None:
            self.clock += 1.0
            created_at = self.clock
        if output_items is None:
            output_items = [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": f"reply of {call_id}"}],
                }
            ]
        view = CallView(
            model_call_id=call_id,
            prompt_len=len(prompt),
            generation_len=len(generation),
            cumulative_len=len(prompt) + len(generation),
            cumulative_digest=digest(prompt + generation),
            prompt_digest=digest(prompt),
            created_at=created_at,
            parent_call_id=parent,
            edge_method="token_prefix" if status == "verified" else None,
            edge_status=status,
            shared_len=len(self.cumulative(parent)) if status == "verified" and parent else None,
            response_id=response_id if response_id is not None else f"chatcmpl-{call_id}",
            output_items=output_items,
            token_item_index=token_item_index if output_items else None,
            model="Qwen/Qwen3-4B-Thinking-2507",
        )
        self.views[call_id] = view
        self.prompts[call_id] = prompt
        self.generations[call_id] = generation
        return view

    def _prove(self, prompt: list[int]) -> str | None:
        best: tuple[int, str] | None = None
        for call_id in sorted(self.views):
            cumulative = self.cumulative(call_id)
            if len(cumulative) <= len(prompt) and prompt[: len(cumulative)] == cumulative:
                key = (-len(cumulative), call_id)
                best = key if best is None or key < best else best
        return best[1] if best else None

    def calls(self) -> list[CallView]:
        return list(self.views.values())

    def plan(self, result: dict[str, Any] | None = None, **kwargs: Any) -> BuildPlan:
        kwargs.setdefault("n_calls", len(self.views))
        kwargs.setdefault("incomplete", False)
        return plan_build(self.calls(), result=result, **kwargs)

    def links(self, call_ids: Sequence[str]) -> list[ChainLinkTokens]:
        """What storage reads for a delivered chain: each prompt beyond its chain predecessor."""
        links = []
        before: list[int] = []
        for call_id in call_ids:
            prompt = self.prompts[call_id]
            assert prompt[: len(before)] == before, "the plan linked a call that does not extend"
            links.append(
                ChainLinkTokens(
                    model_call_id=call_id,
                    prompt_suffix=prompt[len(before) :],
                    generation_token_ids=self.generations[call_id],
                    generation_log_probs=[-0.25] * len(self.generations[call_id]),
                    output_items=self.views[call_id].output_items,
                    token_item_index=self.views[call_id].token_item_index,
                )
            )
            before = self.cumulative(call_id)
        return links


def tool_loop(rollout: Rollout, n: int, prefix: str = "c", seed: int = 100) -> list[str]:
    """A harness's tool loop: ``n`` calls, each continuing the previous one faithfully."""
    ids = [f"{prefix}{i}" for i in range(1, n + 1)]
    rollout.add(ids[0], [*SYSTEM_TURN, *turn(USER, seed), *HEADER], answer(seed + 1))
    for i, call_id in enumerate(ids[1:], start=1):
        rollout.add(
            call_id, rollout.continue_(ids[i - 1], seed + 10 * i), answer(seed + 10 * i + 1)
        )
    return ids


def responded(call_id: str) -> dict[str, Any]:
    """A rollout result whose scored response carries the served id of ``call_id``."""
    return {"response": {"id": f"chatcmpl-{call_id}", "output": []}}


def chain_ids(plan: BuildPlan) -> list[tuple[str, ...]]:
    return [chain.call_ids for chain in plan.chains]


# ------------------------------------------------------------------------- healthy rollouts


def test_tool_loop_delivers_one_chain_with_full_metrics() -> None:
    r = Rollout()
    ids = tool_loop(r, 4)
    plan = r.plan()
    assert plan.mask_reasons == [] and not plan.masked
    assert plan.delivered is not None
    assert plan.delivered.call_ids == tuple(ids)
    assert (plan.delivered.label, plan.delivered.role) == ("main", "terminal")
    assert plan.quarantines == []
    assert set(plan.metrics) == METRIC_KEYS
    captured = sum(v.generation_len for v in r.views.values())
    assert plan.metrics | {"terminal_attribution": None} == {
        "n_calls": 4,
        "chains": 1,
        "roots": 1,
        "delivered_fraction": 1.0,
        "quarantined_calls": 0,
        "empty_generation_calls": 0,
        "unresolved_parent_calls": 0,
        "terminal_attribution": None,
        "capture_incomplete": False,
        "error": None,
        "generated_tokens_captured": captured,
        "generated_tokens_delivered": captured,
        "mask_reasons": [],
        "parent_link_failures": {},
        "quarantined_fraction": 0.0,
    }
    assert plan.metrics["terminal_attribution"]["chain"] == ""
    assert plan.metrics["terminal_attribution"]["method"] == "none"


def test_attributed_tool_loop_reports_delivered_chain() -> None:
    r = Rollout()
    ids = tool_loop(r, 3)
    plan = r.plan(responded(ids[-1]))
    assert plan.terminal.call_id == ids[-1]
    assert plan.metrics["terminal_attribution"] == {
        "method": "response_id",
        "call_id": ids[-1],
        "reason": "response_has_no_output",
        "chain": "delivered",
    }
    assert plan.delivered is not None and plan.delivered.call_ids == tuple(ids)
    assert not plan.masked


def test_n_calls_is_reported_as_given() -> None:
    r = Rollout()
    tool_loop(r, 2)
    assert r.plan(n_calls=7).metrics["n_calls"] == 7


def test_delivered_plan_projects_to_a_contiguous_response() -> None:
    r = Rollout()
    ids = tool_loop(r, 5)
    plan = r.plan()
    assert plan.delivered is not None
    response = project_chain("3-0", r.links(plan.delivered.call_ids), "m")
    assert_prefix_contiguous(response)
    last = response["output"][-1]
    assert last["prompt_token_ids"] + last["generation_token_ids"] == r.cumulative(ids[-1])
    assert response["usage"]["output_tokens"] == plan.metrics["generated_tokens_delivered"]


# ---------------------------------------------------------------------------------- retries


def test_retry_of_the_first_call_keeps_the_extended_sibling() -> None:
    r = Rollout()
    prompt = [*SYSTEM_TURN, *turn(USER, 5), *HEADER]
    r.add("a1", prompt, answer(6))
    r.add("b1", prompt, answer(7))  # the harness retried and continued this one
    r.add("c2", r.continue_("b1", 8), answer(9))
    plan = r.plan()
    assert not plan.masked
    assert plan.delivered is not None and plan.delivered.call_ids == ("b1", "c2")
    assert [(q.model_call_id, q.reason) for q in plan.quarantines] == [("a1", "retry_not_kept")]
    assert plan.quarantines[0].detail == "retry of b1"
    assert plan.metrics["roots"] == 2
    assert plan.metrics["quarantined_calls"] == 1
    assert 0 < plan.metrics["delivered_fraction"] < 1


def test_retry_of_a_middle_call_keeps_the_extended_sibling() -> None:
    r = Rollout()
    ids = tool_loop(r, 2)
    middle = r.continue_(ids[1], 50)
    r.add("m1", middle, answer(51))
    r.add("m2", middle, answer(52))
    r.add("m3", middle, answer(53))
    r.add("end", r.continue_("m2", 54), answer(55))
    plan = r.plan()
    assert not plan.masked
    assert plan.delivered is not None and plan.delivered.call_ids == (*ids, "m2", "end")
    assert {(q.model_call_id, q.reason) for q in plan.quarantines} == {
        ("m1", "retry_not_kept"),
        ("m3", "retry_not_kept"),
    }
    captured = plan.metrics["generated_tokens_captured"]
    delivered = plan.metrics["generated_tokens_delivered"]
    assert plan.metrics["delivered_fraction"] == round(delivered / captured, 4)


def test_unresolved_retry_of_the_final_call_masks() -> None:
    r = Rollout()
    ids = tool_loop(r, 2)
    final = r.continue_(ids[1], 60)
    r.add("f1", final, answer(61))
    r.add("f2", final, answer(62))
    plan = r.plan()
    assert plan.mask_reasons == ["unresolved_retry"]
    assert plan.delivered is None
    assert plan.unresolved_retries == ["f1", "f2"]
    assert [(q.model_call_id, q.reason) for q in plan.quarantines] == [("f2", "retry_not_kept")]


@pytest.mark.parametrize("kept", ["f1", "f2"])
def test_attributed_final_retry_keeps_the_terminal(kept: str) -> None:
    r = Rollout()
    ids = tool_loop(r, 2)
    final = r.continue_(ids[1], 60)
    r.add("f1", final, answer(61))
    r.add("f2", final, answer(62))
    plan = r.plan(responded(kept))
    assert plan.mask_reasons == []
    assert plan.delivered is not None and plan.delivered.call_ids == (*ids, kept)
    dropped = {"f1", "f2"} - {kept}
    assert [(q.model_call_id, q.reason) for q in plan.quarantines] == [
        (dropped.pop(), "retry_not_kept")
    ]
    assert plan.unresolved_retries == []


def test_identical_final_retries_are_the_same_tokens_and_never_mask() -> None:
    r = Rollout()
    ids = tool_loop(r, 2)
    final = r.continue_(ids[1], 60)
    r.add("f2", final, answer(61))
    r.add("f1", final, answer(61))
    plan = r.plan()
    assert plan.mask_reasons == []
    assert plan.delivered is not None and plan.delivered.call_ids == (*ids, "f1")
    assert [(q.model_call_id, q.reason, q.detail) for q in plan.quarantines] == [
        ("f2", "identical_retry", "same tokens as f1")
    ]


def test_identical_retry_attributed_to_the_larger_id_delivers_that_call() -> None:
    r = Rollout()
    ids = tool_loop(r, 2)
    final = r.continue_(ids[1], 60)
    r.add("f1", final, answer(61))
    r.add("f2", final, answer(61))
    plan = r.plan({"_ng_terminal_model_call_id": "f2"})
    assert plan.terminal.method == "explicit"
    assert plan.delivered is not None and plan.delivered.call_ids == (*ids, "f2")
    assert plan.mask_reasons == []


def test_identical_retry_of_a_middle_call_follows_the_collapsed_parent() -> None:
    r = Rollout()
    ids = tool_loop(r, 1)
    middle = r.continue_(ids[0], 70)
    r.add("m1", middle, answer(71))
    r.add("m2", middle, answer(71))
    child = r.add("end", r.continue_("m1", 72), answer(73))
    assert child.parent_call_id == "m1"  # ingest collapsed the identical candidates
    plan = r.plan()
    assert plan.mask_reasons == []
    assert plan.delivered is not None and plan.delivered.call_ids == (*ids, "m1", "end")
    assert [q.reason for q in plan.quarantines] == ["identical_retry"]


def test_identical_and_different_retries_mixed() -> None:
    r = Rollout()
    ids = tool_loop(r, 1)
    final = r.continue_(ids[0], 80)
    r.add("f1", final, answer(81))
    r.add("f2", final, answer(81))
    r.add("f3", final, answer(82))
    unattributed = r.plan()
    assert unattributed.mask_reasons == ["unresolved_retry"]
    attributed = r.plan(responded("f3"))
    assert attributed.mask_reasons == []
    assert attributed.delivered is not None
    assert attributed.delivered.call_ids == (*ids, "f3")
    assert {(q.model_call_id, q.reason) for q in attributed.quarantines} == {
        ("f1", "retry_not_kept"),
        ("f2", "retry_not_kept"),
    }


def test_off_path_retry_does_not_mask_an_attributed_rollout() -> None:
    r = Rollout()
    title_prompt = [*turn(SYSTEM, 900), *turn(USER, 901), *HEADER]
    r.add("t1", title_prompt, answer(902))
    r.add("t2", title_prompt, answer(903))  # the title call was retried, nothing continued it
    ids = tool_loop(r, 3)
    assert r.plan().mask_reasons == ["unresolved_retry", "multiple_chains_unattributed"]
    plan = r.plan(responded(ids[-1]))
    assert plan.mask_reasons == []
    assert plan.delivered is not None and plan.delivered.call_ids == tuple(ids)
    assert [(q.model_call_id, q.reason) for q in plan.quarantines] == [("t2", "retry_not_kept")]
    assert plan.unresolved_retries == []


def test_retried_fork_where_both_siblings_were_extended_keeps_both() -> None:
    r = Rollout()
    ids = tool_loop(r, 1)
    middle = r.continue_(ids[0], 90)
    r.add("x", middle, answer(91))
    r.add("y", middle, answer(92))
    r.add("x2", r.continue_("x", 93), answer(94))
    r.add("y2", r.continue_("y", 95), answer(96))
    plan = r.plan(deliver="all-chains")
    assert plan.quarantines == []
    assert plan.mask_reasons == ["multiple_chains_unattributed"]
    assert sorted(chain_ids(plan)) == [(*ids, "x", "x2"), (*ids, "y", "y2")]
    attributed = r.plan(responded("y2"), deliver="all-chains")
    assert attributed.delivered is not None
    assert attributed.delivered.call_ids == (*ids, "y", "y2")
    assert [(c.label, c.role) for c in attributed.chains] == [
        ("main", "terminal"),
        ("branch-0", "side"),
    ]


# --------------------------------------------------------------- compaction, side calls


def compacted(r: Rollout) -> tuple[list[str], list[str]]:
    """A conversation, its summarizer call, then a compacted conversation that succeeds it."""
    before = tool_loop(r, 3, prefix="p")
    r.add("p-summary", r.continue_(before[-1], 300, role=USER), answer(301, 40))
    summary_prompt = [*SYSTEM_TURN, *turn(USER, 302, 60), *HEADER]
    after = ["q1", "q2"]
    r.add("q1", summary_prompt, answer(303))
    r.add("q2", r.continue_("q1", 304), answer(305))
    return [*before, "p-summary"], after


def test_compaction_starts_a_new_root_and_masks_without_attribution() -> None:
    r = Rollout()
    before, after = compacted(r)
    assert r.views["q1"].parent_call_id is None
    plan = r.plan(deliver="all-chains")
    assert plan.mask_reasons == ["multiple_chains_unattributed"]
    assert plan.delivered is None
    assert sorted(chain_ids(plan)) == sorted([tuple(before), tuple(after)])
    assert {(c.label, c.role) for c in plan.chains} == {("branch-0", "side"), ("branch-1", "side")}


def test_compaction_attributed_delivers_the_compacted_chain() -> None:
    r = Rollout()
    before, after = compacted(r)
    plan = r.plan(responded("q2"), deliver="all-chains")
    assert plan.mask_reasons == []
    assert plan.delivered is not None and plan.delivered.call_ids == tuple(after)
    assert [(c.call_ids, c.label, c.role) for c in plan.chains] == [
        (tuple(after), "main", "terminal"),
        (tuple(before), "branch-0", "pre_compaction"),
    ]
    assert plan.metrics["chains"] == 2
    assert plan.metrics["delivered_fraction"] < 1


def test_one_mode_emits_only_the_delivered_chain_but_counts_all() -> None:
    r = Rollout()
    _, after = compacted(r)
    plan = r.plan(responded("q2"))
    assert chain_ids(plan) == [tuple(after)]
    assert plan.metrics["chains"] == 2
    masked = r.plan()
    assert masked.chains == [] and masked.metrics["chains"] == 2


def title_and_loop(r: Rollout) -> list[str]:
    r.add("title", [*turn(SYSTEM, 400), *turn(USER, 401), *HEADER], answer(402, 6))
    return tool_loop(r, 3)


def test_title_generation_side_call_is_excluded_when_attributed() -> None:
    r = Rollout()
    ids = title_and_loop(r)
    assert r.views["title"].created_at < r.views[ids[0]].created_at
    plan = r.plan(responded(ids[-1]), deliver="all-chains")
    assert plan.mask_reasons == []
    assert plan.delivered is not None and plan.delivered.call_ids == tuple(ids)
    assert [(c.call_ids, c.role) for c in plan.chains] == [
        (tuple(ids), "terminal"),
        (("title",), "side"),
    ]
    title_tokens = r.views["title"].generation_len
    captured = plan.metrics["generated_tokens_captured"]
    assert plan.metrics["generated_tokens_delivered"] == captured - title_tokens
    assert plan.metrics["delivered_fraction"] == round((captured - title_tokens) / captured, 4)
    assert plan.metrics["delivered_fraction"] < 1


def test_title_generation_side_call_masks_without_attribution() -> None:
    r = Rollout()
    title_and_loop(r)
    plan = r.plan()
    assert plan.mask_reasons == ["multiple_chains_unattributed"]
    assert plan.delivered is None
    assert plan.metrics["chains"] == 2
    assert plan.metrics["roots"] == 2
    # NeMo Gym 0.7.0's meaning: the main chain (the one whose root came first, here the title
    # call) is counted even though the rollout masks.
    title_tokens = r.views["title"].generation_len
    captured = plan.metrics["generated_tokens_captured"]
    assert plan.metrics["generated_tokens_delivered"] == title_tokens
    assert plan.metrics["delivered_fraction"] == round(title_tokens / captured, 4)


def test_sub_agent_side_chain_is_side_and_excluded() -> None:
    r = Rollout()
    ids = tool_loop(r, 2)
    r.add("s1", [*turn(SYSTEM, 500), *turn(USER, 501), *HEADER], answer(502))
    r.add("s2", r.continue_("s1", 503), answer(504))
    r.add("c3", r.continue_(ids[-1], 505), answer(506))
    plan = r.plan(responded("c3"), deliver="all-chains")
    assert plan.mask_reasons == []
    assert plan.delivered is not None and plan.delivered.call_ids == (*ids, "c3")
    assert [(c.call_ids, c.label, c.role) for c in plan.chains] == [
        ((*ids, "c3"), "main", "terminal"),
        (("s1", "s2"), "branch-0", "side"),
    ]
    assert r.plan().mask_reasons == ["multiple_chains_unattributed"]


def test_calls_extending_the_terminal_are_excluded() -> None:
    r = Rollout()
    ids = tool_loop(r, 4)
    plan = r.plan(responded(ids[1]), deliver="all-chains")
    assert plan.mask_reasons == []
    assert chain_ids(plan) == [tuple(ids[:2])]
    assert plan.metrics["chains"] == 1
    assert plan.metrics["delivered_fraction"] < 1


def test_fork_before_the_terminal_becomes_a_branch() -> None:
    r = Rollout()
    ids = tool_loop(r, 3)
    r.add("fork", r.continue_(ids[0], 600), answer(601))
    plan = r.plan(responded(ids[-1]), deliver="all-chains")
    assert [(c.call_ids, c.label) for c in plan.chains] == [
        (tuple(ids), "main"),
        ((ids[0], "fork"), "branch-0"),
    ]


# ------------------------------------------------------------------------ empty generations


def test_only_empty_generations_mask_with_no_trainable_tokens() -> None:
    r = Rollout()
    prompt = [*SYSTEM_TURN, *turn(USER, 700), *HEADER]
    r.add("e1", prompt, [])
    r.add("e2", prompt, [])
    plan = r.plan()
    assert plan.mask_reasons == ["no_trainable_tokens"]
    assert plan.metrics["empty_generation_calls"] == 2
    assert plan.metrics["chains"] == 0
    assert plan.metrics["delivered_fraction"] == 0.0
    assert plan.metrics["generated_tokens_captured"] == 0


def test_retry_after_an_empty_generation_links_to_the_empty_calls_parent() -> None:
    r = Rollout()
    ids = tool_loop(r, 2)
    middle = r.continue_(ids[1], 710)
    r.add("empty", middle, [])
    retry = r.add("retry", middle, answer(711))
    assert retry.parent_call_id == "empty"  # the empty call's cumulative is the whole prompt
    r.add("last", r.continue_("retry", 712), answer(713))
    plan = r.plan()
    assert plan.mask_reasons == []
    assert plan.delivered is not None
    assert plan.delivered.call_ids == (*ids, "retry", "last")
    assert plan.metrics["empty_generation_calls"] == 1
    assert plan.metrics["unresolved_parent_calls"] == 0
    response = project_chain("r", r.links(plan.delivered.call_ids), "m")
    assert_prefix_contiguous(response)


def test_child_of_an_empty_root_is_a_clean_root() -> None:
    r = Rollout()
    prompt = [*SYSTEM_TURN, *turn(USER, 720), *HEADER]
    r.add("empty", prompt, [])
    r.add("first", prompt, answer(721))
    r.add("second", r.continue_("first", 722), answer(723))
    plan = r.plan()
    assert plan.mask_reasons == []
    assert plan.delivered is not None and plan.delivered.call_ids == ("first", "second")
    assert plan.metrics["roots"] == 1


def test_empty_parent_whose_cumulative_is_not_its_prompt_is_unresolved() -> None:
    r = Rollout()
    ids = tool_loop(r, 1)
    middle = r.continue_(ids[0], 730)
    r.add("empty", middle, [])
    r.add("retry", middle, answer(731))
    r.views["empty"] = dataclasses.replace(r.views["empty"], cumulative_digest="0" * 64)
    plan = r.plan()
    assert plan.metrics["parent_link_failures"] == {"parent_empty_generation": 1}
    assert "unresolved_parent" in plan.mask_reasons


def test_terminal_naming_an_empty_generation_is_not_captured() -> None:
    r = Rollout()
    ids = tool_loop(r, 2)
    r.add("empty", r.continue_(ids[-1], 740), [])
    plan = r.plan({"_ng_terminal_model_call_id": "empty"})
    assert plan.terminal.chain == "not_captured"
    assert plan.mask_reasons == ["terminal_not_captured"]
    assert plan.delivered is None


# -------------------------------------------------------------------- unresolved lineage


def drifted(r: Rollout) -> list[str]:
    ids = tool_loop(r, 2)
    rerendered = [*r.prompts[ids[1]], *text(750, 5), NEWLINE, *turn(TOOL, 751), *HEADER]
    r.add("drift", rerendered, answer(752), parent=ids[1], status="drifted")
    return ids


def test_drifted_edge_is_a_root_with_an_unresolved_boundary() -> None:
    r = Rollout()
    ids = drifted(r)
    plan = r.plan(deliver="all-chains")
    assert plan.mask_reasons == ["unresolved_parent", "multiple_chains_unattributed"]
    assert plan.metrics["unresolved_parent_calls"] == 1
    assert plan.metrics["parent_link_failures"] == {"parent_drifted": 1}
    assert plan.metrics["roots"] == 2
    assert sorted(chain_ids(plan)) == [tuple(ids), ("drift",)]


def test_drifted_terminal_is_broken() -> None:
    r = Rollout()
    drifted(r)
    plan = r.plan(responded("drift"))
    assert plan.terminal.chain == "broken"
    assert plan.mask_reasons == ["terminal_broken"]
    assert plan.delivered is None


def test_terminal_before_the_drift_is_still_delivered() -> None:
    r = Rollout()
    ids = drifted(r)
    plan = r.plan(responded(ids[-1]))
    assert plan.terminal.chain == "delivered"
    assert plan.mask_reasons == []


def test_single_drifted_call_masks_under_the_strict_rule() -> None:
    r = Rollout()
    r.add(
        "only",
        [*SYSTEM_TURN, *turn(USER, 760), *HEADER],
        answer(761),
        parent="gone",
        status="drifted",
    )
    plan = r.plan()
    assert plan.metrics["chains"] == 1
    assert plan.mask_reasons == ["unresolved_parent"]


def test_missing_parent_is_an_unresolved_boundary() -> None:
    r = Rollout()
    ids = tool_loop(r, 2)
    orphan = dataclasses.replace(r.views[ids[1]], parent_call_id="filtered-call")
    plan = plan_build([r.views[ids[0]], orphan], n_calls=2, incomplete=False, result=None)
    assert plan.metrics["parent_link_failures"] == {"parent_call_id_missing": 1}
    assert plan.mask_reasons == ["unresolved_parent", "multiple_chains_unattributed"]


def test_edge_without_a_parent_id_is_missing_not_a_root() -> None:
    r = Rollout()
    ids = tool_loop(r, 1)
    anonymous = dataclasses.replace(r.views[ids[0]], parent_call_id=None, edge_status="verified")
    plan = plan_build([anonymous], n_calls=1, incomplete=False, result=None)
    assert plan.metrics["parent_link_failures"] == {"parent_call_id_missing": 1}
    assert plan.mask_reasons == ["unresolved_parent"]


def test_unknown_edge_status_is_never_trusted() -> None:
    r = Rollout()
    ids = tool_loop(r, 2)
    r.views[ids[1]] = dataclasses.replace(r.views[ids[1]], edge_status="conversation")
    plan = r.plan()
    assert plan.metrics["parent_link_failures"] == {"parent_unverified": 1}
    assert "unresolved_parent" in plan.mask_reasons


def test_ambiguous_parent_quarantines_the_subtree() -> None:
    r = Rollout()
    ids = tool_loop(r, 2)
    r.add("amb", r.continue_(ids[1], 770), answer(771), parent=ids[1], status="ambiguous")
    r.add("amb-child", r.continue_("amb", 772), answer(773), parent="amb", status="verified")
    plan = r.plan(deliver="all-chains")
    assert [(q.model_call_id, q.reason) for q in plan.quarantines] == [
        ("amb", "ambiguous_parent"),
        ("amb-child", "ambiguous_parent"),
    ]
    assert plan.quarantines[1].detail == "descendant of amb"
    assert plan.mask_reasons == ["unresolved_parent"]
    assert plan.metrics["unresolved_parent_calls"] == 1
    assert plan.metrics["chains"] == 0  # the conversation went on through an unproven link
    broken = r.plan(responded("amb-child"))
    assert broken.terminal.chain == "broken"
    assert broken.mask_reasons == ["terminal_broken"]
    earlier = r.plan(responded(ids[-1]))
    assert earlier.mask_reasons == []
    assert earlier.delivered is not None and earlier.delivered.call_ids == tuple(ids)


# ---------------------------------------------------------------------- terminal rules


def test_declared_terminal_unmatched_masks_even_with_one_chain() -> None:
    r = Rollout()
    tool_loop(r, 3)
    plan = r.plan({"terminal_response_id": "chatcmpl-not-served"})
    assert plan.mask_reasons == ["declared_terminal_unmatched"]
    assert plan.terminal.reason == "declared_terminal_not_captured"
    assert plan.delivered is None


def test_declared_terminal_matched_delivers() -> None:
    r = Rollout()
    ids = title_and_loop(r)
    plan = r.plan({"terminal_response_id": f"chatcmpl-{ids[-1]}"})
    assert plan.terminal.method == "declared"
    assert plan.mask_reasons == []


def test_declared_terminal_with_disagreeing_witness_masks() -> None:
    r = Rollout()
    ids = tool_loop(r, 3)
    result = {"terminal_response_id": f"chatcmpl-{ids[-1]}", **responded(ids[0])}
    plan = r.plan(result)
    assert plan.terminal.call_id is None
    assert plan.mask_reasons == ["declared_terminal_unmatched"]


def test_witness_disagreement_falls_back_to_the_strict_rule() -> None:
    r = Rollout()
    ids = tool_loop(r, 3)
    result = {"_ng_terminal_model_call_id": ids[0], **responded(ids[-1])}
    plan = r.plan(result)
    assert plan.terminal.call_id is None
    assert f"witness_disagreement[explicit={ids[0]};response_id={ids[-1]}]" in plan.terminal.reason
    assert plan.mask_reasons == []  # one chain, nothing unresolved
    r.add("title", [*turn(SYSTEM, 400), *turn(USER, 401), *HEADER], answer(402, 6))
    assert r.plan(result).mask_reasons == ["multiple_chains_unattributed"]


# ----------------------------------------------------------------- snapshot-level rules


def test_incomplete_capture_always_masks_but_keeps_the_chain() -> None:
    r = Rollout()
    ids = tool_loop(r, 2)
    for result in (None, responded(ids[-1])):
        plan = r.plan(result, incomplete=True)
        assert plan.mask_reasons == ["capture_incomplete"]
        assert plan.metrics["capture_incomplete"] is True
        assert plan.delivered is not None and plan.delivered.call_ids == tuple(ids)


def test_no_records() -> None:
    plan = plan_build([], n_calls=0, incomplete=False, result=responded("x"))
    assert plan.mask_reasons == ["no_records"]
    assert plan.delivered is None and plan.chains == []
    assert set(plan.metrics) == METRIC_KEYS
    assert plan_build([], n_calls=0, incomplete=True, result=None).mask_reasons == [
        "capture_incomplete",
        "no_records",
    ]


def test_mask_reasons_come_in_canonical_order() -> None:
    r = Rollout()
    title_and_loop(r)
    drifted_prompt = [*SYSTEM_TURN, *turn(USER, 780), *HEADER]
    r.add("drift", drifted_prompt, answer(781), parent="c1", status="drifted")
    plan = r.plan(incomplete=True)
    assert plan.mask_reasons == [
        "capture_incomplete",
        "unresolved_parent",
        "multiple_chains_unattributed",
    ]
    assert plan.metrics["mask_reasons"] == plan.mask_reasons
    assert all(reason in MASK_REASONS for reason in plan.mask_reasons)


def test_failed_plan_has_the_same_metric_keys() -> None:
    r = Rollout()
    ids = tool_loop(r, 1)
    attributed = r.plan(responded(ids[0])).terminal
    plan = failed_plan(n_calls=3, incomplete=True, error="ValueError: boom", terminal=attributed)
    assert plan.mask_reasons == ["capture_incomplete", "build_failed"]
    assert set(plan.metrics) == METRIC_KEYS
    assert plan.metrics["error"] == "ValueError: boom"
    assert plan.metrics["terminal_attribution"]["chain"] == "error"
    assert plan.metrics["terminal_attribution"]["call_id"] == ids[0]
    assert failed_plan(n_calls=0, incomplete=False, error="x").mask_reasons == ["build_failed"]


def test_unknown_deliver_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="deliver"):
        plan_build([], n_calls=0, incomplete=False, result=None, deliver="every")


def test_contradictory_metadata_is_refused() -> None:
    r = Rollout()
    ids = tool_loop(r, 2)
    first, second = r.views[ids[0]], r.views[ids[1]]
    with pytest.raises(BuildInputError, match="appears twice"):
        plan_build([first, first], n_calls=2, incomplete=False, result=None)
    bad_len = dataclasses.replace(first, cumulative_len=first.cumulative_len + 1)
    with pytest.raises(BuildInputError, match="cumulative_len"):
        plan_build([bad_len], n_calls=1, incomplete=False, result=None)
    too_short = dataclasses.replace(second, prompt_len=1, cumulative_len=1 + second.generation_len)
    with pytest.raises(BuildInputError, match="verified parent"):
        plan_build([first, too_short], n_calls=2, incomplete=False, result=None)
    assert issubclass(BuildInputError, ValueError)


# ----------------------------------------------------------------- scale and determinism


def long_chain(n: int) -> list[CallView]:
    """``n`` calls, each continuing the previous one, digests kept incrementally."""
    views = []
    running = hashlib.sha256()
    length = 0
    parent = None
    for i in range(n):
        suffix, generation = [NEWLINE, TOOL, 1000 + i % 97, IM_END], [2000 + i % 89, IM_END]
        running.update(array("q", suffix).tobytes())
        prompt_digest = running.hexdigest()
        running.update(array("q", generation).tobytes())
        length += len(suffix) + len(generation)
        call_id = f"call-{i:04d}"
        views.append(
            CallView(
                model_call_id=call_id,
                prompt_len=length - len(generation),
                generation_len=len(generation),
                cumulative_len=length,
                cumulative_digest=running.hexdigest(),
                prompt_digest=prompt_digest,
                created_at=1_700_000_000.0 + i,
                parent_call_id=parent,
                edge_method="token_prefix" if parent else None,
                edge_status="verified" if parent else None,
            )
        )
        parent = call_id
    return views


@pytest.mark.slow
def test_thousand_call_chain_builds_fast_without_recursion() -> None:
    views = long_chain(1000)
    shuffled = views[::-1]
    started = time.perf_counter()
    plan = plan_build(shuffled, n_calls=1000, incomplete=False, result=None)
    elapsed = time.perf_counter() - started
    assert plan.delivered is not None and len(plan.delivered.call_ids) == 1000
    assert plan.delivered.call_ids == tuple(v.model_call_id for v in views)
    assert plan.metrics["delivered_fraction"] == 1.0
    assert elapsed < 2.0, f"planning 1,000 calls took {elapsed:.2f}s"
    attributed = plan_build(
        shuffled,
        n_calls=1000,
        incomplete=False,
        result={"_ng_terminal_model_call_id": "call-0999"},
        deliver="all-chains",
    )
    assert attributed.terminal.chain == "delivered"


@pytest.mark.slow
def test_thousand_calls_with_a_retry_at_every_step() -> None:
    views = long_chain(500)
    retries = [
        dataclasses.replace(
            v, model_call_id=v.model_call_id + "-retry", cumulative_digest="r" + v.cumulative_digest
        )
        for v in views
    ]
    started = time.perf_counter()
    plan = plan_build(views + retries, n_calls=1000, incomplete=False, result=None)
    assert time.perf_counter() - started < 2.0
    # every retry but the last one's is resolved by the extended sibling; the last is not
    assert plan.mask_reasons == ["unresolved_retry"]
    assert plan.metrics["quarantined_calls"] == 500


def scenario() -> Rollout:
    """Retries, a title call, an empty generation, a sub-agent, a drift: every rule at once."""
    r = Rollout()
    title_and_loop(r)
    r.add("empty", r.continue_("c3", 800), [])
    r.add("final-a", r.continue_("c3", 800), answer(801))
    r.add("final-b", r.continue_("c3", 800), answer(802))
    r.add("s1", [*turn(SYSTEM, 810), *turn(USER, 811), *HEADER], answer(812))
    r.add("s2", r.continue_("s1", 813), answer(814))
    r.add("drift", [*r.prompts["c2"], 5, *HEADER], answer(815), parent="c2", status="drifted")
    return r


SCENARIO_CALLS = 10


@pytest.mark.parametrize(
    "result",
    [None, responded("final-b"), {"_ng_terminal_model_call_id": "s2"}, responded("drift")],
)
@pytest.mark.parametrize("deliver", ["one", "all-chains"])
def test_plans_do_not_depend_on_input_order(result: dict[str, Any] | None, deliver: str) -> None:
    r = scenario()
    calls = r.calls()
    expected = plan_build(
        calls, n_calls=len(calls), incomplete=False, result=result, deliver=deliver
    )
    for seed in range(20):
        shuffled = calls[:]
        random.Random(seed).shuffle(shuffled)
        assert (
            plan_build(
                shuffled, n_calls=len(calls), incomplete=False, result=result, deliver=deliver
            )
            == expected
        )


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(order=st.permutations(list(range(SCENARIO_CALLS))))
def test_plans_do_not_depend_on_input_order_hypothesis(order: list[int]) -> None:
    calls = scenario().calls()
    kwargs: dict[str, Any] = {
        "n_calls": SCENARIO_CALLS,
        "incomplete": False,
        "result": responded("final-a"),
        "deliver": "all-chains",
    }
    assert plan_build([calls[i] for i in order], **kwargs) == plan_build(calls, **kwargs)


def test_scenario_outcomes() -> None:
    r = scenario()
    unattributed = r.plan(deliver="all-chains")
    assert unattributed.mask_reasons == [
        "unresolved_retry",
        "unresolved_parent",
        "multiple_chains_unattributed",
    ]
    assert all(chain.label.startswith("branch-") for chain in unattributed.chains)
    plan = r.plan(responded("final-b"), deliver="all-chains")
    assert plan.mask_reasons == []
    assert plan.delivered is not None
    assert plan.delivered.call_ids == ("c1", "c2", "c3", "final-b")
    assert plan.metrics["empty_generation_calls"] == 1
    assert [(q.model_call_id, q.reason) for q in plan.quarantines] == [
        ("final-a", "retry_not_kept")
    ]
    assert sorted(c.call_ids for c in plan.chains[1:]) == [
        ("drift",),
        ("s1", "s2"),
        ("title",),
    ]
    response = project_chain("s", r.links(plan.delivered.call_ids), "m")
    assert_prefix_contiguous(response)
