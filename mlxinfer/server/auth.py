"""`--api-key`: requests must carry `Authorization: Bearer KEY`, as OpenAI's API; one without it, or
with another key, is a 401 in OpenAI's shape (code "invalid_api_key") before its body is read.

What needs the key: /v1/... and /metrics. What does not: /health (a load balancer's probe), the chat
page's files (GET /; the page itself sends no key: with --api-key its requests get 401)
and CORS preflights (a browser sends them without credentials). Keys are compared in constant time.

Without a key the server answers anyone who reaches it. That is the default on the loopback address;
on any other address `mlxinfer serve` warns, loudly, and starts (a container or a reverse proxy that
authenticates is the common reason to listen elsewhere, and refusing would only teach people to pass a
dummy key): `mlxinfer.server.is_loopback` says which.
"""

import hmac
import json

from .schemas import error_object

PROTECTED = ("/v1/", "/metrics")


class RequireKey:
    """ASGI middleware: the protected paths need `Authorization: Bearer <key>`."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not scope["path"].startswith(PROTECTED):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        why = "no API key given (send Authorization: Bearer KEY)" if not given else "incorrect API key provided"
        data = json.dumps(error_object(why, "invalid_request_error", None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})
