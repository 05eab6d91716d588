"""An ASGI app (the HTTP API) served by uvicorn inside the gateway's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn
from fastapi import FastAPI


class _EmbeddedServer(uvicorn.Server):
    """uvicorn in the gateway's event loop: the gateway owns the signals and stops it."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """Serves an ASGI app on host:port (0 picks a free port) until stop()."""

    def __init__(self, app: FastAPI, host: str, port: int):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.port: int = self.socket.getsockname()[1]
        self.server = _EmbeddedServer(uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30))
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting connections; in-flight requests get grace_s to finish."""
        if self._task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace_s)
        except TimeoutError:
            self.server.force_exit = True
            await self._task
        self.socket.close()
