// Products straight from a GGUF block type's fields (mlxinfer/block_kernels.py, through
// mx.fast.cuda_kernel): out[m, n] = sum_i x[m, i] * w[n, i] for a few rows m of x (decode), where w's
// values are dequantized in registers exactly as gguf-py computes them, never written to memory.
//
// The order, the same for every row count M (so a row's result does not depend on its batch):
//   one warp per output row n; the row's values are cut into work units of 32 (Q6_K below says which);
//   lane l (0..31) takes units l, l + 32, ... in increasing order and, in each, its 32 values in a
//   fixed sequence, adding them to the lane's partial sum; then the butterfly s += shfl_xor(s, off)
//   for off = 16, 8, 4, 2, 1. How a unit's values are added depends on the type (G::RUN below):
//   - by value (IQ4, Q3_K, Q2_K, Q8_0, F16, BF16): each value w formed exactly as gguf-py forms it, the
//     product x*w rounded, then added (__fmul_rn / __fadd_rn: no contraction into fma);
//   - by runs (the other affine types: runs of 32, a unit; Q6_K: runs of 8), where a run's values are
//     scale * c + bias (c a small integer: the code less its zero, exact as float): in each run the
//     products c*x added in sequence from 0 into s, for a 16-bit x each by one fma (c*x + s rounded
//     once: c*x itself is exact, at most 6 bits by 11, but past float32's range, |x| above ~5e36 in
//     bfloat16, where the fma's one rounding is the order), for float32 x the product rounded, then
//     added; with a bias x's values likewise into sx; then scale*s (+ bias*sx), each step rounded,
//     added to the lane's partial sum. A 16-bit x's value takes 3 float operations where it took 5
//     (the value's own multiply-add, its product with x and the add); the 8B gate/up and head
//     products about 20% faster on an H100 (docs/performance.md).
//   block_kernels.emulate follows both in numpy (block_kernels.terms: a run's codes, scale and bias;
//   fma16: the 16-bit x's fma).
//   Two forms, chosen at launch by dims[4]'s bits (one compiled kernel serves all three): ADD (bit 0)
//   writes res[m, n] + that sum ([M, N] of x's type: the residual stream), as the graph's Add of the
//   product would (mlxi_residual_sum), so a layer's output projection and its residual are one launch;
//   NORM (bit 1) multiplies x's rows RMS-normed with weight nw ([K], x's type) and eps (dims[3], its
//   float32 bits), each normed value exactly what the `rms_norm` kernel writes (mlxi_rms_inv), so a
//   layer's norm and the product after it are one launch. SWIGLU (bit 2, not with NORM) multiplies
//   silu(g) * u of x = [g | u], [M, 2K] (an FFN's merged gate and up products), each value exactly what
//   the `swiglu` kernel writes (mlxi_swiglu_value), so SwiGLU and the down product are one launch.
//   Without its bit, res or nw is not read (the launch passes x there).
//
// How the work is laid out does not change that order. A block's 8 warps first copy x, a tile of
// mlxi_tile<M>() columns at a time (MLXI_TILE_VALUES / M in 1,024s: one row's first 8,192 values),
// into shared memory (coalesced; padded so that the lanes' reads of their own units do not collide in
// its banks), and read it from there: read straight from memory, each lane's four values of x sit 128
// bytes from its neighbours', 32 cache lines a warp's load, and that load, not the weight, bounds the
// product (docs/performance.md). Then each lane takes its units of the tile in turn, with no barrier
// between them: a tile a row, not a tile every 1,024 columns, so that a warp waits for weights while the
// SM's other warps work, not at a barrier. And a warp takes R = dims[2] consecutive output rows
// (1..MLXI_MAX_R, `block_kernels.rows_per_warp`), each with its own partial sums, so that each value of
// x a lane reads serves R rows. Each form of a kernel is compiled for MLXI_MIN_BLOCKS blocks resident on
// an SM (`__launch_bounds__` through the __global__ below; 1: no bound, the compiler's choice (a bound
// of 1 block would let it take up to 255 registers: Q3_K's 8 rows 168 -> 218);
// block_kernels.min_blocks sets 3, at most 80 registers a thread, for the decode forms that fit them), as
// a decode product is bounded by how many warps an SM keeps waiting for weights at once.
//
// Two kernels besides the products form what a prompt's products multiply (MLX's quantized_matmul and
// matmul read the weight once for many rows): `affine_scales` (an affine weight's scales and biases) and
// `q6_k_values` (Q6_K's values), a thread an output value, each the graph's operations rounded as it
// rounds them (block_kernels.FORMED).
//@@HEADER
#define MLXI_THREADS 256
#define MLXI_WARPS 8
#define MLXI_MAX_R 4
#define MLXI_TILE_VALUES 8192
#define MLXI_MIN_BLOCKS 1
#if MLXI_MIN_BLOCKS > 1
#undef __global__
#define __global__ __location__(global) __launch_bounds__(MLXI_THREADS, MLXI_MIN_BLOCKS)
#endif

