"""GPU products straight from a weight's compact fields (metal_kernels/blocks.cu, blocks.metal): for a few
rows of activations (decode), a kernel reads the weight's fields in registers (each value exactly as
gguf-py dequantizes it, or, for the types added by runs, RUNS, each run's codes, scale and bias, which make
those values exactly), instead of the graph writing a float32 matrix (or float32 scales) out at every
product (`mlx_weights`' products, which stay the path for prefill chunks, where the matrix is read once
for many rows, and on the CPU).

Types with a kernel (one frame, blocks.cu's `mlxi_block_matvec`, and a reader of each type's fields):
Q6_K (the output head and half of `attn_v`/`ffn_down` in the Q4_K_M and Q5_K_M files users download),
IQ4_NL, IQ4_XS, Q3_K, Q2_K, F16 and BF16, and the affine types Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, Q4_K, Q5_K
in the compact form the backend keeps (MLX's packed codes, the file's fp16 scales and 6-bit sub-scales),
so that a GPU need not form float32 scales at load (1.17-1.33x the file's bytes) to decode fast. The
summation order is published in blocks.cu's header (value by value, or by runs of one scale: RUNS) and
followed by `emulate` (numpy, of `terms`), which the GPU tests compare with bit for bit; it is the same
for every row count, so a decode row's product does not depend on its batch.

Two forms of every kernel take the launches around a decode product into it (issue 30: decode is bound
by the host's launches): ADD, the residual plus the product (`product(..., residual=)`, the bits of the
graph's Add after it: `with_residual`), and NORM, the product of x's rows RMS-normed (`product(...,
norm=)`), each normed value the bits this module's `rms_norm` kernel writes (`emulate_rms_norm`), which
the MLX backend runs as its RMSNorm wherever the block kernels run. A pre-norm layer's two norms and two
residual adds then cost no launch of their own. A third, SWIGLU (`product(..., swiglu=True)`), multiplies
silu(gate) * up of x = [gate | up] (an FFN's merged product), each value the bits of this module's
`swiglu` kernel (`emulate_swiglu`), which the backend runs for SwiGLU wherever the block kernels run: the
FFN's activation costs no launch of its own either.

A weight group whose matrices are two runs of different types (a Q4_K_M file's Q and K in Q4_K, its V in
Q6_K, in half its layers) is one launch too (`pair_product`, blocks.cu's mlxi_pair_matvec): the first
run's blocks read its fields, the rest the Q6_K run's, each column the bits of its own product.

A prompt's products (more rows than MAX_ROWS) read the weight once for many rows, through MLX's products,
which take formed scales (mx.quantized_matmul) or values (a matmul): two kernels here form them from the
same fields in one launch each, in the shape the product takes (`formed_scales`: the K-quants' and
Q4_1/Q5_1 scales and biases; `formed_values`: Q6_K's values; see FORMED), the bits of the graph's own.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from . import cuda_jit, quants
from .kernels import f32_bits, kernel_args, launch_grid, pruned, published_dot, source_parts, strip_comments
from .quants import AFFINE_BITS

SOURCES = {"cuda": "blocks.cu", "metal": "blocks.metal"}
# type -> (kernel, template constants besides T and M): the block type read from its own fields, and the
# affine types from the compact form the MLX backend keeps (MLX's packed codes, the file's scale fields).
# Template integers are never negative: MLX CUDA names a kernel by its template arguments, and a '-' in
# that name fails its compile (the Q8_0 zero point is ZERO = 128, bias = -(d * 128), not OFFSET = -128).
KERNELS = {
    Q.Q6_K: ("q6_k_matvec", ()),
    Q.Q8_0: ("affine_matvec", (("BITS", 8), ("SCALES", 0), ("ZERO", 128))),
    Q.Q4_0: ("affine_matvec", (("BITS", 4), ("SCALES", 0), ("ZERO", 8))),
    Q.Q5_0: ("affine_matvec", (("BITS", 5), ("SCALES", 0), ("ZERO", 16))),
    Q.Q4_1: ("affine_matvec", (("BITS", 4), ("SCALES", 1), ("ZERO", 0))),
    Q.Q5_1: ("affine_matvec", (("BITS", 5), ("SCALES", 1), ("ZERO", 0))),
    Q.Q4_K: ("affine_matvec", (("BITS", 4), ("SCALES", 2), ("ZERO", 0))),
    Q.Q5_K: ("affine_matvec", (("BITS", 5), ("SCALES", 2), ("ZERO", 0))),
    Q.IQ4_NL: ("iq4_matvec", (("XS", 0),)),
    Q.IQ4_XS: ("iq4_matvec", (("XS", 1),)),
    Q.Q3_K: ("q3_k_matvec", ()),
    Q.Q2_K: ("q2_k_matvec", ()),
    Q.F16: ("half_matvec", (("BF", 0),)),
    Q.BF16: ("half_matvec", (("BF", 1),)),
}
INPUTS = {"q6_k_matvec": ["x", "res", "nw", "ql", "qh", "scales", "d_bits", "dims"],  # res: the residual
          "affine_matvec": ["x", "res", "nw", "w", "s0", "s1", "dims"],  # (ADD), nw: the norm's weight (NORM)
          "iq4_matvec": ["x", "res", "nw", "qs", "d_bits", "sc_h", "sc_l", "dims"],
          "q3_k_matvec": ["x", "res", "nw", "hmask", "qs", "sc3", "d_bits", "dims"],
          "q2_k_matvec": ["x", "res", "nw", "sc2", "qs", "d_bits", "dmin_bits", "dims"],
          "half_matvec": ["x", "res", "nw", "v", "dims"],
          "affine_q6_k_matvec": ["x", "nw", "w", "s0", "s1", "ql", "qh", "scales", "d_bits", "dims"],
          "rms_norm": ["x", "nw", "dims"],
          "swiglu": ["x", "dims"],
          "affine_scales": ["s0", "s1", "dims"],
          "affine_values": ["w", "s0", "s1", "dims"],
          "q6_k_values": ["ql", "qh", "scales", "d_bits", "dims"]}
OUTPUTS = {"affine_scales": ["scales", "biases"]}  # a kernel's outputs, where not one `out`
FIELDS_AT = 3  # a matvec's weight fields start at this input
MAX_ROWS = 8  # rows of x a launch takes (each lane keeps one partial sum per row in registers)
WARPS = 8  # warps per block of 256 threads
MAX_ROWS_PER_WARP = 4  # blocks.cu's MLXI_MAX_R: output rows a warp may take
# A weight of more output rows than WIDE (an output head: 151,936 a Qwen vocabulary) of a type MLX's
# quantized_matmul multiplies (quants.AFFINE_BITS) takes the kernels up to WIDE_MAX_ROWS rows of x, that
# product past them: from 8 rows MLX's tiled form reads such a head several times faster than the
# kernels, below 8 it multiplies row by row, slower than them. A head of another type (a Q4_K_M file's
# Q6_K) stays: past the kernels its product forms every value first. The timings: docs/performance.md,
# "The head on quantized_matmul at 8 rows".
WIDE, WIDE_MAX_ROWS = 65536, 7


# Two products of one x in one launch (blocks.cu's mlxi_pair_matvec, `pair_product`): a weight group whose
# matrices are two runs of different types. A Q4_K_M or Q5_K_M file's layers with a Q6_K V (llama.cpp's
# quantizer gives half the layers one) hold their Q and K in Q4_K or Q5_K and V in Q6_K: one launch for
# the three, not two (14 launches of a 0.6B Qwen3's decode token, whose host time bounds it).
PAIR = "affine_q6_k_matvec"  # the pair kernel
PAIR_FIRST = (Q.Q4_K, Q.Q5_K)  # the types of its first run (its second is Q6_K)

# A prompt's products (more rows than MAX_ROWS) multiply formed scales (mx.quantized_matmul) or values
# (dequantized, then one matmul): `mlx_weights`' graph forms them, one compiled kernel a product, but the
# K-quants' scales come out [N, K/256, 8] and Q6_K's values [N, K/256, 2, 2, 2, 2, 16], and its fields go in
# as views of other shapes: view primitives around each launch (2 a Q4_K/Q5_K product, 5 a Q6_K one:
# 336 of a 17-token Q4_K_M prompt pass's 1,629 primitives, counted by bench/probes/step_graph.py --host),
# each the host's work at every product (a 0.6B prompt's pass is host-bound). These kernels write them
# in the shape the product takes, from the fields the decode kernels read (`kernel_fields`), the same
# bits as the graph's (the same operations, each rounded as the graph rounds it).
FORMED = {Q.Q4_K: "affine_scales", Q.Q5_K: "affine_scales", Q.Q4_1: "affine_scales", Q.Q5_1: "affine_scales",
          Q.Q6_K: "q6_k_values"}
# ... and an affine weight's values (`affine_values`: the weight dequantized in one launch, 8 values a
# thread), which a prompt's product of a large affine weight multiplies on CUDA instead of calling
# mx.quantized_matmul (MLXBackend's `values_rows`): at a prompt's few rows MLX's product reads an 8B
# model's weights at a fraction of the memory's rate, slower still for 4 bits than for 8
# (docs/performance.md, "An 8B prompt pass by kernel").
VALUES = {t: "affine_values" for t in AFFINE_BITS}


def applies(w, x) -> bool:
    """Whether the product x @ w.T goes to a block kernel: a kernel exists for w's type (an affine weight
    only in its compact form, scales not formed at load), x has at most MAX_ROWS rows, and w's rows are
    whole blocks (256 values for the K-quants, 32 for the others); of a weight of more than WIDE rows of an
    affine type, at most WIDE_MAX_ROWS rows of x."""
    if w.qtype not in KERNELS or getattr(w, "float_scales", False) or x.ndim != 2 or x.shape[0] > MAX_ROWS:
        return False
    if w.shape[0] > WIDE and x.shape[0] > WIDE_MAX_ROWS and w.qtype in AFFINE_BITS:
        return False
    return w.shape[1] % row_multiple(w.qtype) == 0


def pair_applies(kind: str, x, a, b) -> bool:
    """Whether x @ a.T and x @ b.T go to one pair launch (`pair_product`): a of a type in PAIR_FIRST, b in
    Q6_K, each a block kernel's product of x (`applies`) with one output row a warp (`default_per_warp`:
    the pair takes no more), of the same row length."""
    return (getattr(a, "qtype", None) in PAIR_FIRST and getattr(b, "qtype", None) == Q.Q6_K and applies(a, x)
            and applies(b, x) and x.shape[0] >= 1 and x.shape[1] == a.shape[1] == b.shape[1]
            and default_per_warp(kind, a.shape[0]) == 1 == default_per_warp(kind, b.shape[0]))


def kernel_names() -> list[str]:
    """The kernels, each with a self-check verdict of its own (a failing one turns off only its types)."""
    return sorted({name for name, _ in KERNELS.values()})


def types_of(kernel: str | None) -> list:
    """The types a kernel multiplies (None: every type with a kernel)."""
    return [t for t, (name, _) in KERNELS.items() if kernel is None or name == kernel]


def row_multiple(qtype) -> int:
    """The values a kernel's row length must be a multiple of: a K-quant's block, or a 32-value group."""
    return 256 if qtype in (Q.Q6_K, Q.Q4_K, Q.Q5_K, Q.IQ4_XS, Q.Q3_K, Q.Q2_K) else 32


def rows_per_warp(kind: str) -> int:
    """The most output rows a warp takes, what its registers hold (blocks.cu: each x value a lane reads
    from shared memory serves that many rows): 4 on CUDA; the Metal twin takes one row a simdgroup. The
    order, and so the bits, are the same for every count."""
    return MAX_ROWS_PER_WARP if kind == "cuda" else 1


MIN_BLOCKS_A_LAUNCH = 512  # blocks a product's launch should have, at least: about four for each SM


def default_per_warp(kind: str, n: int) -> int:
    """Output rows a warp takes in a product of n output rows: the most (`rows_per_warp`: 4, 2, 1) that
    still gives the launch MIN_BLOCKS_A_LAUNCH blocks of 8 warps (else 1), so that every SM keeps several
    blocks of warps waiting for weights. So 1 below 8,177 rows (the 8B shape's narrow products and every
    0.6B one but the head), 2 below 16,353, 4 from there: the fastest of 1, 2 and 4 at each of the 8B
    shape's products in device time (docs/performance.md, "rows at compile time")."""
    most = rows_per_warp(kind)
    return next((r for r in (4, 2) if r <= most and -(-n // (r * WARPS)) >= MIN_BLOCKS_A_LAUNCH), 1)


SWIGLU_FUSED_MAX_VALUES = 1 << 24  # a down product takes the SWIGLU form up to this many weights (N x K)


def fuses_swiglu(w) -> bool:
    """Whether a down product by w takes SwiGLU inside its launch (the SWIGLU form) rather than after the
    `swiglu` kernel's (the same bits either way). Every block of the form stages silu(gate) * up of the
    whole row of x, K values of an exp and a division each, about as many instructions a thread as its
    warp's share of the product at one row a warp: a down product's device time nearly doubles, once a
    wave of blocks. Apart, SwiGLU is one more launch (its host time, ~10 us, and a few us of the device's)
    and computed once. Where decode is host-bound (small shapes: the 0.6B shape's down is 3.1M weights)
    the launch costs more; where it is device-bound (the 8B shape's, 50M) the staging does: the 8B
    Q4_K_M decode step took more device time with the form (docs/performance.md, "the fused forms on a
    device-bound decode"). The bound between the two shapes is a guess, not measured on shapes in
    between."""
    return w.shape[0] * w.shape[1] <= SWIGLU_FUSED_MAX_VALUES


# Blocks of 256 threads a CUDA block kernel is compiled to keep resident on an SM (`__launch_bounds__`,
# blocks.cu's MLXI_MIN_BLOCKS). 3 caps a thread at 80 registers (65,536 / 768, in whole 8s), where the
# compiler's own choice (95-96 at one row of x) let an SM hold 2 blocks, 16 warps, too few to keep a
# decode product's weight loads in flight (Nsight Compute on an H100: 12-24% of the SM's warps active,
# memory at 10-20% of its bandwidth; docs/performance.md): the forms for one row of x (decode at batch
# 1) of the kernels whose readers fit 80 registers. Their forms for more rows get 2 (at most 128, what
# the compiler took before each unit's loads were issued at once; up to 184 without a bound). NVRTC for
# sm_90 spills at most a few values set once (test_the_decode_forms_fit_their_launch_bounds). Q6_K gets 2
# at every row count: its four rows a warp computed together at one row of x (blocks.cu's mlxi_block_rows)
# take 121 registers, and spilled 80 bytes at 80. The other kernels (Q3_K, Q2_K, F16 and BF16) keep 1,
# no bound.
FEW_REGISTERS = {"affine_matvec", "iq4_matvec"}
TWO_BLOCKS = {"q6_k_matvec"}
MIN_BLOCKS_ROWS = 1  # rows of x up to which those forms get 3 (2 rows of Q5_K spill 24 bytes at 80)


def min_blocks(name: str, rows: int) -> int:
    """MLXI_MIN_BLOCKS of kernel `name` compiled for `rows` rows of x (see FEW_REGISTERS; the pair kernel,
    one row a warp, as the affine kernel's forms)."""
    if name in TWO_BLOCKS:
        return 2
    if name == PAIR:
        name = "affine_matvec"
    return (3 if rows <= MIN_BLOCKS_ROWS else 2) if name in FEW_REGISTERS else 1


def bounded(header: str, blocks: int) -> str:
    """A CUDA kernel's header with its MLXI_MIN_BLOCKS set to `blocks` (`min_blocks`: 1 in blocks.cu)."""
    return header.replace("#define MLXI_MIN_BLOCKS 1\n", f"#define MLXI_MIN_BLOCKS {blocks}\n")


def kernel_source(kind: str) -> tuple[str, dict[str, str]]:
    """(header, {kernel name: body}) of blocks.cu or blocks.metal (`kernels.source_parts`); CUDA's without
    comments."""
    header, bodies = source_parts(SOURCES[kind])
    if kind == "cuda":
        return strip_comments(header), {name: strip_comments(body) for name, body in bodies.items()}
    return header, bodies


@lru_cache(maxsize=None)
def kernel_parts(kind: str, name: str) -> tuple[str, str]:
    """(header, body) of one kernel as handed to MLX: for CUDA the header cut to what the body reaches
    (`kernels.pruned`), as MLX hashes a CUDA kernel's whole source at every launch (~16 KB whole; a
    decode token launches ~140 of these); Metal's as written."""
    header, bodies = kernel_source(kind)
    return pruned(header, bodies[name]) if kind == "cuda" else (header, bodies[name])


@lru_cache(maxsize=None)
def _kernel(kind: str, name: str, blocks: int = 1):
    import mlx.core as mx

    header, body = kernel_parts(kind, name)
    outputs = OUTPUTS.get(name, ["out"])
    if kind == "cuda":  # compiled into MLX's kernel cache once per machine (`cuda_jit`)
        return cuda_jit.Kernel(f"mlxinfer_{name}_{kind}", INPUTS[name], outputs, body, bounded(header, blocks))
    return mx.fast.metal_kernel(name=f"mlxinfer_{name}_{kind}", input_names=INPUTS[name], output_names=outputs,
                                source=body, header=header, ensure_row_contiguous=True)


def kernel_fields(w) -> tuple:
    """The inputs a block kernel reads of weight w (a QuantizedWeight or BlockWeight of a type in
    KERNELS): its fields in the kernel's order, fp16 fields as their bits (uint16 views: read exactly in
    the kernel). The backend makes them once at load (`kernel_fields` of the weight), so that a product
    in a compiled step has no view of its own to replay."""
    import mlx.core as mx

    half = lambda a: mx.view(a, mx.uint16)  # noqa: E731
    if KERNELS[w.qtype][0] == "q6_k_matvec":
        ql, qh, scales, d = w.parts
        return ql, qh, scales, half(d)
    if w.qtype == Q.IQ4_XS:
        d, scales_h, scales_l, qs = w.parts
        return qs, half(d), scales_h, scales_l
    if w.qtype == Q.IQ4_NL:  # (sc_h, sc_l unused: IQ4_XS's)
        d, qs = w.parts
        return qs, half(d), half(d), qs
    if w.qtype == Q.Q3_K:
        hmask, qs, scales, d = w.parts
        return hmask, qs, scales, half(d)
    if w.qtype == Q.Q2_K:
        scales, qs, d, dmin = w.parts
        return scales, qs, half(d), half(dmin)
    if w.qtype in (Q.F16, Q.BF16):  # (BF16 kept as its bits)
        return (half(w.parts[0]) if w.qtype == Q.F16 else w.parts[0],)
    if w.qtype in (Q.Q4_K, Q.Q5_K):
        dd, sm = w.parts
        return w.w, half(dd), sm
    d, *rest = w.parts  # (d,) or (d, m); s1 unused without m
    return w.w, half(d), half(rest[0] if rest else d)


def product(kind: str, x, w, per_warp: int | None = None, residual=None, norm=None, swiglu: bool = False):
    """x @ w.T [M, N] in x's dtype, by the kernel of w's type on `kind` ("cuda" or "metal"), each warp
    taking `per_warp` output rows (1..`rows_per_warp`; by default `default_per_warp`'s). With `residual` ([M, N],
    x's dtype): residual + x @ w.T in the same launch, the bits of the graph's `residual + product`
    (the kernels' ADD form: `with_residual` says the roundings). With `norm` = (weight [K] of x's
    dtype, eps): the product of x's rows RMS-normed, each normed value the bits `rms_norm` writes (the
    NORM form). With `swiglu`: x is [M, 2K] = [gate | up], and the product is of silu(gate) * up, each
    value the bits `swiglu` writes (the SWIGLU form; not with `norm`). The forms are chosen at launch
    (dims[4]): the kernel compiled for a type and row count serves them all."""
    rows, k = x.shape[0], w.shape[1]
    n = w.shape[0]
    if x.ndim != 2 or x.shape[1] != (2 * k if swiglu else k):
        raise ValueError(f"x must be [rows, {2 * k if swiglu else k}] for a product by [{n}, {k}]"
                         f"{' of its SwiGLU (gate | up)' if swiglu else ''}, got {list(x.shape)}")
    if swiglu and norm is not None:
        raise ValueError("the SWIGLU and NORM forms of a product do not combine")
    most = rows_per_warp(kind)
    per_warp = default_per_warp(kind, n) if per_warp is None else per_warp
    if not 1 <= per_warp <= most:
        raise ValueError(f"{per_warp} output rows a warp: the {kind} block kernels take 1..{most}")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"the block kernels take 1..{MAX_ROWS} rows of x, got {rows}")
    if residual is not None and (residual.shape != (rows, n) or residual.dtype != x.dtype):
        raise ValueError(f"the residual must be [{rows}, {n}] of x's dtype {x.dtype}, got "
                         f"{list(residual.shape)} of {residual.dtype}")
    nw, eps_bits = _norm_inputs(x, norm, k)
    forms = int(residual is not None) | int(norm is not None) << 1 | int(swiglu) << 2  # dims[4]: ADD, NORM, SWIGLU
    name, consts = KERNELS[w.qtype]
    fields = w.kernel_fields or kernel_fields(w)
    warps = -(-n // per_warp)
    (out,) = _kernel(kind, name, min_blocks(name, rows))(
        inputs=[x, x if residual is None else residual, nw, *fields,
                kernel_args(n, k, per_warp, eps_bits, forms)],
        template=[("T", x.dtype), ("M", rows), *consts], grid=launch_grid(-(-warps // WARPS)),
        threadgroup=(32 * WARPS, 1, 1), output_shapes=[(rows, n)], output_dtypes=[x.dtype])
    return out


def _norm_inputs(x, norm, k: int):
    """(nw, eps's float32 bits) a launch passes for `norm` = (weight [k] of x's dtype, eps): x itself
    (unread) and 0 without the NORM form."""
    if norm is None:
        return x, 0
    nw = norm[0]
    if nw.shape != (k,) or nw.dtype != x.dtype:
        raise ValueError(f"the norm's weight must be [{k}] of x's dtype {x.dtype}, got {list(nw.shape)} of {nw.dtype}")
    return nw, f32_bits(norm[1])


def pair_product(kind: str, x, a, b, norm=None):
    """[x @ a.T | x @ b.T], [M, Na + Nb] in x's dtype, in one launch (`pair_applies` must hold): each
    column the bits of its own matrix's `product` (with `norm` = (weight, eps): of x's rows RMS-normed,
    the NORM form), a's by the affine kernel's reader, b's by Q6_K's, one row a warp."""
    rows, k = x.shape[0], a.shape[1]
    if not pair_applies(kind, x, a, b):
        names = [getattr(getattr(w, "qtype", None), "name", type(w).__name__) for w in (a, b)]
        raise ValueError(f"no pair launch multiplies x {list(x.shape)} by {names[0]} {list(a.shape)} and "
                         f"{names[1]} {list(b.shape)} (the first of {', '.join(t.name for t in PAIR_FIRST)}, "
                         f"the second Q6_K, one row a warp, each 1..{MAX_ROWS} rows of x of their row length)")
    nw, eps_bits = _norm_inputs(x, norm, k)
    na, nb = a.shape[0], b.shape[0]
    blocks = -(-na // WARPS) + -(-nb // WARPS)  # (A's last block's idle warps: B starts a block of its own)
    (out,) = _kernel(kind, PAIR, min_blocks(PAIR, rows))(
        inputs=[x, nw, *(a.kernel_fields or kernel_fields(a)), *(b.kernel_fields or kernel_fields(b)),
                kernel_args(na, k, 1, eps_bits, int(norm is not None) << 1, nb)],
        template=[("T", x.dtype), ("M", rows), *KERNELS[a.qtype][1]], grid=launch_grid(blocks),
        threadgroup=(32 * WARPS, 1, 1), output_shapes=[(rows, na + nb)], output_dtypes=[x.dtype])
    return out


def formed_scales(kind: str, w):
    """(scales, biases) [N, K/32] in w's products' dtype of an affine weight of a type FORMED gives
    `affine_scales` (Q4_K, Q5_K, Q4_1, Q5_1), by that kernel on `kind`: one launch, the bits of
    `mlx_weights.formed_scales` (tested), in the shape mx.quantized_matmul takes."""
    if FORMED.get(getattr(w, "qtype", None)) != "affine_scales" or getattr(w, "float_scales", False):
        raise ValueError(f"the affine_scales kernel forms {', '.join(t.name for t, k in FORMED.items() if k == 'affine_scales')}"
                         f" scales from their fields, not {_type_name(w)}'s")
    n, groups = w.shape[0], w.shape[1] // 32
    return _formed(kind, "affine_scales", (w.kernel_fields or kernel_fields(w))[1:], (n, groups), w.dtype, 2,
                   (("SCALES", 2 if w.qtype in (Q.Q4_K, Q.Q5_K) else 1),))


def formed_values(kind: str, w):
    """[N, K] in w's products' dtype of a Q6_K weight, by the q6_k_values kernel on `kind`: one launch, the
    bits of `mlx_weights.formed_values` (tested), in the shape the product takes."""
    if FORMED.get(getattr(w, "qtype", None)) != "q6_k_values":
        raise ValueError(f"the q6_k_values kernel forms Q6_K values from their fields, not {_type_name(w)}'s")
    return _formed(kind, "q6_k_values", w.kernel_fields or kernel_fields(w), tuple(w.shape), w.dtype, 1, ())[0]


def affine_values(kind: str, w):
    """[N, K] in w's products' dtype of an affine weight (a type in VALUES, its scales not formed at
    load), by the affine_values kernel on `kind`: one launch, the bits of `mlx_weights.affine_values`
    (tested), in the shape the product takes."""
    if getattr(w, "qtype", None) not in VALUES or getattr(w, "float_scales", False):
        raise ValueError(f"the affine_values kernel forms {', '.join(t.name for t in VALUES)} values from their"
                         f" fields, not {_type_name(w)}'s")
    n, k = w.shape
    return _formed(kind, "affine_values", w.kernel_fields or kernel_fields(w), (n, k), w.dtype, 1,
                   KERNELS[w.qtype][1], threads=n * k // 8, dims=(n, k // 32))[0]


def _type_name(w) -> str:
    return getattr(getattr(w, "qtype", None), "name", type(w).__name__)


# Each formed kernel's launch inside mx.compile (one function a kernel, traced once a shape and dtype), so
# that a prompt's pass replays the primitive instead of making and hashing the kernel's source at every
# product, which made the bare launches' prompt graph slower to build on a GPU (docs/performance.md, "A
# prompt's scales and values by one kernel each"). Inside `cuda_jit.collecting()` (a prebuild pass)
# launches stay bare. False: bare (step_profile.py --variants formed-launched).
FORMED_COMPILED = True


def _formed(kind: str, name: str, fields, shape, dtype, outputs: int, consts, threads: int | None = None,
            dims: tuple | None = None) -> list:
    """A formed kernel's `outputs` arrays of `shape` [rows, columns], a thread an element unless `threads`
    says how many (and `dims` the kernel's dims, `shape` by default); none launched for no rows: a row
    slice may have none."""
    import mlx.core as mx

    if shape[0] == 0:
        return [mx.zeros(shape, dtype) for _ in range(outputs)]
    kernel = _kernel(kind, name)
    launch = (shape[0] * shape[1] if threads is None else threads, *(shape if dims is None else dims))
    if FORMED_COMPILED and not cuda_jit.is_collecting():  # (a trace made while collecting would replay its zeros)
        return _compiled_formed(kernel, outputs, tuple(consts))(list(fields), tuple(shape), cuda_jit.dtype_name(dtype), launch)
    return _launch_formed(kernel, fields, shape, dtype, outputs, consts, launch)


@lru_cache(maxsize=None)
def _compiled_formed(kernel, outputs: int, consts):
    """`_launch_formed` of one kernel object in mx.compile (keyed by the object: a kernel replaced in a
    test is traced apart)."""
    import mlx.core as mx

    return mx.compile(lambda fields, shape, dtype, launch: _launch_formed(kernel, fields, shape, getattr(mx, dtype),
                                                                          outputs, consts, launch))


def _launch_formed(kernel, fields, shape, dtype, outputs: int, consts, launch) -> list:
    """The launch: `launch` is (threads, *the kernel's dims)."""
    threads, *dims = launch
    return kernel(
        inputs=[*fields, kernel_args(*dims)], template=[("T", dtype), *consts],
        grid=launch_grid(-(-threads // (32 * WARPS))), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[shape] * outputs, output_dtypes=[dtype] * outputs)


def rms_norm(kind: str, x, weight, eps: float):
    """RMSNorm of x [M, K] with weight [K] (both of one dtype) on `kind`, a warp a row, in blocks.cu's
    published order (`emulate_rms_norm`): the values the NORM form of `product` multiplies."""
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"rms_norm takes [rows, K] with rows and K above 0, got {list(x.shape)}")
    rows, k = x.shape
    if weight.shape != (k,) or weight.dtype != x.dtype:
        raise ValueError(f"the norm's weight must be [{k}] of x's dtype {x.dtype}, got {list(weight.shape)} of {weight.dtype}")
    (out,) = _kernel(kind, "rms_norm")(
        inputs=[x, weight, kernel_args(rows, k, f32_bits(eps))], template=[("T", x.dtype)],
        grid=launch_grid(-(-rows // WARPS)), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(rows, k)], output_dtypes=[x.dtype])
    return out


def swiglu(kind: str, x):
    """silu(gate) * up of x [M, 2F] = [gate | up] a row (both of x's dtype) on `kind`, a thread a value, in
    blocks.cu's published order (`emulate_swiglu`): [M, F], the values the SWIGLU form of `product`
    multiplies."""
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0 or x.shape[1] % 2:
        raise ValueError(f"swiglu takes [rows, 2F] (gate | up) with rows and F above 0, got {list(x.shape)}")
    rows, f = x.shape[0], x.shape[1] // 2
    (out,) = _kernel(kind, "swiglu")(
        inputs=[x, kernel_args(rows, f)], template=[("T", x.dtype)],
        grid=launch_grid(-(-(rows * f) // (32 * WARPS))), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(rows, f)], output_dtypes=[x.dtype])
    return out


EXP_TAYLOR = tuple(np.float32(1.0 / math.factorial(i)) for i in range(7, -1, -1))  # 1/7! .. 1/0!, Horner's order
LN2_HI, LN2_LO, LOG2_E = np.float32(0.693359375), np.float32(-2.12194440e-4), np.float32(1.4426950408889634)


def emulate_exp(t: np.ndarray) -> np.ndarray:
    """blocks.cu's mlxi_exp in numpy, bit for bit (float32 t within [-20, 88]): n = rint(t log2 e),
    r = (t - n C1) - n C2, the Taylor polynomial of degree 7 in Horner's order, times 2^n; every step
    rounded to float32."""
    t = np.asarray(t, np.float32)
    n = np.rint(t * LOG2_E).astype(np.float32)
    r = ((t - n * LN2_HI).astype(np.float32) - (n * LN2_LO).astype(np.float32)).astype(np.float32)
    p = np.full_like(t, EXP_TAYLOR[0])
    for c in EXP_TAYLOR[1:]:
        p = ((p * r).astype(np.float32) + c).astype(np.float32)
    return (p * np.ldexp(np.float32(1.0), n.astype(np.int32))).astype(np.float32)


def emulate_swiglu(x: np.ndarray, narrow) -> np.ndarray:
    """What blocks.cu's `swiglu` writes, in numpy, bit for bit for every input but NaN (a NaN in gives a
    NaN out, its sign and payload the platform's): for x = [g | u] (float32 values of the dtype), silu =
    g / (1 + emulate_exp(t)) for t = -g clamped to [-20, 88], `narrow`ed to the dtype, then silu * u
    narrowed again (the graph's silu op, then its product with up)."""
    x = np.asarray(x, np.float32)
    f = x.shape[1] // 2
    g, u = x[:, :f], x[:, f:]
    t = np.minimum(np.maximum(-g, np.float32(-20.0)), np.float32(88.0))
    with np.errstate(over="ignore", invalid="ignore"):
        silu = narrow((g / (np.float32(1.0) + emulate_exp(t)).astype(np.float32)).astype(np.float32))
        return narrow((silu * u).astype(np.float32))


def emulate_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, narrow) -> np.ndarray:
    """blocks.cu's RMSNorm in numpy, bit for bit: each row's sum of squares in the dot products' order
    (`kernels.published_dot` of the row with itself), times float32 1/K, plus eps, 1 / sqrt (each
    correctly rounded), then (x * inv) * w, each product rounded, and `narrow`ed to the dtype."""
    x, weight = np.asarray(x, np.float32), np.asarray(weight, np.float32)
    k = x.shape[1]
    ss = np.array([published_dot(row[None], row[None])[0, 0] for row in x], dtype=np.float32)
    mean = (ss * (np.float32(1.0) / np.float32(k))).astype(np.float32)
    inv = (np.float32(1.0) / np.sqrt((mean + np.float32(eps)).astype(np.float32))).astype(np.float32)
    return narrow(((x * inv[:, None]).astype(np.float32) * weight[None, :]).astype(np.float32))


def q6_k_values(ql, qh, scales, d) -> np.ndarray:
    """float32 [rows, blocks, 256] of Q6_K fields (quants.split's arrays), in gguf-py's arithmetic:
    (d * scale) * (q - 32), each value's product of its run's scale and its code (`_q6_k_terms`)."""
    codes, dl = _q6_k_terms(ql, qh, scales, d)
    return dl * codes


def _q6_k_terms(ql, qh, scales, d) -> tuple[np.ndarray, np.ndarray]:
    """(q - 32, d * scale): float32 [rows, blocks, 256] each, of Q6_K fields (quants.split's arrays)."""
    i = np.arange(256)
    h, r = i // 128, i % 128
    low = (ql[..., 64 * h + r % 64] >> (4 * (r // 64))) & 0xF
    high = (qh[..., 32 * h + r % 32] >> (2 * (r // 32))) & 0x3
    q = (low | (high << 4)).astype(np.float32) - np.float32(32)
    return q, d.astype(np.float32)[..., None] * scales.astype(np.float32)[..., i // 16]


def unit_columns(qtype, k: int) -> np.ndarray:
    """[K / 32, 32]: the columns of each work unit in the order a lane adds them. Q6_K: unit
    u = 8b + 4h + c holds r = 8c + t + 32j of half h of block b, j = 0..3 then t = 0..7; the affine types:
    unit g is group g, t = 0..31."""
    u = np.arange(k // 32)[:, None]
    if qtype == Q.Q6_K:
        b, h, c = u >> 3, (u >> 2) & 1, u & 3
        jt = np.arange(32)
        return b * 256 + 128 * h + 8 * c + 32 * (jt // 8) + jt % 8
    return 32 * u + np.arange(32)


# Types whose kernels add a unit's values by runs (blocks.cu's G::RUN): the run's length. A run's values
# are scale * code + bias (one scale and bias a run); the others' kernels add value by value.
RUNS = {Q.Q4_0: 32, Q.Q5_0: 32, Q.Q4_1: 32, Q.Q5_1: 32, Q.Q4_K: 32, Q.Q5_K: 32, Q.Q6_K: 8}


class Terms(NamedTuple):
    """A weight of a type added by runs, as its kernel forms it: each value's code less its zero (exact
    as float), and its run's scale and bias (None: the type has none), float32 [N, K] each, so that the
    value is scale * code + bias exactly as gguf-py forms it."""
    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray | None


def terms(raw: np.ndarray, qtype, rows: int, cols: int):
    """What `emulate` takes of a weight (the raw GGUF blocks of a [rows, cols] matrix): its `Terms` for
    a type in RUNS, else its values, float32 [rows, cols] (gguf-py's dequantization)."""
    if qtype not in RUNS:
        return dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
    f32 = np.float32
    if qtype == Q.Q6_K:
        codes, dl = _q6_k_terms(*quants.split(raw, qtype, rows, cols))
        return Terms(codes.reshape(rows, cols), dl.reshape(rows, cols), None)
    q, parts = quants.affine_codes(raw, qtype, rows, cols)
    zero = dict(KERNELS[qtype][1])["ZERO"]
    if qtype in (Q.Q4_K, Q.Q5_K):  # d * sc and -(dmin * m) a group of 32
        dd, sm = parts
        dd = dd.astype(f32)
        scale = dd[..., 0:1] * sm[..., 0, :].astype(f32)
        bias = -(dd[..., 1:2] * sm[..., 1, :].astype(f32))
    else:  # d (and m) a group of 32
        scale = parts[0].astype(f32)
        bias = parts[1].astype(f32) if len(parts) > 1 else None
    per_col = lambda a: np.repeat(a.reshape(rows, cols // 32), 32, axis=1)  # noqa: E731
    return Terms(q.astype(f32) - f32(zero), per_col(scale), None if bias is None else per_col(bias))


def emulate(x: np.ndarray, w, qtype, fma16: bool = False) -> np.ndarray:
    """The kernel's result in numpy, in its published order (blocks.cu): float32 [M, N] for float32 x
    [M, K] and the weight as `terms` gives it (a type in RUNS: its `Terms`; else its values [N, K],
    gguf-py's dequantization, which the kernel forms exactly). Lane l adds units l, l + 32, ...
    (`unit_columns`): value by value, each product rounded then added; or by runs (RUNS), each run's
    products code * x added from 0 (and with a bias x's values so), then scale * that (+ bias * x's sum),
    each step rounded, added. Then the butterfly 16, 8, 4, 2, 1. `fma16`: x's values are of a 16-bit
    type, whose products the kernel adds by one fma each (code * x + s rounded once: code * x is exact,
    but past float32's range, |x| above ~5e36 in bfloat16): here the product and the sum in float64,
    rounded once to float32, which is the fma's result for such operands (a product of at most 17
    significant bits); without it, the product rounded then added, the same bits wherever no product
    overflows."""
    runs = RUNS.get(qtype, 0)
    if bool(runs) != isinstance(w, Terms):
        raise TypeError(f"emulate: a {qtype.name} weight is given by its {'Terms' if runs else 'values'} (block_kernels.terms)")
    if runs:
        codes, scales, biases = w
        n, k = codes.shape
    else:
        values = np.asarray(w, dtype=np.float32)
        n, k = values.shape
    cols = unit_columns(qtype, k)
    units = len(cols)
    acc = np.zeros((x.shape[0], n, 32), dtype=np.float32)
    with np.errstate(over="ignore"):  # (a sum past float32's range is inf, as the kernel's)
        for first in range(0, units, 32):
            u = first + np.arange(32)
            live = u < units  # lanes past the last unit add nothing
            lane_cols = cols[np.minimum(u, units - 1)]  # [32 lanes, 32 steps]
            for step in range(32):
                col = lane_cols[:, step]
                xc = x[:, col][:, None, :]  # [M, 1, 32 lanes]
                if not runs:
                    prod = (xc * values[:, col][None, :, :]).astype(np.float32)
                    acc = np.where(live, acc + prod, acc).astype(np.float32)
                    continue
                if step % runs == 0:
                    s = np.zeros_like(acc)
                    sx = np.zeros_like(xc, dtype=np.float32)
                if fma16:
                    s = (s.astype(np.float64) + xc.astype(np.float64) * codes[:, col][None, :, :]).astype(np.float32)
                else:
                    s = (s + (xc * codes[:, col][None, :, :]).astype(np.float32)).astype(np.float32)
                if biases is not None:
                    sx = (sx + xc).astype(np.float32)
                if (step + 1) % runs == 0:  # the run's end: scale * s (+ bias * sx), added
                    part = (scales[:, col][None, :, :] * s).astype(np.float32)
                    if biases is not None:
                        part = (part + (biases[:, col][None, :, :] * sx).astype(np.float32)).astype(np.float32)
                    acc = np.where(live, acc + part, acc).astype(np.float32)
    lanes = np.arange(32)
    for off in (16, 8, 4, 2, 1):
        acc = acc + acc[..., lanes ^ off]
    return acc[..., 0]


def with_residual(sums: np.ndarray, residual: np.ndarray, narrow) -> np.ndarray:
    """What the ADD form writes, in numpy: the residual plus the product's float32 sums (`emulate`)
    rounded to the output's type first (`narrow`, float32 -> that type's values as float32), added in
    float32 and rounded once more: the graph's Add of the product, two values of that type."""
    return narrow(np.asarray(residual, np.float32) + narrow(sums))
