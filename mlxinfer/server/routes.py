"""The routes, one function each, and what the two generating ones share: submit a request to the
scheduler, then stream its events as SSE chunks or collect them into one answer.

The scheduler's worker thread delivers a request's events (a TokenEvent per token, then a FinishEvent)
to the request's own asyncio queue, through the event loop; whichever way the answer goes, the request
is cancelled when the answer ends, so a client that went away frees its KV slot within a pass.
"""

import asyncio
import json
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool
from sse_starlette.sse import EventSourceResponse

from ..errors import RequestError
from ..grammar import GrammarError
from ..loop import FinishEvent
from ..sampling import SamplingParams, stop_strings
from ..scheduler import QueueFull, Scheduler, SchedulerClosed
from ..scheduler import Request as Submitted
from .errors import ApiError, error_response, public
from .metrics import ServerMetrics
from .reasoning import ReasoningSplitter, prompt_opens_reasoning
from .schemas import (ChatRequest, CompletionRequest, NamedToolChoice, Options, chunk, completion, error_object,
                      logprobs_object, model_list, model_object, response_id, usage_chunk, usage_object)
from .tools import ToolCallParser, call_format, forcing_grammar

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions; chat's default is the rest of the context


@dataclass(frozen=True)
class ServerState:
    """What the routes share, fixed when the app is made (`app.state.server`). The scheduler is not
    here: the lifespan makes it when the server starts, as `app.state.scheduler`."""

    engine: object
    model_id: str  # the id the server reports (the file's name, or --alias); requests may name any model
    fingerprint: str  # system_fingerprint (server.fingerprint)
    max_batch: int
    max_queue: int
    kv_memory: int | None
    metrics: ServerMetrics
    created: int  # when the app was made: the model's `created` in /v1/models
    reasoning: bool = False  # chat turns' <think> text goes to reasoning_content (server.reasoning)


@dataclass(frozen=True)
class Job:
    """A request submitted to the scheduler (one scheduler request per choice), and what its answer
    needs. `events` receives (choice index, event)."""

    scheduler: Scheduler
    reqs: list[Submitted]
    events: asyncio.Queue
    prompt_tokens: int
    chat: bool
    want_logprobs: bool
    rid: str
    top_logprobs: int  # alternatives reported beside each token
    splitters: list  # per choice, a chat turn's reasoning and content splitter (None: not split)
    parsers: list  # per choice, the parser of the tool calls in its content (None: no tools)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens taken from the prefix cache (the first choice's: the others take its prompt)."""
        return self.reqs[0].cached_tokens

    def cancel(self) -> None:
        for req in self.reqs:
            self.scheduler.cancel(req)


# -- the routes, each mounted at its path by app.create_app --------------------------------------
# No return annotations: FastAPI would take one for a response model, and re-validate (and document)
# what the route returns.

async def completions(request: Request, body: CompletionRequest):
    """`logprobs`: N asks for the chosen tokens' logprobs and the N most likely tokens beside each."""
    state = request.app.state.server
    return await answer(request, state, body, await encode(state, body.prompt, "prompt"), chat=False,
                        want_logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0)


async def chat_completions(request: Request, body: ChatRequest):
    state = request.app.state.server
    if not body.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    if body.top_logprobs and not body.logprobs:  # as OpenAI: alternatives only beside the chosen tokens
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    messages = [m.for_template() for m in body.messages]
    tools, fmt, forced = tool_setup(state, body)
    if tools and "tools" in (body.chat_template_kwargs or {}):
        raise ApiError(400, "tools go in `tools`, not in chat_template_kwargs", param="chat_template_kwargs")
    kwargs = {**(body.chat_template_kwargs or {}), **tools} or None
    prompt_ids = await encode(state, messages, "messages", kwargs)
    return await answer(request, state, body, prompt_ids, chat=True,
                        want_logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0, tool_format=fmt,
                        forced=forced)


