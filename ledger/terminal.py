"""Terminal attribution: which captured call produced the response the verifier scored.

A harness captures more calls than the one it kept: title generation, sub-agents, abandoned
retries.  Attribution joins the rollout result to exactly one captured call so that the
builder can deliver that call's chain instead of masking the rollout.  Up to four witnesses
testify, in this order (the order only decides which method is *reported*, never which
witness wins):

``explicit``
    ``result["_ng_terminal_model_call_id"]`` names the call.  Soft: an id that is not among
    the calls abstains (``explicit_terminal_not_captured``).
``declared``
    ``result["terminal_response_id"]`` names the served response id.  Authoritative: no
    matching call (``declared_terminal_not_captured``) or several calls with different tokens
    (``declared_ambiguous``) attribute nothing at once, and the rollout masks.
``response_id``
    ``result["response"]["id"]`` equals one call's ``response_id``.  Abstains with
    ``response_has_no_id``, ``response_id_no_match`` or ``response_id_ambiguous``.
``content``
    The model-authored fingerprint of ``result["response"]["output"]`` matches a call, read
    three ways: a call's cumulative ``continuation_fingerprint`` (``content_cumulative``, a
    full-transcript response), the fingerprint of a call's own ``output_items``
    (``content_output``, a final-turn-only response), or the response's trailing block of
    consecutive model-produced items against a call's own output (a merged transcript; skipped
    when the transcript ends in a non-model item; reported as ``content_output`` too, as NeMo
    Gym 0.7.0 reports it: it is the same reading of the call's own output).  Abstains with
    ``response_has_no_output``, ``response_output_unfingerprintable``,
    ``no_model_authored_output``, ``content_ambiguous`` or ``no_content_match``.

Within a witness, several matches whose full token sequences are identical (same
``cumulative_digest`` and ``cumulative_len``) are one answer and collapse to the smallest call
id; matches with different tokens are an abstention.  Witnesses that did not abstain must
agree the same way, otherwise the verdict is ``witness_disagreement[...]`` and nothing is
attributed; when they agree, the first witness's call is the terminal (an explicit id names
the very attempt the harness kept, even among identical retries).  The reason trail
(abstentions, ``corroborated_by=...``) is kept either way.

Attribution never raises on malformed result content: that is an abstention.  It leaves
``TerminalAttribution.chain`` empty; the builder judges the chain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ledger.fingerprint import model_authored_fingerprint
from ledger.model import CallView, TerminalAttribution

__all__ = ["attribute_terminal", "collapse_identical"]

EXPLICIT_KEY = "_ng_terminal_model_call_id"
DECLARED_KEY = "terminal_response_id"
RESPONSE_KEY = "response"

# Response items the model produced although the fingerprint hashes nothing of them.  They do
# not end a trailing model-authored block (a transcript may close with a reasoning item).
_FINGERPRINT_NEUTRAL_MODEL_TYPES = frozenset({"reasoning"})

# NeMo Gym 0.7.0's labels: a cumulative match is ``content_cumulative``; a match of a call's own
# output, whole response or trailing block, is ``content_output``.
_CONTENT_METHODS = ("content_cumulative", "content_output")


def collapse_identical(candidates: Sequence[CallView]) -> CallView | None:
    """The one answer the candidates give: the smallest call id if all carry the same full
    token sequence, else ``None`` (no candidates, or genuinely different ones)."""
    if not candidates:
        return None
    identities = {(call.cumulative_digest, call.cumulative_len) for call in candidates}
    if len(identities) > 1:
        return None
    return min(candidates, key=lambda call: call.model_call_id)


def attribute_terminal(
    calls: Sequence[CallView], result: Mapping[str, Any] | None
) -> TerminalAttribution:
    """Join the rollout result's scored response to one captured call, or say why not."""
    result = result if result is not None else {}
    reasons: list[str] = []
    witnesses: list[tuple[str, CallView]] = []
    ordered = sorted(calls, key=lambda call: call.model_call_id)

    explicit = _explicit_witness(ordered, result.get(EXPLICIT_KEY), reasons)
    if explicit is not None:
        witnesses.append(("explicit", explicit))

    declared_id = result.get(DECLARED_KEY)
    declared = declared_id is not None and declared_id != ""
    if declared:
        winner = _declared_witness(ordered, declared_id, reasons)
        if winner is None:
            return TerminalAttribution(reason=",".join(reasons), declared=True)
        witnesses.append(("declared", winner))

    response = result.get(RESPONSE_KEY)
    if isinstance(response, Mapping):
        by_id = _response_id_witness(ordered, response, reasons)
        if by_id is not None:
            witnesses.append(("response_id", by_id))
        by_content = _content_witness(ordered, response, reasons)
        if by_content is not None:
            witnesses.append(by_content)
    else:
        reasons.append("no_response_object")

    if not witnesses:
        return TerminalAttribution(reason=",".join(reasons), declared=declared)
    agreed = collapse_identical([call for _, call in witnesses])
    if agreed is None:
        detail = ";".join(f"{method}={call.model_call_id}" for method, call in witnesses)
        reasons.append(f"witness_disagreement[{detail}]")
        return TerminalAttribution(reason=",".join(reasons), declared=declared)
    if len(witnesses) > 1:
        reasons.append("corroborated_by=" + "+".join(method for method, _ in witnesses[1:]))
    # The first witness names the call (NeMo Gym 0.7.0): with identical retries, an explicit or
    # declared witness names the attempt the harness kept, whose log-probs are then delivered.
    method, named = witnesses[0]
    return TerminalAttribution(
        method=method,
        call_id=named.model_call_id,
        reason=",".join(reasons),
        declared=declared,
    )


