"""Read the sampled token ids and log-probs out of an upstream answer (design §5.2).

Precedence (wire-formats §3.2, §4.5; nemo-gym-capture §4.3):

1. a message-level bundle ``choices[0].message.{prompt_token_ids, generation_token_ids,
   generation_log_probs}`` (an upstream that already did capture, e.g. a NeMo Gym server);
2. vLLM's inline ids: chat ``prompt_token_ids`` (top level) + ``choices[0].token_ids``;
   completions: both on the choice;
3. generation ids from ``token_id:N`` log-prob tokens; the prompt then has to come from
   ``/tokenize`` (:attr:`TokenPayload.needs_tokenize`; the proxy makes that call and
   completes the payload with :func:`with_tokenized_prompt`; such a prompt is never proof).

Every source that is present must agree with the others: ids against the ``token_id:N``
log-prob ids, id counts against log-prob counts, and ``usage`` counts against both.  A
disagreement or a partial bundle is :class:`MalformedTokenPayload`; an answer with no token
information at all is :class:`MissingTokenIds`.  Never a silent pick.

Ids and log-probs follow the ledger's own rules (``ledger.token_rules``, shared with ingest):
ids are integers in ``[0, 2**31)``; log-probs are numbers ``<= 0``: finite values, vLLM's
clamp ``-9999.0`` and ``-inf`` (Python's ``json`` reads ``-Infinity`` as ``-inf``) are accepted;
``null``, NaN, ``+inf``, positive values, booleans and strings are malformed, because a record
with a hole in its log-probs cannot be trained on.

The harness never sees token arrays: :func:`strip_chat_response` /
:func:`strip_completion_response` give the copy to answer with (they never raise, so the
model call is answered even when capture fails) and the ``output_items`` to record.
"""

from __future__ import annotations

import copy
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from api.dialects.common import JSONDict, mapping_or_empty
from ledger.errors import CaptureFailed
from ledger.jsonio import copy_parsed
from ledger.token_rules import MAX_TOKEN_ID, check_log_probs, check_token_ids

__all__ = [
    "GenerationSource",
    "MalformedTokenPayload",
    "MissingTokenIds",
    "PromptSource",
    "StrippedResponse",
    "TokenExtractionError",
    "TokenPayload",
    "extract_chat_tokens",
    "extract_completion_tokens",
    "strip_chat_response",
    "strip_completion_response",
    "tokenize_request_body",
    "with_tokenized_prompt",
]

_BUNDLE_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
_TOKEN_ID = re.compile(r"token_id:(\d+)")
_TOKEN_OF = operator.itemgetter("token")
_LOGPROB_OF = operator.itemgetter("logprob")
_CHAT_TOKENIZE_FIELDS = (
    "model",
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "required_prefix_token_ids",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
)
_COMPLETIONS_TOKENIZE_FIELDS = ("model", "prompt", "add_special_tokens")

PromptSource = Literal["message_bundle", "inline", "tokenize"]
GenerationSource = Literal["message_bundle", "inline", "logprobs"]


class TokenExtractionError(CaptureFailed):
    """Capture could not read the tokens; ``reason`` is the incomplete-event reason."""

    reason: ClassVar[str] = "capture_failed"

    def __init__(self, reason_detail: str) -> None:
        super().__init__(reason_detail)
        self.reason_detail = reason_detail


class MissingTokenIds(TokenExtractionError):
    """The answer carries no token ids at all."""

    reason: ClassVar[str] = "missing_token_ids"


class MalformedTokenPayload(TokenExtractionError):
    """Token information is present but partial, ill-typed or self-contradictory."""

    reason: ClassVar[str] = "malformed_token_payload"


@dataclass(frozen=True, slots=True)
class TokenPayload:
    """The tokens of one call.  ``prompt_token_ids`` is ``None`` until ``/tokenize`` filled it
    (``prompt_source == "tokenize"``)."""

    prompt_token_ids: list[int] | None
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    prompt_source: PromptSource
    generation_source: GenerationSource
    routed_experts: Any = None

    @property
    def needs_tokenize(self) -> bool:
        return self.prompt_token_ids is None


