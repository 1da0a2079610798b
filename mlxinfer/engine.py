"""The engine: a GGUF model loaded onto a backend, and the public API over the pass loop.

    engine = load()
    for event in engine.stream("The capital of France is", max_tokens=16):
        ...                                   # TokenEvent(token_id, text, logprob, index), then FinishEvent
    engine.generate(prompt, ...)             # -> Generation (consumes stream)
    engine.generate_batch([p1, p2, ...])     # -> [Generation], computed together
    engine.logits(prompt)                    # float32 [len(ids), vocab]

`Engine` loads and validates the file, encodes prompts (text, token ids or chat messages) and checks
requests; the passes themselves are `mlxinfer.loop.Loop`'s: each call here makes a loop over a fresh
KV cache, admits its sequences and steps it to the end. The server's scheduler runs one loop of its
own over every request (`mlxinfer.scheduler`).
"""

from __future__ import annotations

import hashlib
import os
import re
from importlib import metadata
from typing import Callable, Iterator

import numpy as np

from . import collectives
from .backend import Backend
from .backends import kernel_checks, make_backend
from .chat import render_chat
from .decode_step import DecodeStep
from .errors import GGUFError, RequestError
from .gguf_file import GGUFFile
from .grammar import constraint_of
from .kv_cache import KV_CACHES, PagedKVCache
from .loop import FinishEvent, Generation, Loop
from .model_source import resolve_model
from .models import architecture, model_args
from .models.shard import Shard
from .prompt_cache import DiskPrefixCache
from .sampling import SamplingParams, stop_strings
from .tokenizer import GGUFTokenizer, token_ids

DEFAULT_PROMPT_CACHE_BYTES = 4 << 30  # --prompt-cache-dir's bound unless --prompt-cache-size says otherwise
DEFAULT_PREFILL_CHUNK = Backend.prefill_chunk  # a backend may prefer another (MLX 16-bit on CUDA: 2048)
CHAT_ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_VARIABLES = ("messages", "bos_token", "eos_token", "add_generation_prompt", "source")  # ours to set


