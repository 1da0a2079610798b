"""The engine: load a GGUF model onto a backend, then prefill, decode and sample.

The whole generation loop is `Engine.generate`: one prefill pass over the prompt (causal, filling the
KV cache), then one pass per new token against the cache, until EOS or `max_tokens`.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .backends import make_backend
from .chat import render_chat
from .errors import GGUFError, RequestError
from .gguf_file import GGUFFile
from .kv_cache import BasicKVCache
from .metrics import Metrics
from .model_source import resolve_model
from .models import model_loader
from .sampling import sample
from .tokenizer import GGUFTokenizer


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # generated tokens only (the EOS that stopped generation is not included)
    finish_reason: str  # "stop" (end-of-generation token) or "length" (max_tokens)
    metrics: Metrics
    prompt_ids: list[int]


class Engine:
    pipeline = True  # overlap graph building with evaluation where the backend can (MLX, greedy)

    def __init__(self, path, backend, attention: str = "fused"):
        self.path = str(path)
        self.gguf = GGUFFile(path)
        loader = model_loader(self.gguf)
        self.tokenizer = GGUFTokenizer.from_metadata(self.gguf.metadata, source=self.path)
        emb = self.gguf.tensor("token_embd.weight").shape
        if len(emb) == 2 and emb[0] != self.tokenizer.vocab_size:  # checked before any weight is read
            raise GGUFError(
                f"{self.path}: tokenizer has {self.tokenizer.vocab_size} tokens but token_embd.weight has "
                f"{emb[0]} rows"
            )
        self.backend = backend
        self.attention = attention
        self.model = loader(backend, self.gguf)
        self.args = self.model.args

    # -- helpers ------------------------------------------------------------------------------
    @property
    def backend_label(self) -> str:
        b = self.backend
        return b.name if b.name == "cpu" else f"{b.name} ({b.device})"

    def new_cache(self) -> BasicKVCache:
        return BasicKVCache(self.backend, self.args.n_layers)

    def encode_prompt(self, prompt, chat: bool = False) -> list[int]:
        if isinstance(prompt, bytes):
            try:
                prompt = prompt.decode("utf-8")
            except UnicodeDecodeError as e:
                raise RequestError(f"prompt is not valid UTF-8 (byte {e.start})") from None
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("empty prompt")
            tok = self.tokenizer
            if chat:
                if not tok.chat_template:
                    raise RequestError(f"{self.path}: --chat needs tokenizer.chat_template, which this file lacks")
                bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else ""
                eos = tok.tokens[tok.eos_id] if tok.eos_id is not None else ""
                prompt = render_chat(tok.chat_template, [{"role": "user", "content": prompt}],
                                     bos_token=bos, eos_token=eos, add_generation_prompt=True)
                ids = tok.encode(prompt, add_special=not (bos and prompt.startswith(bos)), parse_special=True)
            else:
                ids = tok.encode(prompt, add_special=True, parse_special=True)
        else:
            ids = [int(i) for i in prompt]
            bad = [i for i in ids if not 0 <= i < self.args.vocab_size]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.args.vocab_size})")
        if not ids:
            raise RequestError("empty prompt")
        return ids

    def _check_context(self, n_prompt: int, max_tokens: int) -> None:
        ctx = self.args.context_length
        if n_prompt + max_tokens > ctx:
            raise RequestError(
                f"prompt of {n_prompt} tokens plus max_tokens {max_tokens} exceeds the model's context "
                f"length {ctx}"
            )

    # -- public API ---------------------------------------------------------------------------
    def logits(self, ids) -> np.ndarray:
        """float32 [len(ids), vocab]: one prefill pass over `ids` from an empty cache."""
        ids = self.encode_prompt(ids if isinstance(ids, (str, bytes)) else list(ids))
        self._check_context(len(ids), 0)
        out = self.model.forward(self.backend, ids, self.new_cache(), all_logits=True)
        return self.backend.to_numpy(out)

    def generate(
        self,
        prompt,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        chat: bool = False,
        on_text: Callable[[str], None] | None = None,
        on_forward: Callable[[str], None] | None = None,
    ) -> Generation:
        """Generate up to `max_tokens` tokens after `prompt` (text or token ids). Greedy when
        temperature is 0. `on_text` receives text as it is produced (streaming); `on_forward`
        receives "prefill", "decode 1", ... after each forward pass (the tracer uses it)."""
        if max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}")
        if not (math.isfinite(temperature) and temperature >= 0 and 0 < top_p <= 1 and top_k >= 0):
            raise RequestError(f"bad sampling options: temperature {temperature}, top_k {top_k}, top_p {top_p}")
        ids = self.encode_prompt(prompt, chat=chat)
        self._check_context(len(ids), max_tokens)
        ops, model, tok = self.backend, self.model, self.tokenizer
        rng = np.random.default_rng(seed)
        metrics = Metrics(self.backend_label, BasicKVCache.name, self.attention, prompt_tokens=len(ids))
        cache = self.new_cache()

        def next_token(logits) -> int:
            if temperature == 0:
                return ops.argmax_with_prob(logits)[0]
            return sample(ops.to_numpy(logits).reshape(-1), rng, temperature, top_k, top_p)

        # Pipelined greedy decoding (MLX): the next step's graph is built, and its evaluation queued,
        # before we wait for the current token, so Python's graph building overlaps the device's work.
        pipelined = self.pipeline and temperature == 0 and on_forward is None and hasattr(ops, "async_argmax")
        pending = None
        out: list[int] = []
        emitted = ""
        finish = "length"
        step_input = ids
        for step in range(max_tokens):
            t0 = time.perf_counter()
            if pipelined:
                current = pending if pending is not None else ops.async_argmax(model.forward(ops, ids, cache))
                more = step + 1 < max_tokens
                pending = ops.async_argmax(model.forward(ops, current, cache)) if more else None
                token = ops.token_value(current)
            else:
                logits = model.forward(ops, step_input, cache)
                token = next_token(logits)
            metrics.forward_ms.append((time.perf_counter() - t0) * 1000.0)
            if on_forward:
                on_forward("prefill" if step == 0 else f"decode {step}")
            if token in tok.eog_ids:
                finish = "stop"
                break
            out.append(token)
            if on_text:
                text = tok.decode(out, skip_special=True)
                if not text.endswith("\ufffd") and len(text) > len(emitted):
                    on_text(text[len(emitted):])
                    emitted = text
            step_input = [token]
        text = tok.decode(out, skip_special=True)
        if on_text and len(text) > len(emitted):
            on_text(text[len(emitted):])
        return Generation(text, out, finish, metrics, ids)


def load(model: str | os.PathLike | None = None, backend: str = "auto", attention: str = "fused",
         device: str | None = None, kernel: str | None = None) -> Engine:
    """Load a GGUF model (None: the default SmolLM2-135M-Instruct) onto a backend.

    backend: "auto" (MLX where it has a GPU, Metal or CUDA; else the CPU reference), "cpu" or "mlx".
    attention: "fused" (the backend's override) or "per-head" (the protocol's default loop).
    device: "cpu" or "gpu" for MLX (default: gpu where available). kernel: the MLX backend's fused
    attention, "graph", "metal" or "cuda" (default: by platform)."""
    ops = make_backend(backend, attention, device, kernel)
    path = resolve_model(model)
    return Engine(path, ops, attention)
