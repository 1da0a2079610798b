"""The request body's size and time limits, enforced before FastAPI reads the body: a client cannot make
the server buffer and parse more than `limit` bytes, nor hold a request open by sending its body
slowly (or never) for more than `timeout` seconds."""

import asyncio
import json

from .schemas import error_object


class BodyLimit:
    """ASGI middleware: a POST body over `limit` bytes (by Content-Length or by what arrives) gets a 413
    before the app sees it, one not whole within `timeout` seconds a 408 (both close the connection).
    The body is read here and replayed; later receive() calls (disconnects) go to the server's own."""

    def __init__(self, app, limit: int, timeout: float):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._refuse(send, 413, f"request body over {self.limit} bytes")
        body, more = b"", True
        try:
            async with asyncio.timeout(self.timeout):
                while more:
                    message = await receive()
                    if message["type"] != "http.request":
                        return  # the client left before sending its body
                    body += message.get("body", b"")
                    if len(body) > self.limit:
                        return await self._refuse(send, 413, f"request body over {self.limit} bytes")
                    more = message.get("more_body", False)
        except TimeoutError:
            return await self._refuse(send, 408, f"request body not received within {self.timeout:g} s "
                                                 f"(--timeout-body)")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, status: int, message: str):
        data = json.dumps(error_object(message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})