// An IEEE half's bits as float, exactly (every half is a float): on the GPU the hardware's conversion
// (PTX cvt.f32.f16, one instruction, HADD2.F32 on sm_90, where the bit arithmetic below took about ten;
// as PTX: through __half2float(__ushort_as_half(h)) NVRTC failed the float32 forms here, the second
// undefined). A NaN's payload may not be kept there, which no output shows: every float operation on a
// NaN gives the canonical one on the GPU. Off the GPU (the host-run kernels of the tests) the bits by
// arithmetic, without a branch.
__device__ __forceinline__ float mlxi_half_bits(unsigned int h) {
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
  return f;
#else
  const unsigned int sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  // zero and subnormals: m * 2^-24, exact (m as float on the float pipe: mlxi_code_float's way)
  const float tiny = __fmul_rn(__fsub_rn(__uint_as_float(0x4B000000u | m), 8388608.0f), 5.9604644775390625e-8f);
  const unsigned int wide = e == 31 ? 0x7f800000u | (m << 13) : ((e + 112u) << 23) | (m << 13);
  return e == 0 ? __uint_as_float(sign | __float_as_uint(tiny)) : __uint_as_float(sign | wide);
#endif
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

// Group g's scale and bias of an affine weight from its compact fields (affine_matvec's s0 and s1;
// SCALES and ZERO as there), each product rounded in float32, then rounded once to T, as float: what
// affine_scales writes and affine_values multiplies. SCALES 2 (Q4_K, Q5_K): g = 8b + j of a row (a row's
// groups are whole blocks of 8), scale d sc_j, bias -(dmin m_j); 1 (Q4_1, Q5_1): d and m; 0 (Q8_0, Q4_0,
// Q5_0): d and -(scale ZERO), exact.
template <typename T, int SCALES, int ZERO, typename S0, typename S1>
__device__ __forceinline__ void mlxi_group_affine(const S0* s0, const S1* s1, long g, float& scale, float& bias) {
  if (SCALES == 2) {
    const long blk = g >> 3;
    const int j = (int)(g & 7);
    scale = (float)(T)__fmul_rn(mlxi_half_bits(s0[2 * blk]), (float)s1[16 * blk + j]);
    bias = (float)(T)(-__fmul_rn(mlxi_half_bits(s0[2 * blk + 1]), (float)s1[16 * blk + 8 + j]));
  } else if (SCALES == 1) {
    scale = (float)(T)mlxi_half_bits(s0[g]);
    bias = (float)(T)mlxi_half_bits(s1[g]);
  } else {
    scale = (float)(T)mlxi_half_bits(s0[g]);
    bias = (float)(T)__fmul_rn(scale, -(float)ZERO);
  }
}

// 8 values of T in one aligned struct: one 16-byte store for a 16-bit T (affine_values' writes).
template <typename T>
struct alignas(sizeof(T) * 8 > 16 ? 16 : sizeof(T) * 8) mlxi_vec8 {
  T v[8];
};

// Code q (below 2^23) less z as float, exactly, on the float pipe: 0x4B000000 | q is the float 2^23 + q,
// and z2 = 2^23 + z (an integer conversion runs at a quarter of a float operation's rate on sm_90, and
// one a weight value bounded these kernels).
__device__ __forceinline__ float mlxi_code_float(unsigned int q, float z2) {
  return __fsub_rn(__uint_as_float(0x4B000000u | q), z2);
}

// Code t (0..31) of a group packed as MLX packs it, less Z, as float, exactly, for BITS 4 and 8 (codes
// that never cross a word): mlxi_code_float's way with the field left where it lies. A field at bits
// [s, s + BITS) of a word, s + BITS <= 20, ORed under the exponent of 2^(23 - s) is the float
// 2^(23 - s) + q (its mantissa's unit is 2^-s), and 2^(23 - s) + Z is exact, so the difference is q - Z
// exactly: one AND and one FADD a code. The AND writes the field and the exponent at once: the word's
// top byte set to 0xFF first (one byte permute a word; every such exponent is even, so bit 23 is cleared
// by the AND), so that the AND's one constant is field mask | exponent (the compiler otherwise fuses an
// OR and an AND into one LOP3 of two constants, one of them moved into a register at every use). A
// word's fields past bit 20 come from its top half, moved down by the same permute. ff00: 0xFF00, held
// in a register by the caller (mlxi_held).
template <int BITS, int Z>
__device__ __forceinline__ float mlxi_code_at(const unsigned int* words, int t, unsigned int ff00) {
  const int bit = BITS * t, wi = bit >> 5, sh = bit & 31, s = sh + BITS <= 20 ? sh : sh - 16;
  const unsigned int w = __byte_perm(words[wi], ff00, sh + BITS <= 20 ? 0x5210 : 0x5432);
  const unsigned int magic = (unsigned int)(127 + 23 - s) << 23;
  const float base = __uint_as_float(magic);  // 2^(23 - s)
  return __fsub_rn(__uint_as_float(w & ((((1u << BITS) - 1u) << s) | magic)), __fadd_rn(base, (float)Z));
}

// Constant c as a register the kernels hold (mlxi_code_at's ff00, mlxi_q6k's magic): at one row of x made
// from dims[0] (an output row count, never negative: its top bit is 0), a value NVRTC cannot see is
// constant, so it keeps it in a register instead of moving it into one at every use; at more rows the
// constant itself (one more register held spills there).
template <int M>
__device__ __forceinline__ unsigned int mlxi_held(unsigned int c, const int* dims) {
  return M > 1 ? c : c | ((unsigned int)dims[0] >> 31);
}

// Entry c (0..15) of IQ4_NL's and IQ4_XS's codebook (llama.cpp's kvalues_iq4nl), as float.
__device__ __forceinline__ float mlxi_iq4_value(unsigned int c) {
  const signed char v[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
  return (float)v[c];
}

// Whether four consecutive values of x starting at x's base can be one vector load (x's rows and every
// offset the kernels load from are multiples of four values, so the base decides).
template <typename X>
__device__ __forceinline__ bool mlxi_aligned4(const X* x) {
  return (reinterpret_cast<unsigned long long>(x) & (4 * sizeof(X) - 1)) == 0;
}

// Four consecutive values of x as float (each conversion exact): one 16-byte (float) or 8-byte (16-bit
// types) load where `vec`, else four.
template <typename X>
__device__ __forceinline__ void mlxi_load4(const X* p, bool vec, float* v) {
  if (vec && sizeof(X) == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
  } else if (vec) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const X* h = reinterpret_cast<const X*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = (float)h[i];
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = (float)p[i];
  }
}

// Where column c of a tile of x sits in shared memory: four floats of padding after every PAD columns.
template <int PAD>
__device__ __forceinline__ int mlxi_xs_at(int c) {
  return c + 4 * (c / PAD);
}

// RMSNorm (the `rms_norm` kernel, and NORM's prologue: a product of the normed rows of x in one launch).
// The published order: row m's scale inv = 1 / sqrt(mean(x^2) + eps), its sum of squares in the dot
// products' order (one warp: lane l adds x_i * x_i for i = l, l + 32, ... in increasing i, each square
// rounded, then the butterfly 16, 8, 4, 2, 1), times the float32 1/K, plus eps, the square root and the
// division each rounded once (correctly rounded: __fsqrt_rn, __fdiv_rn); value c is then
// (x_c * inv) * w_c, each product rounded, and rounded once more to x's type X (what the norm writes).
// block_kernels.emulate_rms_norm follows it in numpy. A NORM-form block waits for this chain before it
// stages x, so its loads are issued 32 at a time (4 at a time, K = 4,096 took 32 memory round trips).
template <typename X>
__device__ __forceinline__ float mlxi_rms_inv(const X* row, int K, float eps, int lane) {
  float s = 0.0f;
#pragma unroll 32
  for (int i = lane; i < K; i += 32) {  // (unrolled: 32 loads in flight; the adds keep their order)
    const float v = (float)row[i];
    s = __fadd_rn(s, __fmul_rn(v, v));
  }
  s = mlxi_warp_total(s);
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fmul_rn(s, __fdiv_rn(1.0f, (float)K)), eps)));
}

template <typename X>
__device__ __forceinline__ float mlxi_norm_value(float v, float inv, float w) {
  return (float)(X)__fmul_rn(__fmul_rn(v, inv), w);
}

// SwiGLU (the `swiglu` kernel, and SWIGLU's staging: the down product of silu(gate) * up in one launch).
// The published order: e = exp(t) for t = -g clamped to [-20, 88] (mlxi_exp: n = rint(t log2 e),
// r = (t - n C1) - n C2 with ln 2 = C1 + C2 (C1 = 355/512, so n C1 is exact), e^r by the Taylor
// polynomial of degree 7 in Horner's order from 1/5040 down, times 2^n, exact: every step rounded, no
// contraction; within 2 float32 units of e^t, block_kernels.emulate_swiglu follows it in numpy);
// silu = g / (1 + e) rounded to X (what the graph's silu op writes), then silu * u rounded to X (its
// product with up). Past the clamp: 1 + e^-20 is 1 in float32, and silu(g) for g < -88 is g / (1 + e^88)
// (-6e-35 at g = -1e4, -1.8 at g = -3e38) where g e^g is nearer 0: no model's gates go there.
__device__ __forceinline__ float mlxi_exp(float t) {
  const float n = rintf(__fmul_rn(t, 1.44269502162933349609375f));
  const float r = __fsub_rn(__fsub_rn(t, __fmul_rn(n, 0.693359375f)), __fmul_rn(n, -2.12194440e-4f));
  float p = 1.98412701e-4f;  // 1/5040, then 1/720, ... 1/2, 1, 1
  p = __fadd_rn(__fmul_rn(p, r), 1.38888892e-3f);
  p = __fadd_rn(__fmul_rn(p, r), 8.33333377e-3f);
  p = __fadd_rn(__fmul_rn(p, r), 4.16666679e-2f);
  p = __fadd_rn(__fmul_rn(p, r), 1.66666672e-1f);
  p = __fadd_rn(__fmul_rn(p, r), 0.5f);
  p = __fadd_rn(__fmul_rn(p, r), 1.0f);
  p = __fadd_rn(__fmul_rn(p, r), 1.0f);
  return __fmul_rn(p, __int_as_float(((int)n + 127) << 23));
}

template <typename X>
__device__ __forceinline__ float mlxi_swiglu_value(float g, float u) {
  const float t = fminf(fmaxf(-g, -20.0f), 88.0f);
  const float silu = (float)(X)__fdiv_rn(g, __fadd_rn(1.0f, mlxi_exp(t)));
  return (float)(X)__fmul_rn(silu, u);
}

