"""The pass loop: sequences, forward passes and the events they produce, in one place.

    loop = Loop(model, ops, tokenizer, cache, prefill_chunk=512)
    seq = loop.admit(prompt_ids, SamplingParams(), max_tokens=64)
    while loop.busy:
        for seq, event in loop.step():        # TokenEvent(token_id, text, logprob, index), then FinishEvent
            ...
    loop.release(seq)                          # a sequence leaves early (cancelled): its slot is freed now
    nxt = loop.admit(ids2, params, 64, keep=True, after=seq)  # a chat's next turn: seq admitted with keep=True;
                                               # only what ids2 adds past what they share is prefilled

`step()` is nano-vllm's `LLMEngine.step()`: plan the next pass (schedule), launch it (run), read the
pass before it and turn its tokens into events (postprocess). A pass advances every active sequence by
its next prefill chunk (`prefill_chunk` prompt tokens; a sequence's chunks always start at multiples of
it, so its floats do not depend on what shares the pass) or by one decode token, then samples a token
for each sequence whose last row was in the pass. Decode rows always go; prefill chunks fill the rest of
the pass (one chunk's worth of rows), so a long prompt delays running sequences by at most one chunk's
pass. On a lazy backend (MLX) the next pass is built and queued before the previous pass's tokens are
read, so building the graph overlaps the device's work; a sequence that stops on an end-of-generation
token or a stop string has then one wasted row. Around a prompt's passes only the building overlaps: such
a pass is started once the pass before it is done, and so is the pass after it, and so is a pass of one
sequence over a cache of WAIT_STORE_BYTES (`_launch` and WAIT_STORE_BYTES say why). Decode passes run as
the compiled step where they can (`mlxinfer.decode_step`). A sequence under a grammar
(`SamplingParams.constraint`) has its pass queued as the others', but the pass's sampling is built only
once the pass before is read: its token mask needs the token that pass holds (`mlxinfer.grammar`); a
grammar that is complete finishes the sequence.

`Engine.stream/generate/generate_batch/logits` and the server's scheduler are thin users of this loop:
they admit sequences, call `step()` and hand the events on.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .batch import Batch
from .decode_step import DecodeStep
from .grammar import mask_words
from .metrics import Metrics
from .sampling import History, Sampler, SamplingParams

# Positions a new sequence's KV cache room holds past its prompt, at most (its max_tokens where fewer):
# a preallocated cache then grows mid-generation only past this many tokens (the paged cache allocates
# blocks as it goes; the server's budget counts prompt + max_tokens whatever this is).
RESERVE_AHEAD = 1024


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # generated tokens only (the EOS that stopped generation is not included)
    finish_reason: str  # "stop" (end-of-generation token or stop string) or "length" (max_tokens)
    metrics: Metrics
    prompt_ids: list[int]
    logprobs: list[float] = field(default_factory=list)  # one per token in token_ids
    seed: int | None = None  # the seed the sampler used (None when greedy)
    top_logprobs: list = field(default_factory=list)  # per token, [(id, logprob)] most likely first, if asked


@dataclass
class TokenEvent:
    token_id: int
    text: str  # the text this token adds ("" while a character or a possible stop string is incomplete)
    logprob: float  # log-probability of the token under the model's distribution
    index: int  # 0 for the first generated token
    top_logprobs: list | None = None  # [(id, logprob)] of the params' top_logprobs most likely tokens


@dataclass
class FinishEvent:
    finish_reason: str
    metrics: Metrics | None  # None for a sequence that left early (cancelled, or an error)
    generation: Generation | None
    text: str = ""  # text held back for a possible stop string and released at the end
    error: str | None = None  # what went wrong, for finish_reason "error"


class Sequence:
    """One request inside the loop: its prompt, cache slot, sampling state and output so far."""

    def __init__(self, prompt: list[int], params: SamplingParams, max_tokens: int, stop: list[str], slot: int,
                 seed: int | None, rng, detok, t0: float):
        self.prompt, self.params, self.max_tokens, self.stop, self.slot = prompt, params, max_tokens, stop, slot
        self.seed, self.rng, self.detok, self.t0 = seed, rng, detok, t0
        self.cached = 0  # tokens written to the cache, counting passes launched but not yet read
        self.cached_tokens = 0  # prompt tokens taken from the cache's prefix blocks at admission
        self.sampled = 0  # tokens sampled, likewise
        self.last = None  # (token array, row) of the newest sampled token: the next decode input
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list = []
        self.times: list[float] = []
        self.text = ""  # text handed out so far
        self.held = ""  # text held back: it could be the start of a stop string
        self.finish: str | None = None
        self.keep = False  # its slot stays held when it finishes (Loop.admit's keep)
        self.batch_size = 1  # the most sequences that were in the loop with it at a pass
        self.leader: Sequence | None = None  # while a fork waits: the sequence whose prompt it takes
        self.forks: list[Sequence] = []  # sequences waiting to take this one's prompt (n > 1 choices)
        self.matcher = None if params.constraint is None else params.constraint.matcher()  # its grammar's state

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.prompt)


@dataclass
class Pass:
    seqs: list  # the sequences sampled in this pass, in logit-row order
    tokens: object = None
    logprobs: object = None
    top: tuple | None = None  # (ids, logprobs) [rows, k] where a sequence asked for top_logprobs
    outputs: tuple = ()  # what reading the pass waits for (its tokens, or a marker of the cache it wrote)
    logits: object = None  # the sampled rows' logits, while their sampling waits for a grammar's masks
    start: tuple = ()  # what starting it computes (its outputs, or its logits while a grammar waits)
    prompt_rows: bool = False  # whether it advances a prompt (a prefill chunk)
    part: tuple = ()  # what the next decode pass waits for instead of `outputs` (`Loop.wait_fraction`)
    first_tokens: bool = False  # whether it samples a sequence's first token (the end of its prompt)
    waits: bool = False  # whether it waits for the pass before: one sequence over a cache of WAIT_STORE_BYTES
    layers: list | None = None  # each layer's output, where it is started a few layers at a time (PACE_LAYERS)


# A decode pass queued while the pass before is still running on the device copies every KV store it
# writes to: the device still holds the stores for the pass before, so MLX cannot write them in place (it
# donates only a buffer nothing else holds), and the cache's memory doubles. Where the device keeps up with
# the host (short caches) the pass before is done by the time the writes are encoded and nothing is copied;
# with a long cache it is not. From this cache size a pass of one sequence waits for the one before
# instead: memory first where the copy is large; below it waiting only costs the overlap (measured:
# docs/performance.md, "Peak memory at long context"). Passes of several sequences stay queued: how a
# batch's passes fare either way is not measured.
WAIT_STORE_BYTES = 2 << 30
# It waits only until the pass before has written the keys of this fraction of its layers (None: the
# whole pass). Each such pass is started in two parts (two evaluations: MLX signals the end of each on its
# own), so that the device runs the rest of the pass before while the next one is encoded: that pass's
# first layers find their stores free (MLX keeps a store a pass reads until the command that read it
# completes), and its last ones too where the device finishes them first. The fraction was chosen by
# measurement (bench/probes/memory_timeline.py --fractions; docs/performance.md, "Decode after 32,767
# tokens"): the same peak memory as waiting for the whole pass, and faster decode.
WAIT_FRACTION: float | None = 0.7
# A pass of prompt rows is one lazy graph, and on a GPU (`ops.holds_pass_buffers`) every buffer of an
# evaluation lives until the device has run all of it: started whole, a pass whose host work is quick
# holds every layer's activations (and attention's scratch) at once. A pass of PACE_MIN_ROWS rows or
# more is therefore started PACE_LAYERS layers ahead of the device at most: the host starts each layer's
# output in turn and, past that many, waits for the one that many layers before (None: started whole).
# Measured on an H100 (docs/performance.md, "prompt passes a few layers at a time"): no later first
# token, and a third to a half off the peak of long or many prompts.
PACE_MIN_ROWS = 256
PACE_LAYERS: int | None = 4


class Loop:
    """The one owner of forward passes over a set of sequences sharing one KV cache.

    `agree(seed)` gives the seed every rank of a tensor-parallel run uses (rank 0's); `on_forward`
    receives a name for each pass as it is launched (the tracer's histograms), which turns off
    pipelining so that each pass is measured alone."""

    def __init__(self, model, ops, tokenizer, cache, prefill_chunk: int, decode_step: DecodeStep | None = None,
                 agree: Callable[[int], int] = lambda seed: seed, pipeline: bool = True,
                 on_forward: Callable[[str], None] | None = None, tensor_parallel: int = 1):
        self.model, self.ops, self.tokenizer, self.cache = model, ops, tokenizer, cache
        self.prefill_chunk = prefill_chunk
        # prefill rows admitted to one pass (decode rows always go): one chunk's worth, so a decoding
        # sequence waits at most one chunk's pass while others prefill
        self.max_pass_rows = prefill_chunk
        self.decode_step, self.agree, self.on_forward = decode_step, agree, on_forward
        self.pipelined = pipeline and ops.lazy and on_forward is None
        self.tensor_parallel = tensor_parallel
        self.seqs: list[Sequence] = []  # the active sequences, in admission order
        self.kept: set[int] = set()  # slots finished sequences admitted with keep=True still hold
        self.admitted = 0  # sequences admitted so far
        self._pending: Pass | None = None
        self._unstarted: Pass | None = None  # built, started by the next step (`step`: a prompt's first tokens)
        self.passes = 0
        self.wait_store_bytes = WAIT_STORE_BYTES  # from this cache size a pass of one sequence waits
        self.wait_fraction = WAIT_FRACTION  # ... for the pass before, or for its first part

    # -- admit / step / release -----------------------------------------------------------------
    def admit(self, prompt: list[int], params: SamplingParams, max_tokens: int, stop=(), t0: float | None = None,
              keep: bool = False, after: Sequence | None = None, fork_of: Sequence | None = None) -> Sequence:
        """A new sequence, given a cache slot (and the cache's prefix blocks its prompt starts with);
        it joins the next pass. `t0`: when its request arrived (time to first token counts from it).
        `keep`: when it finishes its slot stays held with what it wrote, for a later sequence to continue
        (`after=` it): that one prefills only what its prompt adds past the start they share (a chat's
        next turn); `forget(seq)` frees a kept slot.

        `fork_of` (another choice of the same request, admitted before it, with the same prompt): on a
        cache that can fork (paged), this one is not prefilled: when the other's last prompt chunk is
        launched it takes the other's prompt blocks (full ones shared, the last one copied) and samples
        its first token from the same logits row with its own parameters and random state; until then
        it waits. So n choices cost one prefill, and at temperature 0 every choice is the other's."""
        if after is not None:
            if after.finish is None or after.slot not in self.kept:
                raise ValueError("a sequence continues only a finished sequence admitted with keep=True")
            self.kept.remove(after.slot)
            slot, held = self.cache.resume(after.slot, (after.prompt + after.out)[:after.cached], prompt)
        else:
            slot, held = self.cache.alloc(), None
        # room for the prompt and what it may generate, up to RESERVE_AHEAD tokens, in one allocation: a
        # store grown mid-generation holds its old and new copies at once (at 32k tokens of context that
        # transient was the run's peak)
        self.cache.expect(slot, len(prompt) + min(max(max_tokens, 1), RESERVE_AHEAD))
        seed = None if params.greedy else params.resolved_seed()
        if seed is not None and (params.seed is None or params.seed < 0):
            seed = self.agree(seed)  # a random seed: every rank of a TP run takes rank 0's
        rng = None if seed is None else self.ops.new_random(seed)
        seq = Sequence(list(prompt), params, max_tokens, list(stop), slot, seed, rng, self.tokenizer.decode_stream(),
                       time.perf_counter() if t0 is None else t0)
        if held is not None:
            seq.cached = seq.cached_tokens = held
        elif fork_of is not None and self.cache.forks and fork_of.finish is None and fork_of.prefilling \
                and fork_of.prompt == seq.prompt:
            seq.leader = fork_of
            fork_of.forks.append(seq)
        else:
            seq.cached = seq.cached_tokens = self.cache.match_prefix(slot, seq.prompt, self._reusable)
        seq.keep = keep
        self.seqs.append(seq)
        self.admitted += 1
        return seq

    def release(self, seq: Sequence, reason: str = "cancelled") -> None:
        """A sequence leaves before it finished (cancelled, or an error): its slot is freed now, and a
        pass already in flight for it is read as a wasted row."""
        if seq.finish is None:
            seq.finish = reason
            self.cache.release(seq.slot, seq.prompt[:seq.cached])
        if seq in self.seqs:
            self.seqs.remove(seq)
        if seq.leader is not None:  # a fork still waiting
            seq.leader.forks.remove(seq)
            seq.leader = None
        for fork in seq.forks:  # its forks prefill their prompt themselves (from its cached blocks)
            fork.leader = None
            fork.cached = fork.cached_tokens = self.cache.match_prefix(fork.slot, fork.prompt, self._reusable)
        seq.forks = []

    def forget(self, seq: Sequence) -> None:
        """Free the slot a finished sequence admitted with keep=True still holds."""
        if seq.slot in self.kept and seq.finish is not None:
            self.kept.remove(seq.slot)
            self.cache.release(seq.slot, (seq.prompt + seq.out)[:seq.cached])

    @property
    def busy(self) -> bool:
        """Whether a step would do anything: a sequence is active, or a pass is still to be read."""
        return bool(self.seqs) or self._pending is not None or self._unstarted is not None

    def step(self) -> list[tuple[Sequence, object]]:
        """Plan and launch the next pass, read the one before it (pipelined) or this one (not), and
        return the (sequence, event) pairs the read produced.

        A prompt's last pass is waited for before the pass after it starts (`_launch`); its tokens are
        then read and returned first, and that pass, already built, is started by the next step: encoding
        it (a few ms: docs/performance.md) no longer delays the first token (`Pass.first_tokens`;
        a pass of mid-prompt chunks beside decode rows is not held back). So is a pass started a few
        layers at a time (`Pass.layers`: the host waits as it starts it) after any pass: the tokens before
        it are handed out first."""
        if self._unstarted is not None:
            launched, self._unstarted = self._unstarted, None
            self._start(launched)
            self._sample_after_read(launched)
            self._pending = launched
            return []
        plan = self._plan()
        launched = None
        held = False  # launched, started by the next step: the pass before's tokens are handed out first
        if plan:
            self.passes += 1
            name = self._pass_name(plan) if self.on_forward else None
            launched = self._launch(plan)
            if self._pending is not None and (launched.prompt_rows or self._pending.prompt_rows or launched.waits):
                # see `_launch`: the two passes' buffers apart (or a decode pass's first part: `part`)
                part = self._pending.part if not launched.prompt_rows else ()
                self.ops.sync(*(part or self._pending.outputs))
                # a prompt's first token, and any token before a pass started a few layers at a time
                # (the host waits as it goes: `Pass.layers`), are read and handed out first
                held = self._pending.first_tokens or bool(launched.layers)
            if held:
                self._unstarted = launched
            else:
                self._start(launched)
            if self.on_forward:
                self.on_forward(name)
        events = []
        if self._pending is not None:
            events += self._read(self._pending)
        if held:
            self._pending = None
            return events
        if launched is not None:
            self._sample_after_read(launched)
        self._pending = launched
        if not self.pipelined and self._pending is not None:
            events += self._read(self._pending)
            self._pending = None
        return events

    def _start(self, launched: Pass) -> None:
        """Start a built pass: its first part alone (`Pass.part`), or its layers a few at a time
        (`Pass.layers`), then the rest."""
        if launched.part:
            self.ops.start(*launched.part)
        if launched.layers:
            layers, launched.layers = launched.layers, None
            self._start_layers(layers)
        self.ops.start(*launched.start)

    def _pace(self, batch: Batch) -> None:
        """Have the model record `batch`'s layer outputs where its pass is to be started a few layers at
        a time (PACE_LAYERS)."""
        if self.ops.holds_pass_buffers and PACE_LAYERS is not None and batch.n_rows >= PACE_MIN_ROWS:
            batch.layer_outputs = []

    def _start_layers(self, layers: list) -> None:
        """Start each layer's output in turn, waiting for the one PACE_LAYERS before once that many are
        in flight; `layers` is emptied as it goes (a layer's output, once computed, is held by nothing
        here)."""
        in_flight: collections.deque = collections.deque()
        while layers:
            x = layers.pop(0)
            self.ops.start(x)
            in_flight.append(x)
            if len(in_flight) > PACE_LAYERS:
                self.ops.sync(in_flight.popleft())

    def _sample_after_read(self, launched: Pass) -> None:
        """Where a pass's sampling waited for the pass before's tokens (a grammar's mask), build and start
        it: the grammars now hold every token read."""
        if launched.logits is not None:
            self._sample(launched)
            self.ops.start(*launched.outputs)

    def score(self, prompt: list[int]) -> np.ndarray:
        """float32 [len(prompt), vocab]: the logits of every prompt position, prefilled chunk by chunk
        into a slot of its own (freed at the end); no token is sampled."""
        return self.score_batch([prompt])[0]

    def score_batch(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """`score` for several prompts at once: each pass advances every prompt by its next chunk (one
        slot each), so B windows of a perplexity run cost one pass per chunk, not B."""
        ops, cache = self.ops, self.cache
        slots = [cache.alloc() for _ in prompts]
        rows: list[list[np.ndarray]] = [[] for _ in prompts]
        try:
            for slot, prompt in zip(slots, prompts):
                cache.expect(slot, len(prompt))
            for start in range(0, max(map(len, prompts)), self.prefill_chunk):
                live = [b for b, p in enumerate(prompts) if len(p) > start]
                chunks = [prompts[b][start:start + self.prefill_chunk] for b in live]
                batch = Batch(ops, [slots[b] for b in live], [start] * len(live), [len(c) for c in chunks],
                              all_logits=True)
                cache.reserve(batch)
                self._pace(batch)
                ids = ops.index_array([t for c in chunks for t in c])
                logits = self.model(ops, ids, batch, cache)
                if batch.layer_outputs:
                    self._start_layers(batch.layer_outputs)
                logits = ops.to_numpy(logits)
                for b, (r0, r1) in zip(live, batch.rows):
                    rows[b].append(logits[r0:r1])
        finally:
            for slot in slots:
                cache.release(slot)
        return [np.concatenate(r).astype(np.float32, copy=False) for r in rows]

    def _reusable(self, held: int) -> bool:
        """Whether a prompt may take `held` tokens from cached blocks and still get a cold run's bits:
        any number, where a prefill row's bits do not depend on the rest of its chunk
        (`ops.rows_independent`); else a multiple of prefill_chunk, so that every chunk after the prefix
        is the cold run's own (on numpy a row of `q @ k.T` changes with the chunk's row count). Only
        prompt rows are shared, never decode rows (one-row products, another BLAS path:
        docs/determinism.md)."""
        return self.ops.rows_independent or held % self.prefill_chunk == 0

    # -- schedule -------------------------------------------------------------------------------
    def _plan(self) -> list[tuple[Sequence, int]]:
        """The next pass: (sequence, rows) for each sequence that can advance. Decode rows always go;
        prefill chunks go while the pass has room (a waiting sequence keeps its chunk boundaries)."""
        plan, budget = [], self.max_pass_rows
        for s in self.seqs:
            if s.leader is not None:  # a fork waits for its leader's prompt
                continue
            if not s.prefilling:
                if s.sampled < s.max_tokens:
                    plan.append((s, 1))
                continue
            n = min(self.prefill_chunk, len(s.prompt) - s.cached)
            if n <= budget or not plan:  # the first sequence always advances
                plan.append((s, n))
                budget -= n
        return plan

    # -- run ------------------------------------------------------------------------------------
    def _launch(self, plan) -> Pass:
        """Build one forward pass and the sampling of its logit rows (`step` starts it on a lazy backend).

        A pass that advances a prompt is started only once the pass before it is done, and one after it
        only once it is done (and a pass of one sequence, from a cache of WAIT_STORE_BYTES): on a GPU every
        buffer a pass allocates lives until the device has run the pass (all its layers' activations:
        ~2.6 GiB for a 2,048-row chunk of Qwen3-0.6B), so two passes in flight hold two such sets. The
        next pass is still built while the device runs this one; only its start waits. A pass of
        mid-prompt chunks keeps a marker of the stores it wrote (`ops.done_marker`), not the stores: the
        next pass then writes them in place (a store another array still holds is copied whole by the
        scatter)."""
        ops, cache = self.ops, self.cache
        pieces = []
        for s, n in plan:
            if s.prefilling:
                pieces.append(ops.index_array(s.prompt[s.cached:s.cached + n]))
            else:
                tokens, row = s.last
                pieces.append(tokens[row:row + 1])
        ids = pieces[0] if len(pieces) == 1 else ops.concat_index_arrays(pieces)
        sampled = [s for s, n in plan if s.cached + n >= len(s.prompt)]
        batch = Batch(ops, [s.slot for s, _ in plan], [s.cached for s, _ in plan], [n for _, n in plan],
                      logits_for=[s.cached + n >= len(s.prompt) for s, n in plan])
        cache.reserve(batch)
        started = ()
        decoding = all(not s.prefilling for s, _ in plan)
        if not decoding:
            self._pace(batch)
        if self.decode_step is not None and self.decode_step.covers(ops, batch, cache, decoding):
            logits, next_index = self.decode_step(ops, ids, batch, cache)
            started = (next_index,)  # started with this step's outputs, not left lazy for the next step
        else:
            logits = self.model(ops, ids, batch, cache)
        forks = [(f, row) for row, s in enumerate(sampled) for f in s.forks]  # take the leader's prompt now
        for f, row in forks:
            self.cache.fork(sampled[row].slot, f.slot, len(f.prompt))
            f.leader, f.cached, f.cached_tokens = None, len(f.prompt), sampled[row].cached_tokens
        if forks:
            for s in sampled:
                s.forks = []
            logits = ops.gather_rows(logits, ops.index_array(list(range(len(sampled))) + [row for _, row in forks]))
            sampled = sampled + [f for f, _ in forks]
        step = Pass(sampled, logits=logits, prompt_rows=not decoding, layers=batch.layer_outputs,
                    first_tokens=any(s.prefilling and s.cached + n >= len(s.prompt) for s, n in plan),
                    waits=len(plan) == 1 and cache.nbytes() >= self.wait_store_bytes)
        stores = getattr(cache, "keys", None)
        if self.wait_fraction is not None and decoding and step.waits and stores:
            store = stores[min(len(stores) - 1, int(self.wait_fraction * len(stores)))]
            marker = None if store is None else ops.done_marker(store)  # (None: an eager backend's)
            step.part = () if marker is None else (marker,)
        if not sampled:  # a pass of mid-prompt chunks: its product is the cache
            step.outputs, step.logits = (ops.done_marker(*cache.arrays()),), None
            step.start = (*step.outputs, *started)
        elif any(s.matcher is not None for s in sampled):  # sampled once the pass before is read (`step`):
            step.start = (logits, *started)  # a grammar's mask needs the token that pass holds
        else:
            self._sample(step)
            step.start = (*step.outputs, *started)
        live = len(self.seqs)
        for s, n in plan:
            prefilled = s.prefilling
            s.cached += n
            s.batch_size = max(s.batch_size, live)
            if prefilled:  # its full prompt blocks are written (or queued first): later prompts share them
                cache.publish(s.slot, s.prompt[:s.cached])
        return step

    def _sample(self, step: Pass) -> None:
        """Build the sampling of a pass's logit rows (the caller starts it), each row under its grammar's
        mask where it has one."""
        sampled, masks = step.seqs, None
        if any(s.matcher is not None for s in sampled):
            masks = np.full((len(sampled), mask_words(step.logits.shape[-1])), -1, dtype=np.int32)
            for row, s in enumerate(sampled):
                if s.matcher is not None and s.finish is None:  # (a finished one's row is wasted)
                    s.matcher.mask_into(masks[row])
        sampler = Sampler([s.params for s in sampled], [s.rng for s in sampled],
                          [self._history(s) for s in sampled], masks)
        step.tokens, step.logprobs = self.ops.sample_tokens(step.logits, sampler)
        step.top, step.logits = sampler.top, None
        step.outputs = (step.tokens, step.logprobs, *(sampler.top or ()))
        for row, s in enumerate(sampled):
            s.last = (step.tokens, row)
            s.sampled += 1

    @staticmethod
    def _history(s: Sequence) -> History | None:
        """What the penalties of a sequence's next token read (None where it has none): its prompt, its
        tokens read so far, and the token of the pass still in flight (sampled, not yet read)."""
        if not s.params.penalised:
            return None
        pending = None
        if s.sampled > len(s.out) and s.last is not None:  # at most one pass is in flight
            tokens, row = s.last
            pending = tokens[row:row + 1]
        return History(s.prompt, list(s.out), pending)

    # -- postprocess ----------------------------------------------------------------------------
    def _read(self, step: Pass) -> list:
        """Read a pass's tokens (waits for the device), hand out their text, finish sequences. A pass
        with no tokens is waited for too, so that at most one pass is ever in flight."""
        if not step.seqs:
            self.ops.sync(*step.outputs)
            return []
        tokens = self.ops.to_numpy(step.tokens).tolist()
        logprobs = self.ops.to_numpy(step.logprobs).tolist()
        top = None if step.top is None else [self.ops.to_numpy(a).tolist() for a in step.top]
        now = time.perf_counter()
        eog = self.tokenizer.eog_ids
        events = []
        for row, (s, token, logprob) in enumerate(zip(step.seqs, tokens, logprobs)):
            if s.finish is not None:  # stopped while this pass was already queued: a wasted row
                continue
            s.times.append(now)
            if token in eog:
                events.append((s, self._finish(s, "stop")))
                continue
            error = None if s.matcher is None else s.matcher.advance(token)
            if error is not None:  # (the mask allows only what the grammar takes: a broken invariant)
                events.append((s, self._fail(s, f"the grammar refused token {token}: {error}")))
                continue
            s.out.append(token)
            s.logprobs.append(logprob)
            alternatives = None
            if s.params.top_logprobs:
                k = s.params.top_logprobs
                alternatives = list(zip(top[0][row][:k], top[1][row][:k]))
                s.top_logprobs.append(alternatives)
            text, stopped = self._text_delta(s, s.detok.step(token), last=len(s.out) >= s.max_tokens)
            events.append((s, TokenEvent(token, text, logprob, len(s.out) - 1, alternatives)))
            if stopped or (s.matcher is not None and s.matcher.done):  # a complete grammar takes nothing more
                events.append((s, self._finish(s, "stop")))
            elif len(s.out) >= s.max_tokens:
                events.append((s, self._finish(s, "length")))
        return events

    @staticmethod
    def _text_delta(s: Sequence, piece: str, last: bool) -> tuple[str, bool]:
        """Add a detokenized piece; return (text to hand out now, whether a stop string was hit).
        Text that could be the start of a stop string is held back until it cannot (or the
        sequence ends), so a stop string never starts in text already handed out."""
        pending = s.held + piece
        hits = [i for i in (pending.find(x) for x in s.stop) if i >= 0]
        if hits:
            out, s.held = pending[:min(hits)], ""
            s.text += out
            return out, True
        keep = 0 if last else max((k for x in s.stop for k in range(1, min(len(x), len(pending)) + 1)
                                   if pending.endswith(x[:k])), default=0)
        out, s.held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        s.text += out
        return out, False

    def _finish(self, s: Sequence, reason: str) -> FinishEvent:
        s.finish = reason
        tail, s.held = s.held, ""  # held back for a stop string that never came (ended on EOS)
        s.text += tail
        if s.keep:  # held for a sequence that continues it (admit's after=)
            self.kept.add(s.slot)
        else:
            self.cache.release(s.slot, s.prompt[:s.cached])  # its prompt's rows: see _reusable
        self.seqs.remove(s)
        metrics = self._metrics(s)
        gen = Generation(s.text, list(s.out), reason, metrics, list(s.prompt), list(s.logprobs), s.seed,
                         list(s.top_logprobs))
        return FinishEvent(reason, metrics, gen, tail)

    def _fail(self, s: Sequence, error: str) -> FinishEvent:
        self.release(s, "error")
        return FinishEvent("error", None, None, error=error)

    def _metrics(self, s: Sequence) -> Metrics:
        times = s.times
        return Metrics(
            backend=self.ops.describe(), kv_cache=self.cache.name, attention=self.ops.attention,
            prompt_tokens=len(s.prompt), prefill_chunk=self.prefill_chunk,
            time_to_first_token_ms=(times[0] - s.t0) * 1000 if times else 0.0,
            token_intervals_ms=[(b - a) * 1000 for a, b in zip(times, times[1:])],
            finish_reason=s.finish or "", peak_memory_mb=self.ops.peak_memory_mb(), batch_size=s.batch_size,
            tensor_parallel=self.tensor_parallel,
        )

    def _pass_name(self, plan) -> str:
        """The tracer's name of a pass about to be launched: "prefill", "prefill 2/3", "decode 1", or
        "pass 5 (9 rows, 3 sequences)" for a batch."""
        if self.admitted > 1:
            return f"pass {self.passes} ({sum(n for _, n in plan)} rows, {len(plan)} sequences)"
        s, _ = plan[0]
        if s.prefilling:
            chunks = -(-len(s.prompt) // self.prefill_chunk)
            return "prefill" if chunks == 1 else f"prefill {s.cached // self.prefill_chunk + 1}/{chunks}"
        return f"decode {s.sampled}"
