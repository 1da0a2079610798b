"""Perplexity of a model on a text, by llama.cpp's method (`llama-perplexity -f FILE -c N`).

    result = perplexity(engine, text, ctx=512, batch=4)
    print(result.format())              # PPL = 13.2418 +/- 0.31416 (...)

What llama.cpp's tools/perplexity/perplexity.cpp (`perplexity()`, the default, stride 0) does, step for
step, so that the two numbers are comparable on the same file and text:

- The text is tokenized once, whole, with BOS prepended where the model asks for it and control-token
  text left as text (`common_tokenize(ctx, text, add_special=true, parse_special=false)`).
- It is cut into `len(tokens) // N` non-overlapping windows of N tokens; the tail is dropped. Fewer than
  2N tokens is refused. Each window is evaluated from an empty cache, its first token replaced by BOS
  where the model adds BOS (the window keeps N tokens; the replaced token is not scored anyway).
- Only the second half is scored, so that every scored token has at least N/2 tokens of context: the
  logits at positions N/2 .. N-2 against the window's tokens N/2+1 .. N-1, i.e. N - N/2 - 1 tokens
  per window.
- Each scored token's negative log-likelihood, log-sum-exp minus its logit, is summed (and its square)
  over all windows; PPL = exp(mean nll), and its standard error is PPL times the standard error of the
  mean nll, sqrt((mean(nll^2) - mean(nll)^2) / (count - 1)) (first-order propagation through exp).

`batch` windows go through the model together (`Loop.score_batch`: one pass per prefill chunk for all of
them, as llama.cpp's n_seq); a window's logits do not depend on what shares its pass on the cpu backend
and MLX's CPU device, so neither does the result.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from .errors import RequestError


@dataclass
class Perplexity:
    ppl: float
    stderr: float  # of ppl
    ctx: int  # tokens per window
    windows: int
    nll: np.ndarray  # float64, each scored token's negative log-likelihood, window after window
    seconds: float  # in the forward passes

    @property
    def scored(self) -> int:
        return len(self.nll)

    @property
    def tokens_per_s(self) -> float:
        """Tokens evaluated (every token of every window) per second of forward passes."""
        return self.windows * self.ctx / self.seconds if self.seconds > 0 else float("inf")

    def format(self) -> str:
        return (f"PPL = {self.ppl:.4f} +/- {self.stderr:.5f} ({self.windows} windows of {self.ctx} tokens, "
                f"{self.scored} scored; {self.tokens_per_s:.1f} tokens/s)")


def first_scored(ctx: int) -> int:
    """The position whose logits score the first token of a window's scored half (llama.cpp's `first`)."""
    return ctx // 2


def windows(tokens: list[int], ctx: int, bos_id: int | None) -> list[list[int]]:
    """The text's non-overlapping windows of `ctx` tokens (the tail dropped), each one's first token
    replaced by `bos_id` unless it is None. The targets are read from `tokens`, not from these."""
    out = []
    for i in range(len(tokens) // ctx):
        w = list(tokens[i * ctx:(i + 1) * ctx])
        if bos_id is not None:
            w[0] = bos_id
        out.append(w)
    return out


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """float64 [rows]: -log softmax(logits[r])[targets[r]], by log-sum-exp in float64 (llama.cpp sums
    the exponentials in double too)."""
    x = logits.astype(np.float64)
    top = x.max(axis=-1)
    lse = top + np.log(np.exp(x - top[:, None]).sum(axis=-1))
    return lse - x[np.arange(len(targets)), targets]


def estimate(nll: np.ndarray) -> tuple[float, float]:
    """(PPL, its standard error) from the scored tokens' negative log-likelihoods, as llama.cpp's final
    estimate: exp(mean) and exp(mean) * sqrt((mean of squares - square of mean) / (count - 1))."""
    mean = float(np.mean(nll))
    var = float(np.mean(nll * nll)) - mean * mean
    ppl = math.exp(mean)
    return ppl, (ppl * math.sqrt(var / (len(nll) - 1)) if var > 0 and len(nll) > 1 else float("nan"))


def check_options(ctx, batch, context_length: int) -> None:
    """--ctx and --batch as perplexity needs them (RequestError naming the option otherwise)."""
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 3:
        raise RequestError(f"--ctx must be an integer of at least 3 (a window of N tokens scores its last "
                           f"N - N//2 - 1), got {ctx!r}")
    if ctx > context_length:
        raise RequestError(f"--ctx {ctx} exceeds the model's context length {context_length}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise RequestError(f"--batch must be a positive integer, got {batch!r}")


def perplexity(engine, text: str, ctx: int = 512, batch: int = 1, progress: bool = False) -> Perplexity:
    """The model's perplexity on `text` over windows of `ctx` tokens, `batch` windows per pass; a
    progress bar on stderr with `progress`."""
    check_options(ctx, batch, engine.args.context_length)
    if not isinstance(text, str):
        raise RequestError(f"perplexity takes text (str), got {type(text).__name__}")
    tok = engine.tokenizer
    tokens = tok.encode(text, add_special=True, parse_special=False)
    if len(tokens) < 2 * ctx:
        raise RequestError(f"the text is {len(tokens)} tokens: --ctx {ctx} needs at least {2 * ctx} (two windows)")
    wins = windows(tokens, ctx, tok.bos_id if tok.add_bos else None)
    first = first_scored(ctx)
    loop = engine.new_loop()
    nll, seconds = [], 0.0
    with tqdm(total=len(wins), desc="perplexity", unit="window", file=sys.stderr, disable=not progress,
              leave=False) as bar:
        for i in range(0, len(wins), batch):
            t0 = time.perf_counter()
            scored = loop.score_batch(wins[i:i + batch])
            seconds += time.perf_counter() - t0
            for b, logits in enumerate(scored):
                start = (i + b) * ctx
                targets = np.asarray(tokens[start + first + 1:start + ctx])
                nll.append(token_nll(logits[first:ctx - 1], targets))
            bar.update(len(scored))
            if nll:
                bar.set_postfix_str(f"PPL {math.exp(np.concatenate(nll).mean()):.4f}")
    nll = np.concatenate(nll)
    ppl, stderr = estimate(nll)
    return Perplexity(ppl, stderr, ctx, len(wins), nll, seconds)