// Columns col0 .. col0 + cols - 1 of x's M rows, as float, into shared memory xs (row stride STRIDE, column c
// at mlxi_xs_at<PAD>(c)), four at a time by the block's threads in turn. cols is a multiple of 32. With a
// norm weight nw (NORM), each value is row m's normed value (inv[m]: its scale, mlxi_rms_inv); with glu
// (SWIGLU), x's rows are [g | u] of 2K values and each value is mlxi_swiglu_value(g_c, u_c).
template <int PAD, int M, int STRIDE, typename X>
__device__ __forceinline__ void mlxi_stage_x(const X* x, long K, long col0, int cols, bool vec, float* xs,
                                             const X* nw, const float* inv, bool glu) {
  const int quads = cols / 4;
  const bool nvec = nw != nullptr && mlxi_aligned4(nw);
  const long stride = glu ? 2 * K : K;
  for (int i = threadIdx.x; i < M * quads; i += MLXI_THREADS) {
    const int m = i / quads, c = 4 * (i - m * quads);
    float v[4];
    mlxi_load4(x + (long)m * stride + col0 + c, vec, v);
    if (glu) {
      float u[4];
      mlxi_load4(x + (long)m * stride + K + col0 + c, vec, u);
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = mlxi_swiglu_value<X>(v[j], u[j]);
    } else if (nw) {
      float w[4];
      mlxi_load4(nw + col0 + c, nvec, w);
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = mlxi_norm_value<X>(v[j], inv[m], w[j]);
    }
    *reinterpret_cast<float4*>(xs + m * STRIDE + mlxi_xs_at<PAD>(c)) = make_float4(v[0], v[1], v[2], v[3]);
  }
}

// The columns of a tile of M rows of x: MLXI_TILE_VALUES / M, in whole 1,024s (32 units of 32: each lane
// as many), so that a tile holds at most 8,192 floats for every M (36 KB with its padding).
template <int M>
__host__ __device__ constexpr int mlxi_tile() {
  return (MLXI_TILE_VALUES / M) / 1024 * 1024;
}

// The columns of the tile of x that starts at col0: TILE, or what is left of a row of K.
template <int TILE>
__device__ __forceinline__ int mlxi_tile_cols(long K, long col0) {
  return K - col0 < TILE ? (int)(K - col0) : TILE;
}

// Tile columns c .. c + 3 (c a multiple of 4; padding of 4 every PAD), each of M rows.
template <int M, int STRIDE, int PAD>
__device__ __forceinline__ void mlxi_tile_x4(const float* xs, int c, float (&xv)[M][4]) {
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float4 f = *reinterpret_cast<const float4*>(xs + m * STRIDE + mlxi_xs_at<PAD>(c));
    xv[m][0] = f.x; xv[m][1] = f.y; xv[m][2] = f.z; xv[m][3] = f.w;
  }
}

// A group's BITS words of codes: 16-byte loads where BITS is a multiple of 4 and p is so aligned.
template <int BITS>
__device__ __forceinline__ void mlxi_words(const unsigned int* p, unsigned int* words) {
  if (BITS % 4 == 0 && (reinterpret_cast<unsigned long long>(p) & 15) == 0) {
#pragma unroll
    for (int i = 0; i < BITS / 4; ++i) {
      const uint4 v = *reinterpret_cast<const uint4*>(p + 4 * i);
      words[4 * i] = v.x; words[4 * i + 1] = v.y; words[4 * i + 2] = v.z; words[4 * i + 3] = v.w;
    }
#pragma unroll
    for (int i = 4 * (BITS / 4); i < BITS; ++i) words[i] = p[i];
  } else {
#pragma unroll
    for (int i = 0; i < BITS; ++i) words[i] = p[i];
  }
}
// ADD's epilogue: the residual r plus the product's sum s, as the graph adds them: s rounded to the
// output's type first (what the product alone writes), then r + that in float32 and rounded once more
// (MLX's Add of two values of that type; for float32 both roundings are none).
template <typename Y>
__device__ __forceinline__ Y mlxi_residual_sum(Y r, float s) {
  return (Y)__fadd_rn((float)r, (float)(Y)s);
}
// A unit's values into the rows' partial sums, value by value (G::RUN 0): each value formed
// (G::value), its product with x rounded, then added. RT: every row computed, a row past the warp's last
// its last again (rows: how many are the warp's).
template <int M, typename G, int NR, int RT, int STRIDE>
__device__ __forceinline__ void mlxi_unit_by_values(const float* xs, int v, const typename G::Row (&row)[NR], int rows,
                                                    float (&acc)[NR][M]) {
#pragma unroll
  for (int t0 = 0; t0 < 32; t0 += 4) {
    float xv[M][4];
    mlxi_tile_x4<M, STRIDE, G::PAD>(xs, G::column(v, t0), xv);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (RT || r < rows) {
#pragma unroll
        for (int tt = 0; tt < 4; ++tt) {
          const float wv = G::value(row[r], t0 + tt);
#pragma unroll
          for (int m = 0; m < M; ++m) acc[r][m] = __fadd_rn(acc[r][m], __fmul_rn(xv[m][tt], wv));
        }
      }
    }
  }
}

// x's sum over each unit of 32 columns of the tile (in sequence from 0, each addition rounded: what
// mlxi_unit_by_runs adds for a bias), a thread a (row, unit): xsum[m * XG + v], XG units a row.
template <int M, int STRIDE, int PAD, int XG>
__device__ __forceinline__ void mlxi_unit_sums(const float* xs, int cols, float* xsum) {
  const int units = cols / 32;
  for (int i = threadIdx.x; i < M * units; i += MLXI_THREADS) {
    const int m = i / units, v = i - m * units;
    float t = 0.0f;
#pragma unroll
    for (int c = 0; c < 32; c += 4) {
      const float4 f = *reinterpret_cast<const float4*>(xs + m * STRIDE + mlxi_xs_at<PAD>(32 * v + c));
      t = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(t, f.x), f.y), f.z), f.w);
    }
    xsum[m * XG + v] = t;
  }
}

// A unit's values into the rows' partial sums by runs of G::RUN values (scale j * c + bias j, j the
// run): s = the products c*x added in sequence from 0, sx = x's values so (G::BIAS only), then the
// partial sum += scale*s (+ bias*sx), each step rounded. For a 16-bit x, c*x + s by one fma (c*x is exact,
// c at most 6 bits and x's float at most 11, but past float32's range: there the fma's one rounding is
// the published order); for float32 x the product rounded, then added.
template <typename X>
__device__ __forceinline__ float mlxi_code_times_x(float s, float c, float x) {
  return sizeof(X) == 2 ? __fmaf_rn(c, x, s) : __fadd_rn(s, __fmul_rn(c, x));
}
// A run's end: the partial sum acc plus scale * s (+ bias * sx with BIAS), each step rounded.
template <bool BIAS>
__device__ __forceinline__ float mlxi_run_end(float acc, float scale, float s, float bias, float sx) {
  float u = __fmul_rn(scale, s);
  if (BIAS) u = __fadd_rn(u, __fmul_rn(bias, sx));
  return __fadd_rn(acc, u);
}
template <int M, typename G, int NR, int RT, int STRIDE, int XG, typename X>
__device__ __forceinline__ void mlxi_unit_by_runs(const float* xs, const float* xsum, int v, const typename G::Row (&row)[NR],
                                                  int rows, float (&acc)[NR][M]) {
  static_assert(!G::BIAS || G::RUN == 32, "a bias only with runs of a whole unit (one sum of x a unit)");
  if constexpr (RT == 0) {
    // Rows taken one after another (each reading the unit's x again from shared memory), so that only one
    // row's run sums are live, and x's sum over the unit read from xsum (mlxi_unit_sums): at 8 rows of x
    // the rows' sums side by side spilled 216 bytes (NVRTC, sm_90), and x's sums kept beside them 56.
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (r >= rows) continue;
      float s[M];
#pragma unroll
      for (int t0 = 0; t0 < 32; t0 += 4) {
        if (t0 % G::RUN == 0) {
#pragma unroll
          for (int m = 0; m < M; ++m) s[m] = 0.0f;
        }
        float xv[M][4];
        mlxi_tile_x4<M, STRIDE, G::PAD>(xs, G::column(v, t0), xv);
#pragma unroll
        for (int tt = 0; tt < 4; ++tt) {
          const float c = G::code(row[r], t0 + tt);
#pragma unroll
          for (int m = 0; m < M; ++m) s[m] = mlxi_code_times_x<X>(s[m], c, xv[m][tt]);
        }
        if ((t0 + 4) % G::RUN == 0) {
#pragma unroll
          for (int m = 0; m < M; ++m)
            acc[r][m] = mlxi_run_end<G::BIAS>(acc[r][m], G::scale(row[r], t0 / G::RUN), s[m], G::bias(row[r], t0 / G::RUN),
                                              G::BIAS ? xsum[m * XG + v] : 0.0f);
        }
      }
    }
    return;
  }
  // One row of x, RT rows a warp (bounded forms): the rows' run sums side by side, so that each value of x
  // read from shared memory serves every row, and x's run sums in registers.
  float s[NR][M], sx[M];
