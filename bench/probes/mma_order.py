"""Can a tensor-core product be part of a published order (issue 30, item 3)?

A byte-identity contract between two paths that both use `mma.sync.m16n8k16` (bf16 or f16 inputs,
float32 accumulators) holds if the instruction's result for one output element depends only on that
element's 16 products, their k positions and its accumulator, and not on where in the 16 x 8 tile the
element sits (its row, its column) or on the tile's other values. The hardware's internal order of the
16-term sum is not published, so this cannot be read from a document: this probe asks the GPU.

Trials (one warp each, one m16n8k16 instruction):
- `same`: every row of A the same 16 values, every column of B the same, every accumulator the same:
  all 128 results must have the same bits (position invariance);
- `mixed`: trial `same`'s row and column placed at one position of a tile otherwise random: that
  element must equal the `same` trial's (independence from the other elements);
- `exact`: how the result compares with the exactly rounded float32 of the exact sum (float64 here;
  the products of 8-bit significands are exact in float64 and 16 of them plus the accumulator too, for
  the exponent ranges drawn): the share that are exactly rounded, and the largest error in ulps;
- `perm`: the same 16 products with their k positions permuted: whether the position in k matters.

    python3 bench/probes/mma_order.py [--trials 4096] [--out mma.jsonl]

MLX CUDA only.
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx
import numpy as np

from jsonl import emit

HEADER = """
template <typename U> __device__ inline uint32_t mlxi_pack2(const U* p) { return *reinterpret_cast<const uint32_t*>(p); }
"""
BODY = """
    uint32_t lane = threadIdx.x & 31u, warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    uint32_t g = lane >> 2, t = lane & 3u;
    const T* A = a + warp * 256; const T* B = b + warp * 128; const float* C = c + warp * 128;
    uint32_t a0 = mlxi_pack2(A + g * 16 + t * 2), a1 = mlxi_pack2(A + (g + 8) * 16 + t * 2);
    uint32_t a2 = mlxi_pack2(A + g * 16 + t * 2 + 8), a3 = mlxi_pack2(A + (g + 8) * 16 + t * 2 + 8);
    uint32_t b0 = mlxi_pack2(B + g * 16 + t * 2), b1 = mlxi_pack2(B + g * 16 + t * 2 + 8);
    float d0 = C[g * 8 + t * 2], d1 = C[g * 8 + t * 2 + 1], d2 = C[(g + 8) * 8 + t * 2], d3 = C[(g + 8) * 8 + t * 2 + 1];
    if (BF) {
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                   : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                   : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
    float* D = out + warp * 128;
    D[g * 8 + t * 2] = d0; D[g * 8 + t * 2 + 1] = d1; D[(g + 8) * 8 + t * 2] = d2; D[(g + 8) * 8 + t * 2 + 1] = d3;
"""
_KERNEL = mx.fast.cuda_kernel(name="mlxinfer_mma_probe", input_names=["a", "b", "c"], output_names=["out"],
                              source=BODY, header=HEADER, ensure_row_contiguous=True)


def mma(a, b, c, dtype):
    """[trials, 16, 8] float32: one m16n8k16 instruction per trial; a [trials, 16, 16] (m, k), b [trials, 8, 16]
    (n, k), c [trials, 16, 8]."""
    n = a.shape[0]
    (out,) = _KERNEL(inputs=[mx.array(a).astype(dtype), mx.array(b).astype(dtype), mx.array(c)],
                     template=[("T", dtype), ("BF", dtype == mx.bfloat16)], grid=(32 * n, 1, 1),
                     threadgroup=(128, 1, 1), output_shapes=[(n, 16, 8)], output_dtypes=[mx.float32])
    return np.array(out)


def draw(rng, shape, dtype, spread):
    """Values exactly representable in `dtype`, magnitudes over 2^-spread .. 2^spread, both signs."""
    v = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-spread, spread + 1, shape)).astype(np.float32)
    return np.array(mx.array(v).astype(dtype).astype(mx.float32))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=4096)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        print("mma_order.py needs MLX's CUDA backend", file=sys.stderr)
        return 1
    n = args.trials - args.trials % 4
    for name, dtype in (("bfloat16", mx.bfloat16), ("float16", mx.float16)):
        for spread in (0, 4, 12):
            if dtype == mx.float16 and spread > 6:
                continue
            rng = np.random.default_rng(spread)
            row, col = draw(rng, (n, 16), dtype, spread), draw(rng, (n, 16), dtype, spread)
            acc = draw(rng, (n,), mx.float32, spread) * np.float32(4)
            a = np.repeat(row[:, None, :], 16, 1)
            b = np.repeat(col[:, None, :], 8, 1)
            c = np.repeat(np.repeat(acc[:, None, None], 16, 1), 8, 2)
            same = mma(a, b, c, dtype)
            bits = same.view(np.uint32).reshape(n, -1)
            invariant = int(np.sum(np.all(bits == bits[:, :1], axis=1)))
            # the same element at a random position of an otherwise random tile
            ra, rb = draw(rng, (n, 16, 16), dtype, spread), draw(rng, (n, 8, 16), dtype, spread)
            rc = draw(rng, (n, 16, 8), mx.float32, spread)
            i, j = rng.integers(0, 16, n), rng.integers(0, 8, n)
            ra[np.arange(n), i] = row
            rb[np.arange(n), j] = col
            rc[np.arange(n), i, j] = acc
            mixed = mma(ra, rb, rc, dtype)[np.arange(n), i, j]
            independent = int(np.sum(mixed.view(np.uint32) == same[:, 0, 0].view(np.uint32)))
            exact = (row.astype(np.float64) * col.astype(np.float64)).sum(1) + acc.astype(np.float64)
            rounded = exact.astype(np.float32)
            got = same[:, 0, 0]
            ulp = np.abs(got.astype(np.float64) - rounded.astype(np.float64)) / np.maximum(
                np.spacing(np.abs(rounded)).astype(np.float64), 1e-45)
            perm = rng.permutation(16)
            permuted = mma(np.repeat(row[:, None, perm], 16, 1), np.repeat(col[:, None, perm], 8, 1), c, dtype)[:, 0, 0]
            emit({"dtype": name, "spread": spread, "trials": n, "position_invariant": invariant,
                  "independent_of_tile": independent, "exactly_rounded": int(np.sum(got == rounded)),
                  "max_ulps_from_exact": float(ulp.max()), "truncated_toward_zero": int(np.sum(np.abs(got) <= np.abs(rounded))),
                  "k_permutation_same_bits": int(np.sum(permuted.view(np.uint32) == got.view(np.uint32)))}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