def _explicit_witness(calls: Sequence[CallView], named: Any, reasons: list[str]) -> CallView | None:
    if named is None or named == "":
        return None
    if not isinstance(named, str):
        reasons.append("explicit_terminal_invalid")
        return None
    for call in calls:
        if call.model_call_id == named:
            return call
    reasons.append("explicit_terminal_not_captured")
    return None


def _declared_witness(
    calls: Sequence[CallView], declared_id: Any, reasons: list[str]
) -> CallView | None:
    if not isinstance(declared_id, str):
        reasons.append("declared_terminal_invalid")
        return None
    matches = [call for call in calls if call.response_id == declared_id]
    winner = collapse_identical(matches)
    if winner is None:
        reasons.append("declared_ambiguous" if matches else "declared_terminal_not_captured")
    return winner


def _response_id_witness(
    calls: Sequence[CallView], response: Mapping[str, Any], reasons: list[str]
) -> CallView | None:
    response_id = response.get("id")
    if not isinstance(response_id, str) or not response_id:
        reasons.append("response_has_no_id")
        return None
    matches = [call for call in calls if call.response_id == response_id]
    winner = collapse_identical(matches)
    if winner is None:
        reasons.append("response_id_ambiguous" if matches else "response_id_no_match")
    return winner


def _content_witness(
    calls: Sequence[CallView], response: Mapping[str, Any], reasons: list[str]
) -> tuple[str, CallView] | None:
    """Pool the three content readings; the reported method is the strongest reading that
    matched (cumulative, then output, then trailing)."""
    items = response.get("output")
    if not isinstance(items, list) or not items:
        reasons.append("response_has_no_output")
        return None
    try:
        target = model_authored_fingerprint(items)
        trailing = _trailing_block_fingerprint(items)
    except (TypeError, ValueError):
        reasons.append("response_output_unfingerprintable")
        return None
    if not target:
        reasons.append("no_model_authored_output")
        return None

    found: set[str] = set()
    matched: list[CallView] = []
    for call in calls:
        hits = _readings_for(call, target, trailing)
        if hits:
            found |= hits
            matched.append(call)
    winner = collapse_identical(matched)
    if winner is None:
        reasons.append("content_ambiguous" if matched else "no_content_match")
        return None
    method = next(m for m in _CONTENT_METHODS if m in found)
    return method, winner


def _readings_for(call: CallView, target: str, trailing: str) -> set[str]:
    hits: set[str] = set()
    if call.continuation_fingerprint and call.continuation_fingerprint == target:
        hits.add("content_cumulative")
    if call.output_items:
        try:
            own = model_authored_fingerprint(call.output_items)
        except (TypeError, ValueError):
            return hits  # a stored output that cannot be read testifies to nothing
        if own and own == target:
            hits.add("content_output")
        if own and own == trailing:
            hits.add("content_output")
    return hits


def _trailing_block_fingerprint(items: list[Any]) -> str:
    """The fingerprint of the transcript's final run of model-produced items, or ``""`` when
    the transcript ends in a non-model item or consists of that run alone (then the whole
    transcript reading already covers it)."""
    start = len(items)
    while start > 0 and _is_model_produced(items[start - 1]):
        start -= 1
    if start in (0, len(items)):
        return ""
    return model_authored_fingerprint(items[start:])


def _is_model_produced(item: Any) -> bool:
    """Whether the model wrote this item: an assistant message (even one whose parts the
    fingerprint ignores), a reasoning item, or anything the fingerprint counts (tool calls).
    Raises ``TypeError`` for an item that is not an object, like the fingerprint."""
    if not isinstance(item, Mapping):
        raise TypeError(f"response output items must be objects, got {type(item).__name__}")
    if item.get("role") == "assistant" or item.get("type") in _FINGERPRINT_NEUTRAL_MODEL_TYPES:
        return True
    return bool(model_authored_fingerprint([item]))
