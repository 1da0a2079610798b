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

// Code t (0..31) of a group packed as MLX packs it: one little-endian bit stream, code t at bits
// [BITS t, BITS (t + 1)) of the group's BITS words.
template <int BITS>
__device__ __forceinline__ unsigned int mlxi_code(const unsigned int* words, int t) {
  const int bit = BITS * t, wi = bit >> 5, sh = bit & 31;
  unsigned int v = words[wi] >> sh;
  if (sh + BITS > 32) v |= words[wi + 1] << (32 - sh);
  return v & ((1u << BITS) - 1u);
}

// One affine group of 32 values (w_t = scale * q_t + bias, each step rounded) into the row sums acc:
// t = 0..31 in order, x's columns col..col + 31.
template <int BITS, int M, typename X>
__device__ __forceinline__ void mlxi_affine_group(const X* x, long K, long col, const unsigned int* w_row, long g,
                                                  float scale, float bias, float* acc) {
  unsigned int words[BITS];
#pragma unroll
  for (int i = 0; i < BITS; ++i) words[i] = w_row[g * BITS + i];
#pragma unroll
  for (int t = 0; t < 32; ++t) {
    const float w = __fadd_rn(__fmul_rn(scale, (float)mlxi_code<BITS>(words, t)), bias);
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = __fadd_rn(acc[m], __fmul_rn((float)x[(long)m * K + col + t], w));
  }
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
//@@BODY affine_matvec
// The affine types as the MLX backend keeps them (quants.split): w [N, K BITS / 32] uint32 (MLX's packing),
// then the file's scale fields, by SCALES: 0 (Q8_0, Q4_0, Q5_0) s0 [N, K / 32] the fp16 d's bits, scale d,
// bias -(d * ZERO) (ZERO 128, 8, 16: exact), s1 unused; 1 (Q4_1, Q5_1) s0 d and s1 m [N, K / 32] (fp16 bits),
// scale d, bias m; 2 (Q4_K, Q5_K) s0 [N, K / 256, 2] the fp16 d and dmin's bits, s1 [N, K / 256, 2, 8]
// uint8 sub-scales then mins, group g = 8b + j: scale d sc_j, bias -(dmin m_j) (quants: exact).
// dims = [N, K]; out [M, N]. Lane l takes groups l, l + 32, ..., each t = 0..31 (mlxi_affine_group).
const int N = dims[0], K = dims[1];
const int lane = threadIdx.x & 31;
const long n = ((long)blockIdx.y * gridDim.x + blockIdx.x) * MLXI_WARPS + (threadIdx.x >> 5);
if (n >= N) return;
float acc[M];
for (int m = 0; m < M; ++m) acc[m] = 0.0f;
const unsigned int* w_row = w + n * (K / 32) * BITS;
for (long g = lane; g < K / 32; g += 32) {
  const long at = n * (K / 32) + g, blk = n * (K / 256) + (g >> 3);
  float scale, bias;
  if (SCALES == 2) {
    const int j = g & 7;
    scale = __fmul_rn(mlxi_half_bits(s0[2 * blk]), (float)s1[16 * blk + j]);
    bias = -__fmul_rn(mlxi_half_bits(s0[2 * blk + 1]), (float)s1[16 * blk + 8 + j]);
  } else if (SCALES == 1) {
    scale = mlxi_half_bits(s0[at]);
    bias = mlxi_half_bits(s1[at]);
  } else {
    scale = mlxi_half_bits(s0[at]);
    bias = -__fmul_rn(scale, (float)ZERO);
  }
  mlxi_affine_group<BITS, M>(x, K, g * 32, w_row, g, scale, bias, acc);
}
for (int m = 0; m < M; ++m) {
  const float s = mlxi_warp_total(acc[m]);
  if (lane == 0) out[(long)m * N + n] = (T)s;
}
