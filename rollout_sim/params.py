"""Request validation with vLLM 0.32's rules and error texts, into one `Params` per request."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollout_sim.parsers import ToolMode

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
GENERATING_ROUTES = (CHAT_ROUTE, COMPLETIONS_ROUTE)


class ApiError(Exception):
    """A request the simulated server refuses, with vLLM's status, type and param."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.type = {404: "NotFoundError", 500: "InternalServerError"}.get(
            status, "BadRequestError"
        )


@dataclass(frozen=True)
class Params:
    """Sampling and output options common to both generating routes."""

    model: str | None
    n: int
    max_tokens: int | None
    max_param: str
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    include_stop_str: bool
    stream: bool
    include_usage: bool
    logprobs: bool
    top_n: int
    as_ids: bool
    prompt_ids: bool  # return prompt_token_ids
    gen_ids: bool  # return token_ids
    prompt_logprobs: int | None
    request_id: str | None
    tool_mode: ToolMode = "none"
    named_tool: str | None = None
    include_reasoning: bool = True
    return_prompt_text: bool = False
    usage_skew: int = 0  # a "usage" fault over-reports completion_tokens


# ----------------------------------------------------------------- request parsing


def typed(body: Mapping[str, Any], key: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        value = None  # JSON true is not an int
    if not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ApiError(f"`{key}` must be {names}, got {body.get(key)!r}.", param=key)
    return value


def opt_int(body: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value: int | None = typed(body, key, (int,), default)
    return value


def opt_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value: bool = typed(body, key, (bool,), default)
    return value


def _stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if "" in stop:
            raise ApiError("stop cannot contain an empty string.", param="stop")
        return tuple(stop)
    raise ApiError("`stop` must be a string or a list of strings.", param="stop")


def common_params(body: Mapping[str, Any], *, chat: bool, max_tokens: int | None) -> Params:
    stream = opt_bool(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options and not stream:
        raise ApiError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    n: int = typed(body, "n", (int,), 1)
    if n < 1:
        raise ApiError(f"n must be at least 1, got {n}.", param="n")
    temperature = float(typed(body, "temperature", (int, float), 1.0))
    if temperature < 0:
        raise ApiError(f"temperature must be non-negative, got {temperature}.", param="temperature")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    prompt_logprobs = opt_int(body, "prompt_logprobs", None)
    if prompt_logprobs is not None and stream and prompt_logprobs != 0:
        raise ApiError(
            "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs"
        )
    if chat:
        logprobs = opt_bool(body, "logprobs", False)
        top_n = opt_int(body, "top_logprobs", 0) or 0
        if top_n and not logprobs:
            raise ApiError(
                "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
            )
    else:
        completion_logprobs = opt_int(body, "logprobs", None)
        logprobs, top_n = completion_logprobs is not None, completion_logprobs or 0
    if top_n < 0 or (prompt_logprobs or 0) < 0:
        raise ApiError(
            "The simulator returns no whole-vocabulary log-probs (-1); ask for at most 20.",
            param="top_logprobs" if chat else "logprobs",
        )
    if top_n > 20 or (prompt_logprobs or 0) > 20:
        raise ApiError("Requested more than 20 log-probs per token (max_logprobs=20).")
    stop_token_ids = body.get("stop_token_ids") or []
    if not (isinstance(stop_token_ids, list) and all(isinstance(i, int) for i in stop_token_ids)):
        raise ApiError("`stop_token_ids` must be a list of integers.", param="stop_token_ids")
    model = body.get("model")
    return Params(
        model=model if isinstance(model, str) else None,
        n=n,
        max_tokens=max_tokens,
        max_param="max_tokens",
        temperature=temperature,
        seed=opt_int(body, "seed", None),
        stop=_stops(body),
        stop_token_ids=frozenset(stop_token_ids),
        include_stop_str=opt_bool(body, "include_stop_str_in_output", False),
        stream=stream,
        include_usage=bool(
            isinstance(stream_options, dict) and stream_options.get("include_usage")
        ),
        logprobs=logprobs,
        top_n=top_n,
        as_ids=opt_bool(body, "return_tokens_as_token_ids", False),
        prompt_ids=opt_bool(body, "return_token_ids", False),
        gen_ids=opt_bool(body, "return_token_ids", False),
        prompt_logprobs=prompt_logprobs,
        request_id=body.get("request_id") if isinstance(body.get("request_id"), str) else None,
    )


def tool_mode_of(body: Mapping[str, Any], auto_enabled: bool) -> tuple[ToolMode, str | None]:
    """vLLM's `check_tool_usage` rules, then which parser applies."""
    tools = body.get("tools")
    if tools == []:
        raise ApiError(
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely.",
            param="tools",
        )
    if tools is not None and not (
        isinstance(tools, list)
        and all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)
    ):
        raise ApiError("`tools` must be a list of function tools.", param="tools")
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice is None or choice == "none":
        return "none", None
    if not tools:
        raise ApiError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "auto":
        if not auto_enabled:
            raise ApiError(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set"
            )
        return "auto", None
    if choice == "required":
        return "required", None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(
            f"Invalid value for `tool_choice`: {choice}! "
            'Only named tools, "none", "auto" or "required" are supported.',
            param="tool_choice",
        )
    if not any(t["function"].get("name") == fn["name"] for t in tools):
        raise ApiError(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            param="tool_choice",
        )
    return "named", fn["name"]
