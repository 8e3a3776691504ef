"""Plan the rebuild of one frozen rollout from call metadata alone (no I/O, no token arrays).

The storage layer proved every lineage edge at ingest; the builder never infers a parent from
tokens.  It turns those edges into chains, sets aside what cannot be delivered, attributes the
terminal call (``ledger.terminal``) and decides which chain is delivered or why the rollout
masks.  The caller then reads the delivered calls' tokens once and projects them
(``ledger.projection``).

Rules, in the order they are applied:

1. **Empty generations** (``generation_len == 0``) are excluded and counted.  A child whose
   verified parent is an empty call links to that call's own parent (repeatedly, through
   several empty calls) when the empty call's cumulative digest and length equal its prompt's:
   the child's prompt then extends every token the parent extended, so the link is still
   token-proven.  Otherwise the child is a root with the boundary ``parent_empty_generation``.
2. **Edges.**  ``verified`` with the parent among the calls links.  Everything else makes the
   child a root with an *unresolved boundary*: ``parent_drifted`` (the conversation continues
   the parent but the tokens do not), ``parent_digest_mismatch`` (the writer's recorded parent,
   NeMo Gym's request-time decision, is not a token prefix of the prompt),
   ``parent_unresolved`` (the writer recorded an unresolved parent: the request continues
   history nobody captured, or history it rewrote), ``parent_call_id_missing`` (the parent is
   not among the calls, or an edge names no parent), ``parent_unverified`` (a parent with any
   other edge status).  ``ambiguous`` is a
   boundary too (``ambiguous_parent``), and it quarantines the child and its whole subtree;
   the child hangs under the named parent when the lengths allow it, so that parent is not
   mistaken for the end of its conversation.  Every boundary counts in
   ``unresolved_parent_calls``.
3. **Retry siblings**: non-quarantined calls with the same link parent (all roots share one
   group) and the same prompt (``prompt_digest`` + ``prompt_len``).  Members with the same
   cumulative tokens are one generation.  Every member on the terminal path or extended by a
   call stays (two extended members are two conversations that forked after the same tokens,
   a sub-agent and the main agent for example: both chains stay, as in NeMo Gym); when no
   member is, one representative (the smallest id) stays.  The others are quarantined
   ``identical_retry``; they never mask.  Among different generations, every generation that a
   non-quarantined call extended and the one on the attributed terminal path are kept.  If
   none is, the smallest id is kept; without an attributed terminal that group is an
   unresolved retry of the end of a chain (mask ``unresolved_retry``).  Generations not kept
   are quarantined ``retry_not_kept``.
4. **Chains** are root-to-leaf paths of links without a quarantined call; a leaf is a call
   with no children at all (a quarantined child still counts).  When the terminal chain is
   delivered it is the root-to-terminal path, truncated at the terminal: leaf paths through
   the terminal were served after the kept response and are dropped.
5. **Delivery.**  Attributed terminal: ``delivered`` (intact path), ``broken`` (a quarantined
   call or an unresolved boundary on the path) or ``not_captured`` (the named call is an empty
   generation).  Only ``delivered`` delivers; a declared terminal id that attributed nothing
   masks ``declared_terminal_unmatched``.  Unattributed: the strict rule, deliver the single
   chain only if there is no unresolved boundary and no unresolved retry.
6. ``BuildPlan.delivered`` is set exactly when the only mask reason, if any, is
   ``capture_incomplete`` (the caller may still project it for diagnosis); the delivered chain
   is labelled ``main`` and the others ``branch-0``, ``branch-1``, ... in order of
   (root created_at, root id, leaf created_at, leaf id).
7. **Metrics** have NeMo Gym 0.7.0's names and meanings: ``generated_tokens_delivered`` and
   ``delivered_fraction`` count the *main* chain (the delivered one, else the chain whose root
   came first), also when the rollout masks; ``quarantined_fraction`` is quarantined calls over
   ``n_calls``; the unresolved retries and unresolved parent calls are lists on the plan.

Roles (``deliver="all-chains"`` emits every chain, ``"one"`` only the delivered one; the
masking rules are the same): the delivered chain is ``terminal``.  Another chain is
``pre_compaction`` when it has at least two calls and its last call was created before the
delivered chain's root: a multi-turn conversation that ended before the delivered one began,
which is what a compacted history leaves behind.  One-call chains that ended early (title
generation, summarizer calls) and chains that overlap the delivered one (sub-agents, forks)
are ``side``.  Without a delivered chain every chain is ``side``.

Input order never matters: every walk runs over calls sorted by id or by cumulative length,
and no walk recurses.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ledger.errors import BuildInputError
from ledger.model import BuildPlan, CallView, ChainPlan, Quarantine, TerminalAttribution
from ledger.terminal import attribute_terminal

__all__ = [
    "DELIVER_MODES",
    "MASK_REASONS",
    "BuildInputError",
    "failed_plan",
    "plan_build",
]

DELIVER_MODES = ("one", "all-chains")

# Every reason a rollout can be masked for, in the order they are reported.
MASK_REASONS = (
    "capture_incomplete",
    "no_records",
    "unresolved_retry",
    "unresolved_parent",
    "terminal_broken",
    "terminal_not_captured",
    "declared_terminal_unmatched",
    "multiple_chains_unattributed",
    "no_trainable_tokens",
    "build_failed",
)

_CHAIN_MASK = {"broken": "terminal_broken", "not_captured": "terminal_not_captured"}

# The edge method of a link the writer recorded (NeMo Gym's request-time parent decision).
RECORDED_PARENT_METHOD = "recorded_parent"
# Boundaries of a call that has no parent edge although its writer did not record a root.
_BOUNDARY_WITHOUT_PARENT = {"unresolved": "parent_unresolved", "missing": "parent_call_id_missing"}


@dataclass(slots=True)
class _Lineage:
    """The buildable calls and their links, in topological order (parents first)."""

    calls: dict[str, CallView]
    order: list[str]
    parent: dict[str, str | None]
    children: dict[str, list[str]]
    boundary: dict[str, str]
    quarantines: dict[str, Quarantine] = field(default_factory=dict)

    def path_to(self, call_id: str) -> list[str]:
        """Root first, ending at ``call_id``."""
        path = [call_id]
        parent = self.parent[call_id]
        while parent is not None:
            path.append(parent)
            parent = self.parent[parent]
        path.reverse()
        return path

    def quarantine(self, call_id: str, reason: str, detail: str) -> None:
        self.quarantines.setdefault(call_id, Quarantine(call_id, reason, detail))


def plan_build(
    calls: Sequence[CallView],
    *,
    n_calls: int,
    incomplete: bool,
    result: Mapping[str, Any] | None,
    deliver: str = "one",
) -> BuildPlan:
    """Decide the delivered chain (or the mask reasons) of one frozen snapshot."""
    if deliver not in DELIVER_MODES:
        raise ValueError(f"deliver must be one of {DELIVER_MODES}, got {deliver!r}")
    by_id = _index(calls)
    counts = _Counts(n_calls=n_calls, incomplete=incomplete)
    if not by_id:
        reasons = ["capture_incomplete"] * incomplete + ["no_records"]
        return counts.plan([], None, [], TerminalAttribution(), reasons)
    counts.captured = sum(call.generation_len for call in by_id.values())
    counts.prefix = _prefix_counts(by_id.values())
    counts.empty = sum(1 for call in by_id.values() if call.generation_len == 0)

    terminal = attribute_terminal(list(by_id.values()), result)
    lineage = _link(by_id)
    _quarantine_ambiguous(lineage)
    terminal_path = _terminal_path(lineage, terminal.call_id)
    attributed = terminal.call_id is not None
    unresolved_retry = _resolve_retries(lineage, terminal_path, attributed=attributed)
    chain_status = _terminal_chain_status(lineage, terminal.call_id, terminal_path)
    terminal = dataclasses.replace(terminal, chain=chain_status)

    main_path = terminal_path if chain_status == "delivered" else None
    paths = _chain_paths(lineage, main_path)
    reasons = ["capture_incomplete"] * incomplete
    if attributed:
        reasons += [_CHAIN_MASK[chain_status]] if chain_status in _CHAIN_MASK else []
    elif terminal.declared:
        reasons.append("declared_terminal_unmatched")
    else:
        strict = _strict_reasons(lineage, paths, unresolved_retry)
        reasons += strict
        if not strict:  # exactly one chain, nothing unresolved
            main_path = paths[0]

    chains, delivered = _label(lineage, paths, main_path)
    counts.chains = len(chains)
    counts.roots = sum(1 for cid in lineage.order if lineage.parent[cid] is None)
    counts.unresolved = dict(lineage.boundary)
    counts.unresolved_retries = list(unresolved_retry)
    main = _main_chain(lineage, paths, main_path)
    counts.delivered = sum(lineage.calls[cid].generation_len for cid in main)
    emitted = chains if deliver == "all-chains" else [c for c in chains if c is delivered]
    quarantines = sorted(lineage.quarantines.values(), key=lambda q: q.model_call_id)
    return counts.plan(emitted, delivered, quarantines, terminal, reasons)


def _main_chain(
    lineage: _Lineage, paths: list[list[str]], main_path: list[str] | None
) -> list[str]:
    """NeMo Gym's main chain: the delivered one, else the chain whose root has the smallest
    (created_at, call id); what ``generated_tokens_delivered`` counts, masked or not."""
    if main_path is not None:
        return main_path
    if not paths:
        return []
    calls = lineage.calls
    return min(paths, key=lambda p: (calls[p[0]].created_at, p[0]))


def failed_plan(
    *,
    n_calls: int,
    incomplete: bool,
    error: str,
    terminal: TerminalAttribution | None = None,
) -> BuildPlan:
    """The plan a caller records when building or projecting raised: masked ``build_failed``,
    ``metrics["error"] = error``, the terminal attribution (if any was made) with chain
    ``error``, and the same metric keys as every other plan."""
    counts = _Counts(n_calls=n_calls, incomplete=incomplete, error=error)
    attribution = dataclasses.replace(terminal or TerminalAttribution(), chain="error")
    reasons = ["capture_incomplete"] * incomplete + ["build_failed"]
    return counts.plan([], None, [], attribution, reasons)


@dataclass(slots=True)
class _Counts:
    """What the metrics block reports besides the plan itself."""

    n_calls: int
    incomplete: bool
    error: str | None = None
    captured: int = 0
    delivered: int = 0
    chains: int = 0
    roots: int = 0
    empty: int = 0
    unresolved: dict[str, str] = field(default_factory=dict)
    unresolved_retries: list[str] = field(default_factory=list)
    prefix: dict[str, int] | None = None

    def plan(
        self,
        chains: list[ChainPlan],
        delivered: ChainPlan | None,
        quarantines: list[Quarantine],
        terminal: TerminalAttribution,
        reasons: Iterable[str],
    ) -> BuildPlan:
        ordered = sorted(set(reasons), key=MASK_REASONS.index)
        failures: dict[str, int] = {}
        for reason in sorted(self.unresolved.values()):
            failures[reason] = failures.get(reason, 0) + 1
        fraction = round(self.delivered / self.captured, 4) if self.captured else 0.0
        quarantined = round(len(quarantines) / self.n_calls, 4) if self.n_calls else 0.0
        metrics: dict[str, Any] = {
            "n_calls": self.n_calls,
            "chains": self.chains,
            "roots": self.roots,
            "delivered_fraction": fraction,
            "quarantined_calls": len(quarantines),
            "quarantined_fraction": quarantined,
            "empty_generation_calls": self.empty,
            "unresolved_parent_calls": len(self.unresolved),
            "terminal_attribution": terminal.as_metrics(),
            "capture_incomplete": self.incomplete,
            "error": self.error,
            "generated_tokens_captured": self.captured,
            "generated_tokens_delivered": self.delivered,
            "mask_reasons": list(ordered),
            "parent_link_failures": failures,
        }
        if self.prefix is not None:
            metrics.update(self.prefix)
        return BuildPlan(
            chains,
            delivered,
            quarantines,
            terminal,
            ordered,
            metrics,
            unresolved_retries=list(self.unresolved_retries),
            unresolved_parent_calls=sorted(self.unresolved),
        )


def _prefix_counts(calls: Iterable[CallView]) -> dict[str, int] | None:
    """The seed's prefix-supply counters over the calls recorded with prefix supply on (None
    when there are none): total, eligible (a prefix was required) and supplied (proven)."""
    on = [c for c in calls if c.prefix_requested is not None]
    if not on:
        return None
    return {
        "prefix_supply_total": len(on),
        "prefix_supply_eligible": sum(1 for c in on if c.prefix_requested),
        "prefix_supply_supplied": sum(1 for c in on if c.prefix_supplied),
    }


# ---------------------------------------------------------------------------------- lineage


def _index(calls: Iterable[CallView]) -> dict[str, CallView]:
    by_id: dict[str, CallView] = {}
    for call in sorted(calls, key=lambda c: c.model_call_id):
        if call.model_call_id in by_id:
            raise BuildInputError(f"model_call_id {call.model_call_id!r} appears twice")
        if call.cumulative_len != call.prompt_len + call.generation_len or call.generation_len < 0:
            raise BuildInputError(
                f"call {call.model_call_id!r}: cumulative_len {call.cumulative_len} is not "
                f"prompt_len {call.prompt_len} + generation_len {call.generation_len}"
            )
        by_id[call.model_call_id] = call
    return by_id


def _link(by_id: dict[str, CallView]) -> _Lineage:
    """Resolve each buildable call's edge into a link parent or an unresolved boundary."""
    buildable = {cid: call for cid, call in by_id.items() if call.generation_len > 0}
    parent: dict[str, str | None] = {}
    boundary: dict[str, str] = {}
    for cid, call in buildable.items():
        link, reason = _effective_edge(call, by_id)
        if link is not None and buildable[link].cumulative_len > call.prompt_len:
            if reason is None:
                raise BuildInputError(
                    f"verified parent {link!r} of {cid!r} has cumulative_len "
                    f"{buildable[link].cumulative_len} > prompt_len {call.prompt_len}"
                )
            link = None  # an ambiguous parent that cannot even be a prefix: leave it a root
        parent[cid] = link
        if reason is not None:
            boundary[cid] = reason
    # A link parent's cumulative tokens are a prefix of the child's prompt, which is shorter
    # than the child's cumulative tokens: sorting by cumulative length puts parents first.
    order = sorted(buildable, key=lambda cid: (buildable[cid].cumulative_len, cid))
    children: dict[str, list[str]] = {cid: [] for cid in order}
    for cid in order:
        link = parent[cid]
        if link is not None:
            children[link].append(cid)
    return _Lineage(buildable, order, parent, children, boundary)


