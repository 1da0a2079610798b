"""The engine: load a GGUF model onto a backend, then generate, one sequence or many, as a stream.

The loop is one generator, `Engine._run`, over forward passes. Each pass advances every active sequence
by its next prefill chunk (`prefill_chunk` prompt tokens; a sequence's chunks always start at multiples
of it, so its floats do not depend on what shares the pass) or by one decode token, then samples a token
for each sequence whose last row was in the pass. On a lazy backend (MLX) the next pass is built and
queued before the previous pass's tokens are read, so building the graph overlaps the device's work;
a sequence that stops on an end-of-generation token or a stop string has then one wasted row.

    engine = load()
    for event in engine.stream("The capital of France is", max_tokens=16):
        ...                                   # TokenEvent(token_id, text, logprob, index), then FinishEvent
    engine.generate(prompt, ...)             # -> Generation (consumes stream)
    engine.generate_batch([p1, p2, ...])     # -> [Generation], computed together
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from .backends import make_backend
from .batch import Batch
from .chat import render_chat
from .distributed import Shard, join
from .errors import GGUFError, RequestError
from .gguf_file import GGUFFile
from .kv_cache import KV_CACHES, PagedKVCache, PreallocKVCache
from .metrics import Metrics
from .model_source import resolve_model
from .models import architecture, model_args
from .sampling import Sampler, SamplingParams, stop_strings
from .tokenizer import GGUFTokenizer, token_ids

DEFAULT_PREFILL_CHUNK = 512
MAX_COMPILED_STEPS = 16  # compiled decode steps an engine keeps (one per cache class and batch size)
CHAT_ROLES = ("system", "user", "assistant")


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # generated tokens only (the EOS that stopped generation is not included)
    finish_reason: str  # "stop" (end-of-generation token or stop string) or "length" (max_tokens)
    metrics: Metrics
    prompt_ids: list[int]
    logprobs: list[float] = field(default_factory=list)  # one per token in token_ids
    seed: int | None = None  # the seed the sampler used (None when greedy)


@dataclass
class TokenEvent:
    token_id: int
    text: str  # the text this token adds ("" while a character or a possible stop string is incomplete)
    logprob: float  # log-probability of the token under the model's distribution
    index: int  # 0 for the first generated token


@dataclass
class FinishEvent:
    finish_reason: str
    metrics: Metrics
    generation: Generation
    text: str = ""  # text held back for a possible stop string and released at the end


class _Sequence:
    """One request inside the loop: its prompt, cache slot, sampling state and output so far."""

    def __init__(self, engine, prompt_ids, params, max_tokens, stop, slot, t0):
        self.prompt = prompt_ids
        self.params = params
        self.seed = None if params.greedy else params.resolved_seed()
        if self.seed is not None and (params.seed is None or params.seed < 0):
            self.seed = engine.agree(self.seed)  # a random seed: every rank of a TP run takes rank 0's
        self.rng = None if params.greedy else engine.backend.new_random(self.seed)
        self.max_tokens = max_tokens
        self.stop = stop
        self.slot = slot
        self.t0 = t0
        self.cached = 0  # tokens written to the cache, counting passes launched but not yet read
        self.sampled = 0  # tokens sampled, likewise
        self.last = None  # (token array, row) of the newest sampled token: the next decode input
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.times: list[float] = []
        self.detok = engine.tokenizer.decode_stream()
        self.text = ""  # text handed out so far
        self.held = ""  # text held back: it could be the start of a stop string
        self.finish: str | None = None

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.prompt)


@dataclass
class _Pass:
    seqs: list  # the sequences sampled in this pass, in logit-row order
    tokens: object = None
    logprobs: object = None
    outputs: tuple = ()  # what reading the pass waits for (its tokens, or the cache it wrote)


class Engine:
    pipeline = True  # on a lazy backend, queue the next pass before reading the current one's tokens
    compile_decode = True  # decode passes as one compiled step where the backend can (see _compiled)

    def __init__(self, path, backend, kv: str = "prealloc", prefill_chunk: int | None = None, tp: int = 1):
        if kv not in KV_CACHES:
            raise RequestError(f"unknown KV cache {kv!r} (choose from {', '.join(KV_CACHES)})")
        rank, group = join(tp)  # before reading the file: a tp run that was not launched fails at once
        chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise RequestError(f"prefill chunk must be a positive integer, got {prefill_chunk!r}")
        self.path = str(path)
        self.gguf = GGUFFile(path)
        arch = architecture(self.gguf)
        self.tokenizer = GGUFTokenizer.from_metadata(self.gguf.metadata, source=self.path)
        emb = self.gguf.tensor("token_embd.weight").shape
        if len(emb) == 2 and emb[0] != self.tokenizer.vocab_size:  # checked before any weight is read
            raise GGUFError(
                f"{self.path}: tokenizer has {self.tokenizer.vocab_size} tokens but token_embd.weight has "
                f"{emb[0]} rows"
            )
        self.args = model_args(self.gguf)
        self.backend = backend
        self.kv = kv
        self.prefill_chunk = chunk
        # prefill rows admitted to one pass (decode rows always go): one chunk's worth, so a decoding
        # sequence waits at most one chunk's pass while others prefill
        self.max_pass_rows = chunk
        self.shard = Shard.plan(self.gguf, self.args, rank, tp, group)
        self.kv_width = self.shard.n_kv_heads * self.args.head_dim  # this rank's KV heads
        self.model = arch.Model(backend, self.gguf, self.args, self.shard)
        self._steps = {}  # compiled decode steps, by (cache class, batch size)
        self._carried = None  # ((slot, position) of each row, packed index arrays) for the next decode step

    # -- helpers ------------------------------------------------------------------------------
    def new_cache(self):
        a = self.args
        return KV_CACHES[self.kv](self.backend, a.n_layers, self.kv_width)

    def agree(self, seed: int) -> int:
        """The seed every rank of a tensor-parallel run uses: rank 0's (ranks draw random seeds apart)."""
        if self.shard.size == 1:
            return seed
        import mlx.core as mx

        from .distributed import all_sum

        mine = mx.array(np.array([seed if self.shard.rank == 0 else 0], dtype=np.uint64).view(np.uint32))
        return int(np.array(all_sum(mine, self.shard.group)).view(np.uint64)[0])

    def encode_prompt(self, prompt, chat: bool = False) -> list[int]:
        """Token ids of a prompt: text, bytes (UTF-8), token ids, or a chat messages list rendered with
        the model's template. `chat=True` wraps a text prompt as one user message."""
        tok = self.tokenizer
        if isinstance(prompt, bytes):
            try:
                prompt = prompt.decode("utf-8")
            except UnicodeDecodeError as e:
                raise RequestError(f"prompt is not valid UTF-8 (byte {e.start})") from None
        if isinstance(prompt, str) and chat:
            if not prompt:
                raise RequestError("empty prompt")
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, str):
            ids = tok.encode(prompt, add_special=True, parse_special=True) if prompt else []
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._encode_messages(list(prompt))
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = token_ids(prompt)
            bad = [i for i in ids if not 0 <= i < self.args.vocab_size]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.args.vocab_size})")
        else:
            raise RequestError(f"a prompt is text, token ids or a list of chat messages, not {type(prompt).__name__}")
        if not ids:
            raise RequestError("empty prompt")
        return ids

    def _encode_messages(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise RequestError(f"message {i} has role {m.get('role')!r} (choose from {', '.join(CHAT_ROLES)})")
            if not isinstance(m.get("content"), str):
                raise RequestError(f"message {i} has no text 'content'")
        if not tok.chat_template:
            raise RequestError(f"{self.path}: chat messages need tokenizer.chat_template, which this file lacks")
        bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else ""
        eos = tok.tokens[tok.eos_id] if tok.eos_id is not None else ""
        text = render_chat(tok.chat_template, messages, bos_token=bos, eos_token=eos, add_generation_prompt=True,
                           source=f"{self.path}: chat template")
        return tok.encode(text, add_special=not (bos and text.startswith(bos)), parse_special=True)

    def _check_context(self, n_prompt: int, max_tokens: int) -> None:
        ctx = self.args.context_length
        if n_prompt + max_tokens > ctx:
            raise RequestError(
                f"prompt of {n_prompt} tokens plus max_tokens {max_tokens} exceeds the model's context "
                f"length {ctx}"
            )

    def _metrics(self, seq, batch_size: int) -> Metrics:
        times = seq.times
        return Metrics(
            backend=self.backend.describe(), kv_cache=self.kv, attention=self.backend.attention,
            prompt_tokens=len(seq.prompt), prefill_chunk=self.prefill_chunk,
            time_to_first_token_ms=(times[0] - seq.t0) * 1000 if times else 0.0,
            token_intervals_ms=[(b - a) * 1000 for a, b in zip(times, times[1:])],
            finish_reason=seq.finish or "", peak_memory_mb=self.backend.peak_memory_mb(), batch_size=batch_size,
            tensor_parallel=self.shard.size,
        )

    # -- the loop -----------------------------------------------------------------------------
    def _plan(self, seqs):
        """The next pass: (sequence, rows) for each sequence that can advance. Decode rows always go;
        prefill chunks go while the pass has room (a waiting sequence keeps its chunk boundaries)."""
        plan, budget = [], self.max_pass_rows
        for s in seqs:
            if s.finish is not None:
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

    def _launch(self, plan, cache) -> _Pass:
        """Build (and on a lazy backend, start) one forward pass and the sampling of its logit rows."""
        ops = self.backend
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
        carried = ()
        if self._compiled(plan, cache, batch):
            paged = cache.decode_index(ops, batch) if isinstance(cache, PagedKVCache) else ()
            step = self._decode_step(type(cache), len(plan))
            logits, keys, values, next_packed = step(ids, self._step_index(plan, batch), cache.keys, cache.values,
                                                     *paged)
            cache.keys[:], cache.values[:] = keys, values
            self._carried = ([(s.slot, s.cached + 1) for s, _ in plan], next_packed)
            carried = (next_packed,)  # started with this step's outputs, not left lazy for the next step
        else:
            logits = self.model(ops, ids, batch, cache)
        step = _Pass(sampled)
        if sampled:
            sampler = Sampler([s.params for s in sampled], [s.rng for s in sampled])
            step.tokens, step.logprobs = ops.sample_tokens(logits, sampler)
            step.outputs = (step.tokens, step.logprobs)
        else:  # a pass of mid-prompt chunks: its product is the cache
            step.outputs = tuple(cache.arrays())
        ops.start(*step.outputs, *carried)
        for s, n in plan:
            s.cached += n
        for row, s in enumerate(sampled):
            s.last = (step.tokens, row)
            s.sampled += 1
        return step

    def _step_index(self, plan, batch):
        """A compiled decode step's packed index arrays: the last step's next ones (made on the device)
        when they are for the same rows, else the batch's, from the host. Their contents follow from
        each row's (slot, position) alone, so a match is exact whatever ran in between."""
        if self._carried is not None and self._carried[0] == [(s.slot, s.cached) for s, _ in plan]:
            return self._carried[1]
        return batch.packed

    def _compiled(self, plan, cache, batch) -> bool:
        """Whether this pass runs as the compiled decode step: every sequence decodes one token, into
        a preallocated or paged cache, on a backend that compiles (MLX with its GPU attention kernel)
        and whose attention for this batch reads nothing but the batch's arrays (`compiles_pass`)."""
        return (self.compile_decode and self.backend.compiles_decode
                and isinstance(cache, (PreallocKVCache, PagedKVCache))
                and all(n == 1 and s.cached >= len(s.prompt) for s, n in plan)
                and self.backend.compiles_pass(batch, self.model.spec))

    def _decode_step(self, kind: type, n: int):
        """The compiled decode step of `n` sequences over a cache of class `kind`: (ids, packed index
        arrays (Batch.packed), keys, values[, paged index]) -> (logits, keys, values, the next step's
        packed arrays), the per-layer stores in and out. The next step's positions and lengths are one
        more, made on the device: a run of steps over the same sequences reads no index array from the
        host (MLX's CUDA backend keeps arrays made on the host in managed memory, which the GPU
        migrates or reads across the bus; `_launch` passes them on, `_step_index`). Made once per engine, batch size
        and cache class; the backend retraces it only when a shape changes (the cache's capacity), so
        later requests reuse the trace."""
        key = (kind, n)
        if key in self._steps:
            self._steps[key] = self._steps.pop(key)  # most recently used last
        else:
            while len(self._steps) >= MAX_COMPILED_STEPS:  # each holds its traces: keep the recent ones
                del self._steps[next(iter(self._steps))]
            ops = self.backend

            one_more = Batch.decode_step_delta(ops, n)

            def forward(ids, packed, keys, values, *paged):
                batch = Batch.decode_template(ops, n, packed)
                if paged:  # the paged cache's write targets and gather rows (PagedKVCache.decode_index)
                    blocks, offsets, rows, row_seq = paged
                    batch.paged_index = dict(blocks=blocks, offsets=offsets,
                                             padded=(rows, row_seq, rows.shape[0] // n))
                stores = object.__new__(kind)  # the cache as `update` sees it: only its stores are read
                stores.keys, stores.values = list(keys), list(values)
                logits = self.model(ops, ids, batch, stores)
                return logits, stores.keys, stores.values, packed + one_more

            self._steps[key] = ops.compile_decode(forward)
        return self._steps[key]

    def _read(self, step: _Pass, cache, batch_size: int):
        """Read a pass's tokens (waits for the device), hand out their text, finish sequences. A pass
        with no tokens is waited for too, so that at most one pass is ever in flight."""
        if not step.seqs:
            self.backend.sync(*step.outputs)
            return
        tokens = self.backend.to_numpy(step.tokens).tolist()
        logprobs = self.backend.to_numpy(step.logprobs).tolist()
        now = time.perf_counter()
        eog = self.tokenizer.eog_ids
        for s, token, logprob in zip(step.seqs, tokens, logprobs):
            if s.finish is not None:  # stopped while this pass was already queued: a wasted row
                continue
            s.times.append(now)
            if token in eog:
                yield from self._finish(s, "stop", cache, batch_size)
                continue
            s.out.append(token)
            s.logprobs.append(logprob)
            text, stopped = self._text_delta(s, s.detok.step(token), last=len(s.out) >= s.max_tokens)
            yield s, TokenEvent(token, text, logprob, len(s.out) - 1)
            if stopped:
                yield from self._finish(s, "stop", cache, batch_size)
            elif len(s.out) >= s.max_tokens:
                yield from self._finish(s, "length", cache, batch_size)

    @staticmethod
    def _text_delta(s, piece: str, last: bool) -> tuple[str, bool]:
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

    def _finish(self, s, reason: str, cache, batch_size: int):
        s.finish = reason
        tail, s.held = s.held, ""  # held back for a stop string that never came (ended on EOS)
        s.text += tail
        cache.release(s.slot, (s.prompt + s.out)[:s.cached])  # what its cache rows hold
        metrics = self._metrics(s, batch_size)
        gen = Generation(s.text, list(s.out), reason, metrics, list(s.prompt), list(s.logprobs), s.seed)
        yield s, FinishEvent(reason, metrics, gen, tail)

    def _run(self, seqs, cache, on_forward=None) -> Iterator:
        """Passes until every sequence has finished; yields (sequence, event) pairs."""
        pipelined = self.pipeline and self.backend.lazy and on_forward is None
        pending, n_pass = None, 0
        while True:
            plan = self._plan(seqs)
            step = None
            if plan:
                n_pass += 1
                name = self._pass_name(plan, n_pass, len(seqs)) if on_forward else None
                step = self._launch(plan, cache)
                if on_forward:
                    on_forward(name)
            if pending is not None:
                yield from self._read(pending, cache, len(seqs))
            pending = step
            if not pipelined and pending is not None:
                yield from self._read(pending, cache, len(seqs))
                pending = None
            if step is None and pending is None:
                return

    def _pass_name(self, plan, n_pass, n_seqs) -> str:
        """The tracer's name of a pass about to be launched: "prefill", "prefill 2/3", "decode 1", or
        "pass 5 (9 rows, 3 sequences)" for a batch."""
        if n_seqs > 1:
            return f"pass {n_pass} ({sum(n for _, n in plan)} rows, {len(plan)} sequences)"
        s, _ = plan[0]
        if s.prefilling:
            chunks = -(-len(s.prompt) // self.prefill_chunk)
            return "prefill" if chunks == 1 else f"prefill {s.cached // self.prefill_chunk + 1}/{chunks}"
        return f"decode {s.sampled}"

    def _start(self, prompts, max_tokens, params, stop, chat):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        stop = stop_strings(stop)
        encoded = [self.encode_prompt(p, chat=chat) for p in prompts]
        for ids in encoded:
            self._check_context(len(ids), max_tokens)
        cache = self.new_cache()
        t0 = time.perf_counter()
        seqs = []
        for ids in encoded:
            slot = cache.alloc()
            cache.expect(slot, len(ids) + 1)
            seqs.append(_Sequence(self, ids, params, max_tokens, stop, slot, t0))
        return seqs, cache

    # -- public API ---------------------------------------------------------------------------
    def stream(self, prompt, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               min_p: float = 0.0, seed: int | None = None, stop=None, chat: bool = False,
               on_forward: Callable[[str], None] | None = None) -> Iterator:
        """Generate up to `max_tokens` tokens after `prompt`, yielding a TokenEvent per token and a
        FinishEvent at the end. `prompt`: text, token ids, or chat messages ([{"role", "content"}]).
        Greedy when temperature is 0. `stop`: strings that end generation (not included in the text).
        `on_forward` receives a name for each forward pass ("prefill", "decode 1", ...)."""
        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        seqs, cache = self._start([prompt], max_tokens, params, stop, chat)  # bad requests raise here
        return (event for _, event in self._run(seqs, cache, on_forward))

    def generate(self, prompt, on_text: Callable[[str], None] | None = None, **options) -> Generation:
        """Run `stream` to the end and return the Generation; `on_text` receives each text delta."""
        for event in self.stream(prompt, **options):
            if on_text and event.text:
                on_text(event.text)
            if isinstance(event, FinishEvent):
                return event.generation
        raise AssertionError("stream ended without a FinishEvent")

    def generate_batch(self, prompts, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None, stop=None,
                       chat: bool = False, on_forward: Callable[[str], None] | None = None) -> list[Generation]:
        """One Generation per prompt, computed together in batched passes; each sequence finishes on
        its own. A seed seeds every sequence's sampler (the same seed for all)."""
        prompts = list(prompts) if not isinstance(prompts, (str, bytes)) else [prompts]
        if not prompts:
            raise RequestError("generate_batch needs at least one prompt")
        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        seqs, cache = self._start(prompts, max_tokens, params, stop, chat)
        done = {}
        for s, event in self._run(seqs, cache, on_forward):
            if isinstance(event, FinishEvent):
                done[id(s)] = event.generation
        return [done[id(s)] for s in seqs]

    def logits(self, prompt) -> np.ndarray:
        """float32 [len(ids), vocab]: the logits of every prompt position, prefilled chunk by chunk
        from an empty cache."""
        ids = self.encode_prompt(prompt)
        self._check_context(len(ids), 0)
        ops, cache = self.backend, self.new_cache()
        slot = cache.alloc()
        cache.expect(slot, len(ids))
        rows = []
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = ids[start:start + self.prefill_chunk]
            batch = Batch(ops, [slot], [start], [len(chunk)], all_logits=True)
            cache.reserve(batch)
            rows.append(ops.to_numpy(self.model(ops, ops.index_array(chunk), batch, cache)))
        cache.release(slot)
        return np.concatenate(rows).astype(np.float32, copy=False)


def load(model: str | os.PathLike | None = None, backend: str = "auto", attention: str = "fused",
         device: str | None = None, kernel: str | None = None, kv: str = "prealloc",
         prefill_chunk: int | None = None, threads: int | None = None, tp: int = 1) -> Engine:
    """Load a GGUF model (None: the default SmolLM2-135M-Instruct) onto a backend.

    backend: "auto" (MLX where it has a GPU, Metal or CUDA; else the CPU reference), "cpu" or "mlx".
    attention: "fused" (the backend's override) or "per-head" (the protocol's reference loop).
    device: "cpu" or "gpu" for MLX (default: gpu where available). kernel: the MLX backend's fused
    attention, "graph", "metal" or "cuda" (default: by platform). kv: "prealloc" or "basic".
    prefill_chunk: prompt tokens per prefill pass (default 512). threads: the cpu backend's BLAS
    threads, or on MLX's CPU device the threads its large quantized weight products and its attention
    are cut over (default: the cores not already busy, at most cores // tp; None on a GPU). tp: ranks
    of a tensor-parallel run (mlxinfer.distributed); the process must be one of `tp` started by
    mlx.launch."""
    join(tp)  # a tp run that was not launched fails before anything is loaded
    ops = make_backend(backend, attention, device, kernel, threads, ranks=tp)  # the ranks share the cores
    path = resolve_model(model)
    return Engine(path, ops, kv=kv, prefill_chunk=prefill_chunk, tp=tp)