#pragma unroll
  for (int t0 = 0; t0 < 32; t0 += 4) {
    if (t0 % G::RUN == 0) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        sx[m] = 0.0f;
#pragma unroll
        for (int r = 0; r < NR; ++r) s[r][m] = 0.0f;
      }
    }
    float xv[M][4];
    mlxi_tile_x4<M, STRIDE, G::PAD>(xs, G::column(v, t0), xv);
    if (G::BIAS) {
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int tt = 0; tt < 4; ++tt) sx[m] = __fadd_rn(sx[m], xv[m][tt]);
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (RT || r < rows) {
#pragma unroll
        for (int tt = 0; tt < 4; ++tt) {
          const float c = G::code(row[r], t0 + tt);
#pragma unroll
          for (int m = 0; m < M; ++m) s[r][m] = mlxi_code_times_x<X>(s[r][m], c, xv[m][tt]);
        }
      }
    }
    if ((t0 + 4) % G::RUN == 0) {
      const int j = t0 / G::RUN;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        if (RT || r < rows) {
#pragma unroll
          for (int m = 0; m < M; ++m)
            acc[r][m] = mlxi_run_end<G::BIAS>(acc[r][m], G::scale(row[r], j), s[r][m], G::bias(row[r], j), sx[m]);
        }
      }
    }
  }
}

// Every block kernel's frame: the published order (lane l takes work units l, l + 32, ... of 32 values,
// in each its values t = 0..31, by value or by runs as the header says, then the butterfly) laid out in
// tiles of x in shared memory and R rows a warp, with a type's reader G for the values:
//   G::Fields  its pointers;  G::prepare()  once a block, before the first barrier;
//   G::PAD, G::column(v, t)  the tile's padding, and the tile column of value t of the tile's unit v
//     (t a multiple of 4; t .. t + 3 are consecutive columns): `mlxi_groups32` for units of 32
//     consecutive values;
//   G::Row G::load(fields, n, u, K)  what row n's unit u needs;  G::RUN 0: float G::value(row, t)  value
//   t, exactly gguf-py's (t is a constant once the loops are unrolled); G::RUN > 0 (by runs): float
//   G::code(row, t)  value t's code less its zero, and G::scale(row, j), G::bias(row, j) (G::BIAS) run j's,
//   so that value t is scale * code + bias exactly as gguf-py forms it.
// HOIST (a kernel's body passes MLXI_MIN_BLOCKS > 1): every row's fields loaded, past the last row the
// last one's again, with no branch, so that NVRTC issues all of a unit's loads before their first use;
// only in forms with a launch bound, which keeps the registers that takes (unbounded, Q3_K's 8 rows went
// from 168 to 220).
// run: which output rows the launch's blocks from run.block0 on take (mlxi_run: a product's own launch
// takes them all; a pair launch's two runs, mlxi_pair_matvec, each its own).
struct mlxi_run {
  int N, R;   // the run's output rows, and rows a warp
  long block0;  // the run's first block
  long ldo, col0;  // out's row stride and the run's first column in it
};
template <int M, typename G, bool HOIST, int RT, int XS, typename X, typename Y>
__device__ __forceinline__ void mlxi_block_rows(const X* x, Y* out, const int* dims, const typename G::Fields& f,
                                                const Y* res, const X* nw, float* xs, float* inv, const mlxi_run& run) {
  constexpr int TILE = mlxi_tile<M>(), STRIDE = TILE + 4 * (TILE / G::PAD), NR = RT ? RT : MLXI_MAX_R;
  static_assert(M * STRIDE <= XS, "x's tile in shared memory: XS floats, as the entry declares it");
  __shared__ float xsum[G::BIAS && RT == 0 ? M * (TILE / 32) : 1];  // (mlxi_unit_by_runs, without RT)
  const int N = run.N, K = dims[1], R = run.R;
  const bool add = dims[4] & 1, norm = (dims[4] >> 1) & 1, glu = (dims[4] >> 2) & 1;  // ADD, NORM, SWIGLU
  const long warp0 = ((long)blockIdx.y * gridDim.x + blockIdx.x - run.block0) * MLXI_WARPS;
  if (warp0 * R >= N) return;  // (the whole block: no warp of it has a row)
  G::prepare();
  const int lane = threadIdx.x & 31;
  if (norm && (threadIdx.x >> 5) < M)  // NORM: warp m takes row m's scale (dims[3]: eps's float32 bits)
    inv[threadIdx.x >> 5] = mlxi_rms_inv(x + (long)(threadIdx.x >> 5) * K, K, __int_as_float(dims[3]), lane);
  const long n0 = (warp0 + (threadIdx.x >> 5)) * R;
  const int rows = n0 >= N ? 0 : (N - n0 < R ? (int)(N - n0) : R);  // 0: the warp only helps stage x
  const bool vec = mlxi_aligned4(x);
  float acc[NR][M];
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
  for (long col0 = 0; col0 < K; col0 += TILE) {
    const int cols = mlxi_tile_cols<TILE>(K, col0);
    __syncthreads();
    mlxi_stage_x<G::PAD, M, STRIDE>(x, K, col0, cols, vec, xs, norm ? nw : nullptr, inv, glu);
    __syncthreads();
    if constexpr (G::BIAS && RT == 0) {
      mlxi_unit_sums<M, STRIDE, G::PAD, TILE / 32>(xs, cols, xsum);
      __syncthreads();
    }
    if (rows == 0) continue;
    for (int v = lane; 32 * v < cols; v += 32) {  // the tile's units l, l + 32, ...: units col0 / 32 + v
      const long u = col0 / 32 + v;
      typename G::Row row[NR];  // (each row's fields; see HOIST)
#pragma unroll
      for (int r = 0; r < NR; ++r)
        if (HOIST || r < rows) row[r] = G::load(f, n0 + (r < rows ? r : rows - 1), u, K);
      if constexpr (G::RUN > 0)
        mlxi_unit_by_runs<M, G, NR, RT, STRIDE, TILE / 32, X>(xs, xsum, v, row, rows, acc);
      else
        mlxi_unit_by_values<M, G, NR, RT, STRIDE>(xs, v, row, rows, acc);
    }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    if (r < rows) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float s = mlxi_warp_total(acc[r][m]);
        const long at = (long)m * run.ldo + run.col0 + n0 + r;
        if (lane == 0) out[at] = add ? mlxi_residual_sum(res[at], s) : (Y)s;
      }
    }
  }
}

