"""The MLX backend's KV cache rows in their stored types (`--kv-dtype`).

float32, bfloat16 and float16 stores hold the keys and values as they are (cast on write). q8_0 holds
each row of width W (KV heads x head_dim, a multiple of 32) as llama.cpp's block_q8_0 does: per
block of 32 values d = max|x| / 127 and q = round(x / d) as int8 (0 where the block is all zero),
with d kept as float16. One int8 array of rows [..., W + 2 * W/32] holds both, the W values first and
then the W/32 scales' bytes, so that every cache operation that moves rows (scatter, gather, resize,
fork) moves a row's values with its scales. 34 bytes per 32 values, as llama.cpp's `-ctk q8_0`.

Reading dequantizes: float32 d * q, exact (11 bits of d times 8 of q fit float32's 24), so every path
that reads a q8_0 cache (the per-head reference, the graph override, and on a GPU the attention kernels,
which form d * q from the packed rows in registers: `mlxi_kv` in metal_kernels/) reads the same float32
values.
Quantizing what was read gives the same row again (d' = 127 d / 127 = d, q' = q), so rows copied
through float32 (a forked block, the disk prompt cache) keep their bits.
"""

from __future__ import annotations

import mlx.core as mx

Q8_BLOCK = 32
Q8_BYTES_PER_VALUE = (Q8_BLOCK + 2) / Q8_BLOCK  # 32 int8 values and one float16 scale


def value_bytes(kv_dtype: str) -> float:
    """Bytes a stored key or value takes (q8_0: its share of the block's scale included)."""
    return {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}.get(kv_dtype, Q8_BYTES_PER_VALUE)


def packed_width(width: int) -> int:
    """The int8 row width of a q8_0 store of `width` values."""
    return width + 2 * (width // Q8_BLOCK)


def unpacked_width(packed: int) -> int:
    return packed * Q8_BLOCK // (Q8_BLOCK + 2)


def quantize_q8_0(x) -> mx.array:
    """Rows x [N, W] (any float dtype) -> packed int8 rows [N, packed_width(W)]."""
    n, w = x.shape
    xb = mx.reshape(x.astype(mx.float32), (n, w // Q8_BLOCK, Q8_BLOCK))
    d = mx.max(mx.abs(xb), axis=-1, keepdims=True) / 127.0
    inv = mx.where(d > 0, 1.0 / mx.where(d > 0, d, 1.0), 0.0)  # llama.cpp: id = d ? 1/d : 0
    q = mx.round(xb * inv).astype(mx.int8)
    scales = mx.view(d.astype(mx.float16), mx.int8)  # [N, W/32, 2]: each scale's two bytes
    return mx.concatenate([mx.reshape(q, (n, w)), mx.reshape(scales, (n, -1))], axis=1)


def dequantize_q8_0(p) -> mx.array:
    """Packed rows p [..., packed_width(W)] -> float32 [..., W]: d * q, exact."""
    lead, w = p.shape[:-1], unpacked_width(p.shape[-1])
    q = mx.reshape(p[..., :w].astype(mx.float32), (*lead, w // Q8_BLOCK, Q8_BLOCK))
    d = mx.view(mx.contiguous(p[..., w:]), mx.float16).astype(mx.float32)  # [..., W/32]
    return mx.reshape(q * d[..., None], (*lead, w))
