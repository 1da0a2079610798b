"""GGUF weight blocks on the host: each type's fields cut out of its blocks (the file's bytes, per row),
exact repacks into MLX's affine group-32 layout where a type maps onto it, and random blocks of any
type (tests, synthetic files). numpy only: the MLX side (`backends/mlx_weights.py`) turns these arrays
into weights and dequantizes at each use.

How each type is kept (`storage`):
  - affine: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K. Every 32 values share one scale and one bias, so
    MLX's `quantized_matmul` (group 32, bits 4, 5 or 8) reads them: the quants repacked into MLX's bit
    order, the scales kept as the file has them (fp16 d, d and m, or for Q4_K/Q5_K fp16 d and dmin per
    256 values with 6-bit sub-scales unpacked to a byte) and turned into float32 scales and biases in
    the graph at each use: the file's bytes (Q4_K 1.028x, Q5_K 1.023x: their 6-bit sub-scales and
    mins kept a byte each, 16 bytes a block for 12).
  - blocks: Q6_K, Q3_K, Q2_K (sub-blocks of 16 values; MLX's smallest group is 32) and IQ4_NL, IQ4_XS
    (a 16-entry codebook, not affine): the file's fields as they are, dequantized in the graph.
  - half: F16 and BF16, 16 bits in memory, cast to float32 at use. F32 stays float32.

Why the float arithmetic is exact, so MLX's values equal gguf-py's bit for bit: every product either
side forms is of an fp16 number (11 significant bits) and small integers, and fits float32's 24-bit
significand, so it is exact in any order (fma or not):
  Q8_0 d·q: 11 + 7 bits (|q| <= 128 = 2^7);  Q4_0/Q5_0 d·(q - 8 | 16): 11 + 4 bits; the repack's
  d·q' + (-8d | -16d | -128d) is the exact d·(q - offset), which float32 holds, so its one rounding is
  none;  Q4_1/Q5_1 d·q + m: d·q exact (11 + 5), then the same one addition on both sides;
  Q4_K/Q5_K (d·sc)·q - dmin·m: d·sc 11 + 6 bits, ·q 4 or 5 more (<= 22), dmin·m 17: both exact, then
  one subtraction on both sides (MLX adds the negated bias: x - y is x + (-y));
  Q6_K (d·sc)·(q - 32): 11 + 7 + 5 = 23 bits (|sc| <= 128, |q - 32| <= 32, both powers of two at the
  extremes);  Q3_K (d·(sc - 32))·q: 11 + 5 + 2;  Q2_K (d·sc)·q - dmin·m: 11 + 4 + 2 and 11 + 4, one
  subtraction;  IQ4_NL d·k: 11 + 7 (|k| <= 127);  IQ4_XS (d·(ls - 32))·k: 11 + 5 + 7 = 23;
  F16 and BF16 to float32: exact widenings. No product leaves float32's normal range (|fp16| < 2^16,
  its subnormals >= 2^-24, times integers below 2^13), so no product is rounded or flushed.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

GROUP = 32  # MLX's affine group: each 32 consecutive values of a row share a scale and a bias
AFFINE_BITS = {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q4_K: 4, Q.Q5_K: 5}
BLOCK_TYPES = (Q.Q6_K, Q.Q3_K, Q.Q2_K, Q.IQ4_NL, Q.IQ4_XS)
HALF_TYPES = (Q.F16, Q.BF16)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)

# Each type's block: (field, first byte, end byte, dtype), llama.cpp's `block_*` structs in order.
# fp16 fields are the scales (`random_blocks` sets them); the rest are quants and sub-scales.
FIELDS = {
    Q.Q8_0: [("d", 0, 2, np.float16), ("qs", 2, 34, np.uint8)],
    Q.Q4_0: [("d", 0, 2, np.float16), ("qs", 2, 18, np.uint8)],
    Q.Q4_1: [("d", 0, 2, np.float16), ("m", 2, 4, np.float16), ("qs", 4, 20, np.uint8)],
    Q.Q5_0: [("d", 0, 2, np.float16), ("qh", 2, 6, np.uint8), ("qs", 6, 22, np.uint8)],
    Q.Q5_1: [("d", 0, 2, np.float16), ("m", 2, 4, np.float16), ("qh", 4, 8, np.uint8), ("qs", 8, 24, np.uint8)],
    Q.Q4_K: [("d", 0, 2, np.float16), ("dmin", 2, 4, np.float16), ("scales", 4, 16, np.uint8),
             ("qs", 16, 144, np.uint8)],
    Q.Q5_K: [("d", 0, 2, np.float16), ("dmin", 2, 4, np.float16), ("scales", 4, 16, np.uint8),
             ("qh", 16, 48, np.uint8), ("qs", 48, 176, np.uint8)],
    Q.Q6_K: [("ql", 0, 128, np.uint8), ("qh", 128, 192, np.uint8), ("scales", 192, 208, np.int8),
             ("d", 208, 210, np.float16)],
    Q.Q3_K: [("hmask", 0, 32, np.uint8), ("qs", 32, 96, np.uint8), ("scales", 96, 108, np.uint8),
             ("d", 108, 110, np.float16)],
    Q.Q2_K: [("scales", 0, 16, np.uint8), ("qs", 16, 80, np.uint8), ("d", 80, 82, np.float16),
             ("dmin", 82, 84, np.float16)],
    Q.IQ4_NL: [("d", 0, 2, np.float16), ("qs", 2, 18, np.uint8)],
    Q.IQ4_XS: [("d", 0, 2, np.float16), ("scales_h", 2, 4, np.uint16), ("scales_l", 4, 8, np.uint8),
               ("qs", 8, 136, np.uint8)],
}


def storage(qtype) -> str:
    """How the MLX backend keeps a weight matrix of this type (`mlxinfer inspect` prints it)."""
    if qtype in AFFINE_BITS:
        return f"MLX affine {AFFINE_BITS[qtype]}-bit, group 32"
    if qtype in BLOCK_TYPES:
        return "file blocks, dequantized at use"
    if qtype in HALF_TYPES:
        return "16-bit, cast to float32 at use"
    return "float32"


def memory_bytes(qtype, shape) -> int:
    """The bytes a tensor of this type and shape takes on the MLX backend (`split`; vectors, the norms,
    are float32; an [experts, out, in] stack is experts * out rows)."""
    if len(shape) == 1 or qtype == Q.F32:
        return int(np.prod(shape)) * 4
    rows, cols = int(np.prod(shape[:-1])), int(shape[-1])
    if qtype in HALF_TYPES:
        return rows * cols * 2
    block, size = GGML_QUANT_SIZES[qtype]
    extra = 4 if qtype in (Q.Q4_K, Q.Q5_K) else 0  # 12 bytes of packed sub-scales become 16
    return rows * (cols // block) * (size + extra)


def fields(raw: np.ndarray, qtype, rows: int, cols: int) -> dict:
    """The blocks' fields, each [rows, blocks per row, field length] (fp16/uint16 fields [rows, blocks]):
    fresh contiguous arrays, together exactly the file's bytes."""
    block, size = GGML_QUANT_SIZES[qtype]
    b = np.asarray(raw).reshape(rows, cols // block, size)
    out = {}
    for name, start, end, dtype in FIELDS[qtype]:
        a = np.ascontiguousarray(b[..., start:end]).view(dtype)
        out[name] = a[..., 0] if a.shape[-1] == 1 else a
    return out


def nonfinite(raw: np.ndarray, qtype) -> np.ndarray:
    """Which blocks of a tensor's rows `raw` (uint8 [rows, row bytes] of `qtype`) have an inf or NaN
    scale (any fp16 field: d, dmin, m), or for F32, F16 and BF16 which values are inf or NaN: bool
    [rows, blocks or values]. An inf or NaN is an exponent of all ones (fp16's 5 bits, bfloat16's 8).
    No weight can be made of such a block (every value of it, and every logit it reaches, would be inf
    or NaN), and the exactness argument above holds for finite scales only; a finite scale's values are
    finite (|fp16| < 2^16 times integers below 2^13)."""
    raw = np.asarray(raw)
    if qtype == Q.F32:
        return ~np.isfinite(raw.view(np.float32))
    if qtype in HALF_TYPES:
        ones = 0x7C00 if qtype == Q.F16 else 0x7F80
        return (raw.view(np.uint16) & ones) == ones
    b = raw.reshape(len(raw), -1, GGML_QUANT_SIZES[qtype][1])
    bad = np.zeros(b.shape[:2], bool)
    for _, start, _, dtype in FIELDS[qtype]:
        if dtype == np.float16:
            bad |= (np.ascontiguousarray(b[..., start:start + 2]).view(np.uint16)[..., 0] & 0x7C00) == 0x7C00
    return bad


def split(raw: np.ndarray, qtype, rows: int, cols: int) -> tuple:
    """The host arrays of a [rows, cols] matrix as the MLX backend keeps it (see the module's doc), each
    with `rows` as its first axis (so row slices and stacked matrices are slices and concatenations):
    affine: (packed quants uint32 [rows, cols*bits/32], *scale parts); blocks: the fields in FIELDS'
    order; half: (the [rows, cols] values, F16 as float16, BF16 as its uint16 bits)."""
    if qtype == Q.F16:
        return (np.asarray(raw).view(np.float16).reshape(rows, cols),)
    if qtype == Q.BF16:
        return (np.asarray(raw).view(np.uint16).reshape(rows, cols),)
    if qtype in BLOCK_TYPES:
        return tuple(fields(raw, qtype, rows, cols).values())
    q, parts = affine_codes(raw, qtype, rows, cols)
    return (pack_bits(q, AFFINE_BITS[qtype]), *parts)


def affine_codes(raw: np.ndarray, qtype, rows: int, cols: int) -> tuple:
    """An affine type's codes, uint8 [rows, cols] (before MLX's packing), and its scale parts as `split`
    keeps them."""
    q, parts = _AFFINE[qtype](fields(raw, qtype, rows, cols))
    return q.reshape(rows, cols), parts


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL order: element j < 16 is the low nibble of byte j, 16 + j the high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit j of the little-endian 32-bit qh is element j's fifth bit, as 0 or 16."""
    word = np.ascontiguousarray(qh).view("<u4")  # [..., 1]
    return (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins (llama.cpp's get_scale_min_k4):
    sub-blocks 0-3 take the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 take byte 8-11's
    nibbles as their low 4 bits and the top 2 bits of bytes 0-3 / 4-7 as their high ones."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_quants_4(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K low 4 bits: 4 chunks of 32 bytes, sub-block 2c the low nibbles of chunk c, 2c + 1 the high."""
    c = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([c & 0x0F, c >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _affine_q8_0(f):
    return f["qs"] ^ np.uint8(0x80), (f["d"],)  # int8 q as q + 128: the sign bit flipped; bias -128 d


def _affine_q4_0(f):
    return _nibbles(f["qs"]), (f["d"],)  # bias -8 d


def _affine_q4_1(f):
    return _nibbles(f["qs"]), (f["d"], f["m"])  # bias m


def _affine_q5_0(f):
    return _nibbles(f["qs"]) | _high_bits(f["qh"]), (f["d"],)  # bias -16 d


def _affine_q5_1(f):
    return _nibbles(f["qs"]) | _high_bits(f["qh"]), (f["d"], f["m"])


def _k_parts(f):
    """(d and dmin, fp16 [rows, blocks, 2]; sub-scales and mins, uint8 [rows, blocks, 2, 8])."""
    sc, mn = k_scales(f["scales"])
    return np.stack([f["d"], f["dmin"]], axis=-1), np.stack([sc, mn], axis=-2)


def _affine_q4_k(f):
    return _k_quants_4(f["qs"]), _k_parts(f)  # scale d·sc, bias -dmin·m per 32 values


def _affine_q5_k(f):
    """Fifth bits: bit j of qh[i] belongs to element i of sub-block j."""
    qh = f["qh"][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]  # [rows, blocks, 8, 32]
    high = ((qh & 1) << 4).reshape(*f["qh"].shape[:-1], 256)
    return _k_quants_4(f["qs"]) | high, _k_parts(f)


_AFFINE = {Q.Q8_0: _affine_q8_0, Q.Q4_0: _affine_q4_0, Q.Q4_1: _affine_q4_1, Q.Q5_0: _affine_q5_0,
           Q.Q5_1: _affine_q5_1, Q.Q4_K: _affine_q4_k, Q.Q5_K: _affine_q5_k}


def pack_bits(q: np.ndarray, bits: int, chunk_rows: int = 4096) -> np.ndarray:
    """[rows, cols] codes below 2**bits -> MLX's packing: each row one little-endian bit stream, element i
    at bits [bits*i, bits*(i+1)), read as uint32 words [rows, cols*bits/32]. Rows in chunks, so the
    5-bit path's uint64 scratch stays small for an embedding of 150k rows."""
    rows, cols = q.shape
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8).view(np.uint32)
    out = np.empty((rows, cols * bits // 8), np.uint8)
    per = 8  # codes per packed unit (other than 4 and 8 bits): 8 codes of `bits` bits are `bits` bytes
    for r0 in range(0, rows, chunk_rows):
        part = q[r0:r0 + chunk_rows]
        if bits == 4:
            out[r0:r0 + chunk_rows] = part[:, 0::2] | (part[:, 1::2] << 4)
            continue
        units = part.reshape(len(part), cols // per, per).astype(np.uint64)
        word = np.bitwise_or.reduce(units << (np.arange(per, dtype=np.uint64) * np.uint64(bits)), axis=-1)
        out[r0:r0 + chunk_rows] = word[..., None].view(np.uint8)[..., :bits].reshape(len(part), -1)
    return out.view(np.uint32)


# Edge scales for `random_blocks(edges=True)`: zeros of both signs, fp16 subnormals (smallest, largest),
# the smallest normal, negatives, one, and a large finite value (no inf or NaN: the loaders refuse a
# block with one, `nonfinite`).
EDGE_SCALES = np.array([0.0, -0.0, 2.0 ** -24, -(2.0 ** -24), 1023 * 2.0 ** -24, 2.0 ** -14, -1.0, 1.0,
                        65504.0, -65504.0, 0.5, 3.0e-3, -7.5e-4], np.float16)


def random_blocks(rng, qtype, rows: int, cols: int, std: float = 1.0, edges: bool = False) -> np.ndarray:
    """Random raw blocks of any type, uint8 [rows, row bytes] (GGUFWriter's raw_dtype form): uniform
    bytes (every code and sub-scale), fp16 scales set so the values have about `std` (every value is
    linear in the fp16 scales: a probe with scale 1, then rescaled). With `edges`, some blocks are all
    0x00 or all 0xFF bytes (zero and maximal codes and sub-scales) and the fp16 scales cycle through
    EDGE_SCALES: for exactness tests, not for models. F16/BF16: random values (edges: EDGE_SCALES mixed in)."""
    if qtype in HALF_TYPES:
        v = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        if edges:
            v.reshape(-1)[::3] = np.resize(EDGE_SCALES.astype(np.float32), v.reshape(-1)[::3].shape)
        if qtype == Q.F16:
            return v.astype(np.float16).view(np.uint8).reshape(rows, -1)
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)  # truncated: fine
    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    halves = [(s, e) for _, s, e, dt in FIELDS[qtype] if dt == np.float16]
    if edges:
        flat = b.reshape(-1, size)
        flat[0::7], flat[1::7] = 0x00, 0xFF
        for k, (s, _) in enumerate(halves):
            vals = np.resize(np.roll(EDGE_SCALES, 3 * k), len(flat))
            flat[:, s:s + 2] = vals.view(np.uint8).reshape(-1, 2)
        return b.reshape(rows, -1)
    for s, _ in halves:
        b[..., s:s + 2] = np.ones(1, np.float16).view(np.uint8)
    probe = dequantize(b.reshape(rows, -1)[: min(rows, 64)], qtype)
    scale = np.float16(std / max(float(np.std(probe)), 1e-30))
    for s, _ in halves:
        b[..., s:s + 2] = np.full(b.shape[:-1], scale, np.float16).view(np.uint8).reshape(*b.shape[:-1], 2)
    return b.reshape(rows, -1)