class Engine:
    pipeline = True  # on a lazy backend, queue the next pass before reading the current one's tokens
    compile_decode = True  # decode passes as one compiled step where the backend can (mlxinfer.decode_step)

    def __init__(self, path, backend, kv: str = "prealloc", prefill_chunk: int | None = None, tp: int = 1,
                 prompt_cache_dir=None, prompt_cache_size: int = DEFAULT_PROMPT_CACHE_BYTES):
        if kv not in KV_CACHES:
            raise RequestError(f"unknown KV cache {kv!r} (choose from {', '.join(KV_CACHES)})")
        rank, group = collectives.join(tp)  # before reading the file: a tp run that was not launched fails at once
        chunk = prefill_chunk
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
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
        self.shard = Shard.plan(self.gguf, self.args, rank, tp, group)
        self.kv_width = self.shard.n_kv_heads * self.args.head_dim  # this rank's KV heads
        self.model = arch.Model(backend, self.gguf, self.args, self.shard)
        self.specs = getattr(self.model, "specs", None) or [self.model.spec] * self.args.n_layers  # each layer's attention
        backend.check_model(self.specs)  # its kernels, in its shape
        if chunk is None:  # the backend's, once its self-check has said which paths it runs
            self.prefill_chunk = backend.prefill_chunk
        self.decode_step = DecodeStep(self.model, self.specs)
        self.prompt_cache = None  # prefix blocks on disk (prompt_cache.py), for the paged cache
        if prompt_cache_dir is not None:
            if kv != "paged":
                raise RequestError(f"a prompt cache directory needs the paged KV cache (kv='paged'), not {kv!r}")
            self.prompt_cache = DiskPrefixCache(prompt_cache_dir, prompt_cache_size, self.prompt_cache_identity(),
                                                self.args.n_layers, PagedKVCache.BLOCK_SIZE, self.kv_width)

    def prompt_cache_identity(self) -> bytes:
        """What decides a KV block's values, which names its files on disk: the model file's digest, the
        engine's version and its kernels' sources (`kernel_checks.sources_digest`: a kernel's bits change with its
        code, the version need not), the backend with its kernels and threads, the prefill chunk (a row's bits may
        depend on it), this rank's share and the cache's shapes (float32)."""
        try:
            version = metadata.version("mlxinfer")
        except metadata.PackageNotFoundError:
            version = "unknown"
        h = hashlib.sha256(self.gguf.digest())
        b = self.backend
        for part in (version, kernel_checks.sources_digest(), b.describe(), b.attention, b.kernel, self.prefill_chunk, self.shard.rank,
                     self.shard.size, self.args.n_layers, self.kv_width, PagedKVCache.BLOCK_SIZE, "float32"):
            h.update(b"\0" + str(part).encode())
        return h.digest()

    # -- what a request is made of ---------------------------------------------------------------
    def new_cache(self, **options):
        """A KV cache of this engine's kind for its model (options: the cache class's own)."""
        if self.prompt_cache is not None:
            options.setdefault("disk", self.prompt_cache)
        if self.kv == "prealloc":  # (the paged and basic caches keep every position of every layer)
            options.setdefault("windows", [spec.window for spec in self.specs])
        return KV_CACHES[self.kv](self.backend, self.args.n_layers, self.kv_width, **options)

    def new_loop(self, cache=None, on_forward: Callable[[str], None] | None = None) -> Loop:
        """A pass loop over `cache` (default: a fresh one) with this engine's model and settings."""
        return Loop(self.model, self.backend, self.tokenizer, self.new_cache() if cache is None else cache,
                    self.prefill_chunk, self.decode_step if self.compile_decode else None, agree=self.agree,
                    pipeline=self.pipeline, on_forward=on_forward, tensor_parallel=self.shard.size)

    def agree(self, seed: int) -> int:
        """The seed every rank of a tensor-parallel run uses: rank 0's (ranks draw random seeds apart)."""
        if self.shard.size == 1:
            return seed
        return collectives.agree_seed(seed, self.shard.rank, self.shard.group)

    def encode_prompt(self, prompt, chat: bool = False, system: str | None = None,
                      template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a prompt: text, bytes (UTF-8), token ids, or a chat messages list rendered with
        the model's template. `chat=True` wraps a text prompt as one user message (after `system`'s).
        `template_kwargs`: more variables for the chat template (e.g. Qwen3's enable_thinking=False)."""
        tok = self.tokenizer
        if isinstance(prompt, bytes):
            try:
                prompt = prompt.decode("utf-8")
            except UnicodeDecodeError as e:
                raise RequestError(f"prompt is not valid UTF-8 (byte {e.start})") from None
        if isinstance(prompt, str) and chat:
            if not prompt:
                raise RequestError("empty prompt")
            prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        if isinstance(prompt, str):
            ids = tok.encode(prompt, add_special=True, parse_special=True) if prompt else []
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._encode_messages(list(prompt), template_kwargs or {})
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

    def _encode_messages(self, messages: list[dict], template_kwargs: dict) -> list[int]:
        tok = self.tokenizer
        taken = sorted(set(template_kwargs) & set(TEMPLATE_VARIABLES))
        if taken:
            raise RequestError(f"chat template variable {taken[0]!r} is set by mlxinfer, not by template kwargs")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise RequestError(f"message {i} has role {m.get('role')!r} (choose from {', '.join(CHAT_ROLES)})")
            if not isinstance(m.get("content"), str):
                raise RequestError(f"message {i} has no text 'content'")
        if not tok.chat_template:
            raise RequestError(f"{self.path}: chat messages need tokenizer.chat_template, which this file lacks")
        bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else ""
        eos = tok.tokens[tok.eos_id] if tok.eos_id is not None else ""

        def render(messages):
            return render_chat(tok.chat_template, messages, bos_token=bos, eos_token=eos, add_generation_prompt=True,
                               source=f"{self.path}: chat template", **template_kwargs)
        text = render(messages)
        add = not (bos and text.startswith(bos))
        typed = {i: m["content"] for i, m in enumerate(messages) if tok.control_text(m["content"])}
        if not typed:
            return tok.encode(text, add_special=add, parse_special=True)
        return tok.encode_parts(self._parts(text, render, messages, typed), add_special=add)

    def _parts(self, text: str, render: Callable, messages: list[dict], typed: dict[int, str]) -> list[tuple]:
        """A rendered chat prompt as (text, parse_special) parts: the messages `typed` (index: content),
        which write control tokens (`<|im_end|>`) in their text, are text (parse_special False) and the
        template's own tokens are parsed. Where they are is found by rendering again with a marker for
        each such message: the template must keep a message's text as it is (else a RequestError)."""
        marks = {i: f"\ue000{i}\ue001" for i in typed}  # private-use characters, in no template
        marked = render([dict(m, content=marks[i]) if i in marks else m for i, m in enumerate(messages)])
        pieces = re.split("(" + "|".join(marks.values()) + ")", marked)
        content = {mark: typed[i] for i, mark in marks.items()}
        parts = [(content[p], False) if p in content else (p, True) for p in pieces]
        if "".join(p for p, _ in parts) != text or len(pieces) != 2 * len(marks) + 1:
            i = min(typed)
            raise RequestError(f"message {i} writes the control token {self.tokenizer.control_text(typed[i])!r} "
                               "as text, and this chat template changes a message's text, so it cannot be kept as text")
        return parts

    def sampling_params(self, response_format=None, grammar: str | None = None, regex: str | None = None,
                        **options) -> SamplingParams:
        """SamplingParams checked against this model (logit_bias names tokens of its vocabulary); an
        option SamplingParams does not have is a RequestError naming it. `response_format` (OpenAI's:
        {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": {...}}}), `grammar`
        (Lark or GBNF text) or `regex`: the grammar the output follows (mlxinfer.grammar)."""
        constraint = constraint_of(self.tokenizer, self.args.vocab_size, response_format, grammar, regex)
        if constraint is not None:
            options["constraint"] = constraint
        fields = SamplingParams.__dataclass_fields__
        unknown = [k for k in options if k not in fields]
        if unknown:
            raise RequestError(f"unknown sampling option {unknown[0]!r} (choose from {', '.join(fields)})")
        if options.get("logit_bias") is None:
            options.pop("logit_bias", None)
        params = SamplingParams(**options)
        bad = [k for k, _ in params.logit_bias if k >= self.args.vocab_size]
        if bad:
            raise RequestError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.args.vocab_size})")
        return params

    def check_context(self, n_prompt: int, max_tokens: int) -> None:
        """RequestError where a prompt of n_prompt tokens and max_tokens more do not fit the context."""
        ctx = self.args.context_length
        if n_prompt + max_tokens > ctx:
            raise RequestError(
                f"prompt of {n_prompt} tokens plus max_tokens {max_tokens} exceeds the model's context "
                f"length {ctx}"
            )

    def room(self, n_prompt: int, max_tokens: int) -> int:
        """`max_tokens` capped to what the context leaves after a prompt of `n_prompt` tokens: the one rule
        of the API and the CLI (generation ends where the context does, finish_reason "length"; the CLI
        says so in a notice). A prompt that leaves no room for a token is a RequestError. (The server
        refuses such a request instead, with 400: OpenAI's contract.)"""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        ctx = self.args.context_length
        if n_prompt >= ctx:
            raise RequestError(f"prompt of {n_prompt} tokens (and one to generate) exceeds the model's context "
                               f"length {ctx}")
        return min(max_tokens, ctx - n_prompt)

    def _requests(self, prompts, max_tokens, stop, chat) -> tuple[list[list[int]], list[str], list[int]]:
        """Every prompt encoded (once) and checked, the stop strings, and each prompt's max_tokens capped
        to the context it leaves (`room`); bad requests raise here, before anything runs."""
        self.room(0, max_tokens)
        stop = stop_strings(stop)
        encoded = [self.encode_prompt(p, chat=chat) for p in prompts]
        return encoded, stop, [self.room(len(ids), max_tokens) for ids in encoded]

    # -- public API ---------------------------------------------------------------------------
    def stream(self, prompt, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               min_p: float = 0.0, seed: int | None = None, stop=None, chat: bool = False,
               on_forward: Callable[[str], None] | None = None, **sampling) -> Iterator:
        """Generate up to `max_tokens` tokens after `prompt` (fewer where the context ends first: `room`),
        yielding a TokenEvent per token and a FinishEvent at the end. `prompt`: text, token ids, or chat
        messages ([{"role", "content"}]).
        Greedy when temperature is 0. `stop`: strings that end generation (not included in the text).
        `on_forward` receives a name for each forward pass ("prefill", "decode 1", ...). `sampling`:
        SamplingParams' other fields (repetition_penalty, presence_penalty, frequency_penalty,
        logit_bias {id: bias}, top_logprobs; mlxinfer.sampling says what each does), and structured
        output: response_format=, grammar= or regex= (`sampling_params`)."""
        params = self.sampling_params(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                      **sampling)
        (ids,), stop, (room,) = self._requests([prompt], max_tokens, stop, chat)  # bad requests raise here
        loop = self.new_loop(on_forward=on_forward)
        loop.admit(ids, params, room, stop)
        return _events(loop)

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
                       chat: bool = False, on_forward: Callable[[str], None] | None = None,
                       **sampling) -> list[Generation]:
        """One Generation per prompt, computed together in batched passes; each sequence finishes on
        its own. A seed seeds every sequence's sampler (the same seed for all); `sampling` as `stream`'s."""
        prompts = list(prompts) if not isinstance(prompts, (str, bytes)) else [prompts]
        if not prompts:
            raise RequestError("generate_batch needs at least one prompt")
        params = self.sampling_params(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                      **sampling)
        encoded, stop, rooms = self._requests(prompts, max_tokens, stop, chat)
        loop = self.new_loop(on_forward=on_forward)
        seqs = [loop.admit(ids, params, room, stop) for ids, room in zip(encoded, rooms)]
        done = {}
        while loop.busy:
            for s, event in loop.step():
                if isinstance(event, FinishEvent):
                    done[id(s)] = event.generation
        return [done[id(s)] for s in seqs]

    def conversation(self) -> Conversation:
        """A chat whose turns reuse the KV cache of the turns before (`Conversation`)."""
        return Conversation(self)

    def logits(self, prompt) -> np.ndarray:
        """float32 [len(ids), vocab]: the logits of every prompt position, prefilled chunk by chunk
        from an empty cache."""
        ids = self.encode_prompt(prompt)
        self.check_context(len(ids), 0)
        return self.new_loop().score(ids)


