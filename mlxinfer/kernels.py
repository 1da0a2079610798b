"""Custom fused-attention kernels for the MLX backend: `mx.fast.metal_kernel` and its CUDA twin
`mx.fast.cuda_kernel`, built from the sources in `metal_kernels/`.

Both cover a decode step (one query row), the case that runs per generated token. A prefill chunk
(T > 1) goes to the protocol's per-head default: on the GPU its score and context products have more
than one row, so MLX sends them to cuBLASLt (CUDA) whose summation order is unpublished (and TF32 by
default), and no kernel of ours can promise the same bits.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

import mlx.core as mx

from .backend import attention_scale

SOURCES = {"metal": "fused_attention.metal", "cuda": "fused_attention_cuda.cu"}


def kernel_source(kind: str) -> tuple[str, str]:
    """(header, body) of a kernel source file, split at its //@@HEADER and //@@BODY markers."""
    text = resources.files("metal_kernels").joinpath(SOURCES[kind]).read_text(encoding="utf-8")
    _, rest = text.split("//@@HEADER\n", 1)
    header, body = rest.split("//@@BODY\n", 1)
    return header, body


@lru_cache(maxsize=None)
def _kernel(kind: str):
    header, body = kernel_source(kind)
    make = mx.fast.metal_kernel if kind == "metal" else mx.fast.cuda_kernel
    return make(name=f"mlxinfer_fused_attention_{kind}", input_names=["q", "k", "v", "scale", "seq"],
                output_names=["out", "attn"], source=body, header=header, ensure_row_contiguous=True)


def softmax_block_dim(s: int) -> int:
    """The thread-block size MLX's GPU softmax picks for a row of s values (4 values per thread)."""
    threads = (s + 3) // 4
    for bd in (32, 64, 128, 256, 512):
        if threads <= bd:
            return bd
    return 1024


def gemv_values_per_thread(k: int) -> int:
    """How many consecutive products MLX's gemv kernel gives each lane for a dot product of length k."""
    return 4 if k % 128 == 0 else 2 if k % 64 == 0 else 1


def fused_attention(kind: str, q, k, v, n_heads: int, n_kv_heads: int, head_dim: int):
    """Decode-step attention with the `kind` kernel; None for T > 1 (the caller runs the default)."""
    if q.shape[0] != 1:
        return None
    s = k.shape[0]
    bd = softmax_block_dim(s)
    out, _ = _kernel(kind)(
        inputs=[q, k, v, mx.array([attention_scale(head_dim)], dtype=mx.float32), mx.array([s], dtype=mx.int32)],
        template=[("H", n_heads), ("KV", n_kv_heads), ("D", head_dim), ("BLOCK_DIM", bd),
                  ("NPT_QK", gemv_values_per_thread(head_dim)), ("NPT_PV", gemv_values_per_thread(s))],
        grid=(n_heads * bd, 1, 1),
        threadgroup=(bd, 1, 1),
        output_shapes=[(1, n_heads * head_dim), (n_heads, s)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return out
