"""Project a delivered chain into a Responses-shaped response whose token fields are contiguous.

Each call of the chain contributes its output items (text, tool calls, reasoning: deep-copied,
never the caller's objects).  One item per call, the *carrier*, gets the token fields:
``prompt_token_ids`` (every token before this call's generation: the root's prompt, then each
earlier generation and each later prompt suffix), ``generation_token_ids``,
``generation_log_probs`` and, when captured, ``routed_experts``.  So each carrier's prompt
extends everything before it, prompt positions are context and generated positions carry
their log-probs.

The carrier is ``output_items[token_item_index]`` when that index is valid, else the last
item; a call with no items gets a token-only ``{"type": "message", "role": "assistant",
"content": []}``.  Token fields found on any copied item are dropped before the carrier gets
its own, so only carriers hold tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from ledger.errors import ProjectionError
from ledger.model import ChainLinkTokens

__all__ = ["ProjectionError", "assert_prefix_contiguous", "project_chain"]

# Set on the carrier only; a stale copy on any other item would break contiguity.
TOKEN_FIELDS = (
    "prompt_token_ids",
    "generation_token_ids",
    "generation_log_probs",
    "routed_experts",
)


def project_chain(
    rollout_id: str, links: Sequence[ChainLinkTokens], model: str, *, owned: bool = False
) -> dict[str, Any]:
    """The Responses-shaped response for one chain (root first), usage included.

    The chain's tokens are laid out once, in one cumulative list; every carrier's prompt and
    generation are slices of it, so the carriers are prefix-contiguous by construction (each
    prompt ends where the chain's tokens up to that call end) and no token is decoded or
    compared twice.  Each carrier still holds its own lists.

    ``owned``: the links were read for this projection only (``Ledger.load_chain``); their
    output items are taken over instead of deep-copied.  By default nothing of the caller's is
    mutated or shared.
    """
    if not links:
        raise ProjectionError(f"rollout {rollout_id!r}: capture produced no safe trainable chain")
    cumulative: list[int] = []
    output: list[dict[str, Any]] = []
    carriers: list[tuple[dict[str, Any], int, ChainLinkTokens]] = []
    for link in links:
        if len(link.generation_token_ids) != len(link.generation_log_probs):
            raise ProjectionError(
                f"call {link.model_call_id!r}: {len(link.generation_token_ids)} generated "
                f"tokens but {len(link.generation_log_probs)} log-probs"
            )
        cumulative.extend(link.prompt_suffix)
        items, carrier = _items_with_carrier(link, owned=owned)
        carriers.append((items[carrier], len(cumulative), link))
        cumulative.extend(link.generation_token_ids)
        output.extend(items)
    input_tokens = carriers[0][1]
    output_tokens = 0
    # One list allocation per carrier when the links are owned (few allocations: a garbage
    # collection in this loop would traverse every prompt list made so far).
    for item, start, link in carriers:
        item["prompt_token_ids"] = cumulative[:start]
        if owned:
            item["generation_token_ids"] = link.generation_token_ids
            item["generation_log_probs"] = link.generation_log_probs
            if link.routed_experts is not None:
                item["routed_experts"] = link.routed_experts
        else:
            item["generation_token_ids"] = list(link.generation_token_ids)
            item["generation_log_probs"] = list(link.generation_log_probs)
            if link.routed_experts is not None:
                item["routed_experts"] = copy.deepcopy(link.routed_experts)
        output_tokens += len(link.generation_token_ids)
    return {
        "id": f"proj-{rollout_id}",
        "object": "response",
        "model": model,
        "output": output,
        "usage": {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
        },
    }


def assert_prefix_contiguous(response: Mapping[str, Any]) -> None:
    """Raise :class:`ProjectionError` unless every item that carries generated tokens has a
    prompt extending all tokens of the carriers before it, and at least one item does."""
    output = response.get("output")
    if not isinstance(output, list):
        raise ProjectionError("response has no output list")
    seen: list[int] = []
    carriers = 0
    generated = 0
    for index, item in enumerate(output):
        if not isinstance(item, Mapping) or "generation_token_ids" not in item:
            continue
        prompt = item.get("prompt_token_ids")
        generation = item.get("generation_token_ids")
        log_probs = item.get("generation_log_probs")
        if not isinstance(prompt, list) or not isinstance(generation, list):
            raise ProjectionError(f"output[{index}]: token fields are not lists")
        if not isinstance(log_probs, list) or len(log_probs) != len(generation):
            raise ProjectionError(
                f"output[{index}]: generation_log_probs do not match generation_token_ids"
            )
        if len(prompt) < len(seen) or prompt[: len(seen)] != seen:
            raise ProjectionError(
                f"projection is not prefix-contiguous: output[{index}].prompt_token_ids does "
                f"not extend the {len(seen)} tokens before it (first difference at "
                f"{_first_difference(prompt, seen)})"
            )
        seen = prompt + generation
        carriers += 1
        generated += len(generation)
    if not carriers or not generated:
        raise ProjectionError("capture produced no trainable generated tokens")


def _items_with_carrier(link: ChainLinkTokens, *, owned: bool) -> tuple[list[dict[str, Any]], int]:
    items = list(link.output_items) if owned else copy.deepcopy(link.output_items)
    if not items:
        return [{"type": "message", "role": "assistant", "content": []}], 0
    for position, item in enumerate(items):
        if not isinstance(item, dict):
            raise ProjectionError(
                f"call {link.model_call_id!r}: output_items[{position}] is not an object"
            )
        for name in TOKEN_FIELDS:
            item.pop(name, None)
    index = link.token_item_index
    if index is not None and 0 <= index < len(items):
        return items, index
    return items, len(items) - 1


def _first_difference(prompt: list[int], seen: list[int]) -> int:
    for position, (a, b) in enumerate(zip(prompt, seen, strict=False)):
        if a != b:
            return position
    return min(len(prompt), len(seen))