// The frame's entry: x's tile and the rows' norm scales in shared memory (declared once here, not in
// each of mlxi_block_rows' instances), then the rows a warp takes (dims[2]): in a form with HOIST, known
// at compile time (4 for 3 or 4, 2, 1), so that the rows' products are computed without a branch and the
// compiler interleaves their chains; elsewhere read at run time (RT 0), each row behind its branch. Only
// at one row of x (decode at batch 1): at 8, rows interleaved spill (NVRTC, sm_90, 128 registers: Q4_K's
// 4 rows 104 bytes, and with the 2- and 1-row instances beside the run-time one, Q8_0's 56).
template <int M, typename G, bool HOIST, typename X, typename Y>
__device__ __forceinline__ void mlxi_block_matvec(const X* x, Y* out, const int* dims, const typename G::Fields& f,
                                                  const Y* res, const X* nw) {
  constexpr int TILE = mlxi_tile<M>(), STRIDE = TILE + 4 * (TILE / G::PAD);
  static_assert(TILE >= 1024 && TILE % 1024 == 0, "a tile holds whole units of 32, as many a lane");
  static_assert(M * STRIDE * 4 <= 48 * 1024 - 1024, "static shared memory: at most 48 KB a block");
  static_assert(M <= MLXI_WARPS, "NORM: a warp a row's scale");
  __shared__ __align__(16) float xs[M * STRIDE];  // (float4 reads and writes)
  __shared__ float inv[MLXI_WARPS];
  const mlxi_run run = {dims[0], dims[2], 0, dims[0], 0};
  if (!HOIST || M > 1)
    mlxi_block_rows<M, G, HOIST, 0, M * STRIDE>(x, out, dims, f, res, nw, xs, inv, run);
  else if (dims[2] > 2)
    mlxi_block_rows<M, G, HOIST, 4, M * STRIDE>(x, out, dims, f, res, nw, xs, inv, run);
  else if (dims[2] == 2)
    mlxi_block_rows<M, G, HOIST, 2, M * STRIDE>(x, out, dims, f, res, nw, xs, inv, run);
  else
    mlxi_block_rows<M, G, HOIST, 1, M * STRIDE>(x, out, dims, f, res, nw, xs, inv, run);
}

// Two products of one x in one launch (a weight group's two runs of different types: a Q4_K_M file's Q
// and K in Q4_K, its V in Q6_K), out = [x @ A.T | x @ B.T], [M, NA + NB]: the first ceil(NA / 8) blocks
// take A's rows with A's reader GA, the rest B's with GB, each row by the frame above in the published
// order, so each column is the bits of its run's own launch (the forms: NORM or none; the norm's scale
// computed by each block, as in a launch of its own). One row a warp (dims[2] is 1: a pair launch is
// for products narrow enough that `default_per_warp` gives 1), at every row count of x known at compile
// time. x's tile is declared once here at the larger reader's stride and lent to both (two instances'
// own tiles would exceed the 48 KB of static shared memory). dims = [NA, K, 1, eps bits, forms, NB].
template <int M, typename GA, typename GB, bool HOIST, typename X, typename Y>
__device__ __forceinline__ void mlxi_pair_matvec(const X* x, Y* out, const int* dims, const typename GA::Fields& fa,
                                                 const typename GB::Fields& fb, const X* nw) {
  constexpr int TILE = mlxi_tile<M>(), SA = TILE + 4 * (TILE / GA::PAD), SB = TILE + 4 * (TILE / GB::PAD);
  constexpr int STRIDE = SA > SB ? SA : SB;
  static_assert(M * STRIDE * 4 <= 48 * 1024 - 1024, "static shared memory: at most 48 KB a block");
  static_assert(M <= MLXI_WARPS, "NORM: a warp a row's scale");
  __shared__ __align__(16) float xs[M * STRIDE];
  __shared__ float inv[MLXI_WARPS];
  const long blocks_a = ((long)dims[0] + MLXI_WARPS - 1) / MLXI_WARPS, ldo = (long)dims[0] + dims[5];
  if ((long)blockIdx.y * gridDim.x + blockIdx.x < blocks_a)
    mlxi_block_rows<M, GA, HOIST, 1, M * STRIDE>(x, out, dims, fa, out, nw, xs, inv, {dims[0], 1, 0, ldo, 0});
  else
    mlxi_block_rows<M, GB, HOIST, 1, M * STRIDE>(x, out, dims, fb, out, nw, xs, inv, {dims[5], 1, blocks_a, ldo, dims[0]});
}

// Readers whose unit is a group of 32 consecutive values: a tile's unit v at its columns 32 v .. 32 v + 31.
struct mlxi_groups32 {
  static constexpr int PAD = 32, RUN = 0;  // (by value)
  static constexpr bool BIAS = false;
  __device__ static int column(int v, int t) { return 32 * v + t; }
};

// Q6_K (q6_k_matvec says the fields and the units): unit u = 8b + 4h + c of block b holds values
// r = 8c + t + 32j of its half h (t, j: 0..7, 0..3), taken j = 0..3 then t = 0..7, so value k of the
// unit is j = k / 8, t = k % 8: low four bits ql[64h + r % 64] >> 4 (r / 64), high two
// qh[32h + r % 32] >> 2 (r / 32), q = low | high << 4, value (d * scales[8h + 2j + c / 2]) * (q - 32).
// A tile holds its unit v (unit u = 8b + 4h + c of the row, less the tile's first) at columns
// 256 (v / 8) + 128 h + 8 c + 32 j + t.
struct mlxi_q6k {
  static constexpr int PAD = 128, RUN = 8;  // by runs of 8 (j: one sub-scale each), no bias
  static constexpr bool BIAS = false;
  __device__ static int column(int v, int k) {
    return 256 * (v >> 3) + 128 * ((v >> 2) & 1) + 8 * (v & 3) + 32 * (k >> 3) + (k & 7);
  }
  struct Fields {
    const uint8_t* ql;
    const uint8_t* qh;
    const int8_t* scales;
    const uint16_t* d_bits;
    unsigned int magic;  // 0x4B000000 (value's byte permute; mlxi_held)
  };
  struct Row {
    uint2 lo0, lo1, hb;
    unsigned int magic;
    float dl[4];
  };
  __device__ static void prepare() {}
  __device__ static Row load(const Fields& f, long n, long u, long K) {
    Row r;
    const int h = (u >> 2) & 1, c = u & 3;
    const long blk = n * (K / 256) + (u >> 3);
    const float d = mlxi_half_bits(f.d_bits[blk]);
    r.magic = f.magic;
    r.lo0 = *reinterpret_cast<const uint2*>(f.ql + blk * 128 + 64 * h + 8 * c);
    r.lo1 = *reinterpret_cast<const uint2*>(f.ql + blk * 128 + 64 * h + 32 + 8 * c);
    r.hb = *reinterpret_cast<const uint2*>(f.qh + blk * 64 + 32 * h + 8 * c);
    const int8_t* sc = f.scales + blk * 16 + 8 * h + (c >> 1);
#pragma unroll
    for (int j = 0; j < 4; ++j) r.dl[j] = __fmul_rn(d, (float)sc[2 * j]);
    return r;
  }
  // Value k's code less 32: the codes of a word's four bytes formed at once (low nibbles | high bits
  // moved to bits 4-5 of each byte: two shifts and two LOP3s for four codes, which the compiler shares
  // between them), then code t's byte under the exponent of 2^23 by one byte permute, less 2^23 + 32.
  __device__ static float code(const Row& r, int k) {
    const int j = k >> 3, t = k & 7;
    const uint2 lo = (j & 1) ? r.lo1 : r.lo0;
    const unsigned int lw = t < 4 ? lo.x : lo.y, hw = t < 4 ? r.hb.x : r.hb.y;
    const unsigned int low = (lw >> (4 * (j >> 1))) & 0x0F0F0F0Fu;
    const unsigned int high = (j < 3 ? hw << (4 - 2 * j) : hw >> 2) & 0x30303030u;
    const unsigned int q = __byte_perm(low | high, r.magic, 0x7540 | (t & 3));  // 2^23 + q's bits
    return __fsub_rn(__uint_as_float(q), 8388640.0f);  // q - 32
  }
  __device__ static float scale(const Row& r, int j) { return r.dl[j]; }  // d * sc: run j's (j = k / 8)
  __device__ static float bias(const Row&, int) { return 0.0f; }
};

