"""The Backend protocol: the primitive ops every model is written against.

A backend owns its tensor type (numpy arrays for `cpu`, lazy `mx.array`s for `mlx`) and implements the
primitives below. Models never touch tensors directly: every step of the forward pass is a call on the
backend, so a tracing wrapper (`mlxinfer.tracing`) sees and counts each one.

All tensors are 2-D `[rows, cols]` float32 unless an op says otherwise. Weight matrices are opaque
handles made by `load_weight`; `matmul(x, w)` treats them as the logical `[in, out]` matrix.

`fused_attention` is the one composite op. Its default implementation below is the per-head loop built
from the primitives; its op order is the contract any override must reproduce bit for bit.
"""

from __future__ import annotations

import math

import numpy as np

# The protocol's op names, in one place: the tracing backend wraps exactly these.
PRIMITIVE_OPS = (
    "matmul",
    "transpose_2d",
    "softmax_rows",
    "sum_squares_rows",
    "add_scalar",
    "rsqrt",
    "mul_rows",
    "hadamard",
    "add",
    "scale",
    "silu",
    "rope",
    "reshape",
    "copy_2d_from_cols",
    "copy_2d_into_cols",
    "zeros",
    "concat_dim0",
    "slice_rows",
    "gather_rows",
    "causal_mask",
    "argmax_with_prob",
)
OPS = PRIMITIVE_OPS + ("fused_attention",)


def attention_scale(head_dim: int) -> float:
    """1/sqrt(head_dim), rounded once to float32: every attention path multiplies by this value."""
    return float(np.float32(1.0 / math.sqrt(head_dim)))


