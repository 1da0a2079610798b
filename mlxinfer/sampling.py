"""Choosing the next token from logits: greedy, or temperature / top-k / top-p / min-p sampling, after
logit bias and repetition / presence / frequency penalties.

One algorithm, written twice: in numpy for the cpu backend and as an MLX graph for the MLX backend, so
that on MLX a sampled token stays on the device and the next pass can be queued before it is read
(pipelined sampling, like greedy). The steps apply in this order, to each row on its own:

  0. the logits are adjusted, in float32 (greedy rows too), in the order llama.cpp's sampler chain
     applies them: `logit_bias` adds its bias to its tokens (OpenAI); `repetition_penalty` r divides
     the positive logits and multiplies the negative ones of every token seen in the prompt or the
     generated text so far, all of it, no window (HF's and llama.cpp's formula; llama.cpp windows it to
     the last 64 tokens by default); `presence_penalty` a and `frequency_penalty` f subtract
     a + f * count from each token generated `count` > 0 times (OpenAI's formula, generated tokens only);
     then a grammar's token mask (`constraint`, mlxinfer.grammar) sets every token the grammar does
     not allow next to -inf;
  1. x = logits / temperature (a temperature below GREEDY_BELOW, 0 included, means greedy: the first
     largest logit);
  2. top_k > 0: keep the k largest values of x (every value tied with the k-th stays);
  3. p = softmax(x); top_p < 1: keep the smallest set of most likely tokens whose probability
     reaches top_p (at least one);
  4. min_p > 0: keep the tokens with p >= min_p * max(p);
  5. renormalise what is kept and draw one token with the sequence's own random state.

The log-probability reported with a token, and the `top_logprobs` most likely tokens reported beside
it, are under the model's distribution (log softmax of the raw logits, before step 0), as vLLM's
default and OpenAI's `logprobs` are. On MLX the token sampled in the pass still in flight is part of
the history (it is on the device, `History.pending`), so the penalties see every generated token. Each sequence owns its random state, seeded by `seed` (None or a
negative seed draws a fresh one, as llama.cpp's -1 does), so its draws do not depend on which other
sequences share the batch. The two backends use different generators: a seed reproduces a run on the
same backend, not across backends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import RequestError
from .grammar import Constraint, unpack_mlx, unpack_numpy

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
    for x in stop:  # generated text is UTF-8: a lone surrogate could never match it
        bad = next((c for c in x if 0xD800 <= ord(c) <= 0xDFFF), None)
        if bad is not None:
            raise RequestError(f"a stop string is not valid Unicode: a lone surrogate U+{ord(bad):04X}")
    return list(stop)


MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a bias (-100 bans a token, +100 forces it)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()  # ((token id, bias), ...); a dict {id: bias} is taken too
    top_logprobs: int = 0  # the most likely tokens (and their logprobs) reported beside each token
    constraint: Constraint | None = None  # a grammar the tokens follow (mlxinfer.grammar)

    def __post_init__(self):
        def bad(what):
            raise RequestError(f"bad sampling option: {what}")

        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((k, v) for k, v in bias))
        except (TypeError, ValueError):
            bad(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", bias)
        for k, v in bias:
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                bad(f"logit_bias keys must be token ids, got {k!r}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                bad(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {k}")
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) \
                or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")

        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            bad(f"constraint must be a grammar.Constraint, got {type(self.constraint).__name__}")
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

    @property
    def penalised(self) -> bool:
        """Whether the row needs its sequence's history (step 0's penalties)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts(self) -> bool:
        return self.penalised or bool(self.logit_bias)

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


@dataclass
class History:
    """What a sequence's penalties read: its prompt and generated token ids known on the host, and on a
    pipelined backend the token sampled in the pass still in flight (a one-element device array)."""

    prompt: list
    generated: list
    pending: object = None


def adjust_logits_numpy(row: np.ndarray, p: SamplingParams, history: History | None) -> np.ndarray:
    """Step 0 for one row: a float32 copy with the bias and the penalties applied."""
    x = np.array(row, dtype=np.float32)
    v = x.size
    if p.logit_bias:
        ids = np.array([k for k, _ in p.logit_bias], dtype=np.int64)
        x[ids] += np.array([b for _, b in p.logit_bias], dtype=np.float32)
    if p.penalised:
        gen = list(history.generated) + ([] if history.pending is None else [int(np.asarray(history.pending)[0])])
        counts = np.bincount(np.array(gen, dtype=np.int64), minlength=v).astype(np.float32)
        if p.repetition_penalty != 1.0:
            seen = (np.bincount(np.array(history.prompt, dtype=np.int64), minlength=v) > 0) | (counts > 0)
            r = np.float32(p.repetition_penalty)
            x = np.where(seen, np.where(x > 0, x / r, x * r), x)
        if p.presence_penalty or p.frequency_penalty:
            x = x - np.where(counts > 0, np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty),
                             np.float32(0))
    return x.astype(np.float32, copy=False)


