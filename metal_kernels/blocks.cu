// Products straight from a GGUF block type's fields (mlxinfer/block_kernels.py, through
// mx.fast.cuda_kernel): out[m, n] = sum_i x[m, i] * w[n, i] for a few rows m of x (decode), where w's
// values are dequantized in registers exactly as gguf-py computes them, never written to memory.
//
// The order, the same for every row count M (so a row's result does not depend on its batch):
//   one warp per output row n; lane l (0..31) walks the blocks b = 0, 1, ... of the row and, in each
//   block, the values it owns in a fixed sequence (Q6_K below); each product x*w is rounded, then added
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
// w = (d * scales[i / 16]) * (q - 32). Lane l owns, in each half h, r = l, l + 32, l + 64, l + 96 (one qh
// byte, two ql bytes), in that order.
const int N = dims[0], K = dims[1];
const int nb = K / 256;
const int lane = threadIdx.x & 31;
const long n = ((long)blockIdx.y * gridDim.x + blockIdx.x) * MLXI_WARPS + (threadIdx.x >> 5);
if (n >= N) return;
float acc[M];
for (int m = 0; m < M; ++m) acc[m] = 0.0f;
for (int b = 0; b < nb; ++b) {
  const long blk = n * nb + b;
  const float d = mlxi_half_bits(d_bits[blk]);
  const uint8_t* l = ql + blk * 128;
  const uint8_t* hb = qh + blk * 64;
  const int8_t* sc = scales + blk * 16;
  for (int h = 0; h < 2; ++h) {
    const unsigned int hi = hb[32 * h + lane];
    const unsigned int lo0 = l[64 * h + lane], lo1 = l[64 * h + 32 + lane];
    const unsigned int q4[4] = {(lo0 & 0xfu) | ((hi & 3u) << 4), (lo1 & 0xfu) | (((hi >> 2) & 3u) << 4),
                                (lo0 >> 4) | (((hi >> 4) & 3u) << 4), (lo1 >> 4) | (((hi >> 6) & 3u) << 4)};
    for (int j = 0; j < 4; ++j) {
      const int r = lane + 32 * j;
      const float w = __fmul_rn(__fmul_rn(d, (float)sc[8 * h + r / 16]), (float)((int)q4[j] - 32));
      const long col = (long)b * 256 + 128 * h + r;
      for (int m = 0; m < M; ++m) acc[m] = __fadd_rn(acc[m], __fmul_rn((float)x[(long)m * K + col], w));
    }
  }
}
for (int m = 0; m < M; ++m) {
  const float s = mlxi_warp_total(acc[m]);
  if (lane == 0) out[(long)m * N + n] = (T)s;
}
