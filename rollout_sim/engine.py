"""A simulated vLLM 0.32 OpenAI-compatible server.

It answers with vLLM 0.32's exact JSON and SSE shapes (shared/reference/wire-formats.md
§1), real token ids from a pluggable tokenizer and reproducible log-probs, so the capture
proxy can be tested (and demonstrated) without a model. What the "model" says comes
from, in order: a scripted reply queued with `SimEngine.script`, the `responder`
callable, or a seeded word-salad policy. Sampled ids are always
`tokenizer.encode(text) + [eos]`, so an echoed history re-renders onto them.

Faults (HTTP 500, hangs, dropped streams, missing or malformed token payloads) are
queued at run time on `SimEngine.faults`; every request received is kept in
`SimEngine.requests`.

Over 600 lines on purpose, for now: every route (chat, completions, tokenize, models) is a
method of the one `SimEngine`, sharing its sampler, fault queue and request log; splitting it
into per-route mixins waits until branches still editing the pre-move `ledger/sim/engine.py`
have been merged onto this file (a pure rename lets git carry their edits here).
"""

from __future__ import annotations

import array
import bisect
import hashlib
import json
import math
import random
import secrets
import struct
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, TypedDict, Unpack

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from rollout_sim.chat import assistant_text, has_non_text_content, message_text
from rollout_sim.faults import Fault, Faults, SimulatedDisconnect
from rollout_sim.params import (
    CHAT_ROUTE,
    COMPLETIONS_ROUTE,
    ApiError,
    Params,
    common_params,
    opt_bool,
    opt_int,
    tool_mode_of,
)
from rollout_sim.parsers import ToolMode, parse_output
from rollout_sim.stream import Sample, Step, interleave, json_response, sse, text_offsets

VLLM_VERSION = "0.32.0"
LOGPROB_FLOOR = -9999.0  # vLLM clamps -inf to this

_VOCABULARY = (
    "the a model token answer request file value list result check step plan data "
    "simple small quick clear good next first last new open read write run test "
    "it we you this that here there now then so and but with for from into about "
    "looks seems works needs returns shows reads writes keeps finds uses makes"
)
_WORDS = tuple(_VOCABULARY.split())


class Tokenizer(Protocol):
    """What the simulated engine needs from a tokenizer and its chat template."""

    @property
    def eos_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> list[int]: ...


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reply:
    """What the simulated model samples for one choice.

    `token_ids`, when given, is used verbatim as the whole sample (add the EOS id
    yourself): for tests of tokens that do not round-trip through text.
    """

    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    token_ids: tuple[int, ...] | None = None

    def render(self, tool_mode: ToolMode) -> str:
        """The raw text the model emits, in the format the tool mode decodes."""
        calls = [{"name": c.name, "arguments": dict(c.arguments)} for c in self.tool_calls]
        if tool_mode == "required" and calls:
            body = json.dumps(
                [{"name": c["name"], "parameters": c["arguments"]} for c in calls],
                ensure_ascii=False,
            )
        elif tool_mode == "named" and calls:
            body = json.dumps(calls[0]["arguments"], ensure_ascii=False)
        else:
            body = assistant_text(self.text, calls)
        return body if self.reasoning is None else f"<think>{self.reasoning}</think>{body}"


@dataclass(frozen=True)
class SimRequest:
    """A parsed generation request, as a responder or a script matcher sees it."""

    route: str
    body: Mapping[str, Any]
    prompt_ids: tuple[int, ...]
    choice_index: int = 0

    @property
    def messages(self) -> list[dict[str, Any]]:
        msgs = self.body.get("messages")
        return list(msgs) if isinstance(msgs, list) else []

    @property
    def tools(self) -> list[dict[str, Any]]:
        tools = self.body.get("tools")
        return list(tools) if isinstance(tools, list) else []

    @property
    def last_user_text(self) -> str | None:
        for message in reversed(self.messages):
            if isinstance(message, dict) and message.get("role") == "user":
                return message_text(message.get("content"))
        return None


Responder = Callable[[SimRequest], Reply | str | None]
Matcher = Callable[[SimRequest], bool]


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: Any  # parsed JSON, or None when the body was empty or not JSON
    raw: bytes


def _f32(x: float) -> float:
    """Round to float32: vLLM's log-probs are float32 values widened to Python floats."""
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def _clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _apply_fault(params: Params, fault: Fault | None) -> Params:
    """Faults on the token payload are the server answering as if not asked."""
    if fault is not None and fault.kind == "no_token_ids":
        return replace(
            params,
            prompt_ids=False,
            gen_ids=False,
            logprobs=params.logprobs and fault.keep_logprobs,
        )
    if fault is not None and fault.kind == "malformed_tokens" and fault.variant == "usage":
        return replace(params, usage_skew=1)
    return params


