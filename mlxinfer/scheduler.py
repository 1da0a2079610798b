"""Continuous batching: one worker thread steps one pass loop (`mlxinfer.loop`) over every running
request; new requests join at pass boundaries, each finishes (or is cancelled) on its own.

    sched = Scheduler(engine, max_batch=8, max_queue=64, kv_memory=None)
    req = sched.submit(prompt_ids, SamplingParams(...), max_tokens=64, stop=[], on_event=callback)
    ...                                   # callback(TokenEvent) per token, then callback(FinishEvent)
    sched.cancel(req)                     # e.g. the client went away: its cache slot is freed within a pass
    sched.close()

The passes are the loop's (`Loop.step`): decode rows of every running request always go, prefill
chunks of new requests fill the rest of a pass (one chunk's worth of rows), so a long prompt never
stalls the running streams for more than one chunk's pass, and a request's chunks keep their
boundaries, so on the cpu backend its floats (and its greedy text) are those it gets alone. This module
adds what a server needs around the loop: a queue, admission under the batch and memory limits, a
worker thread, cancellation from other threads, and statistics.

Admission: at most `max_batch` requests run (the n choices of one request, `submit_choices`, count n
and are admitted together); up to `max_queue` wait (beyond that `submit` raises
`QueueFull`); with `kv_memory` (bytes) a request waits until the cache, sized for every running request
at its longest (prompt + max_tokens) and this one, as the cache sizes itself (`nbytes_for`: the
preallocated cache gives every slot up to the highest in use the longest length rounded up to its step;
the paged cache whole blocks), fits the budget, and one that cannot fit even alone is refused. Callbacks run on the worker thread and must not block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .errors import MlxinferError, RequestError
from .kv_cache import PagedKVCache
from .loop import FinishEvent, Sequence

log = logging.getLogger("mlxinfer.scheduler")


class QueueFull(MlxinferError):
    """More requests are waiting than the scheduler's max_queue."""


class SchedulerClosed(MlxinferError):
    """The scheduler is shutting down (or its worker died) and takes no requests."""


