"""The MLX backend's weight matrices, kept as compact as the file (`mlxinfer.quants` says which type
takes which form and why each is exact):

  - `QuantizedWeight`: MLX affine group-32 quants (bits 4, 5, 8) and the file's own scale fields;
    scales and biases are formed at each use (`affine_scales`: in float32, rounded once to the products'
    dtype; one compiled kernel a product, `formed_scales`, or on a GPU blocks.cu's, `former`), then
    `mx.quantized_matmul`; on CUDA a product of many rows (`MLXBackend.dense_rows`), and a prompt's
    product of a large weight of fewer than 8 bits (`values_rows`), dequantizes the weight first (`dense`:
    blocks.cu's affine_values kernel, or `affine_values`' graph of the same bits; `dense_product`).
  - `BlockWeight`: the file's block fields (Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS) or 16-bit values (F16,
    BF16), dequantized to float32 in the graph at each use (`dequantize`: MLX bit operations doing
    gguf-py's arithmetic; on a GPU by one compiled function where that keeps the bits, `formed_values`,
    or Q6_K's by blocks.cu's kernel, `former`),
    then a float32 product. This costs time, not memory: on MLX's CPU a product
    of Q6_K, Q3_K or Q2_K takes 2-3.5x an affine type's, F16/BF16 1.5-2.5x, IQ4_NL/IQ4_XS ~10x (MLX's
    gather for the codebook); figures in tests/test_quants.py's docstring, `bench/probes/weight_types.py`
    measures them. A product dequantizes a slice of rows at a time (`dense_product`, `DENSE_SLICE_BYTES`),
    so the float32 matrix is never whole in memory. On a GPU decode rows of every such type go to a kernel
    (`block_kernels`).
  - float32 arrays (F32 files), [in, out] for products.
  - `ExpertStack`: a mixture's [experts, out, in] stacks in one of the forms above, rows flattened.

Products run in the backend's activation dtype (`--dtype`): affine scales and biases, dequantized
blocks and float matrices are cast to it (scales and float matrices once at load where they are formed
once, blocks at each use), so that MLX's products take and give that dtype.

Every array has the matrix's rows as its first axis, so a row slice, a gathered row and stacked
matrices (`WeightGroup`, `WeightRuns`) are slices, gathers and concatenations of each array.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from .. import block_kernels
from ..quants import AFFINE_BITS, GROUP, IQ4_VALUES

_OFFSET = {Q.Q8_0: -128.0, Q.Q4_0: -8.0, Q.Q5_0: -16.0}  # bias = offset·d; the others carry m or dmin
DENSE_SLICE_BYTES = 512 << 20  # the most of a weight `dense_product` dequantizes at once (float32 bytes)


def affine_scales(qtype, parts, dtype=mx.float32) -> tuple[mx.array, mx.array]:
    """(scales, biases) [rows, in/32] in `dtype` from the kept scale fields: d (and m) for the 32-value
    types; d, dmin [rows, blocks, 2] and sub-scales, mins [rows, blocks, 2, 8] for Q4_K/Q5_K, or those as
    `split_scale_fields`' four views (scale d·sc, bias -dmin·m; exact products: quants' doc), formed in
    float32 and rounded once to `dtype` (`_scale_chains`), as [rows, in/32]."""
    scales, biases = _scale_chains(qtype, parts, dtype)
    shape = _as_rows(scales.shape)
    return mx.reshape(scales, shape), mx.reshape(biases, shape)


def _as_rows(shape) -> tuple[int, int]:
    """[rows, ...] as (rows, the rest), the count given: a reshape cannot infer -1 for zero rows."""
    return shape[0], int(np.prod(shape[1:]))


def _scale_chains(qtype, parts, dtype) -> tuple[mx.array, mx.array]:
    """affine_scales' two chains of elementwise operations from the fields, of one shape ([rows, blocks,
    8] for Q4_K/Q5_K, else [rows, in/32]): the offset types' bias is the rounded scale times the offset
    (a power of two: the same value as the float32 scale's product rounded), the K-quants' fields are
    cast a part at a time. No multiply feeds an add, so no compiler can contract one into an fma."""
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, sc, dmin, m = parts if len(parts) == 4 else split_scale_fields(parts)
        scales = d.astype(mx.float32) * sc.astype(mx.float32)
        biases = -(dmin.astype(mx.float32) * m.astype(mx.float32))
        return scales.astype(dtype), biases.astype(dtype)
    scales = parts[0].astype(mx.float32).astype(dtype)
    if qtype in _OFFSET:
        return scales, scales * mx.array(_OFFSET[qtype], dtype)
    return scales, parts[1].astype(mx.float32).astype(dtype)


def split_scale_fields(parts) -> tuple:
    """Q4_K's and Q5_K's scale fields (d, dmin [rows, blocks, 2]; sub-scales, mins [rows, blocks, 2, 8])
    as the four views `affine_scales` multiplies: d [rows, blocks, 1], sub-scales [rows, blocks, 8], dmin,
    mins. Evaluated once at load (`QuantizedWeight.split`), they are arrays of their own over the
    fields' memory (no copy), so that a product's graph starts from them instead of slicing the fields
    again (a dozen view primitives a product of a prompt's pass, each the host's work to evaluate)."""
    dd, sm = parts
    return dd[..., 0:1], sm[..., 0, :], dd[..., 1:2], sm[..., 1, :]


@lru_cache(maxsize=None)
def formed_scales(qtype, dtype):
    """`affine_scales` in `dtype` as one compiled function of one launch on a GPU (where the graph
    launches four to seven a product of a prompt's pass; bench/probes/step_graph.py counts them). The
    offset types' bias is made from the scale, so MLX's compiler fuses the two into one kernel; the
    others' are two chains from different fields, each a kernel of its own, so both are computed for
    every element of one [2, ...] array, `mx.where` keeping the scale's in its first half and the bias's
    in its second (one kernel; the halves are contiguous, so the scales and biases are views: one
    reshape of the whole to [2 rows, in/32] and one split, two view primitives where a slice and a
    reshape of each half were four, each the host's work at every product of a prompt's pass). The same
    operations: the same bits (tested)."""
    def formed(*parts):
        scales, biases = _scale_chains(qtype, parts, dtype)
        if qtype in _OFFSET:  # the bias made from the scale: one kernel for both already
            return scales, biases
        both = mx.where(mx.array(np.array([True, False]).reshape((2,) + (1,) * scales.ndim)), scales, biases)
        rows, cols = _as_rows(scales.shape)
        return tuple(mx.split(mx.reshape(both, (2 * rows, cols)), 2))

    return mx.compile(formed)


def _shifts(*values, dtype=mx.uint8, shape=None) -> mx.array:
    """The shift amounts as a constant, made in `shape` (no reshape primitive in the graph)."""
    return mx.array(np.array(values).reshape(shape or (len(values),)), dtype=dtype)


S04, S0246, S0_7 = (0, 4), (0, 2, 4, 6), tuple(range(8))


def _unpack(a, shape, shifts, new_axis_shape, mask):
    """gguf-py's `(a.reshape(shape) >> shifts.reshape(new_axis_shape)) & mask`."""
    return (mx.reshape(a, shape) >> _shifts(*shifts, dtype=a.dtype, shape=new_axis_shape)) & mask


def _q6_k(n, ql, qh, scales, d):
    # value i = 128 h + 64 s + 32 k + 16 g + t of a block, in one broadcast shape [n, h, s, k, g, t] (so
    # that a compiled function fuses it into one kernel: `formed_values`): low four bits ql[64 h + 32 k
    # + 16 g + t] >> 4 s, high two qh[32 h + 16 g + t] >> 2 (2 s + k), scale (h s k g)
    lo = _unpack(ql, (n, 2, 1, 2, 2, 16), S04, (1, 1, 2, 1, 1, 1), 0x0F)
    hi = _unpack(qh, (n, 2, 1, 1, 2, 16), S0246, (1, 1, 2, 2, 1, 1), 0x03)
    q = (lo | (hi << 4)).astype(mx.float32) - 32.0
    dl = mx.reshape(d, (n, 1, 1, 1, 1, 1)).astype(mx.float32) * mx.reshape(scales, (n, 2, 2, 2, 2, 1)).astype(mx.float32)
    return dl * q


def _q3_k(n, hmask, qs, scales, d):
    sc = mx.reshape(scales, (n, 12))
    lo = mx.reshape(_unpack(sc[:, :8], (n, 1, 8), S04, (1, 2, 1), 0x0F), (n, 16))
    hi = mx.reshape(_unpack(sc[:, 8:], (n, 1, 4), S0246, (1, 4, 1), 0x03), (n, 16))
    s = (lo | (hi << 4)).astype(mx.float32) - 32.0
    dl = mx.reshape(mx.reshape(d, (n, 1)).astype(mx.float32) * s, (n, 16, 1))
    low = mx.reshape(_unpack(qs, (n, 2, 1, 32), S0246, (1, 1, 4, 1), 0x03), (n, 16, 16))
    high = mx.reshape(_unpack(hmask, (n, 1, 1, 32), S0_7, (1, 1, 8, 1), 0x01), (n, 16, 16)) ^ 1  # set: no offset
    return dl * (low.astype(mx.float32) - (high << 2).astype(mx.float32))


def _q2_k(n, scales, qs, d, dmin):
    sc = mx.reshape(scales, (n, 16, 1))
    dl = mx.reshape(d, (n, 1, 1)).astype(mx.float32) * (sc & 0x0F).astype(mx.float32)
    ml = mx.reshape(dmin, (n, 1, 1)).astype(mx.float32) * (sc >> 4).astype(mx.float32)
    q = mx.reshape(_unpack(qs, (n, 2, 1, 32), S0246, (1, 1, 4, 1), 0x03), (n, 16, 16)).astype(mx.float32)
    return dl * q - ml


def _iq4_nl(n, d, qs):
    k = mx.take(mx.array(IQ4_VALUES.astype(np.float32)), _unpack(qs, (n, 1, 1, 16), S04, (1, 1, 2, 1), 0x0F))
    return mx.reshape(d, (n, 1)).astype(mx.float32) * mx.reshape(k, (n, 32))


def _iq4_xs(n, d, scales_h, scales_l, qs):
    lo = mx.reshape(_unpack(scales_l, (n, 4, 1), S04, (1, 1, 2), 0x0F), (n, 8))
    hi = (mx.reshape(scales_h, (n, 1)) >> _shifts(*range(0, 16, 2), dtype=mx.uint16)).astype(mx.uint8) & 0x03
    ls = (lo | (hi << 4)).astype(mx.float32) - 32.0
    dl = mx.reshape(mx.reshape(d, (n, 1)).astype(mx.float32) * ls, (n, 8, 1))
    k = mx.take(mx.array(IQ4_VALUES.astype(np.float32)), _unpack(qs, (n, 8, 1, 16), S04, (1, 1, 2, 1), 0x0F))
    return dl * mx.reshape(k, (n, 8, 32))


_BLOCKS = {Q.Q6_K: _q6_k, Q.Q3_K: _q3_k, Q.Q2_K: _q2_k, Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs}


# The block types whose `dequantize` is only products and subtractions before them (no product then an
# addition or subtraction, which a fused kernel's compiler may contract into one fma, not gguf-py's two
# roundings: Q2_K's dl * q - ml), so that one compiled kernel gives the graph's bits (`formed_values`).
FUSABLE = frozenset({Q.Q6_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS})


@lru_cache(maxsize=None)
def formed_values(qtype, dtype):
    """`dequantize` of a FUSABLE type's fields, cast to `dtype`, as one compiled function: MLX fuses its
    elementwise operations (shifts, masks, conversions, products; Q6_K's written in one broadcast shape:
    one kernel a slice, the cast to the dtype included), where the graph launches each
    (bench/probes/step_graph.py --host --pass prefill counts them). The same operations: the same bits
    (tested). The shape comes from the fields: rows, then blocks."""
    values = GGML_QUANT_SIZES[qtype][0]
    return mx.compile(lambda *parts: dequantize(qtype, parts, parts[0].shape[0], parts[0].shape[1] * values, dtype))


def dequantize(qtype, parts, rows: int, cols: int, dtype=mx.float32) -> mx.array:
    """[rows, cols] of a BlockWeight's arrays as gguf-py computes them in float32 (the same products and
    subtractions, exact: quants' doc), rounded once to `dtype`: before the reshape to [rows, cols], so
    that a compiled function (`formed_values`) fuses the cast too (after it, a kernel of its own)."""
    if qtype == Q.F16:
        return parts[0].astype(mx.float32).astype(dtype)
    if qtype == Q.BF16:  # kept as its uint16 bits, a float32's top half
        return mx.view(parts[0].astype(mx.uint32) << 16, mx.float32).astype(dtype)
    n = rows * parts[0].shape[1]  # blocks
    return mx.reshape(_BLOCKS[qtype](n, *parts).astype(dtype), (rows, cols))


@dataclass
class QuantizedWeight:
    """An [out, in] matrix in MLX's affine quantized layout; `matmul` reads it as [in, out]."""

    w: mx.array  # uint32 [out, in*bits/32]
    parts: tuple  # the file's scale fields, per row (`affine_scales`), or float32 (scales, biases)
    qtype: Q
    shape: tuple[int, int]  # (out, in)
    float_scales: bool = False  # parts are the (scales, biases) in `dtype`, formed once at load
    dtype: mx.Dtype = mx.float32  # the products' dtype: scales and biases are cast to it
    compiled: bool = False  # its scales formed by `formed_scales` (on a GPU: one launch, not four)
    kernel_fields: tuple = ()  # the block kernels' inputs, made once at load (`block_kernels.kernel_fields`)
    split: tuple = ()  # Q4_K / Q5_K: the scale fields as `split_scale_fields`' views, made once at load
    former: str | None = None  # the GPU ("cuda", "metal") whose kernel forms its scales (`block_kernels.FORMED`)

    @property
    def bits(self) -> int:
        return AFFINE_BITS[self.qtype]

    def affine(self, parts=None) -> tuple[mx.array, mx.array]:
        """(scales, biases) in the products' dtype: where `compiled`, the weight's own fields by one
        compiled kernel (`formed_scales`: traced once for each shape, a weight's and its row slices'),
        else, and for gathered rows' fields (`parts`: their count changes from pass to pass), in the
        graph. (MLX's CPU device compiles with a C++ compiler at first use, for a launch that costs it
        nothing: so on a GPU only.) With a `former`, the weight's own by its kernel instead
        (`block_kernels.formed_scales`: the same bits, no view primitive around the launch)."""
        if self.float_scales:
            return self.parts if parts is None else parts
        if parts is None and self.former and block_kernels.FORMED.get(self.qtype) == "affine_scales":
            return tuple(block_kernels.formed_scales(self.former, self))
        if parts is None and self.compiled:
            return formed_scales(self.qtype, self.dtype)(*(self.split or self.parts))
        return affine_scales(self.qtype, (self.split or self.parts) if parts is None else parts, self.dtype)

    @property
    def scales(self) -> mx.array:
        return self.affine()[0]

    @property
    def biases(self) -> mx.array:
        return self.affine()[1]

    def row_slice(self, a: int, b: int) -> "QuantizedWeight":
        return QuantizedWeight(self.w[a:b], tuple(p[a:b] for p in self.parts), self.qtype, (b - a, self.shape[1]),
                               self.float_scales, self.dtype, self.compiled, tuple(f[a:b] for f in self.kernel_fields),
                               tuple(f[a:b] for f in self.split), self.former)

    def product(self, x) -> mx.array:
        """x @ self.T."""
        scales, biases = self.affine()
        return mx.quantized_matmul(x, self.w, scales, biases, transpose=True, group_size=GROUP, bits=self.bits)

    def dense(self) -> mx.array:
        """The [out, in] matrix in the products' dtype (`dense_product`: a prompt's rows on CUDA), by the
        affine_values kernel where the weight has a `former` (one launch), else by `affine_values`' graph:
        the same bits."""
        if self.former and not self.float_scales:
            return block_kernels.affine_values(self.former, self)
        return affine_values(self)

    def after(self, y) -> "QuantizedWeight":
        """This weight with its codes (and the kernels' views of its fields) made to depend on y
        (`dense_product`)."""
        return replace(self, w=mx.depends([self.w], [y])[0],
                       kernel_fields=tuple(mx.depends(list(self.kernel_fields), [y])) if self.kernel_fields else ())

    def rows(self, ids) -> mx.array:
        scales, biases = self.affine(tuple(p[ids] for p in self.parts))
        return mx.dequantize(self.w[ids], scales, biases, group_size=GROUP, bits=self.bits)


def affine_values(w: QuantizedWeight) -> mx.array:
    """w's [out, in] values in its products' dtype: each code times its group's scale plus its bias (the
    scales and biases in the products' dtype, `QuantizedWeight.affine`) in float32 (the product exact: a
    code of at most 8 bits times a scale of at most 17 significant bits; the sum rounded), then rounded
    once to the dtype. The codes are MLX's dequantization with scale 1 and bias 0 (exact). blocks.cu's
    affine_values kernel writes the same bits in one launch. (In float32 the values are gguf-py's, +-0
    aside; in 16 bits they may differ from `mx.dequantize`'s, whose arithmetic is in the dtype there.)"""
    scales, biases = w.affine()
    n, k = w.shape
    ones = mx.ones(scales.shape, mx.float32)
    codes = mx.reshape(mx.dequantize(w.w, ones, mx.zeros_like(ones), group_size=GROUP, bits=w.bits), (n, k // GROUP, GROUP))
    products = mx.multiply(codes, mx.expand_dims(scales.astype(mx.float32), -1))
    return mx.reshape(mx.add(products, mx.expand_dims(biases.astype(mx.float32), -1)).astype(w.dtype), (n, k))


@dataclass
class BlockWeight:
    """An [out, in] matrix kept as the file's blocks (or 16-bit values), dequantized at each use."""

    parts: tuple
    qtype: Q
    shape: tuple[int, int]  # (out, in)
    dtype: mx.Dtype = mx.float32  # the products' dtype: the dequantized values are cast to it
    kernel_fields: tuple = ()  # the block kernels' inputs, made once at load (`block_kernels.kernel_fields`)
    compiled: bool = False  # a FUSABLE type's values formed by `formed_values` (on a GPU: one launch, not ~10)
    former: str | None = None  # the GPU ("cuda", "metal") whose kernel forms its values (`block_kernels.FORMED`)

    def row_slice(self, a: int, b: int) -> "BlockWeight":
        return BlockWeight(tuple(p[a:b] for p in self.parts), self.qtype, (b - a, self.shape[1]), self.dtype,
                           tuple(f[a:b] for f in self.kernel_fields), self.compiled, self.former)

    def dense(self) -> mx.array:
        if self.former:  # its kernel (`block_kernels.formed_values`: the same bits, no view around it)
            return block_kernels.formed_values(self.former, self)
        if self.compiled and self.qtype in FUSABLE:
            return formed_values(self.qtype, self.dtype)(*self.parts)
        return dequantize(self.qtype, self.parts, *self.shape, self.dtype)

    def after(self, y) -> "BlockWeight":
        """This weight with its fields (and the kernels' views of them) made to depend on y (`dense_product`)."""
        return replace(self, parts=tuple(mx.depends(list(self.parts), [y])),
                       kernel_fields=tuple(mx.depends(list(self.kernel_fields), [y])) if self.kernel_fields else ())

    def product(self, x) -> mx.array:
        return dense_product(self, x)

    def rows(self, ids) -> mx.array:
        ids = mx.reshape(ids, (-1,))
        return dequantize(self.qtype, tuple(p[ids] for p in self.parts), ids.shape[0], self.shape[1])


PackedWeight = (QuantizedWeight, BlockWeight)  # the kinds with a row_slice / product / rows / dense


def dense_product(w, x) -> mx.array:
    """x @ w.T with w dequantized (`w.dense()`) in slices of rows of at most DENSE_SLICE_BYTES as
    float32, the first slice's fields made to depend on x and each later slice's on the previous slice's
    product (`w.after`: left to itself MLX dequantizes every slice, and every product's of a pass, before
    the first product: nothing they read waits), so the transient matrix is one slice, not the whole (a
    Qwen3-8B-shaped Q6_K output head is 2.5 GB as float32), nor every layer's. 512 MB: an 8B shape's
    largest layer product (gate and up, 24,576 x 4,096) is one slice, one launch of each kind; at 128 MB it
    was three, and their concatenation, on a prompt pass whose host work bounds it (docs/performance.md,
    "An 8B prompt pass by kernel")."""
    rows, cols = w.shape
    step = max(1, DENSE_SLICE_BYTES // (4 * cols))
    outs = []
    for a in range(0, rows, step):
        part = w.row_slice(a, min(a + step, rows)) if rows > step else w
        outs.append(mx.matmul(x, mx.transpose(part.after(outs[-1] if outs else x).dense())))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)


@dataclass
class ExpertStack:
    """[experts, out, in] expert matrices (a mixture of experts' `*_exps`) kept as compact as the file:
    `weight` is a QuantizedWeight or BlockWeight of the stack as [experts * out, in] rows, or None for
    float32, then `dense` [experts, in, out]. `products` multiplies each row by its chosen experts:
    affine types through `mx.gather_qmm` (only the chosen experts' codes are read), block and 16-bit
    types dequantized then `mx.gather_mm` (`chosen`: only the selected experts where they are fewer
    than the stack's)."""

    shape: tuple[int, int, int]  # (experts, out, in)
    weight: object = None
    dense: object = None

    def products(self, x, ids) -> mx.array:
        """x [N, 1, 1, in] by the experts `ids` [N, k] -> [N, k, 1, out]."""
        e, out, n_in = self.shape
        w = self.weight
        if w is None:
            return mx.gather_mm(x, self.dense, rhs_indices=ids)
        if isinstance(w, QuantizedWeight):
            scales, biases = (mx.reshape(a, (e, out, -1)) for a in w.affine())
            return mx.gather_qmm(x, mx.reshape(w.w, (e, out, -1)), scales, biases, rhs_indices=ids, transpose=True,
                                 group_size=GROUP, bits=w.bits)
        if ids.size < e:
            w, ids = self.chosen(ids)
        return mx.gather_mm(x, mx.swapaxes(mx.reshape(w.dense(), (-1, out, n_in)), 1, 2), rhs_indices=ids)

    def chosen(self, ids) -> tuple[BlockWeight, mx.array]:
        """The selected experts alone: a BlockWeight of the N·k experts `ids` [N, k] names, in its order
        (each field's [experts, out, ...] view gathered on the expert axis: stored bytes, no arithmetic),
        and the indices into it (the j-th of the flattened ids reads its j-th expert).

        The rule (`products`: this while N·k < e): an expert is dequantized once each time it is
        selected, so this is less work than the whole stack while the selections are fewer than the
        experts (decode: 8 of 128 in Qwen3-30B-A3B, 1/16 of the work and of the transient float32
        stack); from N·k >= e on (prefill, large batches) the whole stack once is no more. Selections,
        not distinct experts: counting those needs the ids on the host, a sync inside the step and a
        shape the compiled decode step cannot trace. The products are gather_mm's over the same
        values, so the bits are the whole stack's (tested on MLX's CPU)."""
        e, out, _ = self.shape
        w, flat = self.weight, mx.reshape(ids, (-1,))
        parts = tuple(mx.reshape(mx.take(mx.reshape(p, (e, out, *p.shape[1:])), flat, axis=0), (-1, *p.shape[1:]))
                      for p in w.parts)
        local = mx.reshape(mx.arange(flat.size, dtype=ids.dtype), ids.shape)
        return BlockWeight(parts, w.qtype, (flat.size * out, w.shape[1]), w.dtype), local


@dataclass
class WeightGroup:
    """Matrices that multiply the same activations, side by side as one (`merged`: a packed weight's
    rows stacked, or a float [in, sum(out)] array), so `linear_group` is one product; iterating gives
    each matrix as a view of `merged` (the per-matrix handles the default `linear_group` multiplies)."""

    merged: object
    sizes: tuple[int, ...]  # each matrix's output columns

    def __iter__(self):
        start = 0
        for n in self.sizes:
            m = self.merged
            if isinstance(m, PackedWeight):
                yield m.row_slice(start, start + n)
            else:
                yield m[:, start:start + n]
            start += n


@dataclass
class WeightRuns:
    """Matrices that multiply the same activations but do not all share a layout (a Q4_K_M file's Q and
    K in Q4_K beside a V in Q6_K): each run of consecutive matrices of one layout a `WeightGroup`, one
    product a run; iterating gives each matrix in order, as a WeightGroup does."""

    runs: tuple  # WeightGroup each

    def __iter__(self):
        for run in self.runs:
            yield from run


def to_device(qtype, arrays, shape, float_scales: bool = False, dtype=mx.float32, compiled: bool = False) -> object:
    """The weight from `quants.split`'s host arrays (or a float32 matrix when qtype is None, cast to
    `dtype`). With `float_scales` an affine type's scales and biases are formed once here instead of at
    each use: the same bits (the same operations), one elementwise pass less a product, 1.17x (Q8_0,
    Q5_1) to 1.33x (Q4_0, Q4_K) the file's bytes instead of 1.0-1.03x in float32. `compiled`: the affine
    scales formed at each use by one compiled kernel (`QuantizedWeight.affine`), and a FUSABLE block
    type's values (`BlockWeight.dense`)."""
    arrays = tuple(mx.array(a) for a in arrays)
    if qtype is None:
        arrays = (arrays[0].astype(dtype),)
    mx.eval(*arrays)
    if qtype is None:
        return arrays[0]
    if qtype in AFFINE_BITS:
        if float_scales:
            affine = affine_scales(qtype, arrays[1:], dtype)
            mx.eval(*affine)
            return QuantizedWeight(arrays[0], affine, qtype, shape, True, dtype)
        split = ()
        if qtype in (Q.Q4_K, Q.Q5_K):
            split = split_scale_fields(arrays[1:])
            mx.eval(*split)
        return QuantizedWeight(arrays[0], arrays[1:], qtype, shape, dtype=dtype, compiled=compiled, split=split)
    return BlockWeight(arrays, qtype, shape, dtype, compiled=compiled)