class Conversation:
    """Turns of one chat over one KV cache kept between them: each turn's prompt (the whole history,
    rendered) prefills only what it adds past the tokens the cache holds from the turn before (the
    longest start they share: all of the last turn where the template renders it again as it was;
    less where the template rewrites earlier turns or the reply's text tokenizes differently; with
    `--kv paged` whole blocks). A turn cut short (an error, Ctrl-C) drops what the cache held.

        conv = engine.conversation()
        for event in conv.stream(engine.encode_prompt(messages), max_tokens=64): ...
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.loop = engine.new_loop()
        self.last = None  # the finished turn whose slot the loop keeps
        self.prefilled = 0  # prompt tokens the last turn prefilled (the rest came from the cache)

    def stream(self, ids: list[int], max_tokens: int = 64, stop=None, **sampling) -> Iterator:
        """The events of one turn generated after `ids` (`Engine.stream`'s options, max_tokens capped to
        the context as there)."""
        params = self.engine.sampling_params(**sampling)
        room = self.engine.room(len(ids), max_tokens)
        stop = stop_strings(stop)
        last, self.last = self.last, None
        seq = self.loop.admit(ids, params, room, stop, keep=True, after=last)
        self.prefilled = len(ids) - seq.cached_tokens
        try:
            yield from _events(self.loop)
        except BaseException:  # a pass may be half done: start the next turn from an empty cache
            self.loop = self.engine.new_loop()
            raise
        self.last = seq

    def reset(self) -> None:
        """Forget the conversation's cache (the next turn prefills its whole prompt)."""
        if self.last is not None:
            self.loop.forget(self.last)
            self.last = None


