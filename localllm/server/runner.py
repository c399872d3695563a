"""Runs the app on uvicorn over already-bound sockets.

On SIGTERM or SIGINT uvicorn stops accepting connections; open streams may run on for
`shutdown_timeout` seconds, after which their requests are aborted, so each stream still ends
with a last chunk (finish reason "abort") and `[DONE]`; then the server returns. A second
SIGINT stops at once.
"""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import Callable, Sequence

import uvicorn

from localllm.server.app import build_app
from localllm.server.state import ServerState


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState,
                 on_ready: Callable[[], None]) -> None:
        super().__init__(config)
        self._state = state
        self._on_ready = on_ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            self._on_ready()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._state.begin_shutdown()
        await super().shutdown(sockets)


def make_server(state: ServerState, on_ready: Callable[[], None] = lambda: None) -> _Server:
    config = uvicorn.Config(
        build_app(state), log_config=None, access_log=False, lifespan="off", http="h11",
        ws="none", server_header=False, timeout_keep_alive=30,
        timeout_graceful_shutdown=math.ceil(state.options.shutdown_timeout) + 5)
    return _Server(config, state, on_ready)


def serve(state: ServerState, sockets: Sequence[socket.socket],
          on_ready: Callable[[], None] = lambda: None) -> None:
    """Serve until SIGTERM/SIGINT (handled by uvicorn on the main thread)."""
    server = make_server(state, on_ready)
    asyncio.run(server.serve(sockets=list(sockets)))
