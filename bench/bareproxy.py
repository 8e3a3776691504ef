"""A bare pass-through proxy on the same stack as ``rollout-ledger serve`` (FastAPI, uvicorn with
httptools, httpx, orjson) and no ledger: the reference the proxy-overhead target is measured
against.  ``python -m bench.bareproxy --port P --upstream URL`` forwards
``/ng-rollout/<id>/training-token-capture/<rest>`` to ``URL/<rest>`` unchanged and answers with
the upstream's answer unchanged (no capture fields, nothing recorded).
"""

from __future__ import annotations

import argparse
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response


def make_app(upstream: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(base_url=upstream, timeout=300)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True}

    @app.post("/ng-rollout/{rollout_id}/training-token-capture/{rest:path}")
    async def forward(rollout_id: str, rest: str, request: Request) -> Response:
        resp = await client.post(
            "/" + rest, content=await request.body(), headers={"content-type": "application/json"}
        )
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    args = ap.parse_args()
    uvicorn.run(
        make_app(args.upstream),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        http="httptools",
    )


if __name__ == "__main__":
    main()
