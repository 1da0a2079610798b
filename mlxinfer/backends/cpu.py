"""CPU reference backend: numpy float32, deterministic. The oracle other backends are checked against.

Weights are dequantized to float32 once at load (with `gguf`'s dequantisation); a weight handle is the
transposed view `W.T` of the [out, in] array, so `x @ W.T` runs as one BLAS sgemm with no copy.
"""

from __future__ import annotations

import numpy as np

from ..backend import Backend, attention_scale


def _softmax_last_axis(x: np.ndarray) -> np.ndarray:
    # The one softmax both attention paths use, so its float order is shared by construction.
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=-1, keepdims=True)


class CPUBackend(Backend):
    name = "cpu"
    device = "cpu"

    def __init__(self):
        self._dequantized: dict[str, np.ndarray] = {}
        self._rope_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    # -- data in and out ----------------------------------------------------------------------
    def from_numpy(self, a):
        return np.ascontiguousarray(a, dtype=np.float32)

    def to_numpy(self, x):
        return np.asarray(x, dtype=np.float32)

    def _dequant(self, gguf, name):
        w = self._dequantized.get(name)
        if w is None:
            w = np.ascontiguousarray(gguf.dequantize(name), dtype=np.float32)
            self._dequantized[name] = w
        return w

    def load_weight(self, gguf, name):
        w = self._dequant(gguf, name)
        if w.ndim != 2:
            raise ValueError(f"{gguf.path}: tensor {name!r} should be a matrix, found shape {w.shape}")
        return w.T

    def load_embedding(self, gguf, name):
        return self._dequant(gguf, name)

    def load_vector(self, gguf, name):
        return self._dequant(gguf, name).reshape(1, -1)

    # -- primitives ---------------------------------------------------------------------------
    def matmul(self, a, b):
        return np.matmul(a, b)

    def transpose_2d(self, x):
        return x.T

    def softmax_rows(self, x):
        return _softmax_last_axis(x)

    def sum_squares_rows(self, x):
        return np.sum(x * x, axis=1, keepdims=True)

    def add_scalar(self, x, s):
        return x + np.float32(s)

    def rsqrt(self, x):
        return np.float32(1.0) / np.sqrt(x)

    def mul_rows(self, x, col):
        return x * col

    def hadamard(self, a, b):
        return a * b

    def add(self, a, b):
        return a + b

    def scale(self, x, s):
        return x * np.float32(s)

    def silu(self, x):
        return x / (np.float32(1.0) + np.exp(-x))

    def _rope_table(self, head_dim, base, offset, t):
        key = (head_dim, base)
        cos, sin = self._rope_cache.get(key, (None, None))
        if cos is None or cos.shape[0] < offset + t:
            n = max(offset + t, 2 * (0 if cos is None else cos.shape[0]), 256)
            inv_freq = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
            ang = np.arange(n, dtype=np.float64)[:, None] * inv_freq[None, :]
            cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
            self._rope_cache[key] = (cos, sin)
        return cos[offset : offset + t], sin[offset : offset + t]

    def rope(self, x, n_heads, head_dim, offset, base, traditional):
        t = x.shape[0]
        cos, sin = self._rope_table(head_dim, base, offset, t)
        c, s = cos[:, None, :], sin[:, None, :]
        xh = x.reshape(t, n_heads, head_dim)
        half = head_dim // 2
        if traditional:
            x1, x2 = xh[..., 0::2], xh[..., 1::2]
        else:
            x1, x2 = xh[..., :half], xh[..., half:]
        out = np.empty_like(xh)
        if traditional:
            out[..., 0::2] = x1 * c - x2 * s
            out[..., 1::2] = x2 * c + x1 * s
        else:
            out[..., :half] = x1 * c - x2 * s
            out[..., half:] = x2 * c + x1 * s
        return out.reshape(t, n_heads * head_dim)

    def reshape(self, x, rows, cols):
        return x.reshape(rows, cols)

    def copy_2d_from_cols(self, x, width, col):
        return np.ascontiguousarray(x[:, col : col + width])

    def copy_2d_into_cols(self, dst, src, col):
        dst[:, col : col + src.shape[1]] = src
        return dst

    def zeros(self, rows, cols):
        return np.zeros((rows, cols), dtype=np.float32)

    def concat_dim0(self, a, b):
        return np.concatenate([a, b], axis=0)

    def slice_rows(self, x, start, stop):
        return np.ascontiguousarray(x[start:stop])

    def gather_rows(self, table, ids):
        return table[np.asarray(ids, dtype=np.int64)]

    def causal_mask(self, scores, offset):
        t, s = scores.shape[-2:]
        masked = np.triu(np.ones((t, s), dtype=bool), k=offset + 1)
        return np.where(masked, np.float32(-np.inf), scores)

    def argmax_with_prob(self, logits_row):
        row = np.asarray(logits_row, dtype=np.float32).reshape(-1)
        i = int(np.argmax(row))
        p = 1.0 / float(np.sum(np.exp(row.astype(np.float64) - float(row[i]))))
        return i, p

    # -- fused attention override -------------------------------------------------------------
    def fused_attention(self, q, k, v, n_heads, n_kv_heads, head_dim):
        """All heads in three batched numpy calls, no per-head tensors; byte-identical to the
        protocol default: each head's K and V are contiguous [S, D] blocks (as the default's copies
        are), the score matmul reads K through a transposed view (as `transpose_2d` does), and
        numpy's batched matmul runs the same BLAS call per head that the default runs once."""
        t, s = q.shape[0], k.shape[0]
        kv, d = n_kv_heads, head_dim
        group = n_heads // n_kv_heads
        # [KV, group, T, D]: query head h = kv_h*group + g.
        qh = np.ascontiguousarray(q.reshape(t, kv, group, d).transpose(1, 2, 0, 3))
        kh = np.ascontiguousarray(k.reshape(s, kv, d).transpose(1, 0, 2))[:, None]  # [KV, 1, S, D]
        vh = np.ascontiguousarray(v.reshape(s, kv, d).transpose(1, 0, 2))[:, None]
        scores = np.matmul(qh, kh.transpose(0, 1, 3, 2))  # [KV, group, T, S]
        scores = scores * np.float32(attention_scale(d))
        if t > 1:
            scores = self.causal_mask(scores, s - t)
        attn = _softmax_last_axis(scores)
        ctx = np.matmul(attn, vh)  # [KV, group, T, D]
        return ctx.transpose(2, 0, 1, 3).reshape(t, n_heads * d)