def _effective_edge(call: CallView, by_id: dict[str, CallView]) -> tuple[str | None, str | None]:
    """``(link parent, boundary reason)`` for one buildable call, skipping empty parents."""
    current = call
    skipped: set[str] = set()
    while True:
        parent_id = current.parent_call_id
        if parent_id is None:
            # An edge whose parent the snapshot could not name is not a root.
            if current.edge_status is None:
                return None, None
            return None, _BOUNDARY_WITHOUT_PARENT.get(current.edge_status, "parent_call_id_missing")
        parent = by_id.get(parent_id)
        if current.edge_status == "ambiguous":
            usable = parent is not None and parent.generation_len > 0
            return (parent_id if usable else None), "ambiguous_parent"
        if current.edge_status == "drifted":
            recorded = current.edge_method == RECORDED_PARENT_METHOD
            return None, "parent_digest_mismatch" if recorded else "parent_drifted"
        if current.edge_status != "verified":
            return None, "parent_unverified"
        if parent is None:
            return None, "parent_call_id_missing"
        if parent.generation_len > 0:
            return parent_id, None
        if (parent.cumulative_digest, parent.cumulative_len) != (
            parent.prompt_digest,
            parent.prompt_len,
        ):
            return None, "parent_empty_generation"
        if parent_id in skipped:
            raise BuildInputError(f"lineage cycle through empty call {parent_id!r}")
        skipped.add(parent_id)
        current = parent


