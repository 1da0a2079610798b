"""The request body's size limit, enforced before FastAPI reads the body: a client cannot make the
server buffer and parse more than `limit` bytes."""

import json

from .schemas import error_object


class BodyLimit:
    """ASGI middleware: a POST body over `limit` bytes (by Content-Length or by what arrives) gets a 413
    before the app sees it. The body is read here and replayed; later receive() calls (disconnects)
    go to the server's own."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._too_large(send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            body += message.get("body", b"")
            if len(body) > self.limit:
                return await self._too_large(send)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send):
        data = json.dumps(error_object(f"request body over {self.limit} bytes")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})