@dataclass
class Request:
    prompt: list
    params: object
    max_tokens: int
    stop: list
    on_event: Callable
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    seq: Sequence | None = None
    done: bool = False
    group: list | None = None  # the n choices of one request (this one among them), admitted together

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens taken from the prefix cache (0 until admitted)."""
        return 0 if self.seq is None else self.seq.cached_tokens


def kv_bytes_per_token(engine) -> int:
    """Bytes of KV cache one position takes: keys and values of every layer, float32."""
    return 2 * engine.args.n_layers * engine.kv_width * 4


def budget_blocks(engine, kv_memory: int | None) -> int | None:
    """The paged cache's blocks under a budget of `kv_memory` bytes (None: unbounded); a budget below
    one block is a RequestError (`mlxinfer serve` checks it before it starts listening)."""
    if kv_memory is None:
        return None
    block = PagedKVCache.BLOCK_SIZE
    block_bytes = block * kv_bytes_per_token(engine)
    if kv_memory < block_bytes:
        raise RequestError(f"kv_memory {kv_memory} holds less than one block of {block} positions "
                           f"({block_bytes} bytes)")
    return kv_memory // block_bytes


class Scheduler:
    def __init__(self, engine, max_batch: int = 8, max_queue: int = 64, kv_memory: int | None = None):
        for name, v in (("max_batch", max_batch), ("max_queue", max_queue)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise RequestError(f"{name} must be a positive integer, got {v!r}")
        if kv_memory is not None and (isinstance(kv_memory, bool) or not isinstance(kv_memory, int) or kv_memory < 1):
            raise RequestError(f"kv_memory must be a positive number of bytes, got {kv_memory!r}")
        self.engine = engine
        self.max_batch, self.max_queue, self.kv_memory = max_batch, max_queue, kv_memory
        self.paged = engine.kv == "paged"
        # paged: a fixed pool of blocks under the memory budget, prefixes reused across requests
        self.cache_options = dict(max_blocks=budget_blocks(engine, kv_memory)) if self.paged else {}
        self._fresh_loop()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_seq: dict[int, Request] = {}  # id(request.seq) -> request, for the loop's events
        self.cv = threading.Condition()
        self.closed = False
        self.error: BaseException | None = None
        self.stopped_because: str | None = None  # stop()'s reason, given to the requests it ends
        self.thread = threading.Thread(target=self._loop, name="mlxinfer-scheduler", daemon=True)
        self.thread.start()

    # -- called from other threads -------------------------------------------------------------
    def check(self, n_prompt: int, max_tokens: int, n: int = 1) -> None:
        """Raise RequestError where a request (of n choices) can never run (context, or the memory budget)."""
        self.engine.check_context(n_prompt, max_tokens)
        need = self.cache.nbytes_for(dict.fromkeys(range(n), n_prompt + max_tokens))
        if self.kv_memory is not None and need > self.kv_memory:
            choices = f" x n {n}" if n > 1 else ""
            raise RequestError(f"prompt of {n_prompt} tokens plus max_tokens {max_tokens}{choices} needs {need} bytes "
                               f"of KV cache, more than the server's budget of {self.kv_memory}")

    def room(self, n_prompt: int) -> int:
        """The most tokens a prompt of n_prompt tokens can be given: the rest of the context, and under a
        memory budget what the cache can hold for it alone (a request without max_tokens gets this; 0:
        none). Bytes grow with the length, so the bound is found by bisection."""
        hi = self.engine.args.context_length - n_prompt
        if self.kv_memory is None or hi < 1:
            return max(0, hi)
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cache.nbytes_for({0: n_prompt + mid}) <= self.kv_memory:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def submit(self, prompt, params, max_tokens: int, stop, on_event: Callable) -> Request:
        return self.submit_choices(prompt, [params], max_tokens, stop, [on_event])[0]

    def submit_choices(self, prompt, params: list, max_tokens: int, stop, on_events: list) -> list[Request]:
        """n requests for n choices of one prompt (each its own params and callback): admitted together
        (they count n against max_batch and the memory budget), prefilled once (`Loop.admit`'s
        fork_of), each finished or cancelled on its own."""
        if len(params) > self.max_batch:
            raise RequestError(f"n {len(params)} is more than the server's max_batch {self.max_batch}")
        self.check(len(prompt), max_tokens, len(params))
        reqs = [Request(list(prompt), p, max_tokens, list(stop), cb) for p, cb in zip(params, on_events)]
        for req in reqs:
            req.group = reqs
        with self.cv:
            if self.closed:
                raise SchedulerClosed("the server is shutting down" if self.error is None
                                      else f"the scheduler stopped: {self.error}")
            # the queue holds max_queue requests beyond those the batch is about to take: requests that
            # arrive together at an idle server wait for the worker to admit them, not a 429
            room = self.max_queue + max(0, self.max_batch - len(self.running))
            if len(self.waiting) + len(reqs) > room:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting (max_queue {self.max_queue})")
            self.waiting.extend(reqs)
            self.cv.notify()
        return reqs

    def cancel(self, req: Request) -> None:
        """Stop a request: a waiting one leaves the queue now, a running one's slot is released before
        the next pass is planned."""
        with self.cv:
            req.cancelled = True
            if req in self.waiting:
                self.waiting.remove(req)
                self._deliver(req, FinishEvent("cancelled", None, None))
            self.cv.notify()

    def stats(self) -> dict:
        with self.cv:
            st = dict(running=len(self.running), waiting=len(self.waiting), slots_in_use=self.cache.in_use,
                      kv_bytes=self.cache.nbytes(), passes=self.passes)
            if self.paged:
                b = self.cache.blocks
                st.update(blocks_used=b.used, blocks_cached=b.n_cached,
                          blocks_free=(b.max_blocks or b.n_blocks) - b.used - b.n_cached, prefix_hit_tokens=b.hits)
            return st

    @property
    def passes(self) -> int:
        """Forward passes run so far."""
        return self.loop.passes

    def close(self, timeout: float = 10.0) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.thread.join(timeout)

    def stop(self, why: str) -> None:
        """Take no more requests and end every one running or waiting, as cancelled with `why` for its
        error, once the pass in flight is done (the server's drain, at its deadline); returns at once."""
        with self.cv:
            self.closed, self.stopped_because = True, why
            self.cv.notify()

    # -- the worker ----------------------------------------------------------------------------
    def _fits(self, reqs: list[Request]) -> bool:
        """Whether the cache, sized as it sizes itself (whole blocks, or every slot as long as the longest
        sequence rounded up to its step), holds every running request at its longest and these too
        (cached prefix blocks can be evicted, so they count as free; choices' shared blocks count once
        per choice: an upper bound)."""
        if self.kv_memory is None:
            return True
        lengths = {r.seq.slot: len(r.prompt) + r.max_tokens for r in self.running}
        for slot, req in zip(self.cache.next_slots(len(reqs)), reqs):
            lengths[slot] = len(req.prompt) + req.max_tokens
        return self.cache.nbytes_for(lengths) <= self.kv_memory

    def _admit(self) -> None:
        """Under the lock: drop cancelled requests, move waiting ones into the batch while they fit."""
        for req in [r for r in self.running if r.cancelled]:
            self._end(req, "cancelled")
        while self.waiting and len(self.running) < self.max_batch:
            group = [r for r in self.waiting if r.group is self.waiting[0].group]  # (its choices not cancelled)
            if len(self.running) + len(group) > self.max_batch or not self._fits(group):
                break
            first = None
            for req in group:
                self.waiting.remove(req)
                req.seq = self.loop.admit(req.prompt, req.params, req.max_tokens, req.stop, t0=req.submitted,
                                          fork_of=first)
                first = first or req.seq
                self.by_seq[id(req.seq)] = req
                self.running.append(req)

    def _end(self, req: Request, reason: str, error: str | None = None) -> None:
        """A request leaves the batch without a FinishEvent from the loop (cancelled, or an error)."""
        self.loop.release(req.seq, reason)
        self._leave(req)
        self._deliver(req, FinishEvent(reason, None, None, error=error))

    def _pass_failed(self, e: Exception) -> None:
        """Under the lock: a pass raised. Its requests (every running one: they shared it) end with the
        error, the loop and cache start afresh (the failed pass may have left them half-advanced), and
        the worker goes on with the queue."""
        what = f"{type(e).__name__}: {e}"
        log.error("a forward pass failed (%s); its %d request(s) end with an error", what, len(self.running))
        for req in list(self.running):  # (their slots go with the old cache: nothing is released into it)
            self._leave(req)
            self._deliver(req, FinishEvent("error", None, None, error=what))
        self._fresh_loop()

    def _fresh_loop(self) -> None:
        """A new KV cache and a pass loop over it."""
        self.cache = self.engine.new_cache(**self.cache_options)
        self.loop = self.engine.new_loop(self.cache)

    def _leave(self, req: Request) -> None:
        self.running.remove(req)
        del self.by_seq[id(req.seq)]

    def _deliver(self, req: Request, event) -> None:
        if req.done:
            return
        req.done = isinstance(event, FinishEvent)
        try:
            req.on_event(event)
        except Exception:  # a consumer's failure must not stop the other requests
            req.cancelled = True

    def _loop(self) -> None:
        try:
            while True:
                with self.cv:
                    self._admit()
                    while not self.loop.busy and not self.closed:
                        self.cv.wait()
                        self._admit()
                    if self.closed:
                        break
                try:
                    events = self.loop.step()
                except Exception as e:  # noqa: BLE001 - one failed pass must not stop the server
                    with self.cv:
                        self._pass_failed(e)
                    continue
                for seq, event in events:
                    req = self.by_seq.get(id(seq))
                    if req is None:
                        continue
                    self._deliver(req, event)
                    if isinstance(event, FinishEvent):
                        with self.cv:
                            self._leave(req)
        except BaseException as e:  # noqa: BLE001 - every waiting client must hear of it
            self.error = e
            raise
        finally:
            with self.cv:
                self.closed = True
                reason, why = ("error", None) if self.error else ("cancelled", self.stopped_because)
                for req in list(self.running):
                    self._end(req, reason, why)
                while self.waiting:
                    self._deliver(self.waiting.popleft(), FinishEvent(reason, None, None, error=why))