def tool_setup(state: ServerState, body: ChatRequest) -> tuple[dict, str | None, str | None]:
    """A chat request's tools: (the template's `tools` variable, or nothing; the format its calls are
    parsed in, None: not parsed; the grammar that forces a call, for tool_choice "required" or a
    named function). tool_choice "none" renders no tools and parses no calls."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice names a tool, but the request has no tools", param="tool_choice")
        return {}, None, None
    if choice == "none":
        return {}, None, None
    fmt = call_format(state.engine.tokenizer.chat_template)
    if fmt is None:
        raise ApiError(400, "this model's chat template does not render tools", param="tools")
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if name is not None and name not in [t["function"]["name"] for t in tools]:
        raise ApiError(400, f"tool_choice names {name!r}, which is not one of the tools", param="tool_choice")
    forced = None
    if choice == "required" or name is not None:
        if body.response_format is not None or body.grammar is not None or body.guided_regex is not None:
            raise ApiError(400, "tool_choice required or named forces a call: it does not go with "
                                "response_format, grammar or guided_regex", param="tool_choice")
        forced = forcing_grammar(fmt, tools, name)
    return {"tools": tools}, fmt, forced


async def models(request: Request):
    state = request.app.state.server
    return model_list(state.model_id, state.created)


async def model(request: Request, model_id: str):
    state = request.app.state.server
    if model_id != state.model_id:
        raise ApiError(404, f"model {model_id!r} does not exist (this server serves {state.model_id!r})",
                       "not_found_error", "model", "model_not_found")
    return model_object(state.model_id, state.created)


async def health(request: Request):
    s = request.app.state.scheduler
    if s is None or s.closed:
        return error_response(503, "not running", "server_error")
    return {"status": "ok"}


async def metrics(request: Request):
    state, s = request.app.state.server, request.app.state.scheduler
    if s is not None:
        state.metrics.refresh(s.stats())
    return PlainTextResponse(state.metrics.text(), media_type="text/plain; version=0.0.4")


# -- what the routes share -----------------------------------------------------------------------

def running_scheduler(request: Request) -> Scheduler:
    s = request.app.state.scheduler
    if s is None or s.closed:
        raise ApiError(503, "the server is not running requests (starting up or shutting down)",
                       "server_error", headers={"Retry-After": "1"})
    return s


async def encode(state: ServerState, prompt, param: str, template_kwargs: dict | None = None) -> list[int]:
    """The prompt's token ids, rendered and tokenized on a worker thread: a long prompt takes the event
    loop's time otherwise (eight 1 MiB prompts froze /health and every stream for 7 s)."""
    try:
        return await run_in_threadpool(state.engine.encode_prompt, prompt, template_kwargs=template_kwargs)
    except RequestError as e:
        raise ApiError(400, str(e), param=param) from None


def max_tokens_of(scheduler: Scheduler, body: Options, n_prompt: int, chat: bool) -> int:
    """The request's max_tokens, or its default: a chat turn runs to its end or the context's (as
    llama-server and vLLM), or what the KV budget can hold for it; a completion stops at OpenAI's 16."""
    asked = body.max_completion_tokens or body.max_tokens
    if asked is not None:
        return asked
    return max(1, scheduler.room(n_prompt)) if chat else COMPLETION_MAX_TOKENS


def sampling_params(state: ServerState, body: Options, top_logprobs: int, forced: str | None = None) -> SamplingParams:
    """The request's sampling options, checked against the model (logit_bias names its tokens), and its
    structured output's grammar (`forced`: one from tool_choice)."""
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit():
            raise ApiError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias")
        bias[int(key)] = float(value)
    try:
        return state.engine.sampling_params(
            temperature=float(body.temperature), top_k=body.top_k, top_p=float(body.top_p), min_p=float(body.min_p),
            seed=body.seed, repetition_penalty=float(body.repetition_penalty),
            presence_penalty=float(body.presence_penalty), frequency_penalty=float(body.frequency_penalty),
            logit_bias=bias, top_logprobs=top_logprobs,
            response_format=None if body.response_format is None else body.response_format.for_engine(),
            grammar=forced if forced is not None else body.grammar, regex=body.guided_regex)
    except GrammarError as e:  # the one constraint field the request set (several: a conflict, none named)
        given = [name for name in ("response_format", "grammar", "guided_regex") if getattr(body, name) is not None]
        param = "tool_choice" if forced is not None else given[0] if len(given) == 1 else None
        raise ApiError(400, str(e), param=param) from None
    except RequestError as e:
        raise ApiError(400, str(e), param="logit_bias" if "logit_bias" in str(e) else None) from None


