"""A simulated vLLM 0.32 engine: the tests' fake upstream and the demo's model.

Usage::

    from rollout_sim import ByteTokenizer, SimEngine

    engine = SimEngine(ByteTokenizer(), model_name="smol", max_model_len=2048)
    engine.script("Hello there.")                      # next reply, exact text
    engine.script_tool_call("get_weather", {"city": "Paris"})
    engine.faults.next("http_500")                     # next generating request fails
    app = engine.app                                   # ASGI app (httpx.ASGITransport, uvicorn)
"""

from rollout_sim.engine import (
    VLLM_VERSION,
    EngineOptions,
    RecordedRequest,
    Reply,
    Responder,
    SimEngine,
    SimRequest,
    Tokenizer,
    ToolCall,
    create_sim_vllm_app,
    engine_of,
)
from rollout_sim.faults import Fault, FaultKind, Faults, SimulatedDisconnect
from rollout_sim.server import ThreadedServer
from rollout_sim.tokenizer import ByteTokenizer

__all__ = [
    "VLLM_VERSION",
    "ByteTokenizer",
    "EngineOptions",
    "Fault",
    "FaultKind",
    "Faults",
    "RecordedRequest",
    "Reply",
    "Responder",
    "SimEngine",
    "SimRequest",
    "SimulatedDisconnect",
    "ThreadedServer",
    "Tokenizer",
    "ToolCall",
    "create_sim_vllm_app",
    "engine_of",
]