def _events(loop: Loop) -> Iterator:
    """The events of a loop's sequences until none is left."""
    while loop.busy:
        for _, event in loop.step():
            yield event


def load(model: str | os.PathLike | None = None, backend: str = "auto", attention: str = "fused",
         device: str | None = None, kernel: str | None = None, kv: str = "prealloc",
         prefill_chunk: int | None = None, threads: int | None = None, tp: int = 1, prompt_cache_dir=None,
         prompt_cache_size: int = DEFAULT_PROMPT_CACHE_BYTES, dtype: str | None = None,
         kv_dtype: str | None = None) -> Engine:
    """Load a GGUF model (None: the default SmolLM2-135M-Instruct) onto a backend.

    backend: "auto" (MLX where it has a GPU, Metal or CUDA; else the CPU reference), "cpu" or "mlx".
    attention: "fused" (the backend's override) or "per-head" (the protocol's reference loop).
    device: "cpu" or "gpu" for MLX (default: gpu where available). kernel: the MLX backend's fused
    attention, "graph", "metal" or "cuda" (default: by platform). kv: "prealloc", "paged" or "basic".
    prefill_chunk: prompt tokens per prefill pass (default: the backend's, 512; 2,048 on CUDA in 16
    bits). threads: the cpu backend's BLAS threads, or on MLX's CPU device the threads its large
    quantized weight products and its attention are cut over (default: the cores not already busy, at most cores // tp; None on a GPU). tp: ranks
    of a tensor-parallel run (mlxinfer.models.shard); the process must be one of `tp` started by
    mlx.launch. prompt_cache_dir: a directory where the paged cache (kv="paged") keeps full prompt
    blocks across runs, at most prompt_cache_size bytes (least recently used removed first). dtype: the
    MLX backend's activations, "float32", "bfloat16" or "float16" (default: float32 on MLX's CPU,
    `backend.GPU_DEFAULT_DTYPES` on a GPU: bfloat16 on CUDA, float32 on Metal; the cpu backend: float32
    only); kv_dtype: what its KV
    cache stores, one of those or "q8_0" (default: dtype)."""
    collectives.join(tp)  # a tp run that was not launched fails before anything is loaded
    ops = make_backend(backend, attention, device, kernel, threads, ranks=tp, dtype=dtype,
                       kv_dtype=kv_dtype)  # the ranks share the cores
    path = resolve_model(model)
    return Engine(path, ops, kv=kv, prefill_chunk=prefill_chunk, tp=tp, prompt_cache_dir=prompt_cache_dir,
                  prompt_cache_size=prompt_cache_size)
