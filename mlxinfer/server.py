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
"""


import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Literal

from .errors import MlxinferError, RequestError
from .loop import FinishEvent
from .sampling import SamplingParams, stop_strings
from .scheduler import QueueFull, Scheduler, SchedulerClosed

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above any prompt that fits a context window as text


def _imports():
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise MlxinferError(f"mlxinfer serve needs the server extra ({e.name} is missing): "
                            "pip install 'mlxinfer[serve]'") from None


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
        data = json.dumps({"error": {"message": f"request body over {self.limit} bytes",
                                     "type": "invalid_request_error", "param": None, "code": None}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                 headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def create_app(engine, model_id: str, max_batch: int = 8, max_queue: int = 64, kv_memory: int | None = None,
               max_body_bytes: int = MAX_BODY_BYTES):
    """The ASGI app serving `engine` as `model_id`; starts the scheduler's worker thread (stopped at
    shutdown). `app.state.scheduler` is the scheduler (tests read its stats)."""
    _imports()
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
    from sse_starlette.sse import EventSourceResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    Number = StrictInt | StrictFloat

    class Options(BaseModel):
        model_config = ConfigDict(extra="ignore")
        model: StrictStr | None = None
        max_tokens: StrictInt | None = Field(default=None, ge=1)
        max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
        temperature: Number = Field(default=1.0, ge=0, le=2)
        top_p: Number = Field(default=1.0, gt=0, le=1)
        seed: StrictInt | None = None
        stop: StrictStr | list[StrictStr] | None = None
        n: StrictInt = 1
        stream: StrictBool = False
        stream_options: dict | None = None

    class CompletionRequest(Options):
        prompt: StrictStr | list[StrictInt]
        logprobs: StrictInt | None = Field(default=None, ge=0, le=5)

    class Message(BaseModel):
        role: Literal["system", "user", "assistant"]
        content: StrictStr

    class ChatRequest(Options):
        messages: list[Message]
        logprobs: StrictBool = False
        top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)

    registry = CollectorRegistry()
    m_running = Gauge("mlxinfer_requests_running", "Requests in the running batch", registry=registry)
    m_waiting = Gauge("mlxinfer_requests_waiting", "Requests queued for the batch", registry=registry)
    m_requests = Counter("mlxinfer_requests", "Requests finished, by finish reason", ["reason"], registry=registry)
    m_prompt = Counter("mlxinfer_prompt_tokens", "Prompt tokens prefilled (not from the prefix cache)",
                       registry=registry)
    m_cached = Counter("mlxinfer_prompt_tokens_cached", "Prompt tokens served from the prefix cache",
                       registry=registry)
    m_generated = Counter("mlxinfer_generation_tokens", "Tokens generated (rate() gives tokens/s)",
                          registry=registry)
    m_ttft = Histogram("mlxinfer_time_to_first_token_seconds", "Time to first token", registry=registry,
                       buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
    m_itl = Histogram("mlxinfer_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                      registry=registry, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
    m_slots = Gauge("mlxinfer_kv_slots_used", "KV cache slots held by running requests", registry=registry)
    m_slots_free = Gauge("mlxinfer_kv_slots_free", "KV cache slots free (max_batch - used)", registry=registry)
    m_kv_bytes = Gauge("mlxinfer_kv_cache_bytes", "Bytes the KV cache holds", registry=registry)
    m_blocks = Gauge("mlxinfer_kv_blocks", "KV cache blocks (paged cache), by state: used by running requests, "
                     "cached for prefix reuse (evictable), free", ["state"], registry=registry)

    @asynccontextmanager
    async def lifespan(app):
        app.state.scheduler = Scheduler(engine, max_batch=max_batch, max_queue=max_queue, kv_memory=kv_memory)
        yield
        app.state.scheduler.close()

    app = FastAPI(title="mlxinfer", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.scheduler = None
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    created = int(time.time())

    def error_body(status, message, type_="invalid_request_error", param=None, code=None, headers=None):
        return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                            status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_body(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e: RequestValidationError):
        errors = e.errors()
        # a value that fits no branch of a union (a prompt is text or token ids) gets an error per branch:
        # the deepest says most ("prompt.0: ... a valid integer" for [1.9], not "prompt: ... a valid string")
        first = max(errors, key=lambda x: len(x.get("loc", ())), default={})
        branch = {"str", "int", "float", "bool", "list[int]"}  # pydantic's names of union branches in a loc
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body" and x not in branch)
        if first.get("type") == "json_invalid":
            return error_body(400, "request body is not valid JSON")
        return error_body(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e):
        return error_body(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else
                          "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(request, e):
        return error_body(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    def scheduler() -> Scheduler:
        s = app.state.scheduler
        if s is None or s.closed:
            raise ApiError(503, "the server is not running requests (starting up or shutting down)",
                           "server_error", headers={"Retry-After": "1"})
        return s

    def check_model(model):
        if model is not None and model != model_id:
            raise ApiError(404, f"model {model!r} does not exist (this server serves {model_id!r})",
                           "not_found_error", "model", "model_not_found")

    def submit(body: Options, prompt_ids: list[int], loop, queue: asyncio.Queue):
        if body.n != 1:
            raise ApiError(400, f"n must be 1, got {body.n}", param="n")
        max_tokens = body.max_completion_tokens or body.max_tokens or 16
        try:
            stop = stop_strings(body.stop)
        except RequestError as e:
            raise ApiError(400, str(e), param="stop") from None
        try:
            params = SamplingParams(temperature=float(body.temperature), top_p=float(body.top_p), seed=body.seed)
            return scheduler().submit(prompt_ids, params, max_tokens, stop,
                                      lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error", headers={"Retry-After": "1"}) from None
        except SchedulerClosed as e:
            raise ApiError(503, str(e), "server_error", headers={"Retry-After": "1"}) from None
        except RequestError as e:
            raise ApiError(400, str(e)) from None

    def encode(prompt) -> list[int]:
        try:
            return engine.encode_prompt(prompt)
        except RequestError as e:
            raise ApiError(400, str(e), param="prompt" if not isinstance(prompt, list) or not prompt
                           or not isinstance(prompt[0], dict) else "messages") from None

    def record(ev: FinishEvent, req, prompt_tokens: int):
        m_requests.labels(ev.finish_reason).inc()
        if ev.metrics is None:
            return
        m_prompt.inc(prompt_tokens - req.cached_tokens)
        m_cached.inc(req.cached_tokens)
        m_generated.inc(ev.metrics.generated_tokens)
        if ev.metrics.time_to_first_token_ms:
            m_ttft.observe(ev.metrics.time_to_first_token_ms / 1000)
        for iv in ev.metrics.token_intervals_ms:
            m_itl.observe(iv / 1000)

    def usage(req, prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}

    async def run(request: Request, body, prompt_ids, chat: bool, want_logprobs: bool):
        """Submit and answer: one JSON response, or an SSE stream of chunks."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        req = submit(body, prompt_ids, loop, queue)
        sched = app.state.scheduler
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"

        def logprobs_of(token_ids, logprobs, offsets):
            """OpenAI's logprobs object of some generated tokens (chat or completions shape); offsets:
            where each token's text starts in the completion's text (completions' `text_offset`)."""
            if not want_logprobs:
                return None
            toks = [engine.tokenizer.decode([t]) for t in token_ids]
            if chat:
                return {"content": [{"token": t, "logprob": p, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                                    for t, p in zip(toks, logprobs)]}
            return {"tokens": toks, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": list(offsets)}

        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))

            sent = [0]  # characters of text streamed so far

            def chunk(delta_text, token=None, logprob=None, reason=None, first=False):
                lp = None if token is None else logprobs_of([token], [logprob], [sent[0]])
                sent[0] += len(delta_text)
                if chat:
                    delta = ({"role": "assistant", "content": delta_text} if first else
                             ({"content": delta_text} if reason is None or delta_text else {}))
                    choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}
                    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                            "model": model_id, "choices": [choice]}
                choice = {"index": 0, "text": delta_text, "logprobs": lp, "finish_reason": reason}
                return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_id,
                        "choices": [choice]}

            async def events():
                n_tokens, first = 0, True
                try:
                    while True:
                        ev = await queue.get()
                        if isinstance(ev, FinishEvent):
                            record(ev, req, len(prompt_ids))
                            if ev.finish_reason not in ("stop", "length"):
                                yield {"data": json.dumps({"error": {"message": f"request ended: {ev.finish_reason}",
                                                                     "type": "server_error", "param": None,
                                                                     "code": None}})}
                                return
                            yield {"data": json.dumps(chunk(ev.text, reason=ev.finish_reason, first=first))}
                            if include_usage:
                                c = chunk("")
                                c["choices"], c["usage"] = [], usage(req, len(prompt_ids), n_tokens)
                                yield {"data": json.dumps(c)}
                            yield {"data": "[DONE]"}
                            return
                        n_tokens += 1
                        yield {"data": json.dumps(chunk(ev.text, ev.token_id, ev.logprob, first=first))}
                        first = False
                finally:  # the client went away (or the stream ended): free the slot within a pass
                    sched.cancel(req)

            return EventSourceResponse(events(), ping=15)

        text, tokens, logprobs = [], [], []
        clock = asyncio.get_running_loop().time
        next_check = clock() + 0.5
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(queue.get(), timeout=max(0.01, next_check - clock()))
                except asyncio.TimeoutError:
                    ev = None
                if isinstance(ev, FinishEvent):
                    break
                if clock() >= next_check:  # every half second, tokens arriving or not: a client that
                    next_check = clock() + 0.5  # left stops its request within a second
                    if await request.is_disconnected():
                        raise ApiError(400, "client disconnected") from None
                if ev is None:
                    continue
                text.append(ev.text)
                tokens.append(ev.token_id)
                logprobs.append(ev.logprob)
        finally:
            sched.cancel(req)
        record(ev, req, len(prompt_ids))
        if ev.finish_reason not in ("stop", "length"):
            raise ApiError(503, f"request ended: {ev.finish_reason}", "server_error")
        text.append(ev.text)
        out = "".join(text)
        offsets, at = [], 0
        for piece in text[:len(tokens)]:  # each token's text, in the order they came
            offsets.append(at)
            at += len(piece)
        lp = logprobs_of(tokens, logprobs, offsets)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out}, "logprobs": lp,
                      "finish_reason": ev.finish_reason}
        else:
            choice = {"index": 0, "text": out, "logprobs": lp, "finish_reason": ev.finish_reason}
        return {"id": rid, "object": obj, "created": int(time.time()), "model": model_id, "choices": [choice],
                "usage": usage(req, len(prompt_ids), len(tokens))}

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        check_model(body.model)
        return await run(request, body, encode(body.prompt), chat=False, want_logprobs=body.logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        check_model(body.model)
        if not body.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        if body.top_logprobs:
            raise ApiError(400, "top_logprobs is not supported (only the chosen tokens' logprobs)",
                           param="top_logprobs")
        messages = [m.model_dump() for m in body.messages]
        return await run(request, body, encode(messages), chat=True, want_logprobs=body.logprobs)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "mlxinfer"}]}

    @app.get("/health")
    async def health():
        s = app.state.scheduler
        if s is None or s.closed:
            return error_body(503, "not running", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        s = app.state.scheduler
        if s is not None:
            st = s.stats()
            m_running.set(st["running"])
            m_waiting.set(st["waiting"])
            m_slots.set(st["slots_in_use"])
            m_slots_free.set(max_batch - st["slots_in_use"])
            m_kv_bytes.set(st["kv_bytes"])
            for state in ("used", "cached", "free"):
                if f"blocks_{state}" in st:
                    m_blocks.labels(state).set(st[f"blocks_{state}"])
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    return app


def serve(engine, model_id: str, host: str = "127.0.0.1", port: int = 8080, max_batch: int = 8,
          max_queue: int = 64, kv_memory: int | None = None, log_level: str = "info") -> None:
    """Run the server until interrupted (Ctrl-C)."""
    _imports()
    import uvicorn

    app = create_app(engine, model_id, max_batch=max_batch, max_queue=max_queue, kv_memory=kv_memory)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
