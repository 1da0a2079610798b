// Products straight from a GGUF block type's fields for MLX's Metal backend (mx.fast.metal_kernel): the
// twin of blocks.cu, in the same order (one simdgroup per output row, lane l's work units and values in
// the same sequence, added value by value or by runs as blocks.cu's header says for each type, the
// butterfly 16, 8, 4, 2, 1). A simdgroup takes one
// output row (dims[2] is 1: `block_kernels.rows_per_warp`); blocks.cu's warps may take several.
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

// ADD's epilogue (blocks.cu's mlxi_residual_sum): the residual r plus the sum s rounded to T first, added
// in float32 and rounded once more, as the graph's Add of the product; res is not read without ADD.
template <typename T>
inline T mlxi_residual_sum(T r, float s) {
  return T(float(r) + float(T(s)));
}

// Entry c of IQ4_NL's and IQ4_XS's codebook (blocks.cu's mlxi_iq4_value).
inline float mlxi_iq4_value(uint c) {
  const char v[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
  return float(v[c]);
}

// Group g's scale and bias of an affine weight, rounded to T, as float (blocks.cu's mlxi_group_affine).
template <typename T, int SCALES, int ZERO, typename S0, typename S1>
inline void mlxi_group_affine(S0 s0, S1 s1, long g, thread float& scale, thread float& bias) {
  if (SCALES == 2) {
    const long blk = g >> 3;
    const int j = int(g & 7);
    scale = float(T(mlxi_half_bits(s0[2 * blk]) * float(s1[16 * blk + j])));
    const float mins = mlxi_half_bits(s0[2 * blk + 1]) * float(s1[16 * blk + 8 + j]);
    bias = float(T(-mins));
  } else if (SCALES == 1) {
    scale = float(T(mlxi_half_bits(s0[g])));
    bias = float(T(mlxi_half_bits(s1[g])));
  } else {
    scale = float(T(mlxi_half_bits(s0[g])));
    bias = float(T(scale * -float(ZERO)));
  }
}

// Code t of a group packed as MLX packs it (blocks.cu's mlxi_code).
template <int BITS>
inline uint mlxi_code(thread const uint* words, int t) {
  const int bit = BITS * t, wi = bit >> 5, sh = bit & 31;
  uint v = words[wi] >> sh;
  if (sh + BITS > 32) v |= words[wi + 1] << (32 - sh);
  return v & ((1u << BITS) - 1u);
}

// RMSNorm (blocks.cu's mlxi_rms_inv and mlxi_norm_value, the same order): row's scale, one simdgroup
// (lane l adds x_i * x_i for i = l, l + 32, ..., each rounded; the butterfly), times the float32 1/K,
// plus eps, the square root and the division each correctly rounded; a value (x * inv) * w, each
// product rounded, and rounded to T. (MSL's tables give precise divide as correctly rounded; precise sqrt's
// rounding is not confirmed here: on a Mac `verify_rms_norm` compares this kernel with the numpy order
// bit for bit before any norm uses it.)
template <typename XP>
inline float mlxi_rms_inv(XP row, int K, float eps, uint lane) {
  float s = 0.0f;
  for (int i = lane; i < K; i += 32) {
    const float v = float(row[i]);
    s = s + v * v;
  }
  s = mlxi_warp_total(s);
  return metal::precise::divide(1.0f, metal::precise::sqrt(s * metal::precise::divide(1.0f, float(K)) + eps));
}

template <typename T>
inline float mlxi_norm_value(float v, float inv, float w) {
  return float(T((v * inv) * w));
}

// SwiGLU (blocks.cu's mlxi_exp and mlxi_swiglu_value, the same order): e^t by n = rint(t log2 e),
// r = (t - n C1) - n C2, the degree-7 Taylor polynomial in Horner's order, times 2^n; silu = g / (1 + e)
// for t = -g clamped to [-20, 88], rounded to T, times u, rounded to T.
inline float mlxi_exp(float t) {
  const float n = metal::rint(t * 1.44269502162933349609375f);
  const float r = (t - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.98412701e-4f;
  p = p * r + 1.38888892e-3f;
  p = p * r + 8.33333377e-3f;
  p = p * r + 4.16666679e-2f;
  p = p * r + 1.66666672e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * as_type<float>((int(n) + 127) << 23);
}

template <typename T>
inline float mlxi_swiglu_value(float g, float u) {
  const float t = metal::min(metal::max(-g, -20.0f), 88.0f);
  const float silu = float(T(metal::precise::divide(g, 1.0f + mlxi_exp(t))));
  return float(T(silu * u));
}

// Value c of x's row m as the product reads it: xform 1 (NORM) normed (inv[m]: the row's scale); xform 2
// (SWIGLU) x's rows are [g | u] of 2K values, and the value mlxi_swiglu_value(g_c, u_c).
template <typename T, typename XP, typename NP>
inline float mlxi_x(XP x, NP nw, thread const float* inv, int xform, int m, long K, long c) {
  if (xform == 2) return mlxi_swiglu_value<T>(float(x[(long)m * 2 * K + c]), float(x[(long)m * 2 * K + K + c]));
  const float v = float(x[(long)m * K + c]);
  return xform == 1 ? mlxi_norm_value<T>(v, inv[m], float(nw[c])) : v;
}

// A run's sum s plus code c times x's value v (blocks.cu's mlxi_code_times_x): for a 16-bit T one fma (c * v
// is exact but past float32's range, where the fma's one rounding is the order), for float32 the product
// rounded, then added.
template <typename T>
inline float mlxi_code_times_x(float s, float c, float v) {
  if (sizeof(T) == 2) return fma(c, v, s);
  const float prod = c * v;
  return s + prod;
}

// One affine group of 32 values into the row sums (blocks.cu's order): 8-bit codes (Q8_0) value by value,
// each value scale * code + bias, its product with x rounded, then added; the others by a run of 32: the
// products (code - zero) * x added from 0 (mlxi_code_times_x), x's values so where there is a bias,
// then scale * that (+ bias * x's sum), each step rounded (blocks.cu's mlxi_unit_by_runs).
template <int BITS, int ZERO, bool BIAS, int M, typename T, typename XP, typename WP, typename NP>
inline void mlxi_affine_group(XP x, long K, long col, WP w_row, long g, float scale, float bias, thread float* acc,
                              NP nw, thread const float* inv, int xform) {
  uint words[BITS];
  for (int i = 0; i < BITS; ++i) words[i] = w_row[g * BITS + i];
  if (BITS == 8) {
    for (int t = 0; t < 32; ++t) {
      const float sq = scale * float(mlxi_code<BITS>(words, t));
      const float w = sq + bias;
      for (int m = 0; m < M; ++m) {
        const float prod = mlxi_x<T>(x, nw, inv, xform, m, K, col + t) * w;
        acc[m] = acc[m] + prod;
      }
    }
    return;
  }
  for (int m = 0; m < M; ++m) {
    float s = 0.0f, sx = 0.0f;
    for (int t = 0; t < 32; ++t) {
      const float v = mlxi_x<T>(x, nw, inv, xform, m, K, col + t);
      s = mlxi_code_times_x<T>(s, float(int(mlxi_code<BITS>(words, t)) - ZERO), v);
      sx = sx + v;
    }
    const float run = scale * s;
    acc[m] = acc[m] + (BIAS ? run + bias * sx : run);
  }
}
// Row n's sums of a Q6_K weight into acc (q6_k_matvec's fields and order): work units of 32 values (u = 8b
// + 4h + c: r = 8c + t + 32j), lane l taking units l, l + 32, ..., each in the order j = 0..3, t = 0..7.
template <int M, typename T, typename XP, typename NP, typename QL, typename QH, typename SC, typename DB>
inline void mlxi_q6k_row(XP x, NP nw, thread const float* inv, int xform, long K, long n, uint lane, QL ql, QH qh,
                         SC scales, DB d_bits, thread float* acc) {
  for (int u = lane; u < K / 32; u += 32) {
    const int b = u >> 3, h = (u >> 2) & 1, c = u & 3;
    const long blk = n * (K / 256) + b;
    const float d = mlxi_half_bits(d_bits[blk]);
    const long lo_at = blk * 128 + 64 * h + 8 * c, hb_at = blk * 64 + 32 * h + 8 * c;
    const long col = (long)b * 256 + 128 * h + 8 * c;
    for (int j = 0; j < 4; ++j) {  // a run of 8 a sub-scale: (q - 32) * x added from 0, then dl * that
      const float dl = d * float(scales[blk * 16 + 8 * h + (c >> 1) + 2 * j]);
      float s[M];
      for (int m = 0; m < M; ++m) s[m] = 0.0f;
      for (int t = 0; t < 8; ++t) {
        const uint lb = ql[lo_at + 32 * (j & 1) + t], hbyte = qh[hb_at + t];
        const uint q = ((lb >> (4 * (j >> 1))) & 0xfu) | (((hbyte >> (2 * j)) & 3u) << 4);
        const float code = float(int(q) - 32);
        for (int m = 0; m < M; ++m) s[m] = mlxi_code_times_x<T>(s[m], code, mlxi_x<T>(x, nw, inv, xform, m, K, col + 32 * j + t));
      }
      for (int m = 0; m < M; ++m) {
        const float run = dl * s[m];
        acc[m] = acc[m] + run;
      }
    }
  }
}

// Row n's sums of an affine weight into acc (affine_matvec's fields, its scale fields by SCALES: 0, d
// and ZERO; 1, d and m; 2, the K-quants'), lane l taking groups l, l + 32, ...
template <int BITS, int SCALES, int ZERO, int M, typename T, typename XP, typename NP, typename WP, typename S0,
          typename S1>
inline void mlxi_affine_row(XP x, NP nw, thread const float* inv, int xform, long K, long n, uint lane, WP w, S0 s0,
                            S1 s1, thread float* acc) {
  const auto w_row = w + n * (K / 32) * BITS;
  for (long g = lane; g < K / 32; g += 32) {
    const long at = n * (K / 32) + g, blk = n * (K / 256) + (g >> 3);
    float scale, bias;
    if (SCALES == 2) {
      const int j = g & 7;
      scale = mlxi_half_bits(s0[2 * blk]) * float(s1[16 * blk + j]);
      const float mins = mlxi_half_bits(s0[2 * blk + 1]) * float(s1[16 * blk + 8 + j]);
      bias = -mins;
    } else if (SCALES == 1) {
      scale = mlxi_half_bits(s0[at]);
      bias = mlxi_half_bits(s1[at]);
    } else {
      scale = mlxi_half_bits(s0[at]);
      bias = -(scale * float(ZERO));  // (8-bit codes, by value; by runs the zero is in the code)
    }
    mlxi_affine_group<BITS, SCALES == 0 ? ZERO : 0, SCALES != 0, M, T>(x, K, g * 32, w_row, g, scale, bias, acc, nw,
                                                                    inv, xform);
  }
}
//@@BODY q6_k_matvec
// As in blocks.cu: x [M, K], ql, qh, scales, d_bits (Q6_K fields), dims = [N, K, 1, eps bits, forms], out [M, N]
// (mlxi_q6k_row: the units and their order).
const int N = dims[0], K = dims[1];
const uint lane = thread_index_in_simdgroup;
const long n = ((long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x)
    * MLXI_WARPS + simdgroup_index_in_threadgroup;
if (n >= N) return;
const bool add = dims[4] & 1, norm = (dims[4] >> 1) & 1;  // ADD, NORM, SWIGLU (blocks.cu's dims[4])
const int xform = (dims[4] >> 1) & 3;  // how x is read: 1 normed, 2 SwiGLU of [g | u]
float inv[M];  // NORM: each row's scale (dims[3]: eps's float32 bits)
for (int m = 0; m < M; ++m) inv[m] = norm ? mlxi_rms_inv(x + (long)m * K, K, as_type<float>(dims[3]), lane) : 1.0f;
float acc[M];
for (int m = 0; m < M; ++m) acc[m] = 0.0f;
mlxi_q6k_row<M, T>(x, nw, inv, xform, K, n, lane, ql, qh, scales, d_bits, acc);
for (int m = 0; m < M; ++m) {
  const float s = mlxi_warp_total(acc[m]);
  if (lane == 0) out[(long)m * N + n] = add ? mlxi_residual_sum(res[(long)m * N + n], s) : T(s);
}
//@@BODY affine_matvec
// As in blocks.cu: the affine types, their scale fields by SCALES (0: d and ZERO; 1: d, m; 2: K-quants).
const int N = dims[0], K = dims[1];
const uint lane = thread_index_in_simdgroup;
const long n = ((long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x)
    * MLXI_WARPS + simdgroup_index_in_threadgroup;
if (n >= N) return;
const bool add = dims[4] & 1, norm = (dims[4] >> 1) & 1;  // ADD, NORM, SWIGLU (blocks.cu's dims[4])
const int xform = (dims[4] >> 1) & 3;  // how x is read: 1 normed, 2 SwiGLU of [g | u]
float inv[M];  // NORM: each row's scale (dims[3]: eps's float32 bits)
for (int m = 0; m < M; ++m) inv[m] = norm ? mlxi_rms_inv(x + (long)m * K, K, as_type<float>(dims[3]), lane) : 1.0f;
float acc[M];
for (int m = 0; m < M; ++m) acc[m] = 0.0f;
mlxi_affine_row<BITS, SCALES, ZERO, M, T>(x, nw, inv, xform, K, n, lane, w, s0, s1, acc);
for (int m = 0; m < M; ++m) {
  const float s = mlxi_warp_total(acc[m]);
  if (lane == 0) out[(long)m * N + n] = add ? mlxi_residual_sum(res[(long)m * N + n], s) : T(s);
}
//@@BODY affine_q6_k_matvec
// As in blocks.cu (mlxi_pair_matvec): a weight group's two runs in one launch, A of an affine type (w, s0,
// s1) then B in Q6_K (ql, qh, scales, d_bits); dims = [NA, K, 1, eps bits, forms, NB] (forms: NORM or none);
// out [M, NA + NB] = [x @ A.T | x @ B.T]: the first ceil(NA / 8) threadgroups take A's rows, the rest B's.
const int NA = dims[0], K = dims[1], N = NA + dims[5];
const uint lane = thread_index_in_simdgroup;
const long group = (long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x;
const long blocks_a = (NA + MLXI_WARPS - 1) / MLXI_WARPS;
const bool in_a = group < blocks_a;
const long r = (in_a ? group : group - blocks_a) * MLXI_WARPS + simdgroup_index_in_threadgroup;  // the run's row
const long n = in_a ? r : NA + r;  // out's column
if (in_a ? r >= NA : n >= N) return;
const bool norm = (dims[4] >> 1) & 1;
const int xform = norm ? 1 : 0;
float inv[M];  // NORM: each row's scale (dims[3]: eps's float32 bits)
for (int m = 0; m < M; ++m) inv[m] = norm ? mlxi_rms_inv(x + (long)m * K, K, as_type<float>(dims[3]), lane) : 1.0f;
float acc[M];
for (int m = 0; m < M; ++m) acc[m] = 0.0f;
if (in_a)
  mlxi_affine_row<BITS, SCALES, ZERO, M, T>(x, nw, inv, xform, K, r, lane, w, s0, s1, acc);
else
  mlxi_q6k_row<M, T>(x, nw, inv, xform, K, r, lane, ql, qh, scales, d_bits, acc);
for (int m = 0; m < M; ++m) {
  const float s = mlxi_warp_total(acc[m]);
  if (lane == 0) out[(long)m * N + n] = T(s);
}
//@@BODY iq4_matvec
// As in blocks.cu: IQ4_NL (XS 0) and IQ4_XS (XS 1), qs, d_bits, sc_h, sc_l (IQ4_XS's scales; unused for
// IQ4_NL), dims = [N, K, 1, eps bits, forms]; group g of 32 values, dl = d or d * (ls - 32), value t = dl * the codebook's
// entry for code t (byte t's low nibble for t < 16, else byte t - 16's high one); lane l takes groups
// l, l + 32, ..., each t = 0..31.
const int N = dims[0], K = dims[1];
const uint lane = thread_index_in_simdgroup;
const long n = ((long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x)
    * MLXI_WARPS + simdgroup_index_in_threadgroup;
if (n >= N) return;
const bool add = dims[4] & 1, norm = (dims[4] >> 1) & 1;  // ADD, NORM, SWIGLU (blocks.cu's dims[4])
const int xform = (dims[4] >> 1) & 3;  // how x is read: 1 normed, 2 SwiGLU of [g | u]
float inv[M];  // NORM: each row's scale (dims[3]: eps's float32 bits)
for (int m = 0; m < M; ++m) inv[m] = norm ? mlxi_rms_inv(x + (long)m * K, K, as_type<float>(dims[3]), lane) : 1.0f;
float acc[M];
for (int m = 0; m < M; ++m) acc[m] = 0.0f;
for (long g = lane; g < K / 32; g += 32) {
  float dl;
  long at;
  if (XS) {
    const long blk = n * (K / 256) + (g >> 3);
    const int j = g & 7;
    const uint ls = ((uint(sc_l[4 * blk + (j >> 1)]) >> (4 * (j & 1))) & 0xfu) | (((uint(sc_h[blk]) >> (2 * j)) & 3u) << 4);
    dl = mlxi_half_bits(d_bits[blk]) * float(int(ls) - 32);
    at = blk * 128 + 16 * j;
  } else {
    dl = mlxi_half_bits(d_bits[n * (K / 32) + g]);
    at = (n * (K / 32) + g) * 16;
  }
  for (int t = 0; t < 32; ++t) {
    const uint code = (uint(qs[at + (t & 15)]) >> (4 * (t >> 4))) & 0xfu;
    const float w = dl * mlxi_iq4_value(code);
    for (int m = 0; m < M; ++m) {
      const float prod = mlxi_x<T>(x, nw, inv, xform, m, K, g * 32 + t) * w;
      acc[m] = acc[m] + prod;
    }
  }
}
for (int m = 0; m < M; ++m) {
  const float s = mlxi_warp_total(acc[m]);
  if (lane == 0) out[(long)m * N + n] = add ? mlxi_residual_sum(res[(long)m * N + n], s) : T(s);
}
//@@BODY q3_k_matvec
// As in blocks.cu (mlxi_q3k): hmask, qs, sc3, d_bits, dims = [N, K, 1, eps bits, forms]; group g = values 32 j .. 32 j + 31
// of block g / 8; value t: low (qs[32 h + t] >> 2 s) & 3, high (hmask[t] >> j) & 1 (h = j / 4, s = j % 4),
// q = low - 4 (1 - high), times d * (scale k - 32), k = 2 j + t / 16.
const int N = dims[0], K = dims[1];
const uint lane = thread_index_in_simdgroup;
const long n = ((long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x)
    * MLXI_WARPS + simdgroup_index_in_threadgroup;
if (n >= N) return;
const bool add = dims[4] & 1, norm = (dims[4] >> 1) & 1;  // ADD, NORM, SWIGLU (blocks.cu's dims[4])
const int xform = (dims[4] >> 1) & 3;  // how x is read: 1 normed, 2 SwiGLU of [g | u]
float inv[M];  // NORM: each row's scale (dims[3]: eps's float32 bits)
for (int m = 0; m < M; ++m) inv[m] = norm ? mlxi_rms_inv(x + (long)m * K, K, as_type<float>(dims[3]), lane) : 1.0f;
float acc[M];
for (int m = 0; m < M; ++m) acc[m] = 0.0f;
for (long g = lane; g < K / 32; g += 32) {
  const long blk = n * (K / 256) + (g >> 3);
  const int j = g & 7, h = j >> 2, s = j & 3;
  const float d = mlxi_half_bits(d_bits[blk]);
  for (int t = 0; t < 32; ++t) {
    const int k = 2 * j + (t >> 4);
    const uint lo = k < 8 ? uint(sc3[blk * 12 + k]) & 0xfu : uint(sc3[blk * 12 + k - 8]) >> 4;
    const uint sc = lo | (((uint(sc3[blk * 12 + 8 + (k & 3)]) >> (2 * (k >> 2))) & 3u) << 4);
    const float dl = d * float(int(sc) - 32);
    const uint low = (uint(qs[blk * 64 + 32 * h + t]) >> (2 * s)) & 3u;
    const uint high = (uint(hmask[blk * 32 + t]) >> j) & 1u;
    const float w = dl * float(int(low) - 4 * int(1u - high));
    for (int m = 0; m < M; ++m) {
      const float prod = mlxi_x<T>(x, nw, inv, xform, m, K, g * 32 + t) * w;
      acc[m] = acc[m] + prod;
    }
  }
}
for (int m = 0; m < M; ++m) {
  const float s = mlxi_warp_total(acc[m]);
  if (lane == 0) out[(long)m * N + n] = add ? mlxi_residual_sum(res[(long)m * N + n], s) : T(s);
}
//@@BODY q2_k_matvec
// As in blocks.cu (mlxi_q2k): sc2, qs, d_bits, dmin_bits, dims = [N, K, 1, eps bits, forms]; value t of group g (values
// 32 j .. of block g / 8): q = (qs[32 h + t] >> 2 s) & 3, dl * q - ml with scale byte k = 2 j + t / 16.
const int N = dims[0], K = dims[1];
const uint lane = thread_index_in_simdgroup;
const long n = ((long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x)
    * MLXI_WARPS + simdgroup_index_in_threadgroup;
if (n >= N) return;
const bool add = dims[4] & 1, norm = (dims[4] >> 1) & 1;  // ADD, NORM, SWIGLU (blocks.cu's dims[4])
const int xform = (dims[4] >> 1) & 3;  // how x is read: 1 normed, 2 SwiGLU of [g | u]
float inv[M];  // NORM: each row's scale (dims[3]: eps's float32 bits)
for (int m = 0; m < M; ++m) inv[m] = norm ? mlxi_rms_inv(x + (long)m * K, K, as_type<float>(dims[3]), lane) : 1.0f;
float acc[M];
for (int m = 0; m < M; ++m) acc[m] = 0.0f;
for (long g = lane; g < K / 32; g += 32) {
  const long blk = n * (K / 256) + (g >> 3);
  const int j = g & 7, h = j >> 2, s = j & 3;
  const float d = mlxi_half_bits(d_bits[blk]), dmin = mlxi_half_bits(dmin_bits[blk]);
  for (int t = 0; t < 32; ++t) {
    const uint c = uint(sc2[blk * 16 + 2 * j + (t >> 4)]);
    const float dl = d * float(c & 0xfu), ml = dmin * float(c >> 4);
    const uint q = (uint(qs[blk * 64 + 32 * h + t]) >> (2 * s)) & 3u;
    const float dq = dl * float(q);
    const float w = dq - ml;
    for (int m = 0; m < M; ++m) {
      const float prod = mlxi_x<T>(x, nw, inv, xform, m, K, g * 32 + t) * w;
      acc[m] = acc[m] + prod;
    }
  }
}
for (int m = 0; m < M; ++m) {
  const float s = mlxi_warp_total(acc[m]);
  if (lane == 0) out[(long)m * N + n] = add ? mlxi_residual_sum(res[(long)m * N + n], s) : T(s);
}
//@@BODY half_matvec
// As in blocks.cu (mlxi_half_values): v [N, K] the F16 (BF 0) or BF16 (BF 1) values' bits, dims = [N, K, 1, eps bits, forms].
const int N = dims[0], K = dims[1];
const uint lane = thread_index_in_simdgroup;
const long n = ((long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x)
    * MLXI_WARPS + simdgroup_index_in_threadgroup;
if (n >= N) return;
const bool add = dims[4] & 1, norm = (dims[4] >> 1) & 1;  // ADD, NORM, SWIGLU (blocks.cu's dims[4])
const int xform = (dims[4] >> 1) & 3;  // how x is read: 1 normed, 2 SwiGLU of [g | u]
float inv[M];  // NORM: each row's scale (dims[3]: eps's float32 bits)
for (int m = 0; m < M; ++m) inv[m] = norm ? mlxi_rms_inv(x + (long)m * K, K, as_type<float>(dims[3]), lane) : 1.0f;
float acc[M];
for (int m = 0; m < M; ++m) acc[m] = 0.0f;
for (long g = lane; g < K / 32; g += 32) {
  for (int t = 0; t < 32; ++t) {
    const uint h = uint(v[n * K + g * 32 + t]);
    const float w = BF ? as_type<float>(h << 16) : mlxi_half_bits(h);
    for (int m = 0; m < M; ++m) {
      const float prod = mlxi_x<T>(x, nw, inv, xform, m, K, g * 32 + t) * w;
      acc[m] = acc[m] + prod;
    }
  }
}
for (int m = 0; m < M; ++m) {
  const float s = mlxi_warp_total(acc[m]);
  if (lane == 0) out[(long)m * N + n] = add ? mlxi_residual_sum(res[(long)m * N + n], s) : T(s);
}
//@@BODY affine_scales
// As in blocks.cu: an affine weight's scales and biases [N, K / 32] (T) from s0, s1 (SCALES 2: the
// K-quants' d sc_j and -(dmin m_j); 1: d and m), a thread a group, each rounded once to T; dims = [N, K / 32].
const long groups = (long)dims[0] * dims[1];
const long i = ((long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x)
    * MLXI_THREADS + thread_index_in_threadgroup;
if (i < groups) {
  float scale, bias;
  mlxi_group_affine<T, SCALES, 0>(s0, s1, i, scale, bias);
  scales[i] = T(scale);
  biases[i] = T(bias);
}
//@@BODY affine_values
// As in blocks.cu: an affine weight's values [N, K] (T) from w, s0, s1 (SCALES and ZERO as affine_matvec's),
// a thread 8 values of a group: scale and bias rounded to T as affine_scales rounds them (SCALES 0: d and
// -(scale ZERO)), then code * scale + bias, each step rounded in float32 (fp contract off), then to T;
// dims = [N, K / 32].
const long groups = (long)dims[0] * dims[1];
const long i = ((long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x)
    * MLXI_THREADS + thread_index_in_threadgroup;
if (i < 4 * groups) {
  const long g = i >> 2;
  const int part = int(i & 3);
  float scale, bias;
  mlxi_group_affine<T, SCALES, ZERO>(s0, s1, g, scale, bias);
  uint words[BITS];
  for (int k = 0; k < BITS; ++k) words[k] = w[g * BITS + k];
  for (int t = 0; t < 8; ++t) {
    const float q = float(mlxi_code<BITS>(words, 8 * part + t));
    out[8 * i + t] = T(q * scale + bias);
  }
}
//@@BODY q6_k_values
// As in blocks.cu: Q6_K's values [N, K] (T), (d * scales[v / 16]) * (q - 32) each rounded, then to T, a
// thread a value; dims = [N, K].
const long K = dims[1], total = (long)dims[0] * K;
const long i = ((long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x)
    * MLXI_THREADS + thread_index_in_threadgroup;
if (i < total) {
  const long blk = i >> 8;
  const int v = int(i & 255), h = v >> 7, r = v & 127;
  const uint low = (uint(ql[128 * blk + 64 * h + (r & 63)]) >> (4 * (r >> 6))) & 0xfu;
  const uint high = (uint(qh[64 * blk + 32 * h + (r & 31)]) >> (2 * (r >> 5))) & 3u;
  const float dl = mlxi_half_bits(d_bits[blk]) * float(scales[16 * blk + (v >> 4)]);
  out[i] = T(dl * float(int(low | (high << 4)) - 32));
}
//@@BODY rms_norm
// As in blocks.cu: RMSNorm of x [M, K] with weight nw [K], a simdgroup a row; dims = [M, K, eps's bits, 0].
const long rows = dims[0];
const int K = dims[1];
const uint lane = thread_index_in_simdgroup;
const long row = ((long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x)
    * MLXI_WARPS + simdgroup_index_in_threadgroup;
if (row < rows) {
  const float inv = mlxi_rms_inv(x + row * K, K, as_type<float>(dims[2]), lane);
  for (int c = lane; c < K; c += 32) out[row * K + c] = T(mlxi_norm_value<T>(float(x[row * K + c]), inv, float(nw[c])));
}
//@@BODY swiglu
// As in blocks.cu: SwiGLU of x [M, 2K] = [gate | up] a row, out [M, K], a thread a value; dims = [M, K, 0, 0].
const long K = dims[1], total = (long)dims[0] * K;
const long i = ((long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x)
    * MLXI_THREADS + thread_index_in_threadgroup;
if (i < total) {
  const long m = i / K, c = i - m * K;
  out[i] = T(mlxi_swiglu_value<T>(float(x[2 * K * m + c]), float(x[2 * K * m + K + c])));
}