def submit(request: Request, body: Options, prompt_ids: list[int], chat: bool, want_logprobs: bool,
           top_logprobs: int, params: SamplingParams, tool_format: str | None = None) -> Job:
    state = request.app.state.server
    try:
        stop = stop_strings(body.stop)
    except RequestError as e:
        raise ApiError(400, str(e), param="stop") from None
    # choice i samples with seed + i: reproducible one by one, and not n copies of one sample
    choices = [params if i == 0 or params.seed is None or params.seed < 0 else replace(params, seed=params.seed + i)
               for i in range(body.n)]
    loop, events, submitted = asyncio.get_running_loop(), asyncio.Queue(), []

    def deliver(i: int):
        def arrived(ev):  # on the event loop (after `submitted` is filled), whether or not anyone still reads
            if isinstance(ev, FinishEvent):  # so a request whose client left is counted too
                state.metrics.record(ev, len(prompt_ids) if i == 0 else 0, submitted[0].cached_tokens if i == 0 else 0)
            events.put_nowait((i, ev))
        return lambda ev: loop.call_soon_threadsafe(arrived, ev)
    try:
        scheduler = running_scheduler(request)
        max_tokens = max_tokens_of(scheduler, body, len(prompt_ids), chat)
        reqs = scheduler.submit_choices(prompt_ids, choices, max_tokens, stop, [deliver(i) for i in range(body.n)])
        submitted.extend(reqs)
    except QueueFull as e:
        raise ApiError(429, str(e), "rate_limit_error", headers={"Retry-After": "1"}) from None
    except SchedulerClosed as e:
        raise ApiError(503, str(e), "server_error", headers={"Retry-After": "1"}) from None
    except RequestError as e:
        raise ApiError(400, str(e), param="n" if str(e).startswith("n ") else None) from None
    splitters = [None] * body.n
    if chat and state.reasoning:
        opens = prompt_opens_reasoning(state.engine.tokenizer.decode(prompt_ids[-8:]))
        splitters = [ReasoningSplitter(opens) for _ in range(body.n)]
    parsers = [None if tool_format is None else ToolCallParser(tool_format) for _ in range(body.n)]
    return Job(scheduler, reqs, events, len(prompt_ids), chat, want_logprobs, response_id(chat), top_logprobs,
               splitters, parsers)


def split(job: Job, i: int, text: str, last: bool = False) -> tuple[str, str, list]:
    """(reasoning, content, tool calls) of some text of choice i's answer; `last`: the end of the turn
    (nothing held)."""
    splitter, parser = job.splitters[i], job.parsers[i]
    reasoning, content = "", text
    if splitter is not None:
        reasoning, content = splitter.feed(text)
        if last:
            r, c = splitter.finish()
            reasoning, content = reasoning + r, content + c
    if parser is None:
        return reasoning, content, []
    content, calls = parser.feed(content)
    if last:
        c, more = parser.finish()
        content, calls = content + c, calls + more
    return reasoning, content, calls


def finish_reason(job: Job, i: int, ev: FinishEvent) -> str:
    """OpenAI's finish_reason: "tool_calls" where the answer called a tool."""
    parser = job.parsers[i]
    return "tool_calls" if parser is not None and parser.found else ev.finish_reason


def ended(ev: FinishEvent) -> str:
    """The error message of a request that did not finish (cancelled, the server shutting down, or a
    failed pass, whose error it names)."""
    return f"request failed: {ev.error}" if ev.error else f"request ended: {ev.finish_reason}"


def token_logprobs(state: ServerState, job: Job, token_ids, logprobs, offsets, tops) -> dict | None:
    """The logprobs object of some generated tokens, where the request asked for them; tops: per
    token, its [(id, logprob)] alternatives."""
    if not job.want_logprobs:
        return None
    text = state.engine.tokenizer.token_text
    texts = [text(t) for t in token_ids]
    top = [[(text(a), q) for a, q in alts] for alts in tops] if job.top_logprobs else None
    return logprobs_object(texts, logprobs, offsets, job.chat, top)


async def answer(request: Request, state: ServerState, body: Options, prompt_ids: list[int], chat: bool,
                 want_logprobs: bool, top_logprobs: int, tool_format: str | None = None, forced: str | None = None):
    """Submit and answer: one JSON response, or an SSE stream of chunks. The options are checked on a
    worker thread: a grammar compiles there (milliseconds; the first one builds the vocabulary's grammar
    tokenizer, about a second for 150k tokens)."""
    params = await run_in_threadpool(sampling_params, state, body, top_logprobs, forced)
    job = submit(request, body, prompt_ids, chat, want_logprobs, top_logprobs, params, tool_format)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventSourceResponse(stream(state, job, include_usage), ping=15)
    return await collect(request, state, job)


