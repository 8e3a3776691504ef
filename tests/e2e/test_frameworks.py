"""Real agent frameworks drive multi-turn tool-using rollouts through the proxy against real
vLLM; every rollout is then collected and verified by the oracle (``harness``; issue #11 point 5).

    framework -> `rollout-ledger serve` -> recorder -> vLLM

- the OpenAI Agents SDK with its chat-completions model (``OpenAIChatCompletionsModel``) and with
  its Responses model (``OpenAIResponsesModel``, the proxy's ``/v1/responses`` dialect);
- LangGraph's ``create_react_agent`` with langchain-openai's ``ChatOpenAI``;
- the Anthropic SDK's ``beta.messages.tool_runner``.

(The hand-written OpenAI and Anthropic SDK tool loops are in ``test_vllm_e2e``.)

Each framework runs ``E2E_ROLLOUTS_PER_FRAMEWORK`` rollouts (default 2) with different questions.
The first model call is forced to call the tool (``tool_choice`` required/any, strict schema,
enum argument); later calls run with the framework's own choice (``auto``).  Every loop is bounded
by the framework's own limit (``max_turns``, ``recursion_limit``, ``max_iterations``); a rollout
that hits it is still a rollout, reported with ``stopped_by`` and checked like any other.

The frameworks are the ``e2e`` extra of pyproject.toml; a framework that is not installed skips
its test, unless ``E2E_REQUIRE_FRAMEWORKS=1`` (``scripts/e2e-vllm.sh`` sets it) makes that a
failure.
"""

from __future__ import annotations

import asyncio
import importlib
import os
from types import ModuleType
from typing import Any, Literal

import pytest

from tests.e2e.harness import (
    ANSWER_MAX_TOKENS,
    E2E_MARKS,
    MODEL,
    REQUEST_TIMEOUT_S,
    ROLLOUTS_PER_FRAMEWORK,
    SYSTEM_TOOLS,
    TOOL_MAX_TOKENS,
    WEATHER_DESCRIPTION,
    WEATHER_TOOL_SCHEMA,
    Proxy,
    Rollout,
    driving,
    question,
    verify,
    weather,
)

pytestmark = E2E_MARKS
REQUIRE = os.environ.get("E2E_REQUIRE_FRAMEWORKS", "0") == "1"
City = Literal["Paris", "London", "Tokyo", "Rome"]


def _need(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if REQUIRE:
            pytest.fail(f"{module} is not installed (pip install -e '.[e2e]'): {exc}")
        pytest.skip(f"{module} is not installed (pip install -e '.[e2e]')")


# --------------------------------------------------------------------------- OpenAI Agents SDK


def _agents_rollout(proxy: Proxy, k: int, responses: bool) -> Rollout:
    agents = _need("agents")
    openai = _need("openai")
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: City) -> str:
        """Get the current weather for a city."""
        return weather(city)

    kind = "responses" if responses else "chat"
    with driving(proxy, f"agents-sdk-{kind}", f"agents-{kind}-{k}") as r:
        client = openai.AsyncOpenAI(
            base_url=proxy.base(r.rollout_id) + "/v1",
            api_key="sk-e2e",
            max_retries=0,
            timeout=REQUEST_TIMEOUT_S,
        )
        model_cls = agents.OpenAIResponsesModel if responses else agents.OpenAIChatCompletionsModel
        agent = agents.Agent(
            name="weather",
            instructions=SYSTEM_TOOLS,
            model=model_cls(MODEL, client),
            tools=[get_weather],
            # Forced on the first call; the SDK resets tool_choice after a tool call
            # (reset_tool_choice, its default), so the next call may answer.
            model_settings=agents.ModelSettings(
                tool_choice="required", temperature=0, max_tokens=TOOL_MAX_TOKENS
            ),
        )

        async def run() -> None:
            try:
                await agents.Runner.run(agent, question(k), max_turns=3)
            except agents.MaxTurnsExceeded as exc:
                r.stopped_by = f"MaxTurnsExceeded: {exc}"
            finally:
                await client.close()

        asyncio.run(run())
    return r