class Backend:
    """Base class of all backends. Subclasses implement every primitive; overriding
    `fused_attention` is optional (and must then be byte-identical to the default)."""

    name = "base"
    device = "cpu"

    # -- data in and out (not ops of the forward pass; not traced) ---------------------------
    def from_numpy(self, a: np.ndarray):
        raise NotImplementedError

    def to_numpy(self, x) -> np.ndarray:
        raise NotImplementedError

    def load_weight(self, gguf, name: str):
        """A weight matrix stored in GGUF as [out, in] rows, as a handle `matmul` reads as [in, out]."""
        raise NotImplementedError

    def load_embedding(self, gguf, name: str):
        """A [vocab, hidden] table for `gather_rows`."""
        raise NotImplementedError

    def load_vector(self, gguf, name: str):
        """A 1-D parameter (norm weights) as a [1, n] row."""
        raise NotImplementedError

    def sync(self, *xs) -> None:
        """Token boundary: make sure `xs` are computed (lazy backends evaluate here)."""

    # -- primitives ---------------------------------------------------------------------------
    def matmul(self, a, b):
        """[M, K] @ [K, N] -> [M, N]; `b` may be a weight handle."""
        raise NotImplementedError

    def transpose_2d(self, x):
        raise NotImplementedError

    def softmax_rows(self, x):
        """Softmax of each row: subtract the row max, exp, divide by the row sum."""
        raise NotImplementedError

    def sum_squares_rows(self, x):
        """[M, N] -> [M, 1], the sum of squares of each row."""
        raise NotImplementedError

    def add_scalar(self, x, s: float):
        raise NotImplementedError

    def rsqrt(self, x):
        raise NotImplementedError

    def mul_rows(self, x, col):
        """[M, N] * [M, 1]: scale each row by its own scalar."""
        raise NotImplementedError

    def hadamard(self, a, b):
        """Elementwise product; `b` may be a [1, N] row broadcast over the rows of `a`."""
        raise NotImplementedError

    def add(self, a, b):
        raise NotImplementedError

    def scale(self, x, s: float):
        raise NotImplementedError

    def silu(self, x):
        raise NotImplementedError

    def rope(self, x, n_heads: int, head_dim: int, offset: int, base: float, traditional: bool):
        """Rotary position embedding of [T, n_heads*head_dim] rows at positions offset..offset+T-1.
        `traditional=False` rotates halves (x[:d/2], x[d/2:]) as Qwen/NeoX; True rotates
        interleaved pairs (x[2i], x[2i+1]) as llama.cpp does on Llama GGUF files."""
        raise NotImplementedError

    def reshape(self, x, rows: int, cols: int):
        raise NotImplementedError

    def copy_2d_from_cols(self, x, width: int, col: int):
        """A new [M, width] tensor holding columns col..col+width-1 of x."""
        raise NotImplementedError

    def copy_2d_into_cols(self, dst, src, col: int):
        """Write src [M, w] into columns col..col+w-1 of dst; returns the updated dst."""
        raise NotImplementedError

    def zeros(self, rows: int, cols: int):
        raise NotImplementedError

    def concat_dim0(self, a, b):
        raise NotImplementedError

    def slice_rows(self, x, start: int, stop: int):
        """A new tensor holding rows start..stop-1 of x."""
        raise NotImplementedError

    def gather_rows(self, table, ids: list[int]):
        raise NotImplementedError

    def causal_mask(self, scores, offset: int):
        """Set scores[i, j] = -inf where j > i + offset (the strict upper triangle, shifted by the
        number of cached positions before the first query row)."""
        raise NotImplementedError

    def argmax_with_prob(self, logits_row) -> tuple[int, float]:
        """Index of the largest logit of a [1, V] row (first one on ties) and its softmax probability."""
        raise NotImplementedError

    # -- the composite op ---------------------------------------------------------------------
    def fused_attention(self, q, k, v, n_heads: int, n_kv_heads: int, head_dim: int):
        """Attention of T query rows against S cached rows, all heads: q [T, H*D], k and v [S, KV*D]
        -> [T, H*D]. With T > 1 the rows are causal: query row i sees key rows 0..i + (S - T).

        The contract (the default below, op for op). For each query head h in 0..H-1, in order:
          1. kv_h = h // (H // KV)                          (GQA: consecutive heads share a KV head)
          2. q_h = copy_2d_from_cols(q, D, h*D)            [T, D]
             k_h = copy_2d_from_cols(k, D, kv_h*D)         [S, D]
             v_h = copy_2d_from_cols(v, D, kv_h*D)         [S, D]
          3. scores = matmul(q_h, transpose_2d(k_h))        [T, S], each score one dot product over D
                                                            in the backend's matmul order
          4. scores = scale(scores, attention_scale(D))    scale AFTER the matmul, float32 1/sqrt(D)
          5. if T > 1: scores = causal_mask(scores, S - T)
          6. attn = softmax_rows(scores)                    max, exp(x - max), sum, divide
          7. ctx = matmul(attn, v_h)                        [T, D], one dot product over S per value
          8. out = copy_2d_into_cols(out, ctx, h*D)
        An override may batch heads, skip copies and fuse steps, but every float it produces must be
        computed by the same operations on the same operands in the same summation order.
        """
        t = q.shape[0]
        s = k.shape[0]
        group = n_heads // n_kv_heads
        scale = attention_scale(head_dim)
        out = self.zeros(t, n_heads * head_dim)
        for h in range(n_heads):
            kv_h = h // group
            q_h = self.copy_2d_from_cols(q, head_dim, h * head_dim)
            k_h = self.copy_2d_from_cols(k, head_dim, kv_h * head_dim)
            v_h = self.copy_2d_from_cols(v, head_dim, kv_h * head_dim)
            scores = self.matmul(q_h, self.transpose_2d(k_h))
            scores = self.scale(scores, scale)
            if t > 1:
                scores = self.causal_mask(scores, s - t)
            attn = self.softmax_rows(scores)
            ctx = self.matmul(attn, v_h)
            out = self.copy_2d_into_cols(out, ctx, h * head_dim)
        return out


def use_per_head_attention(backend: Backend) -> Backend:
    """Make `backend.fused_attention` the protocol default (the per-head loop) on this instance."""
    backend.fused_attention = Backend.fused_attention.__get__(backend)
    return backend
