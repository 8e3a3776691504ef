"""The headers a proxied request carries upstream: the harness's own, minus hop-by-hop ones,
with credentials as ``api.capability`` says."""

from __future__ import annotations

from fastapi import Request

from api.capability import upstream_credentials

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


def upstream_headers(request: Request) -> dict[str, str]:
    """The harness's headers minus hop-by-hop ones; credentials as api.capability says."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
    if "authorization" not in {k.lower() for k in headers} and "x-api-key" in request.headers:
        headers["authorization"] = f"Bearer {request.headers['x-api-key']}"
    return upstream_credentials(request, headers)


def json_headers(request: Request) -> dict[str, str]:
    return {**auth_headers(request), "content-type": "application/json"}


def auth_headers(request: Request) -> dict[str, str]:
    headers = upstream_headers(request)
    keep = {"authorization", "openai-organization", "openai-project", "x-request-id"}
    return {k: v for k, v in headers.items() if k.lower() in keep}
