"""Choosing the next token from logits: greedy, or temperature / top-k / top-p / min-p sampling.

One algorithm, written twice: in numpy for the cpu backend and as an MLX graph for the MLX backend, so
that on MLX a sampled token stays on the device and the next pass can be queued before it is read
(pipelined sampling, like greedy). The filters apply in this order, to each row on its own:

  1. x = logits / temperature (a temperature below GREEDY_BELOW, 0 included, means greedy: the first
     largest logit);
  2. top_k > 0: keep the k largest values of x (every value tied with the k-th stays);
  3. p = softmax(x); top_p < 1: keep the smallest set of most likely tokens whose probability
     reaches top_p (at least one);
  4. min_p > 0: keep the tokens with p >= min_p * max(p);
  5. renormalise what is kept and draw one token with the sequence's own random state.

The log-probability reported with a token is under the model's distribution (log softmax of the raw
logits), as OpenAI's `logprobs` are. Each sequence owns its random state, seeded by `seed` (None or a
negative seed draws a fresh one, as llama.cpp's -1 does), so its draws do not depend on which other
sequences share the batch. The two backends use different generators: a seed reproduces a run on the
same backend, not across backends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import RequestError

# Every generated token is checked against every stop string (and its prefixes, for the text held back):
# bounded so that one request cannot slow every other sequence of its batch (10,000 stop strings once made
# 150 tokens take 51 s). OpenAI takes 4; llama.cpp's users pass a handful.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
GREEDY_BELOW = 1e-5  # temperatures below this are greedy, as vLLM's _SAMPLING_EPS: softmax(logits / T)
# tends to the argmax as T -> 0, and dividing by a tinier T overflows (float32 on MLX below ~1e-37, float64
# on numpy below ~1e-307: NaN probabilities, where a request would fail or sample nothing)


def stop_strings(stop) -> list[str]:
    """A request's stop strings as a list: None, one string, or a list or tuple of non-empty strings
    (the engine, the server and the CLI all take them here)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise RequestError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not isinstance(x, str) or not x for x in stop):
        raise RequestError("a stop string must be non-empty text")
    longest = max(stop, key=len, default="")
    if len(longest) > MAX_STOP_LENGTH:
        raise RequestError(f"a stop string holds at most {MAX_STOP_LENGTH} characters, got {len(longest)}")
    return list(stop)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        def bad(what):
            raise RequestError(f"bad sampling option: {what}")

        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            bad(f"top_k must be an integer, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad(f"seed must be an integer, got {self.seed!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def resolved_seed(self) -> int:
        """The seed to use: the given one, or a fresh random one for None or a negative seed."""
        if self.seed is None or self.seed < 0:
            return int(np.random.SeedSequence().entropy % (2**63))
        return self.seed


class NumpyRandom:
    def __init__(self, seed: int):
        self.gen = np.random.default_rng(seed)


class MLXRandom:
    def __init__(self, seed: int):
        import mlx.core as mx

        self.key = mx.random.key(seed % (2**63))

    def next_key(self):
        import mlx.core as mx

        self.key, sub = mx.random.split(self.key)
        return sub


def filter_probs_numpy(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Steps 1-4 for one float32 row: the renormalised probabilities (float64) of the kept tokens."""
    x = row.astype(np.float64) / p.temperature
    if 0 < p.top_k < x.size:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x = np.where(x < kth, -np.inf, x)
    probs = np.exp(x - np.max(x))
    probs /= probs.sum()
    keep = probs > 0
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        top = np.zeros_like(keep)
        top[order[: int(np.searchsorted(cum, p.top_p)) + 1]] = True
        keep &= top
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


class Sampler:
    """The sampling work of one pass: one (params, random state) per logit row."""

    def __init__(self, params: list[SamplingParams], rngs: list):
        self.params = params
        self.rngs = rngs

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    def sample_numpy(self, logits: np.ndarray):
        tokens = np.empty(len(self.params), dtype=np.int32)
        logprobs = np.empty(len(self.params), dtype=np.float32)
        for i, (p, rng) in enumerate(zip(self.params, self.rngs)):
            row = logits[i]
            if p.greedy:
                tok = int(np.argmax(row))
            else:
                probs = filter_probs_numpy(row, p)
                tok = int(rng.gen.choice(probs.size, p=probs))
            m = float(np.max(row))
            tokens[i] = tok
            logprobs[i] = float(row[tok]) - m - math.log(float(np.sum(np.exp(row.astype(np.float64) - m))))
        return tokens, logprobs

    def sample_mlx(self, logits):
        """The same algorithm as an MLX graph: nothing is evaluated here."""
        import mlx.core as mx

        logprobs_all = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
        if self.all_greedy:
            tokens = greedy
        else:
            rows = []
            for i, (p, rng) in enumerate(zip(self.params, self.rngs)):
                if p.greedy:
                    rows.append(greedy[i])
                    continue
                x = logits[i] / p.temperature
                if 0 < p.top_k < x.shape[-1]:
                    kth = mx.sort(x)[-p.top_k]
                    x = mx.where(x < kth, -mx.inf, x)
                probs = mx.softmax(x, precise=True)
                keep = probs > 0
                if p.top_p < 1.0:
                    order = mx.argsort(-probs)
                    sorted_p = probs[order]
                    before = mx.cumsum(sorted_p) - sorted_p  # probability of the tokens ahead of each
                    keep_sorted = before < p.top_p
                    keep = mx.logical_and(keep, keep_sorted[mx.argsort(order)])  # back to vocabulary order
                if p.min_p > 0:
                    keep = mx.logical_and(keep, probs >= p.min_p * mx.max(probs))
                scores = mx.where(keep, mx.log(probs), -mx.inf)
                rows.append(mx.random.categorical(scores, key=rng.next_key()).astype(mx.int32))
            tokens = mx.stack(rows)
        chosen = mx.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
        return tokens, chosen
