"""A graceful shutdown: drain, then close (``minisrv serve`` on SIGTERM).

uvicorn's own shutdown closes the listening socket, waits a while for open connections and
then cancels the handlers still running, which a client sees as a 500 or a stream cut in
the middle. ``DrainingServer`` first drains instead: new requests get 503 (the socket
stays open to say so), the requests in flight get ``grace`` seconds to finish, the rest
are ended by ``Frontend.fail_all`` (an error event and ``[DONE]`` on a stream, a 503
otherwise), and only once their handlers have written that does uvicorn's shutdown run.
"""

from __future__ import annotations

import asyncio
import signal
from types import FrameType
from typing import Any

import uvicorn

__all__ = ["DrainingServer"]

WRITE_S = 2.0  # how long the ended handlers get to write their last events


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` that drains ``frontend`` on the first SIGTERM or SIGINT."""

    def __init__(self, config: uvicorn.Config, frontend: Any, grace: float) -> None:
        super().__init__(config)
        self.frontend, self.grace = frontend, grace
        self._drain_asked = False
        self._drain: asyncio.Task[None] | None = None
        self._drained = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain. Second: uvicorn's own exit (a second Ctrl-C forces it)."""
        if self._drain_asked and sig in (signal.SIGINT, signal.SIGTERM):
            super().handle_exit(sig, frame)
            return
        self._drain_asked = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_asked and self._drain is None:
            self._drain = asyncio.create_task(self.drain())
        if self._drained:
            return True
        return await super().on_tick(counter)

    async def drain(self) -> None:
        """Refuse new requests, wait for the running ones, end the rest, then exit."""
        frontend = self.frontend
        frontend.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace
        while frontend.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if frontend.in_flight:
            frontend.fail_all(f"the server is shutting down: the request did not finish "
                              f"within the shutdown timeout of {self.grace:g} s", 503)
        deadline = loop.time() + WRITE_S
        while self._handlers_running() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        self._drained = True

    def _handlers_running(self) -> bool:
        """True while some connection still has a request being answered."""
        state = self.server_state
        return any(getattr(conn, "cycle", None) is not None
                   and not getattr(conn.cycle, "response_complete", True)
                   for conn in state.connections)
