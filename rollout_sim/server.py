"""Serve an ASGI app with uvicorn on a loopback port in a background thread.

For tests that need a real socket (dropped connections, clients that cannot take an
ASGI transport) and for the demo. Readiness is polled with a deadline, never slept on.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any, Literal


class ThreadedServer:
    """`with ThreadedServer(app) as server: httpx.get(server.url + "/health")`."""

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        startup_timeout: float = 10.0,
        lifespan: Literal["auto", "on", "off"] = "off",
    ) -> None:
        import uvicorn  # a runtime dependency, imported only when a server is wanted

        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan=lifespan,
            # A hung request must not hold shutdown for ever.
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="sim-uvicorn", daemon=True)
        self._startup_timeout = startup_timeout
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ThreadedServer:
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("uvicorn exited during startup (port taken? lifespan failed?)")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"uvicorn did not start within {self._startup_timeout} s")
            self._thread.join(0.01)  # a bounded wait on the thread, not a blind sleep
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
