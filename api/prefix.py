"""Prefix supply (issue 11): a continuation is generated over its parent's exact tokens.

A chat template re-renders history, so the prompt of a continuation rarely starts with the
tokens the policy sampled (a tool-call turn is the common case), and the chain cannot be
proven.  With ``supply_prefix_token_ids: true`` the proxy gives the engine the prompt itself:

1. **Parent, at request time.**  The request's model-authored turns fingerprint to the
   continuation fingerprint of earlier captured calls (``Ledger.continuation_candidates``).
   A candidate counts only when its own request context equals this request's context up to
   its last assistant message: the same upstream chat messages, tools and template fields
   (digest stored on the record as ``prefix_context``).  No model-authored turn -> ROOT; no
   candidate -> UNRESOLVED ``no_match``; several with different tokens -> UNRESOLVED
   ``ambiguous``; identical retries collapse to the smallest call id.  Anything but RESOLVED
   sends the request unchanged.  A fork has its own parent, found the same way.
2. **Required prefix** = the parent's full cumulative ids (prompt + sampled generation),
   rebuilt from storage and checked against their digest.
3. **Supplied prompt** (backend ``kv_transfer_params``, stock vLLM >= 0.32) =
   required prefix + closing + suffix, all from the upstream's ``/tokenize`` with the
   request's own messages, tools and template fields:

   - ``full``   = render(messages, generation prompt as the request asks);
   - ``prefix`` = render(messages up to and including the last assistant turn, no
     generation prompt); ``full`` must start with it, and ``suffix = full[len(prefix):]``
     is the template's rendering of the turns after the parent's (tool results, user text)
     and of the generation prompt;
   - ``closing`` = the template's rendering of an empty assistant turn after the same
     history, minus that history with a generation prompt: the tokens that close an
     assistant turn (ChatML: ``<|im_end|>``, ``\\n``).  ``prefix`` must end with them.
     The sampled generation normally ends with the first of them (the end-of-turn token
     is sampled); only the rest (ChatML: ``\\n``) is supplied.  A generation cut by
     ``max_tokens`` (or a stop string) ends with none of them: the whole closing,
     end-of-turn token included, is supplied on the prompt side.

   The ids go upstream as ``kv_transfer_params: {"prompt_token_ids": [...]}``; vLLM uses
   them instead of rendering the messages (tool parsing and ``tool_choice`` still work).
   Backend ``required_prefix_token_ids`` sends only the required prefix; the engine (NeMo
   RL's server) builds the prompt.
4. **Proof.**  The engine's generation-time prompt ids (inline ``prompt_token_ids``, never a
   ``/tokenize`` answer) must start with the required prefix.  Without it the model call
   fails in the harness's dialect and nothing is recorded as captured: an off-policy capture
   is never stored.  vLLM ignores supplied ids when ``echo`` is set or a message carries
   media, so such requests are sent unchanged (counted ``not_applicable``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypedDict, Unpack

import httpx

from api import dialects as d
from api.extract import (
    TokenExtractionError,
    TokenPayload,
    extract_chat_tokens,
    tokenize_request_body,
)
from api.metrics import Metrics
from ledger.store import ContinuationCandidate, Ledger

__all__ = [
    "CONTEXT_KEY",
    "PrefixCall",
    "PrefixPlan",
    "PrefixProofError",
    "apply_plan",
    "check_answer",
    "context_digest",
    "plan_prefix",
    "prepare",
    "prove_prefix",
    "record_fields",
]

log = logging.getLogger("rollout_ledger.prefix")

CONTEXT_KEY = "prefix_context"
KV_BACKEND = "kv_transfer_params"
REQUIRED_BACKEND = "required_prefix_token_ids"
# Fields that change how a chat template renders the messages (with the messages and tools).
_TEMPLATE_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "documents", "model")
# Content-part types vLLM counts as text when it decides whether supplied ids are used.
_TEXT_PARTS = frozenset(
    {"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"}
)
_MEDIA_KEYS = frozenset(
    {
        "input_image",
        "image_url",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "image_pil",
        "audio_url",
        "input_audio",
        "video_url",
    }
)


class PrefixProofError(Exception):
    """The engine did not prove that it generated over the required prefix."""


@dataclass(frozen=True, slots=True)
class PrefixPlan:
    """What prefix supply does for one call.

    ``status``: ``requested`` (a prefix is required; ``required`` holds it and ``prompt`` the
    supplied prompt for the kv backend), else the reason the request goes unchanged:
    ``root``, ``unresolved`` (``reason`` says why), ``not_applicable`` (the dialect or the
    request cannot carry supplied ids) or ``unrenderable`` (the suffix could not be computed).
    """

    status: str
    reason: str = ""
    parent_call_id: str | None = None
    required: tuple[int, ...] = ()
    prompt: tuple[int, ...] = ()

    @property
    def requested(self) -> bool:
        return self.status == "requested"

    @property
    def eligible(self) -> bool:
        """The parent was resolved and verified (a prefix was, or should have been, required)."""
        return self.status in ("requested", "unrenderable")


def context_digest(messages: Sequence[Any], body: Mapping[str, Any]) -> str:
    """Digest of what a chat template renders: the messages plus the template fields."""
    envelope: dict[str, Any] = {"messages": list(messages)}
    envelope.update({k: body.get(k) for k in _TEMPLATE_FIELDS})
    text = json.dumps(envelope, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def record_fields(upstream: d.UpstreamRequest, plan: PrefixPlan | None) -> dict[str, Any]:
    """The extra record fields prefix supply stores on each captured call."""
    messages = upstream.body.get("messages")
    fields: dict[str, Any] = {
        "prefix_requested": plan is not None and plan.requested,
        "prefix_supplied": False,  # set once the proof holds
    }
    if isinstance(messages, list):
        fields[CONTEXT_KEY] = context_digest(messages, upstream.body)
    return fields


class PrefixCall(TypedDict):
    """One captured call, as prefix supply sees it."""

    ledger: Ledger
    client: httpx.AsyncClient
    headers: Mapping[str, str]
    rollout_id: str
    fingerprint: str
    upstream: d.UpstreamRequest
    backend: str


async def plan_prefix(**call: Unpack[PrefixCall]) -> PrefixPlan:
    """Decide the required prefix (and, for the kv backend, the supplied prompt) of a call."""
    ledger, rollout_id, fingerprint = call["ledger"], call["rollout_id"], call["fingerprint"]
    upstream, backend = call["upstream"], call["backend"]
    body = upstream.body
    messages = body.get("messages")
    if upstream.dialect is d.Dialect.COMPLETIONS or not isinstance(messages, list):
        return PrefixPlan("not_applicable", "completions")
    last = _last_assistant(messages)
    if not fingerprint or last is None:
        return PrefixPlan("root", "no_model_authored_turn")
    if backend == KV_BACKEND and _supplied_ids_ignored(body):
        return PrefixPlan("not_applicable", "echo_media_or_own_kv_params")
    context = context_digest(messages[:last], body)
    candidates = await ledger.continuation_candidates(rollout_id, fingerprint)
    matching = [c for c in candidates if c.extra.get(CONTEXT_KEY) == context]
    parent = _single_parent(matching)
    if isinstance(parent, str):
        return PrefixPlan("unresolved", parent)
    required = tuple(await ledger.cumulative_token_ids(rollout_id, parent.model_call_id))
    plan = PrefixPlan("requested", parent_call_id=parent.model_call_id, required=required)
    if backend != KV_BACKEND:
        return plan
    try:
        prompt = await _supplied_prompt(call["client"], call["headers"], body, last, required)
    except _Unrenderable as exc:
        return replace(plan, status="unrenderable", reason=str(exc))
    return replace(plan, prompt=tuple(prompt))


async def prepare(
    *, metrics: Metrics, **call: Unpack[PrefixCall]
) -> tuple[d.UpstreamRequest, PrefixPlan]:
    """Plan and apply prefix supply for one call, counting it; a failed lookup sends the
    request unchanged (UNRESOLVED), never a guessed prefix."""
    rollout_id = call["rollout_id"]
    try:
        plan = await plan_prefix(**call)
    except Exception as exc:  # a lookup failure must not fail the call
        log.warning("prefix lookup failed rollout=%s: %s: %s", rollout_id, type(exc).__name__, exc)
        plan = PrefixPlan("unresolved", f"lookup_failed: {type(exc).__name__}")
    metrics.prefix_total.inc()
    if plan.eligible:
        metrics.prefix_eligible.inc()
    if not plan.requested:
        metrics.prefix_skipped.labels(plan.status).inc()
        if plan.status == "unrenderable":
            log.warning("prefix not supplied rollout=%s: %s", rollout_id, plan.reason)
    return apply_plan(call["upstream"], plan, call["backend"]), plan


def check_answer(plan: PrefixPlan, answer: Mapping[str, Any]) -> str | None:
    """None when the answer proves the plan's prefix, else why it does not."""
    try:
        prove_prefix(plan, extract_chat_tokens(answer))
    except (PrefixProofError, TokenExtractionError) as exc:
        return str(exc)
    return None