// Byte t (0..31) of 32 bytes held as two uint4.
__device__ __forceinline__ unsigned int mlxi_byte32(const uint4& a, const uint4& b, int t) {
  const uint4& h = t < 16 ? a : b;
  const int w = (t >> 2) & 3;
  const unsigned int word = w == 0 ? h.x : w == 1 ? h.y : w == 2 ? h.z : h.w;
  return (word >> (8 * (t & 3))) & 0xffu;
}

// The affine types (affine_matvec says the fields): value t = scale * code t + bias, each step rounded
// (scale * code is exact: an fp16 d, times a 6-bit sub-scale for the K-quants, times the code). By runs
// of 32 (a unit: code() less the zero, scale(), bias()), but 8-bit codes (Q8_0), by value (value(): d *
// (code - 128), exact): the runs' form spilled there (NVRTC, sm_90) and was slower on an H100
// (docs/performance.md).
template <int BITS, int SCALES, int ZERO>
struct mlxi_affine : mlxi_groups32 {
  static constexpr int RUN = BITS == 8 ? 0 : 32;
  static constexpr bool BIAS = SCALES != 0;  // SCALES 0: the zero is in the code
  struct Fields {
    const unsigned int* w;
    const uint16_t* s0;
    const void* s1;  // uint16_t (SCALES 1: m's bits) or uint8_t (SCALES 2: sub-scales and mins)
    unsigned int ff00;  // 0xFF00 (mlxi_code_at; mlxi_held)
  };
  struct Row {
    unsigned int words[BITS];
    float scale, bias;
    unsigned int ff00;
  };
  __device__ static void prepare() {}
  __device__ static Row load(const Fields& f, long n, long g, long K) {
    Row r;
    const long at = n * (K / 32) + g, blk = n * (K / 256) + (g >> 3);
    r.ff00 = f.ff00;
    if (SCALES == 2) {
      const uint8_t* s1 = static_cast<const uint8_t*>(f.s1);
      const int j = g & 7;
      r.scale = __fmul_rn(mlxi_half_bits(f.s0[2 * blk]), (float)s1[16 * blk + j]);
      r.bias = -__fmul_rn(mlxi_half_bits(f.s0[2 * blk + 1]), (float)s1[16 * blk + 8 + j]);
    } else if (SCALES == 1) {
      r.scale = mlxi_half_bits(f.s0[at]);
      r.bias = mlxi_half_bits(static_cast<const uint16_t*>(f.s1)[at]);
    } else {
      r.scale = mlxi_half_bits(f.s0[at]);  // (bias -(scale * ZERO): the code less ZERO instead)
      r.bias = 0.0f;
    }
    mlxi_words<BITS>(f.w + at * BITS, r.words);
    return r;
  }
  // Value t by value (RUN 0: Q8_0's 8-bit codes): d * (code - 128), exact (its bias -(128 d) in the code).
  __device__ static float value(const Row& r, int t) {
    static_assert(BITS == 8 && SCALES == 0, "by value: Q8_0 only (the other affine types by runs)");
    return __fmul_rn(r.scale, mlxi_code_at<8, ZERO>(r.words, t, r.ff00));
  }
  // Code t less the zero (SCALES 0: ZERO; else 0), exactly, for the runs' form.
  __device__ static float code(const Row& r, int t) {
    constexpr int Z = SCALES == 0 ? ZERO : 0;
    if (BITS == 4) return mlxi_code_at<4, Z>(r.words, t, r.ff00);
    return mlxi_code_float(mlxi_code<BITS>(r.words, t), 8388608.0f + Z);
  }
  __device__ static float scale(const Row& r, int) { return r.scale; }
  __device__ static float bias(const Row& r, int) { return r.bias; }
};

// IQ4_NL (XS 0) and IQ4_XS (XS 1): group g is IQ4_NL's block g, or IQ4_XS's sub-block j = g % 8 of block
// g / 8; dl = d or d * (ls - 32), value t = dl * the codebook's entry for code t (byte t's low nibble for
// t < 16, else byte t - 16's high one).
template <int XS>
struct mlxi_iq4 : mlxi_groups32 {
  struct Fields {
    const uint8_t* qs;
    const uint16_t* d_bits;
    const uint16_t* sc_h;
    const uint8_t* sc_l;
  };
  struct Row {
    uint4 codes;
    float dl;
  };
  __device__ static float* table() {  // the codebook, each lane reading its own entry: no bank conflict
    __shared__ float t[16];
    return t;
  }
  __device__ static void prepare() {
    if (threadIdx.x < 16) table()[threadIdx.x] = mlxi_iq4_value(threadIdx.x);
  }
  __device__ static Row load(const Fields& f, long n, long g, long K) {
    Row r;
    if (XS) {
      const long blk = n * (K / 256) + (g >> 3);
      const int j = g & 7;
      const unsigned int ls = ((f.sc_l[4 * blk + (j >> 1)] >> (4 * (j & 1))) & 0xfu) | (((f.sc_h[blk] >> (2 * j)) & 3u) << 4);
      r.dl = __fmul_rn(mlxi_half_bits(f.d_bits[blk]), mlxi_code_float(ls, 8388640.0f));  // d * (ls - 32)
      r.codes = *reinterpret_cast<const uint4*>(f.qs + blk * 128 + 16 * j);
    } else {
      r.dl = mlxi_half_bits(f.d_bits[n * (K / 32) + g]);
      r.codes = *reinterpret_cast<const uint4*>(f.qs + (n * (K / 32) + g) * 16);
    }
    return r;
  }
  __device__ static float value(const Row& r, int t) {
    const int b = t & 15;
    const unsigned int word = b < 4 ? r.codes.x : b < 8 ? r.codes.y : b < 12 ? r.codes.z : r.codes.w;
    const unsigned int code = (word >> (8 * (b & 3) + 4 * (t >> 4))) & 0xfu;
    return __fmul_rn(r.dl, table()[code]);
  }
};

// Q3_K: group g is values 32 j .. 32 j + 31 of block g / 8 (j = g % 8): value i = 128 h + 32 s + t
// (h = j / 4, s = j % 4) has low bits (qs[32 h + t] >> 2 s) & 3 and high bit (hmask[t] >> j) & 1, q =
// low - 4 (1 - high); scale k = i / 16 (2 j for t < 16, else 2 j + 1), 6 bits: k < 8 the low nibble of
// scales[k], else the high nibble of scales[k - 8], with (scales[8 + k % 4] >> 2 (k / 4)) & 3 above;
// value = (d * (scale - 32)) * q.
struct mlxi_q3k : mlxi_groups32 {
  struct Fields {
    const uint8_t* hmask;
    const uint8_t* qs;
    const uint8_t* sc;
    const uint16_t* d_bits;
  };
  struct Row {
    uint4 q0, q1, m0, m1;
    float dl0, dl1;
    int s, j;
  };
  __device__ static void prepare() {}
  __device__ static unsigned int scale(const uint8_t* sc, int k) {
    const unsigned int lo = k < 8 ? sc[k] & 0xfu : sc[k - 8] >> 4;
    return lo | (((sc[8 + (k & 3)] >> (2 * (k >> 2))) & 3u) << 4);
  }
  __device__ static Row load(const Fields& f, long n, long g, long K) {
    Row r;
    const long blk = n * (K / 256) + (g >> 3);
    r.j = g & 7;
    r.s = r.j & 3;
    const uint8_t* sc = f.sc + blk * 12;
    const float d = mlxi_half_bits(f.d_bits[blk]);
    r.dl0 = __fmul_rn(d, mlxi_code_float(scale(sc, 2 * r.j), 8388640.0f));
    r.dl1 = __fmul_rn(d, mlxi_code_float(scale(sc, 2 * r.j + 1), 8388640.0f));
    const uint4* q = reinterpret_cast<const uint4*>(f.qs + blk * 64 + 32 * (r.j >> 2));
    const uint4* m = reinterpret_cast<const uint4*>(f.hmask + blk * 32);
    r.q0 = q[0]; r.q1 = q[1]; r.m0 = m[0]; r.m1 = m[1];
    return r;
  }
  __device__ static float value(const Row& r, int t) {
    const unsigned int low = (mlxi_byte32(r.q0, r.q1, t) >> (2 * r.s)) & 3u;
    const unsigned int high = (mlxi_byte32(r.m0, r.m1, t) >> r.j) & 1u;
    return __fmul_rn(t < 16 ? r.dl0 : r.dl1, mlxi_code_float(low | (high << 2), 8388612.0f));  // low - 4 (1 - high)
  }
};