@dataclass(frozen=True, slots=True)
class StrippedResponse:
    """The answer for the harness and what the record keeps besides tokens.

    ``output_items``: the assistant message wrapped as ``{"type": "message", "role":
    "assistant", ...}`` without token fields (a completion's text becomes its ``content``);
    ``token_item_index`` is the item that carried the tokens (``None`` if there is none).
    """

    harness_body: JSONDict
    output_items: list[JSONDict]
    response_id: str | None
    token_item_index: int | None


# --------------------------------------------------------------------------- stripping


def strip_chat_response(
    response: Mapping[str, Any], *, keep_logprobs: bool = False
) -> StrippedResponse:
    """Split a chat completion into the harness copy (no token fields) and the record view."""
    return _strip(response, keep_logprobs, _chat_output)


def strip_completion_response(
    response: Mapping[str, Any], *, keep_logprobs: bool = False
) -> StrippedResponse:
    """Split a text completion into the harness copy (no token fields) and the record view."""
    return _strip(response, keep_logprobs, _completion_output)


def _strip(
    response: Mapping[str, Any],
    keep_logprobs: bool,
    output_items: Callable[[JSONDict], list[JSONDict]],
) -> StrippedResponse:
    """The harness copy, and the record view of its first choice (by ``output_items``)."""
    body = _without_token_arrays(response, keep_logprobs)
    choices = _choices(body)
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    items = output_items(first)
    return StrippedResponse(body, items, _response_id(response), 0 if items else None)


def _chat_output(choice: JSONDict) -> list[JSONDict]:
    message = choice.get("message")
    if not isinstance(message, dict):
        return []
    items: list[JSONDict] = copy_parsed([{**message, "type": "message", "role": "assistant"}])
    return items


def _completion_output(choice: JSONDict) -> list[JSONDict]:
    if "text" not in choice:
        return []
    return [{"type": "message", "role": "assistant", "content": choice["text"]}]


_CHOICE_ARRAYS = ("token_ids", "routed_experts", "prompt_token_ids")
_MESSAGE_ARRAYS = (*_BUNDLE_FIELDS, "routed_experts")


def _without_token_arrays(response: Mapping[str, Any], keep_logprobs: bool) -> JSONDict:
    """A deep copy of ``response`` without its token fields (``prompt_token_ids`` at the top
    level and on choices, choices' ``token_ids``/``routed_experts``/``logprobs`` unless kept,
    the messages' token bundle), never copying the arrays it drops.

    Deep-copying the whole answer first (a 16k-id prompt, one log-prob object per generated
    token) and deleting afterwards cost milliseconds per call on the event loop.
    """
    body = {k: v for k, v in response.items() if k != "prompt_token_ids"}
    choices = body.get("choices")
    if isinstance(choices, list):
        drop = _CHOICE_ARRAYS if keep_logprobs else (*_CHOICE_ARRAYS, "logprobs")
        body["choices"] = [_without(c, drop) if isinstance(c, Mapping) else c for c in choices]
    copied: JSONDict = copy_parsed(body)
    return copied


def _without(choice: Mapping[str, Any], drop: tuple[str, ...]) -> JSONDict:
    out = {k: v for k, v in choice.items() if k not in drop}
    message = out.get("message")
    if isinstance(message, Mapping):
        out["message"] = {k: v for k, v in message.items() if k not in _MESSAGE_ARRAYS}
    return out


def _choices(body: Mapping[str, Any]) -> list[Any]:
    choices = body.get("choices")
    return choices if isinstance(choices, list) else []


def _response_id(response: Mapping[str, Any]) -> str | None:
    value = response.get("id")
    return value if isinstance(value, str) and value else None


# --------------------------------------------------------------------------- extraction


