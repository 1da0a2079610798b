"""`mlxinfer serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn, server-sent events through
sse-starlette, metrics through prometheus_client) over the continuous-batching scheduler.

    POST /v1/completions         prompt (text or token ids), streaming or not
    POST /v1/chat/completions    messages, rendered with the model's chat template
    GET  /v1/models              the one model served
    GET  /health                 {"status": "ok"} while the scheduler runs, 503 otherwise
    GET  /metrics                Prometheus text: requests running/queued, tokens, TTFT and inter-token
                                 latency histograms, KV slots, bytes and blocks, prefix-cache hits

Options per request: max_tokens (default 16, as OpenAI's completions), temperature (default 1.0, as
OpenAI), top_p, seed, stop (text or list), n (only 1), logprobs (the chosen tokens' log-probabilities;
top alternatives are not computed: a request for them gets a 400), stream, stream_options.include_usage.
Every error is OpenAI's JSON shape {"error": {"message", "type", "param", "code"}} with its status: 400
bad request (malformed JSON, wrong types, max_tokens past the context, empty messages), 404 unknown model
or route, 413 body over the size limit, 429 queue full (with Retry-After), 503 shutting down.

The package, one concern per module:

    schemas.py      the request models (pydantic) and the response objects OpenAI's clients read
    routes.py       one function per route, and the submit / stream / collect they share
    errors.py       ApiError, and the handlers that turn every failure into OpenAI's error object
    metrics.py      the Prometheus collectors
    body_limit.py   the ASGI middleware that refuses an oversized body before it is parsed
    app.py          create_app: the FastAPI app assembled from the above, and the scheduler's lifespan

The server's packages are an optional extra, and the modules above import them at their top. This
module imports none of them: the CLI imports it at its top, and `import mlxinfer.server` must work
where the extra is absent. `require_extra`, `serve` and `create_app` check for the packages first (a missing one is a one-line error that names the install command) and only then import
`app`; that is why `create_app` is looked up through `__getattr__` instead of imported at the top.
"""

from ..errors import MlxinferError

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above any prompt that fits a context window as text

__all__ = ["MAX_BODY_BYTES", "create_app", "require_extra", "serve"]


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
          max_queue: int = 64, kv_memory: int | None = None, log_level: str = "info") -> None:
    """Run the server until interrupted (Ctrl-C)."""
    require_extra()
    import uvicorn

    from .app import create_app

    app = create_app(engine, model_id, max_batch=max_batch, max_queue=max_queue, kv_memory=kv_memory)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def __getattr__(name: str):
    if name == "create_app":
        require_extra()
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
