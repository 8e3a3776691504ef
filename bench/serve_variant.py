"""The proxy + ledger service with a benchmark ledger variant (``bench.variants``) injected.

``python -m bench.serve_variant --ledger timed --db URL --upstream URL --port P``: the same app
``rollout-ledger serve`` runs (``api.app.create_app``, INFO logging as ``serve`` configures it),
with ``GET /_bench/timings`` (per-method ms lists of a timed variant; ``?reset=1`` clears them).
Used only for the overhead breakdown and for the prototypes; the headline proxy numbers come
from ``rollout-ledger serve`` itself.
"""

from __future__ import annotations

import argparse
import logging

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from api.app import create_app
from bench.variants import KINDS, make_ledger
from ledger import migrate
from ledger.config import load_settings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ledger", choices=KINDS, default="timed")
    ap.add_argument("--db", required=True)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    settings = load_settings(db=args.db, upstream=args.upstream, port=args.port)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    migrate.upgrade(settings.db)
    ledger = make_ledger(args.ledger, settings.db)
    app = create_app(settings, ledger=ledger)

    async def timings(request: Request) -> JSONResponse:
        data = dict(getattr(ledger, "timings", {}))
        sizes = list(getattr(ledger, "batch_sizes", []))
        if request.query_params.get("reset"):
            if hasattr(ledger, "timings"):
                ledger.timings = {}
            if hasattr(ledger, "batch_sizes"):
                ledger.batch_sizes.clear()
        return JSONResponse({"timings": data, "batch_sizes": sizes})

    app.router.routes.insert(0, Route("/_bench/timings", timings, methods=["GET"]))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="info", access_log=False)


if __name__ == "__main__":
    main()
