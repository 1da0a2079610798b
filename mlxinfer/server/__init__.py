"""`mlxinfer serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn, server-sent events through
sse-starlette, metrics through prometheus_client) over the continuous-batching scheduler.

    GET  /                       the chat page (page.py: static/index.html, its script and style)
    POST /v1/completions         prompt (text or token ids), streaming or not
    POST /v1/chat/completions    messages, rendered with the model's chat template
    GET  /v1/models              the one model served (GET /v1/models/{id}: it alone)
    GET  /health                 {"status": "ok"} while the scheduler runs, 503 otherwise
    GET  /metrics                Prometheus text: requests running/queued, tokens, TTFT and inter-token
                                 latency histograms, KV slots, bytes and blocks, prefix-cache hits

Options per request (schemas.py lists every field, and those accepted that change nothing): max_tokens
(default: completions 16, as OpenAI's; chat the rest of the context, so a turn ends on its
end-of-generation token), temperature (default 1.0, as OpenAI), top_p, top_k, min_p,
repetition_penalty, presence_penalty, frequency_penalty, logit_bias, seed, stop (text or list), n (up
to 16 choices, prefilled once, choice i seeded seed + i), logprobs and top_logprobs (up to 20), stream, stream_options.include_usage. The `model` a request
names is not checked: one model is served (as llama-server). Messages: system, developer (as system),
user, assistant; content as text or a list of text parts. Every response carries `system_fingerprint`
(fingerprint.py). A chat turn's `<think>` text is `reasoning_content` (reasoning.py; --reasoning), and
`chat_template_kwargs` are variables for the template. Structured output: response_format (json_object,
json_schema), grammar (Lark or GBNF), guided_regex (mlxinfer.grammar). Tools: tools and tool_choice
rendered through the template, the model's calls returned as tool_calls (tools.py); tool messages.
A field the server does not implement is a 400 naming it, never ignored. Every
error is OpenAI's JSON shape {"error": {"message", "type", "param", "code"}} with its status: 400 bad
request (malformed JSON, wrong types, unsupported fields, max_tokens past the context, empty messages),
401 no or another API key (--api-key), 404 unknown route or model id in /v1/models/{id}, 408 body not
received in time, 413 body over the size limit, 429 queue full (with Retry-After), 503 shutting down
(draining) or at the connection cap. CORS: off unless `--cors ORIGIN` names the browser origins allowed.
What a client may hold (connections, the time to send a request or read an answer) is bounded:
`Bounds`, kept where each module below says.

The package, one concern per module:

    schemas.py      the request models (pydantic) and the response objects OpenAI's clients read
    routes.py       one function per route, and the submit / stream / collect they share
    errors.py       ApiError, and the handlers that turn every failure into OpenAI's error object
    reasoning.py    a chat turn's <think> text split from its content, as it streams
    tools.py        tool calls parsed out of a chat turn's text (whole or streamed); forcing grammars
    fingerprint.py  system_fingerprint: the model file's digest, the version and the kernels
    metrics.py      the Prometheus collectors
    page.py         the chat page's routes; its files are static/ (package data)
    body_limit.py   the ASGI middleware that refuses an oversized or too slow body before it is parsed
    auth.py         --api-key: the bearer key the API's paths need
    drain.py        SIGTERM: new requests 503, those taken finish until --drain-timeout (the uvicorn server)
    connections.py  the connection cap and the header and send deadlines (uvicorn's h11 protocol, subclassed)
    app.py          create_app: the FastAPI app assembled from the above, and the scheduler's lifespan

The server's packages are an optional extra, and the modules above import them at their top. This
module imports none of them: the CLI imports it at its top, and `import mlxinfer.server` must work
where the extra is absent. `require_extra`, `serve` and `create_app` check for the packages first (a missing one is a one-line error that names the install command) and only then import
`app`; that is why `create_app` is looked up through `__getattr__` instead of imported at the top.
"""

import ipaddress
import resource
from dataclasses import dataclass

from ..errors import MlxinferError, RequestError

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above any prompt that fits a context window as text
BODY_TIMEOUT = 60.0  # seconds for a request's body (1 MiB in a minute: 17 KB/s)
OTHER_DESCRIPTORS = 64  # files the process holds besides connections: the model, the listener, pipes
ACCEPT_BURSTS = 4  # bursts of accepted sockets open at once before the cap closes them (measured: 3)

__all__ = ["BODY_TIMEOUT", "Bounds", "MAX_BODY_BYTES", "create_app", "is_loopback", "require_extra", "serve"]


@dataclass(frozen=True)
class Bounds:
    """What a client may hold, in connections and seconds (`mlxinfer serve`'s options of the same names;
    connections.py, body_limit.py and drain.py say how each is kept)."""

    max_connections: int = 512
    timeout_keep_alive: float = 5.0  # idle between two requests of a connection (uvicorn's own option)
    timeout_header: float = 15.0  # from the connection's start, or its last response, to a request's headers
    timeout_body: float = BODY_TIMEOUT  # from the headers to the body's last byte
    timeout_send: float = 30.0  # a response the client does not read for this long is cut off
    drain_timeout: float = 30.0  # after SIGTERM, for the requests in flight to finish

    @property
    def backlog(self) -> int:
        """The listen backlog, which is also how many sockets asyncio accepts at a time."""
        return min(self.max_connections, 128)

    def fit_descriptors(self) -> None:
        """Raise this process's open-file limit to hold the connections, the bursts accepted before the
        cap closes them (each a backlog's worth: a socket is accepted, its connection made and, at the
        cap, its file closed on three turns of the event loop, and the listener is read on each) and its
        other files, where the hard limit allows; a RequestError (one line, before the model loads)
        where it does not. (Past the limit every accept fails with a logged traceback: 1.8 million
        lines in 200 s.)"""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = self.max_connections + ACCEPT_BURSTS * self.backlog + OTHER_DESCRIPTORS
        if need <= soft:
            return
        if hard != resource.RLIM_INFINITY and need > hard:
            raise RequestError(f"--max-connections {self.max_connections} needs {need} open files; this process "
                               f"may open {hard} (ulimit -Hn): lower --max-connections")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or name) is only reachable from this machine (server.auth says why it
    matters)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_extra() -> None:
    """Raise a one-line MlxinferError naming the first of the server's packages that is not installed."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise MlxinferError(f"mlxinfer serve needs the server extra ({e.name} is missing): "
                            "pip install 'mlxinfer[serve]'") from None


def serve(engine, model_id: str, host: str = "127.0.0.1", port: int = 8080, max_batch: int = 8,
          max_queue: int = 64, kv_memory: int | None = None, log_level: str = "info", cors_origins: tuple = (),
          reasoning: str = "auto", api_key: str | None = None, bounds: Bounds = Bounds()) -> None:
    """Run the server until stopped: SIGTERM or Ctrl-C drains it (drain.py), a second one stops it."""
    require_extra()
    from .app import create_app, run

    bounds.fit_descriptors()
    app = create_app(engine, model_id, max_batch=max_batch, max_queue=max_queue, kv_memory=kv_memory,
                     cors_origins=cors_origins, reasoning=reasoning, api_key=api_key, body_timeout=bounds.timeout_body)
    run(app, host, port, log_level, bounds)


def __getattr__(name: str):
    if name == "create_app":
        require_extra()
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
