"""The fake upstream for proxy benchmarks: the simulated vLLM engine in its own process.

``python -m bench.simserver --port P --gen-tokens 300`` serves ``SimEngine`` (byte tokenizer: one
ASCII character is one token) whose replies are exactly ``gen-tokens`` tokens (text + EOS),
deterministic per prompt, so a request sent through the proxy and the same request sent
directly get the same answer.  The engine's request log is capped so a long run does not grow
the upstream's memory.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import random

import uvicorn

from bench.workload import text
from rollout_sim import ByteTokenizer, SimEngine, SimRequest


def make_engine(gen_tokens: int, max_model_len: int) -> SimEngine:
    engine = SimEngine(ByteTokenizer(), model_name="smol", max_model_len=max_model_len, seed=7)
    engine.requests = collections.deque(maxlen=8)  # type: ignore[assignment]

    def responder(req: SimRequest) -> str:
        tail = repr(req.prompt_ids[-256:]).encode()
        rng = random.Random(hashlib.sha256(tail).digest())
        return text(rng, max(1, gen_tokens - 1))  # + EOS = gen_tokens

    engine.responder = responder
    return engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--gen-tokens", type=int, default=300)
    ap.add_argument("--max-model-len", type=int, default=65536)
    args = ap.parse_args()
    engine = make_engine(args.gen_tokens, args.max_model_len)
    uvicorn.run(engine.app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
