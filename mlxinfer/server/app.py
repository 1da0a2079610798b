"""The FastAPI app: the routes, the middleware (CORS, the drain's 503, the API key, the body's size and
time limits, outermost first), the error handlers and the lifespan that runs the scheduler, put
together; and `run`, which serves it with uvicorn within the server's bounds."""

import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from ..scheduler import Scheduler
from . import BODY_TIMEOUT, MAX_BODY_BYTES, Bounds
from .auth import RequireKey
from .body_limit import BodyLimit
from .connections import protocol_class
from .drain import Drain, DrainingServer, RefuseWhileDraining
from .errors import HANDLERS
from .fingerprint import system_fingerprint
from .reasoning import splits_reasoning
from .metrics import ServerMetrics
from .page import mount_page
from .routes import ServerState, chat_completions, completions, health, metrics, model, models


SHUTDOWN_GRACE = 10.0  # seconds uvicorn waits for connections to write their last bytes after the drain


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The scheduler runs while the app is served: made at startup, closed (its worker thread joined)
    at shutdown."""
    s = app.state.server
    app.state.scheduler = Scheduler(s.engine, max_batch=s.max_batch, max_queue=s.max_queue, kv_memory=s.kv_memory)
    yield
    app.state.scheduler.close()


def create_app(engine, model_id: str, max_batch: int = 8, max_queue: int = 64, kv_memory: int | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, cors_origins: tuple = (), reasoning: str = "auto",
               api_key: str | None = None, body_timeout: float = BODY_TIMEOUT) -> FastAPI:
    """The ASGI app serving `engine` as `model_id`. While it is served, `app.state.scheduler` is its
    scheduler (tests read its stats); None before. `cors_origins`: the browser origins allowed to call
    it ("*" for any); none by default, so a web page elsewhere cannot read the answers. `reasoning`:
    "auto", "on" or "off", whether chat turns' <think> text goes to reasoning_content (server.reasoning).
    `api_key`: what requests must send as a bearer token (server.auth; None: none). `body_timeout`:
    seconds a request's body may take to arrive (a 408 after). `app.state.drain` is the drain's state
    (server.drain: the server that runs the app sets it)."""
    app = FastAPI(title="mlxinfer", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.server = ServerState(engine, model_id, system_fingerprint(engine), max_batch, max_queue, kv_memory,
                                   ServerMetrics(max_batch), created=int(time.time()),
                                   reasoning=splits_reasoning(reasoning, engine.tokenizer.tokens))
    app.state.scheduler = None
    app.state.drain = Drain()
    app.add_middleware(BodyLimit, limit=max_body_bytes, timeout=body_timeout)
    if api_key is not None:
        app.add_middleware(RequireKey, key=api_key)
    app.add_middleware(RefuseWhileDraining, drain=app.state.drain)
    if cors_origins:  # added last: outermost, so that even a refused body's answer carries the headers
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    for exc, handler in HANDLERS.items():
        app.add_exception_handler(exc, handler)
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    mount_page(app)  # GET /: the chat page
    return app


def run(app: FastAPI, host: str, port: int, log_level: str, bounds: Bounds) -> None:
    """Serve `app` (made by create_app) until stopped: uvicorn with the connection bounds' protocol
    (connections.py) and the drain on SIGTERM (drain.py)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol_class(bounds),
                            backlog=bounds.backlog, timeout_keep_alive=bounds.timeout_keep_alive,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE)
    DrainingServer(config, app, bounds.drain_timeout).run()