// Q2_K: group g is values 32 j .. 32 j + 31 of block g / 8: value i = 128 h + 32 s + t has q =
// (qs[32 h + t] >> 2 s) & 3; scale k = i / 16: dl = d * (scales[k] & 15), ml = dmin * (scales[k] >> 4);
// value = dl * q - ml (dl * q exact: one fma).
struct mlxi_q2k : mlxi_groups32 {
  struct Fields {
    const uint8_t* sc;
    const uint8_t* qs;
    const uint16_t* d_bits;
    const uint16_t* dmin_bits;
  };
  struct Row {
    uint4 q0, q1;
    float dl0, dl1, ml0, ml1;
    int s;
  };
  __device__ static void prepare() {}
  __device__ static Row load(const Fields& f, long n, long g, long K) {
    Row r;
    const long blk = n * (K / 256) + (g >> 3);
    const int j = g & 7;
    r.s = j & 3;
    const float d = mlxi_half_bits(f.d_bits[blk]), dmin = mlxi_half_bits(f.dmin_bits[blk]);
    const unsigned int c0 = f.sc[blk * 16 + 2 * j], c1 = f.sc[blk * 16 + 2 * j + 1];
    r.dl0 = __fmul_rn(d, mlxi_code_float(c0 & 0xfu, 8388608.0f));
    r.dl1 = __fmul_rn(d, mlxi_code_float(c1 & 0xfu, 8388608.0f));
    r.ml0 = __fmul_rn(dmin, mlxi_code_float(c0 >> 4, 8388608.0f));
    r.ml1 = __fmul_rn(dmin, mlxi_code_float(c1 >> 4, 8388608.0f));
    const uint4* q = reinterpret_cast<const uint4*>(f.qs + blk * 64 + 32 * (j >> 2));
    r.q0 = q[0]; r.q1 = q[1];
    return r;
  }
  __device__ static float value(const Row& r, int t) {
    const unsigned int q = (mlxi_byte32(r.q0, r.q1, t) >> (2 * r.s)) & 3u;
    return __fmaf_rn(t < 16 ? r.dl0 : r.dl1, mlxi_code_float(q, 8388608.0f), -(t < 16 ? r.ml0 : r.ml1));
  }
};

// F16 (BF 0) and BF16 (BF 1) values, kept as 16-bit: value t of group g is element 32 g + t of the row.
template <int BF>
struct mlxi_half_values : mlxi_groups32 {
  struct Fields {
    const uint16_t* v;
  };
  struct Row {
    uint4 a[4];
  };
  __device__ static void prepare() {}
  __device__ static Row load(const Fields& f, long n, long g, long K) {
    Row r;
    const uint4* p = reinterpret_cast<const uint4*>(f.v + n * K + 32 * g);
#pragma unroll
    for (int i = 0; i < 4; ++i) r.a[i] = p[i];
    return r;
  }
  __device__ static float value(const Row& r, int t) {
    const uint4& q = r.a[t >> 3];
    const int w = (t >> 1) & 3;
    const unsigned int word = w == 0 ? q.x : w == 1 ? q.y : w == 2 ? q.z : q.w;
    const unsigned int h = (word >> (16 * (t & 1))) & 0xffffu;
    return BF ? __uint_as_float(h << 16) : mlxi_half_bits(h);
  }
};
//@@BODY q6_k_matvec
// x [M, K] (T: float, __half or __nv_bfloat16); the Q6_K fields of w [N, K] as quants.split keeps them,
// per row and block of 256 values: ql [N, K/256, 128] uint8, qh [N, K/256, 64] uint8, scales
// [N, K/256, 16] int8, d [N, K/256] the fp16 scale's bits (uint16); dims = [N, K, R, eps bits, forms]; out [M, N] (T).
// Value i of a block (gguf-py's order): h = i / 128, r = i % 128; low four bits from
// ql[64h + r % 64] >> (4 * (r / 64)), high two from qh[32h + r % 32] >> (2 * (r / 32)); q = low | high << 4;
// w = (d * scales[i / 16]) * (q - 32).
// Work units: u = 8b + p, part p = 4h + c of block b holds r = 8c + t + 32j (t, j: 0..7, 0..3): eight
// consecutive bytes of ql at 64h + 8c and at 64h + 32 + 8c, eight of qh at 32h + 8c, one scale per j.
// Lane l takes the units u = l, l + 32, ... and in each adds j = 0..3, t = 0..7 in that order: the units
// of a row are loaded in parallel by the lanes (mlxi_block_matvec, mlxi_q6k).
mlxi_block_matvec<M, mlxi_q6k, (MLXI_MIN_BLOCKS > 1)>(x, out, dims, {ql, qh, scales, d_bits, mlxi_held<M>(0x4B000000u, dims)}, res, nw);
//@@BODY affine_matvec
// The affine types as the MLX backend keeps them (quants.split): w [N, K BITS / 32] uint32 (MLX's packing),
// then the file's scale fields, by SCALES: 0 (Q8_0, Q4_0, Q5_0) s0 [N, K / 32] the fp16 d's bits, scale d,
// bias -(d * ZERO) (ZERO 128, 8, 16: exact), s1 unused; 1 (Q4_1, Q5_1) s0 d and s1 m [N, K / 32] (fp16 bits),
// scale d, bias m; 2 (Q4_K, Q5_K) s0 [N, K / 256, 2] the fp16 d and dmin's bits, s1 [N, K / 256, 2, 8]
// uint8 sub-scales then mins, group g = 8b + j: scale d sc_j, bias -(dmin m_j) (quants: exact).
// dims = [N, K, R, eps bits, forms]; out [M, N]. Lane l takes groups l, l + 32, ..., each t = 0..31: code t of the group
// (MLX's packing: bits [BITS t, BITS (t + 1)) of the group's BITS words), w = scale * code + bias (each
// step rounded), then the product with x and the sum (mlxi_block_matvec, mlxi_affine).
mlxi_block_matvec<M, mlxi_affine<BITS, SCALES, ZERO>, (MLXI_MIN_BLOCKS > 1)>(x, out, dims, {w, s0, s1, mlxi_held<M>(0xFF00u, dims)}, res, nw);
//@@BODY affine_q6_k_matvec
// A weight group's two runs in one launch (mlxi_pair_matvec): A of an affine type (affine_matvec's
// fields w, s0, s1 and constants), then B in Q6_K (q6_k_matvec's ql, qh, scales, d_bits); dims = [NA, K,
// 1, eps bits, forms, NB] (forms: NORM or none); out [M, NA + NB] = [x @ A.T | x @ B.T].
mlxi_pair_matvec<M, mlxi_affine<BITS, SCALES, ZERO>, mlxi_q6k, (MLXI_MIN_BLOCKS > 1)>(
    x, out, dims, {w, s0, s1, mlxi_held<M>(0xFF00u, dims)}, {ql, qh, scales, d_bits, mlxi_held<M>(0x4B000000u, dims)}, nw);
