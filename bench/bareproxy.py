"""A bare pass-through proxy on the same stack as ``rollout-ledger serve`` (FastAPI, uvicorn with
httptools and serve's event loop, the proxy's own aiohttp poster for the upstream POST, orjson)
and no ledger: the reference the proxy-overhead target is measured against.
``python -m bench.bareproxy --port P --upstream URL`` forwards
``/ng-rollout/<id>/training-token-capture/<rest>`` to ``URL/<rest>`` unchanged and answers with
the upstream's answer unchanged (no capture fields, nothing recorded).

``--capture-body``: the request goes upstream as the ledger sends it (``build_chat_upstream``:
token ids and log-probs asked for, sampling pinned) and the answer, ids and all, comes back
unchanged.  That anchor pays what any capture must (the engine's longer answer, carried and
parsed by the proxy) and nothing of the ledger's own work (extraction, the record, its
commit), so the distance to it is the ledger's share of the overhead.
"""

from __future__ import annotations

import argparse
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request, Response

from api.dialects import build_chat_upstream
from api.server import uvloop_available
from api.upstream import AiohttpPoster


def make_app(upstream: str, *, capture_body: bool = False) -> FastAPI:
    app = FastAPI()
    poster = AiohttpPoster(upstream, timeout_s=300, connect_timeout_s=10)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True}

    @app.post("/ng-rollout/{rollout_id}/training-token-capture/{rest:path}")
    async def forward(rollout_id: str, rest: str, request: Request) -> Response:
        raw = await request.body()
        if capture_body:
            raw = orjson.dumps(build_chat_upstream(orjson.loads(raw)).body)
        resp = await poster.post("/" + rest, raw, {"content-type": "application/json"})
        return Response(resp.body, status_code=resp.status, media_type="application/json")

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--capture-body", action="store_true", help="ask the upstream for tokens")
    args = ap.parse_args()
    uvicorn.run(
        make_app(args.upstream, capture_body=args.capture_body),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        http="httptools",
        loop="uvloop" if uvloop_available() else "asyncio",  # as serve's (api.server)
    )


if __name__ == "__main__":
    main()