def _quarantine_ambiguous(lineage: _Lineage) -> None:
    for cid in lineage.order:
        if lineage.boundary.get(cid) == "ambiguous_parent":
            parent = lineage.calls[cid].parent_call_id
            lineage.quarantine(cid, "ambiguous_parent", f"parent {parent!r} is not unique")
            continue
        link = lineage.parent[cid]
        if link is not None and link in lineage.quarantines:
            lineage.quarantine(cid, "ambiguous_parent", f"descendant of {link}")


def _terminal_path(lineage: _Lineage, terminal_id: str | None) -> list[str]:
    if terminal_id is None or terminal_id not in lineage.calls:
        return []
    return lineage.path_to(terminal_id)


def _terminal_chain_status(
    lineage: _Lineage, terminal_id: str | None, terminal_path: list[str]
) -> str:
    if terminal_id is None:
        return ""
    if not terminal_path:
        return "not_captured"
    intact = terminal_path[0] not in lineage.boundary and not any(
        cid in lineage.quarantines for cid in terminal_path
    )
    return "delivered" if intact else "broken"


# ---------------------------------------------------------------------------------- retries


def _resolve_retries(lineage: _Lineage, terminal_path: list[str], *, attributed: bool) -> list[str]:
    """Quarantine the retry siblings not kept; return the calls of unresolved retry groups."""
    on_path = set(terminal_path)
    ambiguous = set(lineage.quarantines)

    def extended(cid: str) -> bool:
        return any(child not in ambiguous for child in lineage.children[cid])

    groups: dict[tuple[str, str, int], list[str]] = defaultdict(list)
    for cid in sorted(lineage.calls):
        if cid in ambiguous:
            continue
        call = lineage.calls[cid]
        groups[(lineage.parent[cid] or "", call.prompt_digest, call.prompt_len)].append(cid)

    unresolved: list[str] = []
    for key in sorted(groups):
        generations: dict[tuple[str, int], list[str]] = defaultdict(list)
        for cid in groups[key]:
            call = lineage.calls[cid]
            generations[(call.cumulative_digest, call.cumulative_len)].append(cid)
        # Members another call extended, or on the terminal path, are evidence of what the
        # harness kept: every one of them stays, even when their tokens are identical.
        needed = {
            gen: [cid for cid in ids if cid in on_path or extended(cid)]
            for gen, ids in generations.items()
        }
        reps = {gen: (needed[gen] or ids)[0] for gen, ids in generations.items()}
        kept = {gen for gen in generations if len(generations) == 1 or needed[gen]}
        if not kept:
            kept = {min(reps, key=reps.__getitem__)}
            if not attributed:
                unresolved.extend(groups[key])
        kept_ids = ", ".join(sorted(reps[gen] for gen in kept))
        for gen, ids in sorted(generations.items()):
            stays = set(needed[gen]) or {reps[gen]}
            for cid in ids:
                if gen not in kept:
                    lineage.quarantine(cid, "retry_not_kept", f"retry of {kept_ids}")
                elif cid not in stays:
                    lineage.quarantine(cid, "identical_retry", f"same tokens as {reps[gen]}")
    return sorted(unresolved)


