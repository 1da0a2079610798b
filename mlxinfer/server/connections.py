"""What a connection may hold while its client stalls, bounded where uvicorn leaves it open: its h11
protocol, subclassed (`protocol_class` makes one per server).

- A cap on open connections (`max_connections`). At the cap, a new connection closes the one idle
  longest (no request in flight: waiting for its first request's headers, or between keep-alive
  requests) if that one has been idle EVICTABLE_AFTER seconds at least; else the new one is answered
  503 and closed. (The grace keeps a flood from closing a client that connected a moment ago and has
  not yet been read: the server accepts a burst of connections before it reads any.)
  Nothing is refused at the TCP level and no file descriptor runs out (20,000 half-open sockets locked
  every client out and wrote a traceback per failed accept).
- A deadline for a request's headers (`header_timeout`): from the connection's start, or its previous
  response's end, to the end of the headers, whatever trickles in meanwhile (uvicorn's keep-alive timer
  stops at the first byte, so one byte now and then held a connection forever). The connection closes.
- A deadline for a stalled send (`send_timeout`): a response the client has not read for that long
  (the socket's buffers full, the transport paused) closes its connection; the app sees a disconnect,
  so a streamed request is cancelled and its KV slot freed. The socket's send buffer is fixed at
  SEND_BUFFER bytes: Linux's autotuning lets ~3 MB of a stream sit unread before the send stalls.

The request body's deadline is where the body is read (body_limit.py). Closing a connection for a
deadline or the cap writes no log line; reaching the cap writes one warning a minute at most.
"""

import json
import logging
import socket
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

from . import Bounds
from .schemas import error_object

SEND_BUFFER = 64 << 10  # bytes; the kernel doubles it: ~160 KB of a stream unread stalls the send on loopback
WARN_EVERY = 60.0  # seconds between two warnings that the cap is reached
EVICTABLE_AFTER = 1.0  # seconds idle before a connection may be closed to make room for a new one

log = logging.getLogger("mlxinfer.server")


class Limits:
    """A server's bounds, and how many connections the cap closed since it last said so."""

    def __init__(self, bounds: Bounds):
        self.max_connections, self.header_timeout = bounds.max_connections, bounds.timeout_header
        self.send_timeout = bounds.timeout_send
        self.warned, self.closed_at_cap = float("-inf"), 0

    def at_cap(self, evicted: bool) -> None:
        self.closed_at_cap += 1
        now = time.monotonic()
        if now - self.warned >= WARN_EVERY:
            log.warning("%d open connections (--max-connections): %d %s since the last warning",
                        self.max_connections, self.closed_at_cap,
                        "idle connection(s) closed" if evicted else "connection(s) refused with 503")
            self.warned, self.closed_at_cap = now, 0


def protocol_class(bounds: Bounds) -> type:
    """uvicorn's `http` protocol class for a server within `bounds`."""
    return type("Guarded", (Guarded,), {"limits": Limits(bounds)})


class Guarded(H11Protocol):
    limits: Limits

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.idle_since, self.header_timer, self.send_timer = None, None, None
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        if len(self.connections) > self.limits.max_connections and not self._evict_one():
            self.limits.at_cap(evicted=False)
            self._refuse()
            return
        self._await_request()

    def _evict_one(self) -> bool:
        before = time.monotonic() - EVICTABLE_AFTER
        idle = [c for c in self.connections if c is not self and getattr(c, "idle_since", None) is not None
                and c.idle_since <= before]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.idle_since)
        oldest._close()
        self.limits.at_cap(evicted=True)
        return True

    def _refuse(self) -> None:
        body = json.dumps(error_object(f"the server holds its most open connections "
                                       f"({self.limits.max_connections}); retry", "server_error")).encode()
        self.transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                             b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        self._close()

    def _await_request(self) -> None:
        """Idle from now: the next request's headers are due within the header timeout."""
        self._stop(self.header_timer)
        self.idle_since = time.monotonic()
        self.header_timer = self.loop.call_later(self.limits.header_timeout, self._close)

    def _close(self) -> None:
        """Close the connection, counted out of the open ones now (its connection_lost comes later)."""
        self._stop(self.header_timer)
        self._stop(self.send_timer)
        self.idle_since = None
        self.connections.discard(self)
        self.transport.close()

    @staticmethod
    def _stop(timer) -> None:
        if timer is not None:
            timer.cancel()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived: it is in flight
            self._stop(self.header_timer)
            self.idle_since = None

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._await_request()
        super().on_response_complete()  # (which may start a pipelined request: handle_events)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._stop(self.send_timer)
        self.send_timer = self.loop.call_later(self.limits.send_timeout, self.transport.abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop(self.send_timer)

    def connection_lost(self, exc) -> None:
        self._stop(self.header_timer)
        self._stop(self.send_timer)
        self.idle_since = None
        super().connection_lost(exc)
