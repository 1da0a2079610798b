// Products straight from a GGUF block type's fields (mlxinfer/block_kernels.py, through
// mx.fast.cuda_kernel): out[m, n] = sum_i x[m, i] * w[n, i] for a few rows m of x (decode), where w's
// values are dequantized in registers exactly as gguf-py computes them, never written to memory.
//
// The order, the same for every row count M (so a row's result does not depend on its batch):
//   one warp per output row n; the row's values are cut into work units of 32 (Q6_K below says which);
//   lane l (0..31) takes units l, l + 32, ... in increasing order and, in each, its 32 values in a
//   fixed sequence; each product x*w is rounded, then added
//   to the lane's partial sum (__fmul_rn / __fadd_rn: no contraction into fma); then the butterfly
//   s += shfl_xor(s, off) for off = 16, 8, 4, 2, 1. block_kernels.emulate follows it in numpy.
//@@HEADER
#define MLXI_THREADS 256
#define MLXI_WARPS 8

// An IEEE half's bits as float, exactly (every half is a float).
__device__ __forceinline__ float mlxi_half_bits(unsigned int h) {
  const unsigned int sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {  // zero and subnormals: m * 2^-24, exact
    const float v = __fmul_rn((float)m, 5.9604644775390625e-8f);
    return sign ? -v : v;
  }
  if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
  return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

__device__ __forceinline__ float mlxi_warp_total(float s) {
  for (int off = 16; off > 0; off >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off));
  return s;
}
//@@BODY q6_k_matvec
// x [M, K] (T: float, __half or __nv_bfloat16); the Q6_K fields of w [N, K] as quants.split keeps them,
// per row and block of 256 values: ql [N, K/256, 128] uint8, qh [N, K/256, 64] uint8, scales
// [N, K/256, 16] int8, d [N, K/256] the fp16 scale's bits (uint16); dims = [N, K]; out [M, N] (T).
// Value i of a block (gguf-py's order): h = i / 128, r = i % 128; low four bits from
// ql[64h + r % 64] >> (4 * (r / 64)), high two from qh[32h + r % 32] >> (2 * (r / 32)); q = low | high << 4;
// w = (d * scales[i / 16]) * (q - 32).
// Work units: u = 8b + p, part p = 4h + c of block b holds r = 8c + t + 32j (t, j: 0..7, 0..3): eight
// consecutive bytes of ql at 64h + 8c and at 64h + 32 + 8c, eight of qh at 32h + 8c, one scale per j.
// Lane l takes the units u = l, l + 32, ... and in each adds j = 0..3, t = 0..7 in that order: the units
// of a row are loaded in parallel by the lanes (a row of 1,024 values is one unit a lane).
const int N = dims[0], K = dims[1];
const int units = K / 32;
const int lane = threadIdx.x & 31;
const long n = ((long)blockIdx.y * gridDim.x + blockIdx.x) * MLXI_WARPS + (threadIdx.x >> 5);
if (n >= N) return;
float acc[M];
for (int m = 0; m < M; ++m) acc[m] = 0.0f;
for (int u = lane; u < units; u += 32) {
  const int b = u >> 3, h = (u >> 2) & 1, c = u & 3;
  const long blk = n * (K / 256) + b;
  const float d = mlxi_half_bits(d_bits[blk]);
  const uint2 lo0 = *reinterpret_cast<const uint2*>(ql + blk * 128 + 64 * h + 8 * c);
  const uint2 lo1 = *reinterpret_cast<const uint2*>(ql + blk * 128 + 64 * h + 32 + 8 * c);
  const uint2 hb = *reinterpret_cast<const uint2*>(qh + blk * 64 + 32 * h + 8 * c);
  const int8_t* sc = scales + blk * 16 + 8 * h + (c >> 1);
  const long col = (long)b * 256 + 128 * h + 8 * c;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float dl = __fmul_rn(d, (float)sc[2 * j]);
    const uint2 lo = (j & 1) ? lo1 : lo0;
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const unsigned int lb = ((t < 4 ? lo.x : lo.y) >> (8 * (t & 3))) & 0xffu;
      const unsigned int hbyte = ((t < 4 ? hb.x : hb.y) >> (8 * (t & 3))) & 0xffu;
      const unsigned int q = ((lb >> (4 * (j >> 1))) & 0xfu) | (((hbyte >> (2 * j)) & 3u) << 4);
      const float w = __fmul_rn(dl, (float)((int)q - 32));
      for (int m = 0; m < M; ++m) acc[m] = __fadd_rn(acc[m], __fmul_rn((float)x[(long)m * K + col + 32 * j + t], w));
    }
  }
}
for (int m = 0; m < M; ++m) {
  const float s = mlxi_warp_total(acc[m]);
  if (lane == 0) out[(long)m * N + n] = (T)s;
}