async def stream(state: ServerState, job: Job, include_usage: bool):
    """The SSE events of a streamed request: a chunk per token (with its choice's `index`), each
    choice's finishing chunk (with any text held back for a stop string), the usage if asked (the
    prompt once, every choice's tokens), then [DONE]; a request that ended otherwise (a failed pass, the
    server's drain) gets an error object, then [DONE]."""
    n = len(job.reqs)
    n_tokens, first, sent, left = 0, [True] * n, [0] * n, n  # sent: characters of text streamed so far
    try:
        while True:
            i, ev = await job.events.get()
            if isinstance(ev, FinishEvent):
                if ev.finish_reason not in ("stop", "length"):
                    yield {"data": json.dumps(error_object(public(state, ended(ev)), "server_error"))}
                    yield {"data": "[DONE]"}
                    return
                before = len(job.parsers[i].found) if job.parsers[i] else 0
                reasoning, text, calls = split(job, i, ev.text, last=True)
                yield {"data": json.dumps(chunk(job.rid, state.model_id, state.fingerprint, text, None,
                                                finish_reason(job, i, ev), job.chat, first[i], reasoning, index=i,
                                                tool_calls=calls, calls_before=before))}
                left -= 1
                if left:
                    continue
                if include_usage:
                    use = usage_object(job.prompt_tokens, n_tokens, job.cached_tokens)
                    yield {"data": json.dumps(usage_chunk(job.rid, state.model_id, state.fingerprint, use, job.chat))}
                yield {"data": "[DONE]"}
                return
            n_tokens += 1
            lp = token_logprobs(state, job, [ev.token_id], [ev.logprob], [sent[i]], [ev.top_logprobs])
            before = len(job.parsers[i].found) if job.parsers[i] else 0
            reasoning, text, calls = split(job, i, ev.text)
            yield {"data": json.dumps(chunk(job.rid, state.model_id, state.fingerprint, text, lp, None, job.chat,
                                            first[i], reasoning, index=i, tool_calls=calls, calls_before=before))}
            sent[i] += len(ev.text)
            first[i] = False
    finally:  # the client went away (or the stream ended): free the slots within a pass
        job.cancel()


async def collect(request: Request, state: ServerState, job: Job) -> dict:
    """The whole answer of a request that is not streamed: every choice's."""
    n = len(job.reqs)
    text, tokens, logprobs, tops = ([[] for _ in range(n)] for _ in range(4))
    finished: dict[int, FinishEvent] = {}
    clock = asyncio.get_running_loop().time
    next_check = clock() + 0.5
    try:
        while len(finished) < n:
            try:
                i, ev = await asyncio.wait_for(job.events.get(), timeout=max(0.01, next_check - clock()))
            except asyncio.TimeoutError:
                ev = None
            if isinstance(ev, FinishEvent):
                finished[i] = ev
                if ev.finish_reason not in ("stop", "length"):
                    break
                continue
            if clock() >= next_check:  # every half second, tokens arriving or not: a client that
                next_check = clock() + 0.5  # left stops its request within a second
                if await request.is_disconnected():
                    raise ApiError(400, "client disconnected") from None
            if ev is None:
                continue
            text[i].append(ev.text)
            tokens[i].append(ev.token_id)
            logprobs[i].append(ev.logprob)
            tops[i].append(ev.top_logprobs)
    finally:
        job.cancel()
    failed = [ev for ev in finished.values() if ev.finish_reason not in ("stop", "length")]
    if failed:
        raise ApiError(500 if failed[0].finish_reason == "error" else 503, ended(failed[0]), "server_error")
    use = usage_object(job.prompt_tokens, sum(map(len, tokens)), job.cached_tokens)
    answers = []
    for i in range(n):
        ev = finished[i]
        text[i].append(ev.text)
        offsets, at = [], 0
        for piece in text[i][:len(tokens[i])]:  # each token's text, in the order they came
            offsets.append(at)
            at += len(piece)
        lp = token_logprobs(state, job, tokens[i], logprobs[i], offsets, tops[i])
        reasoning, content, calls = split(job, i, "".join(text[i]), last=True)
        answers.append(completion(job.rid, state.model_id, content, lp, finish_reason(job, i, ev), use, job.chat,
                                  state.fingerprint, reasoning, index=i, tool_calls=calls))
    answers[0]["choices"] = [a["choices"][0] for a in answers]
    return answers[0]