# ----------------------------------------------------------------------------------- chains


def _chain_paths(lineage: _Lineage, main_path: list[str] | None) -> list[list[str]]:
    """Every verified chain; with a delivered terminal, its truncated path replaces the leaf
    paths that run through the terminal."""
    terminal = main_path[-1] if main_path else None
    paths = [main_path] if main_path else []
    for cid in lineage.order:
        if lineage.children[cid]:
            continue
        path = lineage.path_to(cid)
        if terminal is not None and terminal in path:
            continue
        if any(node in lineage.quarantines for node in path):
            continue
        paths.append(path)
    return paths


def _strict_reasons(
    lineage: _Lineage, paths: list[list[str]], unresolved_retry: list[str]
) -> list[str]:
    """Unattributed rollouts deliver only one chain with nothing unresolved."""
    reasons: list[str] = []
    if unresolved_retry:
        reasons.append("unresolved_retry")
    if lineage.boundary:
        reasons.append("unresolved_parent")
    if len(paths) > 1:
        reasons.append("multiple_chains_unattributed")
    if not paths and not reasons:
        reasons.append("no_trainable_tokens")
    return reasons


def _label(
    lineage: _Lineage, paths: list[list[str]], main_path: list[str] | None
) -> tuple[list[ChainPlan], ChainPlan | None]:
    calls = lineage.calls
    others = [path for path in paths if path is not main_path]
    others.sort(key=lambda p: (calls[p[0]].created_at, p[0], calls[p[-1]].created_at, p[-1]))
    delivered = None
    chains: list[ChainPlan] = []
    if main_path is not None:
        delivered = ChainPlan(tuple(main_path), "main", "terminal")
        chains.append(delivered)
    for index, path in enumerate(others):
        chains.append(ChainPlan(tuple(path), f"branch-{index}", _role(lineage, path, main_path)))
    return chains, delivered


def _role(lineage: _Lineage, path: list[str], main_path: list[str] | None) -> str:
    if main_path is None or len(path) < 2:
        return "side"
    ended = lineage.calls[path[-1]].created_at
    return "pre_compaction" if ended < lineage.calls[main_path[0]].created_at else "side"
