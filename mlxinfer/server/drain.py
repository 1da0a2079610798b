"""Stopping without cutting anyone off: the first SIGTERM or SIGINT drains the server.

While it drains, the listening socket stays open and every new request (`/health` too, so that a load
balancer takes the server out) gets a 503 with Retry-After and `connection: close`; requests already
taken, running or queued, go on. When none is left, or `drain_timeout` seconds have passed, the server
stops: a request still running then ends as cancelled, naming the drain (a stream's error event, then
`data: [DONE]`; a whole answer's 503), and uvicorn closes the connections once their last bytes are
written. A second signal stops the server at once: the requests end as at the deadline, and uvicorn
stops. `drain_timeout` 0: no drain, uvicorn's stop.
"""

import json
import logging
import time

import uvicorn

from .schemas import error_object

log = logging.getLogger("mlxinfer.server")


class Drain:
    """Whether the server drains, and until when (monotonic seconds)."""

    def __init__(self):
        self.deadline: float | None = None

    @property
    def draining(self) -> bool:
        return self.deadline is not None


class RefuseWhileDraining:
    """ASGI middleware: while the server drains, each new request is a 503 before anything reads it."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.drain.draining:
            return await self.app(scope, receive, send)
        data = json.dumps(error_object("the server is shutting down", "server_error")).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                (b"connection", b"close"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first stop signal drains `app` (made by create_app) for up to
    `drain_timeout` seconds."""

    def __init__(self, config: uvicorn.Config, app, drain_timeout: float):
        super().__init__(config)
        self.app, self.drain_timeout = app, drain_timeout

    def handle_exit(self, sig, frame) -> None:
        drain = self.app.state.drain
        if drain.draining or self.drain_timeout <= 0 or self.should_exit:
            if drain.draining and self.app.state.scheduler is not None:  # a second signal: end them now
                self.app.state.scheduler.stop("the server was stopped (a second signal while it drained)")
            return super().handle_exit(sig, frame)
        drain.deadline = time.monotonic() + self.drain_timeout
        log.warning("draining: %d request(s) in flight get up to %g s; new requests get 503 (signal again to stop now)",
                    len(self.server_state.tasks), self.drain_timeout)

    async def on_tick(self, counter: int) -> bool:
        drain = self.app.state.drain
        if drain.draining and not self.should_exit:
            scheduler = self.app.state.scheduler
            if not self.server_state.tasks:
                self.should_exit = True
            elif time.monotonic() >= drain.deadline:
                log.warning("draining: --drain-timeout %g s passed; ending %d request(s)", self.drain_timeout,
                            len(self.server_state.tasks))
                if scheduler is not None:
                    scheduler.stop(f"the server shut down (--drain-timeout {self.drain_timeout:g} s passed)")
                self.should_exit = True
        return await super().on_tick(counter)