def apply_plan(upstream: d.UpstreamRequest, plan: PrefixPlan, backend: str) -> d.UpstreamRequest:
    """The upstream request carrying the plan's prefix (unchanged unless requested)."""
    if not plan.requested:
        return upstream
    body = dict(upstream.body)
    if backend == KV_BACKEND:
        kv = body.get("kv_transfer_params")
        body["kv_transfer_params"] = {
            **(kv if isinstance(kv, Mapping) else {}),
            "prompt_token_ids": list(plan.prompt),
        }
    else:
        body["required_prefix_token_ids"] = list(plan.required)
    return replace(upstream, body=body)


def prove_prefix(plan: PrefixPlan, payload: TokenPayload) -> None:
    """Raise :class:`PrefixProofError` unless the generation-time prompt starts with the
    required prefix (a ``/tokenize`` answer is never proof)."""
    prompt = payload.prompt_token_ids
    if payload.prompt_source == "tokenize" or prompt is None:
        raise PrefixProofError(
            "the inference server returned no generation-time prompt ids, so the supplied "
            f"prefix of {len(plan.required)} tokens (parent call {plan.parent_call_id}) cannot "
            "be proven; it needs vLLM >= 0.32 with return_token_ids"
        )
    n = len(plan.required)
    if len(prompt) < n or tuple(prompt[:n]) != plan.required:
        at = next(
            (i for i, (a, b) in enumerate(zip(prompt, plan.required, strict=False)) if a != b),
            min(len(prompt), n),
        )
        raise PrefixProofError(
            f"the inference server did not generate over the required prefix of {n} tokens "
            f"(parent call {plan.parent_call_id}): its prompt ({len(prompt)} tokens) differs "
            f"at position {at}; it ignored or altered the supplied ids"
        )


