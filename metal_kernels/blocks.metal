// Products straight from a GGUF block type's fields for MLX's Metal backend (mx.fast.metal_kernel): the
// twin of blocks.cu, in the same order (one simdgroup per output row, lane l's values in the same
// sequence, each product rounded then added, the butterfly 16, 8, 4, 2, 1).
//
// UNVERIFIED ON HARDWARE, as attention.metal: parsed with clang against a stand-in for Metal's headers
// (tests/test_block_kernels.py); on a Mac the MLX backend checks these products on the device against
// MLX's own (`verify_gpu_kernels`) before it uses any kernel of ours.
//@@HEADER
#include <metal_simdgroup>
#pragma clang fp contract(off)
#pragma clang fp reassociate(off)
#define MLXI_THREADS 256
#define MLXI_WARPS 8

inline float mlxi_half_bits(uint h) {
  return float(as_type<half>(ushort(h)));  // every half is a float: exact
}

inline float mlxi_warp_total(float s) {
  for (ushort off = 16; off > 0; off >>= 1) s = s + simd_shuffle_xor(s, off);
  return s;
}
//@@BODY q6_k_matvec
// As in blocks.cu: x [M, K], ql, qh, scales, d_bits (Q6_K fields), dims = [N, K], out [M, N].
const int N = dims[0], K = dims[1];
const int nb = K / 256;
const uint lane = thread_index_in_simdgroup;
const long n = ((long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x)
    * MLXI_WARPS + simdgroup_index_in_threadgroup;
if (n >= N) return;
float acc[M];
for (int m = 0; m < M; ++m) acc[m] = 0.0f;
for (int b = 0; b < nb; ++b) {
  const long blk = n * nb + b;
  const float d = mlxi_half_bits(d_bits[blk]);
  for (int h = 0; h < 2; ++h) {
    const uint hi = qh[blk * 64 + 32 * h + lane];
    const uint lo0 = ql[blk * 128 + 64 * h + lane], lo1 = ql[blk * 128 + 64 * h + 32 + lane];
    const uint q4[4] = {(lo0 & 0xfu) | ((hi & 3u) << 4), (lo1 & 0xfu) | (((hi >> 2) & 3u) << 4),
                        (lo0 >> 4) | (((hi >> 4) & 3u) << 4), (lo1 >> 4) | (((hi >> 6) & 3u) << 4)};
    for (int j = 0; j < 4; ++j) {
      const int r = lane + 32 * j;
      const float dl = d * float(scales[blk * 16 + 8 * h + r / 16]);
      const float w = dl * float(int(q4[j]) - 32);
      const long col = (long)b * 256 + 128 * h + r;
      for (int m = 0; m < M; ++m) {
        const float prod = float(x[(long)m * K + col]) * w;
        acc[m] = acc[m] + prod;
      }
    }
  }
}
for (int m = 0; m < M; ++m) {
  const float s = mlxi_warp_total(acc[m]);
  if (lane == 0) out[(long)m * N + n] = T(s);
}
