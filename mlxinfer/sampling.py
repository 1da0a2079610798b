"""Choosing the next token from logits: greedy on the backend, or temperature / top-k / top-p."""

from __future__ import annotations

import numpy as np


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float, top_k: int = 0,
           top_p: float = 1.0) -> int:
    """Sample one id from a [vocab] float32 row: scale by 1/temperature, keep the top_k largest
    (0 = all), keep the smallest set whose probability reaches top_p, renormalise, draw."""
    x = logits.astype(np.float64) / temperature
    if 0 < top_k < x.size:
        kth = np.partition(x, -top_k)[-top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - np.max(x))
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p)) + 1]
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return int(rng.choice(p.size, p=p))