# ----------------------------------------------------------------- the engine


class SimEngine:
    """The simulated server's state; `app` is the ASGI application serving it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        model_name: str = "smol",
        max_model_len: int = 2048,
        seed: int = 0,
        error_style: Literal["new", "old"] = "new",
        reasoning_parser: bool = False,
        enable_auto_tool_choice: bool = True,
        stream_interval: int = 1,
        strict_model: bool = True,
        required_prefix_extension: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        # NeMo RL's server extension: honour `required_prefix_token_ids` (stock vLLM ignores it).
        self.required_prefix_extension = required_prefix_extension
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.seed = seed
        self.error_style = error_style
        self.reasoning_parser = reasoning_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.stream_interval = max(1, stream_interval)
        self.strict_model = strict_model
        self.system_fingerprint = (
            f"vllm-{VLLM_VERSION}-" + hashlib.sha256(model_name.encode()).hexdigest()[:8]
        )
        self.requests: list[RecordedRequest] = []
        self.faults = Faults()
        self.responder: Responder | None = None
        self._scripts: deque[tuple[Reply, Matcher | None]] = deque()
        self._lock = threading.Lock()
        self._draws = 0
        self._token_text: dict[int, str] = {}
        self.app = self._build_app()

    # ------------------------------------------------------------ test controls

    def script(self, reply: Reply | str, *, when: Matcher | None = None) -> None:
        """Queue what the model says next (on the first request `when` accepts)."""
        with self._lock:
            self._scripts.append((Reply(reply) if isinstance(reply, str) else reply, when))

    def script_tool_call(
        self,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        content: str = "",
        when: Matcher | None = None,
    ) -> None:
        """Queue a turn that calls one tool (hermes text under `tool_choice: auto`)."""
        self.script(Reply(content, (ToolCall(name, dict(arguments or {})),)), when=when)

    @property
    def scripts_pending(self) -> int:
        return len(self._scripts)

    def bodies(self, path: str) -> list[Any]:
        """JSON bodies received on one path, in arrival order."""
        return [r.body for r in self.requests if r.path == path]

    # ------------------------------------------------------------ generation

    def _take_script(self, req: SimRequest) -> Reply | None:
        with self._lock:
            for entry in self._scripts:
                if entry[1] is None or entry[1](req):
                    self._scripts.remove(entry)
                    return entry[0]
        return None

    def _rng(self, params: Params, prompt_ids: Sequence[int], index: int) -> random.Random:
        """Greedy is seed-independent; seeded sampling is reproducible; unseeded differs."""
        if params.temperature == 0:
            salt = "greedy"
        elif params.seed is not None:
            salt = f"seed:{params.seed}:{index}"
        else:
            with self._lock:
                self._draws += 1
                salt = f"draw:{self._draws}"
        digest = hashlib.sha256(f"{self.seed}|{salt}|".encode())
        digest.update(array.array("q", prompt_ids).tobytes())
        return random.Random(digest.digest())

    def _policy(self, rng: random.Random, req: SimRequest, params: Params) -> Reply:
        """The unscripted model: a short sentence, or a call when a tool is forced."""
        if params.tool_mode in ("required", "named"):
            tools = [t["function"] for t in req.tools]
            fn = next((f for f in tools if f.get("name") == params.named_tool), rng.choice(tools))
            return Reply(tool_calls=(ToolCall(str(fn["name"]), self._fake_args(rng, fn)),))
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        return Reply(" ".join(words).capitalize() + rng.choice((".", ".", "!", "?")))

    @staticmethod
    def _fake_args(rng: random.Random, fn: Mapping[str, Any]) -> dict[str, Any]:
        """Arguments of the JSON-schema types a forced call needs, filled at random."""
        schema = fn.get("parameters") or {}
        props: dict[str, Any] = schema.get("properties") or {}
        fill: dict[str, Callable[[], Any]] = {
            "integer": lambda: rng.randint(0, 100),
            "number": lambda: round(rng.uniform(0, 100), 2),
            "boolean": lambda: rng.random() < 0.5,
        }
        word = lambda: rng.choice(_WORDS)  # noqa: E731
        return {
            name: fill.get((props.get(name) or {}).get("type", ""), word)()
            for name in schema.get("required") or list(props)
        }

    def _reply(self, req: SimRequest, rng: random.Random, params: Params) -> Reply:
        reply = self._take_script(req)
        if reply is None and self.responder is not None:
            answer = self.responder(req)
            reply = Reply(answer) if isinstance(answer, str) else answer
        return reply if reply is not None else self._policy(rng, req, params)

    def _stop(
        self, ids: list[int], params: Params, budget: int
    ) -> tuple[int, str, int | str | None, str]:
        """vLLM's per-step stop check: EOS or a stop token, stop strings, then length.

        Returns (kept token count, finish_reason, stop_reason, output text). Uses the text
        each token prefix reveals, so long outputs cost one decode, not one per token.
        """
        full = self.tokenizer.decode(ids, skip_special_tokens=True)
        ends = text_offsets(self.tokenizer, ids, len(full))
        kept = min(budget, len(ids))
        k, finish, end = kept, "length", ends[kept]
        reason: int | str | None = None
        for step, token in enumerate(ids[:kept], start=1):
            if token == self.tokenizer.eos_id or token in params.stop_token_ids:
                # The stop token stays in the ids; its text only with include_stop_str_in_output.
                reason = None if token == self.tokenizer.eos_id else token
                k, finish, end = step, "stop", ends[step if params.include_stop_str else step - 1]
                break
        for stop in params.stop:  # earlier strings win a tie, as in vLLM's loop
            pos = full.find(stop)
            step = bisect.bisect_left(ends, pos + len(stop)) if pos >= 0 else len(ends)
            if step < k or (step == k and finish == "length"):
                k, finish, reason = step, "stop", stop
                end = pos + len(stop) if params.include_stop_str else pos
        return k, finish, reason, full[:end]

    def _logprob(self, rng: random.Random) -> float:
        """Mostly confident tokens, some near-certain (tiny values), a few surprising."""
        r = rng.random()
        if r < 0.01:
            return 0.0
        if r < 0.05:
            return -rng.choice(
                (5.960464477539063e-08, 1.1920928955078125e-07, 2.384185791015625e-07)
            )
        if r < 0.09:
            return -_f32(rng.uniform(6.0, 14.0))
        return -_f32(rng.expovariate(1.5))

    def _alternatives(
        self, rng: random.Random, lp: float, k: int, taken: int
    ) -> list[tuple[int, float]]:
        """k other tokens sharing at most the probability mass `taken` left, best first."""
        rest, used, out = -math.expm1(lp), {taken}, []
        for _ in range(k):
            share = rest * rng.uniform(0.2, 0.8)
            rest -= share
            alt = rng.randrange(self.tokenizer.vocab_size)
            while alt in used:
                alt = rng.randrange(self.tokenizer.vocab_size)
            used.add(alt)
            out.append((alt, _f32(math.log(share)) if share > 0 else -math.inf))
        return sorted(out, key=lambda pair: -pair[1])

    def _step(self, rng: random.Random, token: int, top_n: int, greedy: bool) -> Step:
        lp = self._logprob(rng)
        alts = self._alternatives(rng, lp, top_n, token)
        if greedy:  # the sampled token is the most likely one
            alts = [(alt, min(alt_lp, lp)) for alt, alt_lp in alts]
        return Step(lp, ((token, lp), *alts))

    def _sample(self, req: SimRequest, params: Params, budget: int) -> Sample:
        rng = self._rng(params, req.prompt_ids, req.choice_index)
        reply = self._reply(req, rng, params)
        eos = self.tokenizer.eos_id
        if reply.token_ids is not None:
            ids = list(reply.token_ids)
        else:
            ids = [*self.tokenizer.encode(reply.render(params.tool_mode)), eos]
        kept, finish, stop_reason, text = self._stop(ids, params, budget)
        ids = ids[:kept]
        greedy = params.temperature == 0
        steps = [self._step(rng, t, max(params.top_n, 1), greedy) for t in ids]
        return Sample(req.choice_index, ids, steps, text, finish, stop_reason)

    def _token_str(self, token: int, as_ids: bool) -> tuple[str, list[int]]:
        """(logprob `token` field, `bytes`): bytes are of the decoded text even in id mode."""
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return (f"token_id:{token}" if as_ids else text), list(text.encode("utf-8", "replace"))

    # ------------------------------------------------------------ budgets and errors

    def _check_model(self, params: Params) -> None:
        if self.strict_model and params.model is not None and params.model != self.model_name:
            raise ApiError(f"The model `{params.model}` does not exist.", status=404, param="model")

    def _check_max_tokens(self, params: Params) -> None:
        """0.32 refuses a max_tokens above the context before rendering the prompt."""
        mt, limit = params.max_tokens, self.max_model_len
        if self.error_style == "new" and mt is not None and mt > limit:
            raise ApiError(
                f"{params.max_param}={mt} cannot be greater than max_model_len={limit}. "
                f"Please request fewer output tokens. (parameter={params.max_param}, value={mt})",
                param=params.max_param,
            )

    def _budget(self, prompt_len: int, params: Params, *, truncated_count: bool) -> int:
        """Tokens this choice may generate, or the context-length error of the version."""
        limit, mt = self.max_model_len, params.max_tokens
        if self.error_style == "old":
            if mt is None:
                if prompt_len >= limit:
                    raise ApiError(
                        f"This model's maximum context length is {limit} tokens. However, you "
                        f"requested {prompt_len} tokens in the messages, Please reduce the "
                        "length of the messages."
                    )
                return limit - prompt_len
            if prompt_len + mt > limit:
                raise ApiError(
                    f"'max_tokens' or 'max_completion_tokens' is too large: {mt}. This model's "
                    f"maximum context length is {limit} tokens and your request has "
                    f"{prompt_len} input tokens ({mt} > {limit} - {prompt_len})."
                )
            return mt
        if prompt_len >= limit:
            # Text prompts are tokenized with truncation at limit + 1: hence "at least".
            shown = min(prompt_len, limit + 1) if truncated_count else prompt_len
            raise ApiError(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains at least {shown} input tokens, which exceeds this limit even without "
                "any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={shown})",
                param="input_tokens",
            )
        room = limit - prompt_len
        return room if mt is None else min(mt, room)  # 0.32 clamps instead of refusing

    def error_body(self, err: ApiError) -> dict[str, Any]:
        if self.error_style == "old":  # vLLM <= 0.10.0: flat envelope, no param
            return {
                "object": "error",
                "message": err.message,
                "type": err.type,
                "param": None,
                "code": err.status,
            }
        return {
            "error": {
                "message": err.message,
                "type": err.type,
                "param": err.param,
                "code": err.status,
            }
        }

    def _error(self, err: ApiError) -> Response:
        return json_response(self.error_body(err), err.status)

    # ------------------------------------------------------------ HTTP plumbing

    def _build_app(self) -> Starlette:
        routes = [
            Route(CHAT_ROUTE, self._post(self._chat_response), methods=["POST"]),
            Route(COMPLETIONS_ROUTE, self._post(self._completions_response), methods=["POST"]),
            Route("/tokenize", self._post(self._tokenize), methods=["POST"]),
            Route("/detokenize", self._post(self._detokenize), methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/ping", self._health, methods=["GET", "POST"]),
            Route("/version", self._version, methods=["GET"]),
        ]
        app = Starlette(routes=routes)
        app.state.engine = self
        return app

    async def _record(self, request: Request) -> Any:
        """Keep the request for the test to inspect; return its JSON body (None if none)."""
        raw = await request.body()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = None
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.requests.append(
            RecordedRequest(request.method, request.url.path, request.url.query, headers, body, raw)
        )
        return body

    def _post(
        self, respond: Callable[[Mapping[str, Any], Fault | None], Response]
    ) -> Callable[[Request], Awaitable[Response]]:
        """Endpoint wrapper: record, apply the queued fault, map refusals to vLLM errors."""

        async def endpoint(request: Request) -> Response:
            body = await self._record(request)
            fault = self.faults.take(request.url.path)
            if fault is not None and fault.kind == "http_500":
                return self._error(
                    ApiError("Simulated engine failure (fault injection).", status=500)
                )
            if fault is not None and fault.kind == "hang":
                return await self._hang(request)
            try:
                if not isinstance(body, dict):
                    raise ApiError("The request body must be a JSON object.")
                response = respond(body, fault)
            except ApiError as err:
                return self._error(err)
            if fault is not None and not isinstance(response, StreamingResponse):
                if fault.kind == "drop":  # the connection dies part-way through the answer
                    return _cut_body(response)
                if fault.kind == "stream_error":  # a generation error, non-streaming form
                    return self._error(ApiError("Simulated generation error.", status=500))
            return response

        return endpoint

    async def _hang(self, request: Request) -> Response:
        """Hold the request until the client goes away (or the task is cancelled)."""
        self.faults.hanging += 1
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        finally:
            self.faults.hanging -= 1
        return Response(status_code=499)

    # ------------------------------------------------------------ chat completions

    def _chat_params(self, body: Mapping[str, Any]) -> Params:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError("`messages` must be a non-empty list.", param="messages")
        mct = opt_int(body, "max_completion_tokens", None)
        mt = mct if mct is not None else opt_int(body, "max_tokens", None)
        params = common_params(body, chat=True, max_tokens=mt)
        if opt_bool(body, "continue_final_message", False):
            raise ApiError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                if opt_bool(body, "add_generation_prompt", True)
                else "The simulator does not support `continue_final_message`."
            )
        tool_mode, named = tool_mode_of(body, self.enable_auto_tool_choice)
        include_reasoning = opt_bool(body, "include_reasoning", True)
        # Under a reasoning parser, include_reasoning=false also drops logprobs and token_ids.
        hidden = self.reasoning_parser and not include_reasoning
        return replace(
            params,
            max_param="max_completion_tokens" if mct is not None else "max_tokens",
            tool_mode=tool_mode,
            named_tool=named,
            include_reasoning=include_reasoning,
            return_prompt_text=opt_bool(body, "return_prompt_text", False),
            logprobs=params.logprobs and not hidden,
            gen_ids=params.gen_ids and not hidden,
        )

    def _render(self, body: Mapping[str, Any]) -> list[int]:
        try:
            return self.tokenizer.render_chat(
                list(body["messages"]),
                body.get("tools"),
                opt_bool(body, "add_generation_prompt", True),
            )
        except (TypeError, KeyError, ValueError, AttributeError) as exc:  # refused messages
            raise ApiError(f"invalid messages: {exc}") from exc

    def _reused_prompt_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """vLLM 0.32's ``kv_transfer_params["prompt_token_ids"]`` (``_reused_prompt_token_ids``
        in ``vllm/renderers/online_renderer.py``): popped from the params; ignored when
        ``echo`` is set or a message has non-text content (the messages are rendered then);
        otherwise a non-empty list of in-vocabulary ids used as the prompt, unrendered."""
        kv = body.get("kv_transfer_params")
        if not isinstance(kv, dict):
            return None
        ids = kv.get("prompt_token_ids")  # vLLM pops it; the recorded body stays as sent
        if ids is None or opt_bool(body, "echo", False) or has_non_text_content(body["messages"]):
            return None
        if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
            raise ApiError(
                "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of "
                "non-negative integers.",
                param="kv_transfer_params.prompt_token_ids",
            )
        if max(ids) >= self.tokenizer.vocab_size:
            raise ApiError(
                f"Token id {max(ids)} is out of vocabulary",
                param="kv_transfer_params.prompt_token_ids",
            )
        return list(ids)

    def _required_prefix(self, body: Mapping[str, Any], actual: list[int]) -> list[int]:
        """NeMo RL's correction (wire-formats §3.3): the reference ids replace the shortest
        prefix of the rendered prompt whose text equals the reference's text."""
        ref = body.get("required_prefix_token_ids")
        if not self.required_prefix_extension or not isinstance(ref, list) or not ref:
            return actual
        if actual[: len(ref)] == ref:
            return actual
        ref_text = self.tokenizer.decode(ref)
        if not self.tokenizer.decode(actual).startswith(ref_text):
            raise ApiError("non-monotonically increasing trajectory", status=500)
        for cut in range(1, len(actual) + 1):
            if self.tokenizer.decode(actual[:cut]) == ref_text:
                return [*ref, *actual[cut:]]
        raise ApiError("non-monotonically increasing trajectory", status=500)

    def _chat_response(self, body: Mapping[str, Any], fault: Fault | None) -> Response:
        params = _apply_fault(self._chat_params(body), fault)
        self._check_model(params)
        self._check_max_tokens(params)
        reused = self._reused_prompt_ids(body)
        prompt = reused if reused is not None else self._required_prefix(body, self._render(body))
        budget = self._budget(len(prompt), params, truncated_count=True)
        samples = []
        for i in range(params.n):
            req = SimRequest(CHAT_ROUTE, body, tuple(prompt), i)
            sample = self._sample(req, params, budget)
            self._parse_chat(sample, params)
            samples.append(sample)
        _corrupt(samples, fault, self.tokenizer.vocab_size)
        rid = f"chatcmpl-{params.request_id or secrets.token_hex(8)}"
        if params.stream:
            return sse(self._chat_stream(rid, prompt, samples, params), fault)
        return json_response(self._chat_body(rid, prompt, samples, params))

    def _parse_chat(self, sample: Sample, params: Params) -> None:
        sample.parsed = parse_output(
            sample.text,
            reasoning_parser=self.reasoning_parser,
            tool_mode=params.tool_mode,
            named_tool=params.named_tool,
        )
        if sample.parsed.tools_called and sample.finish_reason == "stop":
            sample.finish_reason = "tool_calls"
        sample.tool_ids = [
            f"chatcmpl-tool-{secrets.token_hex(8)}" for _ in sample.parsed.tool_calls
        ]

    def _chat_logprobs(self, sample: Sample, lo: int, hi: int, params: Params) -> Any:
        if not params.logprobs:
            return None
        content = []
        for token, step in zip(sample.ids[lo:hi], sample.steps[lo:hi], strict=False):
            text, raw = self._token_str(token, params.as_ids)
            top = []
            for alt, alt_lp in step.top[: params.top_n]:
                alt_text, alt_raw = self._token_str(alt, params.as_ids)
                top.append({"token": alt_text, "logprob": _clamp(alt_lp), "bytes": alt_raw})
            content.append(
                {"token": text, "logprob": _clamp(step.logprob), "bytes": raw, "top_logprobs": top}
            )
        return {"content": content}

    @staticmethod
    def _gen_ids(sample: Sample, lo: int, hi: int, params: Params) -> list[int] | None:
        if not params.gen_ids:
            return None
        return (sample.inline_ids if sample.inline_ids is not None else sample.ids)[lo:hi]

    def _prompt_logprobs(self, prompt: Sequence[int], params: Params) -> Any:
        """vLLM's prompt_logprobs: null first, then {"<id>": {logprob, rank, decoded_token}}."""
        if params.prompt_logprobs is None:
            return None
        rng = random.Random(hashlib.sha256(array.array("q", prompt).tobytes()).digest())
        out: list[Any] = [None]
        for token in prompt[1:]:
            lp = self._logprob(rng)
            rank = 1 if lp > -0.7 else rng.randint(2, 500)
            entry = {
                str(token): {
                    "logprob": _clamp(lp),
                    "rank": rank,
                    "decoded_token": self._token_str(token, False)[0],
                }
            }
            alts = self._alternatives(rng, lp, params.prompt_logprobs, token)
            for r, (alt, alt_lp) in enumerate(alts, start=2 if rank == 1 else 1):
                entry[str(alt)] = {
                    "logprob": _clamp(min(alt_lp, lp) if rank == 1 else alt_lp),
                    "rank": r,
                    "decoded_token": self._token_str(alt, False)[0],
                }
            out.append(entry)
        return out

    @staticmethod
    def _usage(prompt_len: int, samples: Sequence[Sample], params: Params) -> dict[str, Any]:
        completion = sum(len(s.ids) for s in samples) + params.usage_skew
        return {
            "prompt_tokens": prompt_len,
            "total_tokens": prompt_len + completion,
            "completion_tokens": completion,
        }

    def _chat_body(
        self, rid: str, prompt: list[int], samples: list[Sample], params: Params
    ) -> dict[str, Any]:
        choices = []
        for s in samples:
            assert s.parsed is not None
            message: dict[str, Any] = {
                "role": "assistant",
                "content": s.parsed.content,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
            }
            if s.parsed.tool_calls:  # vLLM omits an empty tool_calls list
                message["tool_calls"] = [
                    {
                        "id": tid,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for tid, c in zip(s.tool_ids, s.parsed.tool_calls, strict=True)
                ]
            message["reasoning"] = s.parsed.reasoning if params.include_reasoning else None
            choices.append(
                {
                    "index": s.index,
                    "message": message,
                    "logprobs": self._chat_logprobs(s, 0, len(s.ids), params),
                    "finish_reason": s.finish_reason,
                    "stop_reason": s.stop_reason,
                    "token_ids": self._gen_ids(s, 0, len(s.ids), params),
                    "routed_experts": None,
                }
            )
        return self._answer(
            rid,
            "chat.completion",
            choices,
            self._usage(len(prompt), samples, params),
            prompt_logprobs=self._prompt_logprobs(prompt, params),
            prompt_token_ids=prompt if params.prompt_ids else None,
            prompt_text=self.tokenizer.decode(prompt) if params.return_prompt_text else None,
        )

    def _answer(
        self,
        rid: str,
        kind: str,
        choices: list[dict[str, Any]],
        usage: dict[str, Any],
        **prompt_fields: Any,
    ) -> dict[str, Any]:
        """A whole (non-streamed) answer of kind ``chat.completion`` or ``text_completion``,
        its fields in vLLM's order (``prompt_fields`` after the usage)."""
        return {
            "id": rid,
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "system_fingerprint": self.system_fingerprint,
            "usage": {**usage, "prompt_tokens_details": None, "completion_tokens_details": None},
            **prompt_fields,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _chat_stream(
        self, rid: str, prompt: list[int], samples: list[Sample], params: Params
    ) -> list[dict[str, Any]]:
        """Chunks serialised as vLLM does (exclude_unset): only the fields it sets."""
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model_name,
        }
        events = [  # every choice opens with a role chunk carrying the prompt
            {
                **head,
                "choices": [
                    {
                        "index": s.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                "prompt_token_ids": prompt if params.prompt_ids else None,
                "prompt_text": self.tokenizer.decode(prompt) if params.return_prompt_text else None,
            }
            for s in samples
        ]
        # Without a tool or reasoning parser every chunk carries its (maybe empty) content.
        plain = params.tool_mode == "none" and not self.reasoning_parser
        for plan, c in interleave(self.tokenizer, samples, self.stream_interval):
            s = plan.sample
            delta = {"content": s.text[c.a : c.b]} if plain else plan.delta(c)
            logprobs = self._chat_logprobs(s, c.lo, c.hi, params)
            if not (delta or c.last or logprobs or params.gen_ids):
                continue  # vLLM drops a held-back chunk unless ids or logprobs ride on it
            choice: dict[str, Any] = {
                "index": s.index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": None,
            }
            if c.last:
                choice["finish_reason"], choice["stop_reason"] = s.finish_reason, s.stop_reason
            choice["token_ids"] = self._gen_ids(s, c.lo, c.hi, params)
            events.append({**head, "choices": [choice]})
        if params.include_usage:
            usage = self._usage(len(prompt), samples, params)
            events.append(
                {
                    **head,
                    "choices": [],
                    "usage": usage,
                    "system_fingerprint": self.system_fingerprint,
                }
            )
        return events

    # ------------------------------------------------------------ completions

    def _prompts(self, body: Mapping[str, Any]) -> list[tuple[list[int], bool]]:
        """Each prompt's ids, and whether it came as text (so its count may be truncated)."""
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise ApiError(
                "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
            )
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif isinstance(prompt, list) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in prompt
        ):
            items = [prompt]
        elif isinstance(prompt, list):
            items = prompt
        else:
            raise ApiError(
                "`prompt` must be a string, a list of strings or of token ids.", param="prompt"
            )
        out = []
        for item in items:
            if isinstance(item, str):
                out.append((self.tokenizer.encode(item), True))
            elif (
                isinstance(item, list)
                and item
                and all(isinstance(x, int) and not isinstance(x, bool) for x in item)
            ):
                bad = [x for x in item if not 0 <= x < self.tokenizer.vocab_size]
                if bad:
                    raise ApiError(f"Token id {bad[0]} is out of vocabulary", param="prompt")
                out.append((list(item), False))
            else:
                raise ApiError(
                    "`prompt` must be a string, a list of strings or of token ids.", param="prompt"
                )
        return out

    def _completions_response(self, body: Mapping[str, Any], fault: Fault | None) -> Response:
        if opt_bool(body, "echo", False):
            raise ApiError("The simulator does not support `echo`.", param="echo")
        mt = opt_int(body, "max_tokens", None)
        params = common_params(body, chat=False, max_tokens=16 if mt is None else mt)
        params = _apply_fault(params, fault)
        self._check_model(params)
        self._check_max_tokens(params)
        prompts = self._prompts(body)
        budgets = [self._budget(len(p), params, truncated_count=t) for p, t in prompts]
        samples: list[Sample] = []
        for p_idx, ((prompt, _), budget) in enumerate(zip(prompts, budgets, strict=True)):
            for j in range(params.n):
                sample = self._sample(
                    SimRequest(COMPLETIONS_ROUTE, body, tuple(prompt), j), params, budget
                )
                sample.index = p_idx * params.n + j  # choices of prompt i follow those of i-1
                samples.append(sample)
        _corrupt(samples, fault, self.tokenizer.vocab_size)
        rid = f"cmpl-{params.request_id or secrets.token_hex(8)}"
        prompt_ids = [p for p, _ in prompts]
        if params.stream:
            return sse(self._completion_stream(rid, prompt_ids, samples, params), fault)
        return json_response(self._completion_body(rid, prompt_ids, samples, params))

    def _legacy_logprobs(
        self, sample: Sample, lo: int, hi: int, params: Params, text_offset: int
    ) -> Any:
        """The completions shape; `text_offset` advances by each token *string's* length."""
        if not params.logprobs:
            return None
        offsets: list[int] = []
        tokens: list[str] = []
        values: list[float] = []
        tops: list[dict[str, float]] = []
        for token, step in zip(sample.ids[lo:hi], sample.steps[lo:hi], strict=False):
            offsets.append(offsets[-1] + len(tokens[-1]) if tokens else text_offset)
            tokens.append(self._token_str(token, params.as_ids)[0])
            values.append(_clamp(step.logprob))
            top: dict[str, float] = {}  # keyed by token string: equal strings collapse
            for alt, alt_lp in step.top[: params.top_n + 1]:
                top.setdefault(self._token_str(alt, params.as_ids)[0], _clamp(alt_lp))
            tops.append(top)
        return {
            "text_offset": offsets,
            "token_logprobs": values,
            "tokens": tokens,
            "top_logprobs": tops,
        }

    def _completion_body(
        self, rid: str, prompts: list[list[int]], samples: list[Sample], params: Params
    ) -> dict[str, Any]:
        choices = []
        for s in samples:
            prompt = prompts[s.index // params.n]
            choices.append(
                {
                    "index": s.index,
                    "text": s.text,
                    "logprobs": self._legacy_logprobs(s, 0, len(s.ids), params, 0),
                    "finish_reason": s.finish_reason,
                    "stop_reason": s.stop_reason,
                    "token_ids": self._gen_ids(s, 0, len(s.ids), params),
                    "prompt_logprobs": self._prompt_logprobs(prompt, params),
                    "prompt_token_ids": prompt if params.prompt_ids else None,
                    "routed_experts": None,
                }
            )
        usage = self._usage(sum(map(len, prompts)), samples, params)
        return self._answer(rid, "text_completion", choices, usage)

    def _completion_stream(
        self, rid: str, prompts: list[list[int]], samples: list[Sample], params: Params
    ) -> list[dict[str, Any]]:
        """Every choice field is set explicitly in vLLM, so every chunk carries all of them."""
        head = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        events: list[dict[str, Any]] = []
        for plan, c in interleave(self.tokenizer, samples, self.stream_interval):
            s = plan.sample
            choice = {
                "index": s.index,
                "text": s.text[c.a : c.b],
                "logprobs": self._legacy_logprobs(s, c.lo, c.hi, params, c.a),
                "finish_reason": s.finish_reason if c.last else None,
                "stop_reason": s.stop_reason if c.last else None,
                "prompt_token_ids": (
                    prompts[s.index // params.n] if params.prompt_ids and c.lo == 0 else None
                ),
                "token_ids": self._gen_ids(s, c.lo, c.hi, params),
            }
            events.append({**head, "choices": [choice]})
        if params.include_usage:
            usage = self._usage(sum(map(len, prompts)), samples, params)
            events.append(
                {
                    **head,
                    "choices": [],
                    "usage": usage,
                    "system_fingerprint": self.system_fingerprint,
                }
            )
        return events

    # ------------------------------------------------------------ other endpoints

    def _tokenize(self, body: Mapping[str, Any], fault: Fault | None) -> Response:
        if "messages" in body:
            tool_mode_of(body, True)
            tokens = self._render(body)
        elif isinstance(body.get("prompt"), str):
            tokens = self.tokenizer.encode(body["prompt"])
        else:
            raise ApiError("Provide `prompt` (a string) or `messages`.", param="prompt")
        strs = None
        if body.get("return_token_strs"):
            to_str = getattr(self.tokenizer, "id_to_token", None)  # optional on a Tokenizer
            strs = [to_str(t) if to_str else self.tokenizer.decode([t]) for t in tokens]
        return json_response(
            {
                "count": len(tokens),
                "max_model_len": self.max_model_len,
                "tokens": tokens,
                "token_strs": strs,
            }
        )

    def _detokenize(self, body: Mapping[str, Any], fault: Fault | None) -> Response:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ApiError("`tokens` must be a list of token ids.", param="tokens")
        return json_response({"prompt": self.tokenizer.decode(tokens)})

    async def _models(self, request: Request) -> Response:
        await self._record(request)
        created = int(time.time())
        card = {
            "id": self.model_name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{secrets.token_hex(16)}",
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return json_response({"object": "list", "data": [card]})

    async def _health(self, request: Request) -> Response:
        await self._record(request)
        return Response(status_code=200)

    async def _version(self, request: Request) -> Response:
        await self._record(request)
        return json_response({"version": VLLM_VERSION})


def _corrupt(samples: list[Sample], fault: Fault | None, vocab: int) -> None:
    """Apply a `malformed_tokens` fault to the first choice."""
    if fault is None or fault.kind != "malformed_tokens" or not samples or not samples[0].ids:
        return
    first = samples[0]
    if fault.variant == "length":
        first.steps = first.steps[:-1]
    elif fault.variant == "mismatch":
        first.inline_ids = [*first.ids[:-1], (first.ids[-1] + 1) % vocab]


class EngineOptions(TypedDict, total=False):
    """`SimEngine`'s keyword options; what is left out takes `SimEngine`'s default."""

    model_name: str
    max_model_len: int
    seed: int
    error_style: Literal["new", "old"]
    reasoning_parser: bool
    enable_auto_tool_choice: bool
    stream_interval: int
    strict_model: bool
    required_prefix_extension: bool


def create_sim_vllm_app(tokenizer: Tokenizer, **options: Unpack[EngineOptions]) -> Starlette:
    """The ASGI app of a new `SimEngine`; reach the engine with `engine_of(app)`."""
    return SimEngine(tokenizer, **options).app


def engine_of(app: Starlette) -> SimEngine:
    engine = app.state.engine
    assert isinstance(engine, SimEngine)
    return engine


def _cut_body(response: Response) -> StreamingResponse:
    """Send the status, headers and half the body, then drop the connection (fault ``drop``).

    Under uvicorn the client sees a broken connection mid-body (httpx: RemoteProtocolError),
    which is what a crashed or killed server looks like on the wire.
    """
    body = bytes(response.body)

    async def chunks() -> AsyncIterator[bytes]:
        yield body[: len(body) // 2]
        raise SimulatedDisconnect("simulated connection drop (fault injection)")

    return StreamingResponse(
        chunks(), status_code=response.status_code, media_type=response.media_type
    )
