"""MLX backend: every primitive is an MLX graph builder (lazy `mx.array`s); the graph of a forward
pass is evaluated once, at the token boundary (`argmax_with_prob`, `to_numpy`, `sync`).

Runs where MLX runs: Metal on a Mac, CUDA where MLX's CUDA build is installed, the CPU otherwise.

Weights: Q8_0, Q4_0 and Q4_1 stay quantized, repacked exactly into MLX's affine group-32 format
(scale = d, bias = -128·d, -8·d or m; quants re-ordered into MLX's little-endian bit packing), with
scales and biases in float32 (on the CPU, float16 scales are ~35x slower). Every other type (K-quants,
F16, BF16, ...) is dequantized with `gguf`'s code to float32 (`mx.load` mis-decodes Q4_K, so we never
use it), stored [in, out] so the matmul reads it without a transpose.

Fused attention: chosen by platform (overridable with `kernel=`):
  - "graph": all heads in one batched MLX graph (the CPU's override),
  - "metal": `mx.fast.metal_kernel` from metal_kernels/fused_attention.metal,
  - "cuda":  `mx.fast.cuda_kernel` from metal_kernels/fused_attention_cuda.cu.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# MLX's CUDA backend runs float32 cuBLAS matmuls in TF32 unless told otherwise: ~3e-3 error on logits,
# outside our 1e-3 agreement with the CPU reference. Read once by MLX at its first matmul; a user who
# wants TF32 sets MLX_ENABLE_TF32=1 before importing mlxinfer.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

from ..backend import Backend, attention_scale  # noqa: E402
from ..errors import RequestError  # noqa: E402

GROUP = 32


@dataclass
class QuantizedWeight:
    """An [out, in] matrix in MLX's affine quantized layout; `matmul` reads it as [in, out]."""

    w: mx.array  # uint32 [out, in*bits/32]
    scales: mx.array  # float32 [out, in/32]
    biases: mx.array
    bits: int
    shape: tuple[int, int]  # (out, in)

    def rows(self, ids) -> mx.array:
        return mx.dequantize(self.w[ids], self.scales[ids], self.biases[ids], group_size=GROUP, bits=self.bits)


def repack_q8_0(raw: np.ndarray, rows: int, cols: int):
    """GGUF Q8_0 blocks (f16 d, 32 x int8 q; x = d*q) -> MLX 8-bit affine: q+128, scale d, bias -128 d.
    Exact: d*(q+128) - 128*d == d*q in float32 (an 11-bit scale times an 8-bit integer)."""
    b = raw.reshape(rows, cols // 32, 34)
    d = b[..., :2].copy().view(np.float16).astype(np.float32)  # [rows, nb, 1]
    q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [rows, nb, 32]
    w = np.ascontiguousarray(q.reshape(rows, cols)).view(np.uint32)
    return w, d[..., 0], -128.0 * d[..., 0]


def _pack_nibbles(q: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """[rows, cols] values 0..15 -> MLX 4-bit packing (element i at bits 4*(i%8) of word i//8)."""
    q = q.reshape(rows, cols)
    return np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)).view(np.uint32)