//@@BODY iq4_matvec
// IQ4_NL (XS 0) and IQ4_XS (XS 1) as the MLX backend keeps them (quants.split: the file's fields): qs the
// 4-bit codes, 16 bytes per 32 values (IQ4_NL [N, K / 32, 16]; IQ4_XS [N, K / 256, 128], sub-block j at
// 16 j), d_bits the fp16 d's bits ([N, K / 32] or [N, K / 256]); IQ4_XS also sc_h [N, K / 256] uint16 and
// sc_l [N, K / 256, 4] uint8, sub-block j's 6-bit scale ls = (sc_l[j / 2] >> 4 (j % 2)) & 15 |
// ((sc_h >> 2 j) & 3) << 4 (IQ4_NL: unused). dims = [N, K, R, eps bits, forms]; out [M, N]. mlxi_iq4 says the values.
mlxi_block_matvec<M, mlxi_iq4<XS>, (MLXI_MIN_BLOCKS > 1)>(x, out, dims, {qs, d_bits, sc_h, sc_l}, res, nw);
//@@BODY q3_k_matvec
// Q3_K's fields (quants.split) per row and block of 256 values: hmask [N, K/256, 32], qs [N, K/256, 64],
// sc3 [N, K/256, 12] uint8, d_bits [N, K/256] the fp16 d's bits; dims = [N, K, R, eps bits, forms]; out [M, N]. mlxi_q3k
// says the values.
mlxi_block_matvec<M, mlxi_q3k, (MLXI_MIN_BLOCKS > 1)>(x, out, dims, {hmask, qs, sc3, d_bits}, res, nw);
//@@BODY q2_k_matvec
// Q2_K's fields per row and block: sc2 [N, K/256, 16] uint8, qs [N, K/256, 64], d_bits and dmin_bits
// [N, K/256] fp16 bits; dims = [N, K, R, eps bits, forms]; out [M, N]. mlxi_q2k says the values.
mlxi_block_matvec<M, mlxi_q2k, (MLXI_MIN_BLOCKS > 1)>(x, out, dims, {sc2, qs, d_bits, dmin_bits}, res, nw);
//@@BODY half_matvec
// F16 (BF 0) or BF16 (BF 1) values v [N, K] as uint16 bits; dims = [N, K, R, eps bits, forms]; out [M, N].
mlxi_block_matvec<M, mlxi_half_values<BF>, (MLXI_MIN_BLOCKS > 1)>(x, out, dims, {v}, res, nw);
//@@BODY affine_scales
// The scales and biases [N, K / 32] (T) a prompt's product multiplies (mx.quantized_matmul, mx.dequantize)
// from an affine weight's compact fields, a thread a group (mlxi_group_affine: SCALES 2 for Q4_K and
// Q5_K, 1 for Q4_1 and Q5_1): the bits of mlx_weights' `formed_scales` (the graph's chains), written where
// they are used, [N, K / 32] with no view between. dims = [N, K / 32]; scales, biases [N, K / 32] (T).
const long groups = (long)dims[0] * dims[1];
const long i = ((long)blockIdx.y * gridDim.x + blockIdx.x) * MLXI_THREADS + threadIdx.x;
if (i < groups) {
  float scale, bias;
  mlxi_group_affine<T, SCALES, 0>(s0, s1, i, scale, bias);
  scales[i] = (T)scale;  // (a T's value as float and back: the same T)
  biases[i] = (T)bias;
}
//@@BODY affine_values
// An affine weight's values [N, K] (T) a prompt's product multiplies (dequantized, then one matmul: MLX's
// quantized_matmul reads a 4-bit weight slower than an 8-bit one at a prompt's few rows, H100), from its
// compact fields (affine_matvec's w, s0, s1; SCALES and ZERO as there), a thread 8 values of a group:
// the group's scale and bias rounded to T (mlxi_group_affine, as affine_scales writes them), then each
// value code * scale + bias in float32 (the product exact: at most 22 significant
// bits; the sum rounded), then rounded once to T: the bits of mlx_weights' `affine_values` (the
// graph's), written [N, K] with 8 values a store. dims = [N, K / 32]; out [N, K] (T).
const long groups = (long)dims[0] * dims[1];
const long i = ((long)blockIdx.y * gridDim.x + blockIdx.x) * MLXI_THREADS + threadIdx.x;
if (i < 4 * groups) {
  const long g = i >> 2;
  const int part = (int)(i & 3);
  float scale, bias;
  mlxi_group_affine<T, SCALES, ZERO>(s0, s1, g, scale, bias);
  const unsigned int* words = w + g * BITS;
  float f[8];
#pragma unroll
  for (int t = 0; t < 8; ++t) f[t] = __fadd_rn(__fmul_rn((float)mlxi_code<BITS>(words, 8 * part + t), scale), bias);
  const mlxi_vec8<T> v = {{(T)f[0], (T)f[1], (T)f[2], (T)f[3], (T)f[4], (T)f[5], (T)f[6], (T)f[7]}};
  reinterpret_cast<mlxi_vec8<T>*>(out)[i] = v;
}
//@@BODY q6_k_values
// Q6_K's values [N, K] (T) a prompt's product multiplies (dequantized, then one matmul), from
// q6_k_matvec's fields, a thread a value: value v of block b of row n (q6_k_matvec says which bits),
// (d * scales[v / 16]) * (q - 32), each product rounded in float32 (q - 32 is exact), then rounded
// once to T: the bits of mlx_weights' `formed_values` (the graph's), written [N, K] with no view
// between. dims = [N, K]; out [N, K] (T).
const long K = dims[1], total = (long)dims[0] * K;
const long i = ((long)blockIdx.y * gridDim.x + blockIdx.x) * MLXI_THREADS + threadIdx.x;
if (i < total) {
  const long blk = i >> 8;  // (rows are whole blocks of 256)
  const int v = (int)(i & 255), h = v >> 7, r = v & 127;
  const unsigned int low = ((unsigned int)ql[128 * blk + 64 * h + (r & 63)] >> (4 * (r >> 6))) & 0xfu;
  const unsigned int high = ((unsigned int)qh[64 * blk + 32 * h + (r & 31)] >> (2 * (r >> 5))) & 3u;
  const float dl = __fmul_rn(mlxi_half_bits(d_bits[blk]), (float)scales[16 * blk + (v >> 4)]);
  out[i] = (T)__fmul_rn(dl, __fsub_rn((float)(low | (high << 4)), 32.0f));
}
//@@BODY rms_norm
// RMSNorm of x [M, K] (T) with weight nw [K] (T): out [M, K] (T), a warp a row (mlxi_rms_inv: the order);
// dims = [M, K, eps's float32 bits, 0].
const long rows = dims[0];
const int K = dims[1], lane = threadIdx.x & 31;
const long row = ((long)blockIdx.y * gridDim.x + blockIdx.x) * MLXI_WARPS + (threadIdx.x >> 5);
if (row < rows) {
  const T* xr = x + row * K;
  const float inv = mlxi_rms_inv(xr, K, __int_as_float(dims[2]), lane);
  // 16 values of x and nw loaded before any is written: out may alias them for the compiler, so a plain
  // loop waits for each store before the next loads (a 4,096-value row took ~50 us on an H100)
  for (int c0 = lane; c0 < K; c0 += 32 * 16) {
    float v[16], w[16];
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (c0 + 32 * j < K) v[j] = (float)xr[c0 + 32 * j], w[j] = (float)nw[c0 + 32 * j];
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (c0 + 32 * j < K) out[row * K + c0 + 32 * j] = (T)mlxi_norm_value<T>(v[j], inv, w[j]);
  }
}
//@@BODY swiglu
// SwiGLU of x [M, 2K] (T) = [gate | up] a row: out [M, K] (T), a thread a value (mlxi_swiglu_value: the
// order); dims = [M, K, 0, 0] (padded: kernels.kernel_args).
const long K = dims[1], total = (long)dims[0] * K;
const long i = ((long)blockIdx.y * gridDim.x + blockIdx.x) * MLXI_THREADS + threadIdx.x;
if (i < total) {
  const long m = i / K, c = i - m * K;
  out[i] = (T)mlxi_swiglu_value<T>((float)x[2 * K * m + c], (float)x[2 * K * m + K + c]);
}