@pytest.mark.parametrize("responses", [False, True], ids=["chat-completions", "responses"])
def test_openai_agents_sdk(proxy: Proxy, responses: bool) -> None:
    rollouts = [_agents_rollout(proxy, k, responses) for k in range(ROLLOUTS_PER_FRAMEWORK)]
    verify(proxy, rollouts, "agents-responses" if responses else "agents-chat")


# --------------------------------------------------------------------------- LangGraph


def _langgraph_rollout(proxy: Proxy, k: int) -> Rollout:
    lc_openai = _need("langchain_openai")
    lc_tools = _need("langchain_core.tools")
    lc_messages = _need("langchain_core.messages")
    prebuilt = _need("langgraph.prebuilt")
    lg_errors = _need("langgraph.errors")

    @lc_tools.tool
    def get_weather(city: City) -> str:
        """Get the current weather for a city."""
        return weather(city)

    with driving(proxy, "langgraph", f"langgraph-{k}") as r:
        llm = lc_openai.ChatOpenAI(
            model=MODEL,
            base_url=proxy.base(r.rollout_id) + "/v1",
            api_key="sk-e2e",
            temperature=0,
            max_tokens=TOOL_MAX_TOKENS,
            max_retries=0,
            timeout=REQUEST_TIMEOUT_S,
        )
        forced = llm.bind_tools([get_weather], tool_choice="required", strict=True)
        free = llm.bind_tools([get_weather], strict=True)

        def pick(state: dict[str, Any], runtime: Any) -> Any:
            """Force the tool until a tool result is in the history, then let the model choose."""
            done = any(isinstance(m, lc_messages.ToolMessage) for m in state["messages"])
            return free if done else forced

        agent = prebuilt.create_react_agent(pick, [get_weather], prompt=SYSTEM_TOOLS)
        try:
            # Each model call and each tool step is one super-step: at most 3 model calls.
            agent.invoke({"messages": [("user", question(k))]}, {"recursion_limit": 6})
        except lg_errors.GraphRecursionError as exc:
            r.stopped_by = f"GraphRecursionError: {exc}".splitlines()[0]
    return r


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
def test_langgraph_react_agent(proxy: Proxy) -> None:
    rollouts = [_langgraph_rollout(proxy, k) for k in range(ROLLOUTS_PER_FRAMEWORK)]
    verify(proxy, rollouts, "langgraph")


# --------------------------------------------------------------------------- Anthropic tool_runner


def _tool_runner_rollout(proxy: Proxy, k: int) -> Rollout:
    anthropic = _need("anthropic")
    if not hasattr(anthropic.Anthropic(api_key="x").beta.messages, "tool_runner"):
        pytest.skip(f"anthropic {anthropic.__version__} has no beta.messages.tool_runner")

    @anthropic.beta_tool(strict=True, input_schema=WEATHER_TOOL_SCHEMA)
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return weather(city)

    assert get_weather.to_dict()["description"].startswith(WEATHER_DESCRIPTION[:20])
    with driving(proxy, "anthropic-tool-runner", f"tool-runner-{k}") as r:
        client = anthropic.Anthropic(
            base_url=proxy.base(r.rollout_id),
            api_key="sk-e2e",
            max_retries=0,
            timeout=REQUEST_TIMEOUT_S,
        )
        runner = client.beta.messages.tool_runner(
            model=MODEL,
            max_tokens=TOOL_MAX_TOKENS,
            system=SYSTEM_TOOLS,
            messages=[{"role": "user", "content": question(k)}],
            tools=[get_weather],
            tool_choice={"type": "any"},
            max_iterations=3,
            extra_body={"temperature": 0},
        )
        for _ in runner:
            # Forced on the first call only; then the model may answer.
            runner.set_messages_params(
                lambda p: {**p, "tool_choice": {"type": "auto"}, "max_tokens": ANSWER_MAX_TOKENS}
            )
    return r


def test_anthropic_tool_runner(proxy: Proxy) -> None:
    rollouts = [_tool_runner_rollout(proxy, k) for k in range(ROLLOUTS_PER_FRAMEWORK)]
    verify(proxy, rollouts, "tool-runner")