def extract_chat_tokens(response: Mapping[str, Any], *, checked_prompt: int = 0) -> TokenPayload:
    """The tokens of a chat completion, cross-checked; raises a :class:`TokenExtractionError`.

    ``checked_prompt``: the first that many of the top-level ``prompt_token_ids`` are known to
    pass the id rules already (the proxy took them from the rollout's last prompt, checked when
    it was extracted: ``api.proxy.known_prompts``), so only the rest is checked, and the list
    (built by that cache for this answer) is taken as it is, not copied."""
    choice = _only_choice(response)
    message = mapping_or_empty(choice.get("message"))
    payload = _resolve(
        bundle=_message_bundle(message),
        inline=_inline_ids(
            response.get("prompt_token_ids"), choice.get("token_ids"), checked_prompt
        ),
        logprobs=_chat_logprobs(choice.get("logprobs")),
    )
    _check_usage(payload, response.get("usage"))
    experts = message.get("routed_experts")
    experts = choice.get("routed_experts") if experts is None else experts
    return replace(payload, routed_experts=experts)


def extract_completion_tokens(response: Mapping[str, Any]) -> TokenPayload:
    """The tokens of a text completion, cross-checked; raises a :class:`TokenExtractionError`."""
    choice = _only_choice(response)
    payload = _resolve(
        bundle=None,
        inline=_inline_ids(choice.get("prompt_token_ids"), choice.get("token_ids")),
        logprobs=_completion_logprobs(choice.get("logprobs")),
    )
    _check_usage(payload, response.get("usage"))
    return replace(payload, routed_experts=choice.get("routed_experts"))


def tokenize_request_body(upstream_body: Mapping[str, Any]) -> JSONDict:
    """The ``/tokenize`` body for the prompt of an upstream request (chat or completions):
    exactly the prompt-affecting fields, so the count matches what the engine rendered."""
    fields = _CHAT_TOKENIZE_FIELDS if "messages" in upstream_body else _COMPLETIONS_TOKENIZE_FIELDS
    return {key: copy.deepcopy(upstream_body[key]) for key in fields if key in upstream_body}


def with_tokenized_prompt(
    payload: TokenPayload, tokenize_response: Mapping[str, Any], *, usage: Any = None
) -> TokenPayload:
    """``payload`` with its prompt from a ``/tokenize`` answer, checked against ``count`` and
    the completion's ``usage.prompt_tokens``."""
    tokens = _id_list(tokenize_response.get("tokens"), "/tokenize tokens")
    if tokens is None:
        raise MalformedTokenPayload("the /tokenize answer carries no `tokens` list")
    count = tokenize_response.get("count")
    if count is not None and count != len(tokens):
        raise MalformedTokenPayload(f"/tokenize count={count} but {len(tokens)} tokens")
    completed = replace(payload, prompt_token_ids=tokens, prompt_source="tokenize")
    _check_usage(completed, usage)
    return completed


def _only_choice(response: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = response.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], Mapping):
        count = len(choices) if isinstance(choices, list) else "no"
        raise MalformedTokenPayload(f"expected exactly one choice, got {count}")
    return choices[0]


@dataclass(frozen=True, slots=True)
class _LogProbs:
    ids: list[int] | None  # None when the tokens are text, not token_id:N
    values: list[float]


def _resolve(
    *,
    bundle: tuple[list[int], list[int], list[float]] | None,
    inline: tuple[list[int], list[int]] | None,
    logprobs: _LogProbs | None,
) -> TokenPayload:
    if bundle is not None:
        prompt, generation, values = bundle
        if inline is not None and inline != (prompt, generation):
            raise MalformedTokenPayload("the message-level token bundle disagrees with inline ids")
        _check_against_logprobs(generation, logprobs, require=False)
        return TokenPayload(prompt, generation, values, "message_bundle", "message_bundle")
    if inline is not None:
        prompt, generation = inline
        values = _check_against_logprobs(generation, logprobs, require=True)
        return TokenPayload(prompt, generation, values, "inline", "inline")
    if logprobs is None:
        raise MissingTokenIds(
            "the answer carries no token ids (no prompt_token_ids/token_ids, no log-probs): "
            "the upstream must be vLLM >= 0.10.2 or honour return_token_ids and logprobs"
        )
    if logprobs.ids is None:
        raise MissingTokenIds(
            "the log-prob tokens are text, not token_id:N, and the answer has no inline ids: "
            "the upstream ignored return_tokens_as_token_ids and return_token_ids"
        )
    return TokenPayload(None, logprobs.ids, logprobs.values, "tokenize", "logprobs")