def _q4_quants(qs: np.ndarray) -> np.ndarray:
    """GGUF 4-bit block order: element j < 16 is the low nibble of byte j, element 16+j the high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def repack_q4_0(raw: np.ndarray, rows: int, cols: int):
    """Q4_0 (f16 d, 16 bytes; x = d*(q-8)) -> scale d, bias -8 d."""
    b = raw.reshape(rows, cols // 32, 18)
    d = b[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
    return _pack_nibbles(_q4_quants(b[..., 2:]), rows, cols), d, -8.0 * d


def repack_q4_1(raw: np.ndarray, rows: int, cols: int):
    """Q4_1 (f16 d, f16 m, 16 bytes; x = d*q + m) -> scale d, bias m."""
    b = raw.reshape(rows, cols // 32, 20)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
    m = b[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
    return _pack_nibbles(_q4_quants(b[..., 4:]), rows, cols), d, m


REPACK = {Q.Q8_0: (repack_q8_0, 8), Q.Q4_0: (repack_q4_0, 4), Q.Q4_1: (repack_q4_1, 4)}


def gpu_kind() -> str | None:
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return None


class MLXBackend(Backend):
    name = "mlx"

    def __init__(self, device: str | None = None, kernel: str | None = None):
        gpu = gpu_kind()
        if device is None:
            device = "gpu" if gpu else "cpu"
        if device == "gpu" and gpu is None:
            raise RequestError("--device gpu: MLX has no GPU here (neither Metal nor CUDA is available)")
        if device not in ("cpu", "gpu"):
            raise RequestError(f"unknown device {device!r} (choose cpu or gpu)")
        self.device = device
        self.mx_device = mx.gpu if device == "gpu" else mx.cpu
        self.activate()
        if kernel is None:
            kernel = gpu if device == "gpu" else "graph"
        if kernel not in ("graph", "metal", "cuda"):
            raise RequestError(f"unknown fused attention kernel {kernel!r} (graph, metal or cuda)")
        if kernel in ("metal", "cuda") and (device != "gpu" or gpu != kernel):
            raise RequestError(f"the {kernel} attention kernel needs an MLX {kernel} GPU device")
        self.kernel = kernel
        self._cache: dict[str, object] = {}

    def activate(self):
        """Make this backend's device MLX's default. Called where graphs start (inputs, embedding
        lookups), so that two MLX backends on different devices can live in one process."""
        if mx.default_device() != self.mx_device:
            mx.set_default_device(self.mx_device)

    # -- data in and out ----------------------------------------------------------------------
    def from_numpy(self, a):
        self.activate()
        return mx.array(np.asarray(a, dtype=np.float32))

    def to_numpy(self, x):
        return np.array(x, dtype=np.float32, copy=True)

    def sync(self, *xs):
        mx.eval(*xs)

    def _matrix(self, g, name, transposed: bool):
        """A 2-D weight: QuantizedWeight (exact repack; one copy serves both the embedding and a tied
        output head), or a float32 array, [out, in] for row gathers or [in, out] (`transposed`) for
        matmuls, since `x @ W` is ~2.5x faster than `x @ W.T` on MLX's CPU. Cached per layout."""
        t = g.tensor(name)
        if len(t.shape) != 2:
            raise ValueError(f"{g.path}: tensor {name!r} should be a matrix, found shape {list(t.shape)}")
        quantized = t.ggml_type in REPACK
        key = (name, transposed and not quantized)
        if key not in self._cache:
            rows, cols = t.shape
            if quantized:
                repack, bits = REPACK[t.ggml_type]
                w, s, b = repack(g.raw(name), rows, cols)
                out = QuantizedWeight(mx.array(w), mx.array(s), mx.array(b), bits, (rows, cols))
            else:
                m = g.dequantize(name)
                out = mx.array(np.ascontiguousarray(m.T if transposed else m, dtype=np.float32))
            mx.eval(out.w if quantized else out)
            self._cache[key] = out
        return self._cache[key]

    def load_weight(self, g, name):
        return self._matrix(g, name, transposed=True)

    def load_embedding(self, g, name):
        return self._matrix(g, name, transposed=False)

    def load_vector(self, g, name):
        return mx.array(np.ascontiguousarray(g.dequantize(name), dtype=np.float32).reshape(1, -1))

    # -- primitives ---------------------------------------------------------------------------
    def matmul(self, a, b):
        if isinstance(b, QuantizedWeight):
            return mx.quantized_matmul(a, b.w, b.scales, b.biases, transpose=True, group_size=GROUP, bits=b.bits)
        if self.device == "gpu" and a.shape[0] == 1 and b.ndim == 2:
            # A one-row product with B in transposed storage is what MLX's GPU matmul sends to its own
            # gemv kernel (a documented order a custom kernel can follow); a row-major B would go to
            # cuBLASLt on CUDA, whose order is unpublished and TF32 by default.
            return mx.matmul(a, mx.contiguous(b.T).T)
        return mx.matmul(a, b)

    def transpose_2d(self, x):
        return mx.transpose(x)

    def softmax_rows(self, x):
        return mx.softmax(x, axis=-1, precise=True)

    def sum_squares_rows(self, x):
        return mx.sum(x * x, axis=1, keepdims=True)

    def add_scalar(self, x, s):
        return x + s

    def rsqrt(self, x):
        return mx.rsqrt(x)

    def mul_rows(self, x, col):
        return x * col

    def hadamard(self, a, b):
        return a * b

    def add(self, a, b):
        return a + b

    def scale(self, x, s):
        return x * s

    def silu(self, x):
        return x * mx.sigmoid(x)

    def rope(self, x, n_heads, head_dim, offset, base, traditional):
        t = x.shape[0]
        xh = mx.transpose(mx.reshape(x, (t, n_heads, head_dim)), (1, 0, 2))  # [H, T, D]
        y = mx.fast.rope(xh, head_dim, traditional=traditional, base=base, scale=1.0, offset=offset)
        return mx.reshape(mx.transpose(y, (1, 0, 2)), (t, n_heads * head_dim))

    def reshape(self, x, rows, cols):
        return mx.reshape(x, (rows, cols))

    def copy_2d_from_cols(self, x, width, col):
        return mx.contiguous(x[:, col : col + width])

    def copy_2d_into_cols(self, dst, src, col):
        dst[:, col : col + src.shape[1]] = src
        return dst

    def zeros(self, rows, cols):
        return mx.zeros((rows, cols), dtype=mx.float32)

    def concat_dim0(self, a, b):
        return mx.concatenate([a, b], axis=0)

    def slice_rows(self, x, start, stop):
        return x[start:stop]

    def gather_rows(self, table, ids):
        self.activate()
        idx = ids if isinstance(ids, mx.array) else mx.array(np.asarray(ids, dtype=np.int32))
        if isinstance(table, QuantizedWeight):
            return table.rows(idx)
        return table[idx]

    def causal_mask(self, scores, offset):
        t, s = scores.shape[-2:]
        future = mx.arange(s)[None, :] > (mx.arange(t)[:, None] + offset)
        return mx.where(future, mx.array(-np.inf, dtype=mx.float32), scores)

    def argmax_with_prob(self, logits_row):
        row = mx.reshape(logits_row, (-1,))
        i = mx.argmax(row)
        p = mx.exp(row[i] - mx.logsumexp(row))
        mx.eval(i, p)
        return int(i.item()), float(p.item())

    # -- pipelined greedy decoding (not protocol ops: the engine's fast path) ------------------
    def async_argmax(self, logits):
        """The greedy token of the last row as a lazy [1] int32 array, its evaluation started."""
        token = mx.reshape(mx.argmax(logits[-1]), (1,)).astype(mx.int32)
        mx.async_eval(token)
        return token

    def token_value(self, token) -> int:
        return int(token.item())

    # -- fused attention ----------------------------------------------------------------------
    def fused_attention(self, q, k, v, n_heads, n_kv_heads, head_dim):
        if self.kernel == "graph":
            return self._graph_attention(q, k, v, n_heads, n_kv_heads, head_dim)
        from .. import kernels

        out = kernels.fused_attention(self.kernel, q, k, v, n_heads, n_kv_heads, head_dim)
        if out is None:  # prefill chunk: the kernels cover decode steps only (see mlxinfer/kernels.py)
            return Backend.fused_attention(self, q, k, v, n_heads, n_kv_heads, head_dim)
        return out

    def _graph_attention(self, q, k, v, n_heads, n_kv_heads, head_dim):
        """All heads in one batched graph, byte-identical to the per-head default on the same device.

        CPU: each head's product is the same BLAS call the default makes (MLX's CPU matmul loops one
        call per batch element) on the same contiguous [S, D] blocks; scale after the matmul, the same
        mask and softmax. GPU: decode steps only, with K and V in the transposed storage that sends
        every head's one-row products to MLX's gemv kernel, as `matmul` does for the default; prefill
        chunks run the default (their multi-row products go to cuBLASLt)."""
        t, s = q.shape[0], k.shape[0]
        if self.device == "gpu" and t != 1:
            return Backend.fused_attention(self, q, k, v, n_heads, n_kv_heads, head_dim)
        kv, d, group = n_kv_heads, head_dim, n_heads // n_kv_heads
        qh = mx.contiguous(mx.transpose(mx.reshape(q, (t, kv, group, d)), (1, 2, 0, 3)))  # [KV, G, T, D]
        kh = mx.contiguous(mx.transpose(mx.reshape(k, (s, kv, d)), (1, 0, 2)))[:, None]  # [KV, 1, S, D]
        if self.device == "gpu":
            # Each query head gets its own K and V block (no stride-0 broadcast, which MLX's CUDA matmul
            # would fold into a multi-row cuBLASLt product) and V in transposed storage (gemv order).
            kh = mx.contiguous(mx.broadcast_to(kh, (kv, group, s, d)))
            vt = mx.transpose(mx.reshape(v, (s, kv, d)), (1, 2, 0))[:, None]  # [KV, 1, D, S]
            vh = mx.swapaxes(mx.contiguous(mx.broadcast_to(vt, (kv, group, d, s))), -1, -2)
        else:
            vh = mx.contiguous(mx.transpose(mx.reshape(v, (s, kv, d)), (1, 0, 2)))[:, None]
        scores = mx.matmul(qh, mx.swapaxes(kh, -1, -2)) * attention_scale(d)
        if t > 1:
            scores = self.causal_mask(scores, s - t)
        attn = self.softmax_rows(scores)
        ctx = mx.matmul(attn, vh)  # [KV, G, T, D]
        return mx.reshape(mx.transpose(ctx, (2, 0, 1, 3)), (t, n_heads * d))