def adjust_logits_mlx(row, p: SamplingParams, history: History | None):
    """Step 0 as an MLX graph, the same float32 operations as `adjust_logits_numpy`."""
    import mlx.core as mx

    x = row.astype(mx.float32)
    v = x.shape[-1]
    if p.logit_bias:
        ids = mx.array([k for k, _ in p.logit_bias], dtype=mx.int32)
        x = x.at[ids].add(mx.array([b for _, b in p.logit_bias], dtype=mx.float32))
    if p.penalised:
        pieces = [mx.array(list(history.generated), dtype=mx.int32)] if history.generated else []
        if history.pending is not None:
            pieces.append(history.pending.reshape(1).astype(mx.int32))
        counts = mx.zeros((v,), dtype=mx.float32)
        if pieces:
            counts = counts.at[mx.concatenate(pieces)].add(1.0)
        if p.repetition_penalty != 1.0:
            in_prompt = mx.zeros((v,), dtype=mx.float32).at[mx.array(list(history.prompt), dtype=mx.int32)].add(1.0)
            seen = mx.logical_or(in_prompt > 0, counts > 0)
            r = mx.array(p.repetition_penalty, dtype=mx.float32)
            x = mx.where(seen, mx.where(x > 0, x / r, x * r), x)
        if p.presence_penalty or p.frequency_penalty:
            f = mx.array(p.frequency_penalty, dtype=mx.float32)
            a = mx.array(p.presence_penalty, dtype=mx.float32)
            x = x - mx.where(counts > 0, f * counts + a, mx.array(0.0, dtype=mx.float32))
    return x


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
    """The sampling work of one pass: one (params, random state, history) per logit row. A sample call
    returns (tokens, logprobs); where a row asked for `top_logprobs`, `top` then holds (ids, logprobs),
    each [rows, k] with k the most any row asked for, most likely first (else None)."""

    def __init__(self, params: list[SamplingParams], rngs: list, histories: list | None = None,
                 masks: np.ndarray | None = None):
        self.params = params
        self.rngs = rngs
        self.histories = histories or [None] * len(params)
        self.masks = masks  # int32 [rows, words]: the tokens each row may take, a bit each (all set: any)
        self.n_top = max((p.top_logprobs for p in params), default=0)
        self.top = None

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    def sample_numpy(self, logits: np.ndarray):
        tokens = np.empty(len(self.params), dtype=np.int32)
        logprobs = np.empty(len(self.params), dtype=np.float32)
        top_ids = np.zeros((len(self.params), self.n_top), dtype=np.int32)
        top_lps = np.zeros((len(self.params), self.n_top), dtype=np.float32)
        allowed = None if self.masks is None else unpack_numpy(self.masks, logits.shape[-1])
        for i, (p, rng, hist) in enumerate(zip(self.params, self.rngs, self.histories)):
            row = logits[i]
            x = adjust_logits_numpy(row, p, hist) if p.adjusts else row
            if allowed is not None and p.constraint is not None:
                x = np.where(allowed[i], x, np.float32(-np.inf))
            if p.greedy:
                tok = int(np.argmax(x))
            else:
                probs = filter_probs_numpy(x, p)
                tok = int(rng.gen.choice(probs.size, p=probs))
            m = float(np.max(row))
            lse = m + math.log(float(np.sum(np.exp(row.astype(np.float64) - m))))
            tokens[i] = tok
            logprobs[i] = float(row[tok]) - lse
            if self.n_top:
                k = min(self.n_top, row.size)  # the k largest (argpartition: 13x less than a full sort of 49k)
                cand = np.argpartition(-row, k - 1)[:k]
                order = cand[np.lexsort((cand, -row[cand]))]  # most likely first, ties by id
                top_ids[i], top_lps[i] = order, row[order].astype(np.float64) - lse
        self.top = (top_ids, top_lps) if self.n_top else None
        return tokens, logprobs

    def sample_mlx(self, logits):
        """The same algorithm as an MLX graph: nothing is evaluated here."""
        import mlx.core as mx

        logprobs_all = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        adjusted = logits
        if any(p.adjusts for p in self.params):
            adjusted = mx.stack([adjust_logits_mlx(logits[i], p, h) if p.adjusts else logits[i].astype(mx.float32)
                                 for i, (p, h) in enumerate(zip(self.params, self.histories))])
        if self.masks is not None:  # unconstrained rows' words are all ones: where() keeps them as they are
            allowed = unpack_mlx(mx.array(self.masks), logits.shape[-1])
            adjusted = mx.where(allowed, adjusted, mx.array(-mx.inf, dtype=adjusted.dtype))
        greedy = mx.argmax(adjusted, axis=-1).astype(mx.int32)
        if self.all_greedy:
            tokens = greedy
        else:
            rows = []
            for i, (p, rng) in enumerate(zip(self.params, self.rngs)):
                if p.greedy:
                    rows.append(greedy[i])
                    continue
                x = adjusted[i] / p.temperature
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
        self.top = None
        if self.n_top:
            order = mx.argsort(-logprobs_all, axis=-1)[:, :self.n_top].astype(mx.int32)
            self.top = (order, mx.take_along_axis(logprobs_all, order, axis=-1))
        return tokens, chosen