def _check_against_logprobs(
    generation: list[int], logprobs: _LogProbs | None, *, require: bool
) -> list[float]:
    """The log-probs for ``generation``, after checking they line up with its ids."""
    if logprobs is None:
        if require and generation:
            raise MalformedTokenPayload(
                f"{len(generation)} generated token ids but the answer has no log-probs"
            )
        return []
    if len(logprobs.values) != len(generation):
        raise MalformedTokenPayload(
            f"{len(generation)} generated token ids but {len(logprobs.values)} log-probs"
        )
    if logprobs.ids is not None and logprobs.ids != generation:
        position = next(
            i for i, (a, b) in enumerate(zip(logprobs.ids, generation, strict=True)) if a != b
        )
        raise MalformedTokenPayload(
            f"generated token ids disagree with the log-prob token ids at position {position}: "
            f"{generation[position]} != {logprobs.ids[position]}"
        )
    return logprobs.values


def _message_bundle(message: Mapping[str, Any]) -> tuple[list[int], list[int], list[float]] | None:
    present = [field for field in _BUNDLE_FIELDS if message.get(field) is not None]
    if not present:
        return None
    missing = [field for field in _BUNDLE_FIELDS if field not in present]
    if missing:
        raise MalformedTokenPayload(f"partial message-level token bundle; missing: {missing}")
    prompt = _id_list(message["prompt_token_ids"], "message.prompt_token_ids")
    generation = _id_list(message["generation_token_ids"], "message.generation_token_ids")
    values = _logprob_list(message["generation_log_probs"], "message.generation_log_probs")
    assert prompt is not None and generation is not None  # present, so parsed or raised
    if len(values) != len(generation):
        raise MalformedTokenPayload(
            f"message bundle has {len(generation)} generation ids but {len(values)} log-probs"
        )
    return prompt, generation, values


def _inline_ids(
    prompt_value: Any, generation_value: Any, checked_prompt: int = 0
) -> tuple[list[int], list[int]] | None:
    prompt = _id_list(prompt_value, "prompt_token_ids", checked_prompt)
    generation = _id_list(generation_value, "token_ids")
    if prompt is None and generation is None:
        return None
    if prompt is None or generation is None:
        missing = "prompt_token_ids" if prompt is None else "token_ids"
        raise MalformedTokenPayload(f"partial token metadata; missing: {missing}")
    return prompt, generation


def _chat_logprobs(value: Any) -> _LogProbs | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise MalformedTokenPayload("choices[0].logprobs is not an object")
    content = value.get("content")
    if content is None:
        return None
    if not isinstance(content, list):
        raise MalformedTokenPayload("choices[0].logprobs.content is not a list")
    try:  # every entry an object with both keys (what vLLM sends): two passes in C
        tokens = list(map(_TOKEN_OF, content))
        values = list(map(_LOGPROB_OF, content))
    except (KeyError, TypeError):
        entries = [mapping_or_empty(entry) for entry in content]
        tokens = [entry.get("token") for entry in entries]
        values = [entry.get("logprob") for entry in entries]
    return _LogProbs(_token_ids(tokens), _logprob_list(values, "logprobs.content[].logprob"))


