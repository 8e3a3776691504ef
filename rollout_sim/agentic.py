"""The simulated engine as a stand-alone upstream (``rollout-ledger sim``).

Unscripted, the simulated model answers in short sentences and calls a tool only when one is
forced.  An agent loop needs more: here, when the request offers tools and the conversation
does not end with a tool result, the model calls one of the offered tools (hermes format,
parsed by the engine like vLLM's ``--tool-call-parser hermes``); after a tool result, or with
no tools, it answers in text.  Replies are reproducible for a given prompt and seed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Any

from rollout_sim.engine import Reply, Responder, SimEngine, SimRequest, ToolCall
from rollout_sim.tokenizer import ByteTokenizer

__all__ = ["make_sim_engine", "tool_calling_responder"]

_WORDS = ("alpha", "beta", "paris", "london", "seven", "blue", "main", "notes", "today")


def _args_for(rng: random.Random, fn: Mapping[str, Any]) -> dict[str, Any]:
    schema = fn.get("parameters") or {}
    props: Mapping[str, Any] = schema.get("properties") or {}
    out: dict[str, Any] = {}
    for name in schema.get("required") or list(props):
        kind = (props.get(name) or {}).get("type", "string")
        if kind == "integer":
            out[name] = rng.randint(0, 100)
        elif kind == "number":
            out[name] = round(rng.uniform(0, 100), 2)
        elif kind == "boolean":
            out[name] = rng.random() < 0.5
        else:
            out[name] = rng.choice(_WORDS)
    return out


def _wants_tool(req: SimRequest) -> bool:
    if not req.tools or req.body.get("tool_choice") == "none":
        return False
    last = req.messages[-1] if req.messages else {}
    return not (isinstance(last, dict) and last.get("role") == "tool")


def tool_calling_responder(seed: int = 0) -> Responder:
    """A responder that calls an offered tool until it has seen a tool result."""

    def respond(req: SimRequest) -> Reply | None:
        if not _wants_tool(req):
            return None  # the engine's own policy: a short sentence
        digest = hashlib.sha256(f"{seed}|{len(req.prompt_ids)}|{req.prompt_ids[-8:]}".encode())
        rng = random.Random(digest.digest())
        functions = [t.get("function", t) for t in req.tools if isinstance(t, dict)]
        fn = rng.choice(functions)
        return Reply("", (ToolCall(str(fn.get("name")), _args_for(rng, fn)),))

    return respond


def make_sim_engine(*, model_name: str = "smol", seed: int = 0, max_model_len: int = 8192) -> Any:
    """A ``SimEngine`` with the byte tokenizer and the tool-calling responder."""
    engine = SimEngine(
        ByteTokenizer(), model_name=model_name, max_model_len=max_model_len, seed=seed
    )
    engine.responder = tool_calling_responder(seed)
    return engine
