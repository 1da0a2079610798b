"""GPU products straight from a BlockWeight's fields (metal_kernels/blocks.cu, blocks.metal): for a few
rows of activations (decode), a kernel reads the file's blocks and dequantizes each value in registers,
exactly as gguf-py does, instead of the graph writing the whole float32 matrix out at every product
(`mlx_weights.BlockWeight.product`, which stays the path for prefill chunks, where the matrix is read
once for many rows, and on the CPU).

Types with a kernel: Q6_K (the output head and half of `attn_v`/`ffn_down` in the Q4_K_M and Q5_K_M
files users download). The summation order is published in blocks.cu's header and followed by
`emulate` (numpy), which the GPU tests compare with bit for bit; it is the same for every row count,
so a decode row's product does not depend on its batch.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

import numpy as np
from gguf import GGMLQuantizationType as Q

from .kernels import strip_comments

SOURCES = {"cuda": "blocks.cu", "metal": "blocks.metal"}
KERNELS = {Q.Q6_K: "q6_k_matvec"}
MAX_ROWS = 8  # rows of x a launch takes (each lane keeps one partial sum per row in registers)
WARPS = 8  # output rows per block of 256 threads


def applies(w, x) -> bool:
    """Whether the product x @ w.T goes to a block kernel: a kernel exists for w's type, x has at most
    MAX_ROWS rows, and w's rows are whole 256-value blocks."""
    return w.qtype in KERNELS and x.ndim == 2 and x.shape[0] <= MAX_ROWS and w.shape[1] % 256 == 0


def kernel_source(kind: str) -> tuple[str, dict[str, str]]:
    """(header, {kernel name: body}) of blocks.cu or blocks.metal, split at its //@@ markers."""
    text = resources.files("metal_kernels").joinpath(SOURCES[kind]).read_text(encoding="utf-8")
    _, rest = text.split("//@@HEADER\n", 1)
    header, *bodies = rest.split("//@@BODY ")
    if kind == "cuda":  # MLX hashes a CUDA kernel's whole source at every launch: keep it short
        header = strip_comments(header)
        return header, {b.split("\n", 1)[0].strip(): strip_comments(b.split("\n", 1)[1]) for b in bodies}
    return header, {b.split("\n", 1)[0].strip(): b.split("\n", 1)[1] for b in bodies}


INPUTS = {"q6_k_matvec": ["x", "ql", "qh", "scales", "d_bits", "dims"]}


@lru_cache(maxsize=None)
def _kernel(kind: str, name: str):
    import mlx.core as mx

    header, bodies = kernel_source(kind)
    make = mx.fast.metal_kernel if kind == "metal" else mx.fast.cuda_kernel
    return make(name=f"mlxinfer_{name}_{kind}", input_names=INPUTS[name], output_names=["out"],
                source=bodies[name], header=header, ensure_row_contiguous=True)


def product(kind: str, x, w):
    """x @ w.T [M, N] in x's dtype, by the block kernel of w's type on `kind` ("cuda" or "metal")."""
    import mlx.core as mx

    m, k = x.shape
    n = w.shape[0]
    ql, qh, scales, d = w.parts
    blocks = -(-n // WARPS)
    cols = min(blocks, 65535)
    (out,) = _kernel(kind, KERNELS[w.qtype])(
        inputs=[x, ql, qh, scales, mx.view(d, mx.uint16), mx.array([n, k], dtype=mx.int32)],
        template=[("T", x.dtype), ("M", m)], grid=(cols * 32 * WARPS, -(-blocks // cols), 1),
        threadgroup=(32 * WARPS, 1, 1), output_shapes=[(m, n)], output_dtypes=[x.dtype])
    return out


def q6_k_values(ql, qh, scales, d) -> np.ndarray:
    """float32 [rows, blocks, 256] of Q6_K fields (quants.split's arrays), in gguf-py's arithmetic:
    the values the kernel forms in registers."""
    i = np.arange(256)
    h, r = i // 128, i % 128
    low = (ql[..., 64 * h + r % 64] >> (4 * (r // 64))) & 0xF
    high = (qh[..., 32 * h + r % 32] >> (2 * (r // 32))) & 0x3
    q = (low | (high << 4)).astype(np.float32) - np.float32(32)
    dl = d.astype(np.float32)[..., None] * scales.astype(np.float32)[..., i // 16]
    return dl * q


def emulate(x: np.ndarray, w) -> np.ndarray:
    """The kernel's result computed in numpy in its published order (blocks.cu): float32 [M, N] for
    float32 x [M, K] and a Q6_K weight's host fields `w` = (ql, qh, scales, d). Lane l adds the values
    of work units u = l, l + 32, ... (unit u = 8b + 4h + c: block b, r = 8c + t + 32j in half h), in each
    j = 0..3 then t = 0..7; then the butterfly 16, 8, 4, 2, 1."""
    ql, qh, scales, d = (np.asarray(p) for p in w)
    vals = q6_k_values(ql, qh, scales, d).reshape(d.shape[0], -1)  # [N, K]
    n, k = vals.shape
    units = k // 32
    acc = np.zeros((x.shape[0], n, 32), dtype=np.float32)
    for first in range(0, units, 32):
        u = first + np.arange(32)
        live = u < units  # lanes past the last unit add nothing
        u = np.minimum(u, units - 1)
        b, h, c = u >> 3, (u >> 2) & 1, u & 3
        for j in range(4):
            for t in range(8):
                col = b * 256 + 128 * h + 8 * c + 32 * j + t  # [32], one per lane
                prod = (x[:, col][:, None, :] * vals[:, col][None, :, :]).astype(np.float32)
                acc = np.where(live, acc + prod, acc).astype(np.float32)
    lanes = np.arange(32)
    for off in (16, 8, 4, 2, 1):
        acc = acc + acc[..., lanes ^ off]
    return acc[..., 0]