def _completion_logprobs(value: Any) -> _LogProbs | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise MalformedTokenPayload("choices[0].logprobs is not an object")
    tokens, values = value.get("tokens"), value.get("token_logprobs")
    if tokens is None and values is None:
        return None
    if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
        raise MalformedTokenPayload("logprobs.tokens and logprobs.token_logprobs do not line up")
    return _LogProbs(_token_ids(tokens), _logprob_list(values, "logprobs.token_logprobs"))


def _token_ids(tokens: Sequence[Any]) -> list[int] | None:
    """Ids from ``token_id:N`` tokens; ``None`` when all are text; mixed is malformed."""
    parsed = _plain_token_ids(tokens)
    if parsed is not None:
        # Parsed from ASCII digits: non-negative ints by construction; only the range is left.
        if max(parsed) <= MAX_TOKEN_ID:
            return parsed
        try:
            return check_token_ids(parsed, "logprobs token_id:N")
        except ValueError as exc:
            raise MalformedTokenPayload(str(exc)) from None
    matches = [_TOKEN_ID.fullmatch(t) if isinstance(t, str) else None for t in tokens]
    parsed = [int(m.group(1)) for m in matches if m is not None]
    if not parsed and tokens:
        return None
    if len(parsed) != len(tokens):
        position = next(i for i, m in enumerate(matches) if m is None)
        raise MalformedTokenPayload(
            f"log-prob token {position} is {tokens[position]!r}, not token_id:N, while others are"
        )
    try:  # the same rules as inline ids (token_id:N is never negative, but may be too large)
        return check_token_ids(parsed, "logprobs token_id:N")
    except ValueError as exc:
        raise MalformedTokenPayload(str(exc)) from None


def _plain_token_ids(tokens: Sequence[Any]) -> list[int] | None:
    """The ids when every token is ``token_id:`` + ASCII digits (what vLLM sends), parsed with
    string operations over all tokens at once instead of a regex match per token; None for
    anything else (no tokens, text tokens, a malformed one), which the per-token path decides."""
    if not tokens:
        return None
    try:
        joined = "\x00" + "\x00".join(tokens)
    except TypeError:  # a token that is not a string
        return None
    n = len(tokens)
    # Every separator (one before each token, none inside one) is followed by the prefix.
    if joined.count("\x00") != n or joined.count("\x00token_id:") != n:
        return None
    digits = joined.replace("\x00token_id:", "\x00")
    body = digits.replace("\x00", "")
    if not (body.isascii() and body.isdigit()) or "\x00\x00" in digits or digits[-1] == "\x00":
        return None
    return list(map(int, digits[1:].split("\x00")))


def _id_list(value: Any, where: str, checked: int = 0) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise MalformedTokenPayload(f"{where} is not a list")
    try:  # the ledger's own rules (ledger.token_rules): what ingest would refuse, so does capture
        if 0 < checked <= len(value):
            try:
                check_token_ids(value[checked:], where)
                return value
            except ValueError:
                pass  # refused below, with the position in the whole list
        return list(check_token_ids(value, where))
    except ValueError as exc:
        raise MalformedTokenPayload(str(exc)) from None


def _logprob_list(value: Any, where: str) -> list[float]:
    if not isinstance(value, list):
        raise MalformedTokenPayload(f"{where} is not a list")
    try:  # shared with ingest (ledger.token_rules)
        checked = check_log_probs(value, where)
        if set(map(type, checked)) == {float}:
            return list(checked)
        return [float(x) for x in checked]
    except ValueError as exc:
        raise MalformedTokenPayload(str(exc)) from None


def _check_usage(payload: TokenPayload, usage: Any) -> None:
    usage = mapping_or_empty(usage)
    checks = [("completion_tokens", payload.generation_token_ids, "generated")]
    if payload.prompt_token_ids is not None:
        checks.append(("prompt_tokens", payload.prompt_token_ids, "prompt"))
    for field, ids, label in checks:
        reported = usage.get(field)
        if isinstance(reported, int) and not isinstance(reported, bool) and reported != len(ids):
            raise MalformedTokenPayload(
                f"usage.{field}={reported} but {len(ids)} {label} token ids"
            )