# --------------------------------------------------------------------------- internals


class _Unrenderable(Exception):
    pass


def _last_assistant(messages: Sequence[Any]) -> int | None:
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, Mapping) and message.get("role") == "assistant":
            return index
    return None


def _single_parent(candidates: Sequence[ContinuationCandidate]) -> ContinuationCandidate | str:
    """The one parent among candidates (identical retries collapse), or why there is none."""
    if not candidates:
        return "no_match"
    tokens = {(c.cumulative_len, c.cumulative_digest) for c in candidates}
    if len(tokens) > 1:
        return "ambiguous"
    return min(candidates, key=lambda c: c.model_call_id)


def _supplied_ids_ignored(body: Mapping[str, Any]) -> bool:
    """vLLM 0.32 renders the messages instead of using supplied ids when ``echo`` is set or a
    message has non-text content; a harness's own ``kv_transfer_params`` ids win as well."""
    kv = body.get("kv_transfer_params")
    if body.get("echo") is True or (isinstance(kv, Mapping) and "prompt_token_ids" in kv):
        return True
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, Mapping) and (
                any(key in part for key in _MEDIA_KEYS)
                or part.get("type", "text") not in _TEXT_PARTS
            ):
                return True
    return False


async def _supplied_prompt(
    client: httpx.AsyncClient,
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    last: int,
    required: Sequence[int],
) -> list[int]:
    messages = list(body["messages"])
    history = messages[:last]
    full, prefix, opened, probe = await asyncio.gather(
        _render(client, headers, body, messages, None),
        _render(client, headers, body, messages[: last + 1], False),
        _render(client, headers, body, history, True),
        _render(client, headers, body, [*history, {"role": "assistant", "content": ""}], False),
    )
    if full[: len(prefix)] != prefix:
        raise _Unrenderable("the template renders the history differently with later turns")
    if probe[: len(opened)] != opened or len(probe) == len(opened):
        raise _Unrenderable("the template's end of an assistant turn cannot be found")
    closing = probe[len(opened) :]
    if prefix[-len(closing) :] != closing:
        raise _Unrenderable("the rendered assistant turn does not end with the template's closing")
    return [*required, *_missing_closing(required, closing), *full[len(prefix) :]]


def _missing_closing(sequence: Sequence[int], closing: Sequence[int]) -> list[int]:
    """The closing tokens the sampled sequence lacks: none if it ends with all of them, the
    rest if it ends with their start (the sampled end-of-turn token), all of them otherwise
    (a turn cut by ``max_tokens`` or a stop string)."""
    for k in range(len(closing), 0, -1):
        if len(sequence) >= k and list(sequence[-k:]) == list(closing[:k]):
            return list(closing[k:])
    return list(closing)


async def _render(
    client: httpx.AsyncClient,
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    messages: list[Any],
    generation_prompt: bool | None,
) -> list[int]:
    """The upstream's ``/tokenize`` of ``messages`` with the request's tools and template
    fields; ``generation_prompt=None`` keeps what the request itself asks for."""
    tokenize = tokenize_request_body(body)
    tokenize.pop("required_prefix_token_ids", None)
    tokenize["messages"] = messages
    if generation_prompt is not None:
        tokenize["add_generation_prompt"] = generation_prompt
        tokenize.pop("continue_final_message", None)
    try:
        resp = await client.post("/tokenize", json=tokenize, headers=dict(headers))
        resp.raise_for_status()
        tokens = resp.json().get("tokens")
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise _Unrenderable(f"/tokenize failed: {exc}") from exc
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise _Unrenderable("/tokenize answered without a token list")
    return tokens
