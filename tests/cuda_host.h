// The CUDA subset metal_kernels/blocks.cu uses, on the host (tests/cuda_host.py): a kernel body compiled by
// g++ runs as one std::thread per CUDA thread, a block at a time, so that the kernels' indexing, tiles,
// barriers and warp shuffles run where no GPU is. The float intrinsics are IEEE float32 operations
// rounded to nearest, as CUDA's __fmul_rn & co. are (built with -ffp-contract=off: no fma unless asked);
// subnormals are kept, as on the GPU without -ftz. Not a CUDA emulator: what blocks.cu needs, no more.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#define MLXH_HOST  // (attention.cu's tensor-core instruction takes its stand-in below)
#define __device__
#define __host__
#define __forceinline__ inline
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static  // one block runs at a time: a static is the block's shared memory

struct mlxh_dim3 {
  unsigned int x = 0, y = 0, z = 0;
};
thread_local mlxh_dim3 threadIdx, blockIdx;
mlxh_dim3 gridDim, blockDim;

struct float4 {
  float x, y, z, w;
};
struct uint2 {
  unsigned int x, y;
};
struct uint4 {
  unsigned int x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// 16-bit floats: read exactly as float, written from float rounded to nearest even (the kernels' (T)s).
struct __half {
  uint16_t bits;
  __half() = default;
  __half(float f) {
    const _Float16 h = (_Float16)f;
    std::memcpy(&bits, &h, 2);
  }
  operator float() const {
    const unsigned int sign = (bits & 0x8000u) << 16, e = (bits >> 10) & 0x1fu, m = bits & 0x3ffu;
    if (e == 0) {
      const float v = (float)m * 5.9604644775390625e-8f;
      return sign ? -v : v;
    }
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
  }
};
struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    bits = std::isnan(f) ? (uint16_t)((u >> 16) | 0x40u) : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const { return __uint_as_float((unsigned int)bits << 16); }
};

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
inline float __half2float(__half h) { return (float)h; }
inline __half __ushort_as_half(unsigned short u) {
  __half h;
  h.bits = u;
  return h;
}
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
  __nv_bfloat16 h;
  h.bits = u;
  return h;
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __half __float2half_rn(float f) { return __half(f); }

// A block's barrier and each warp's exchange (every thread of a block, and of a warp, reaches each).
std::barrier<>* mlxh_block_barrier = nullptr;
std::barrier<>* mlxh_warp_barrier[32];
float mlxh_exchange[32][32];

inline void __syncthreads() { mlxh_block_barrier->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned int, float v, int off) {
  const unsigned int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  mlxh_exchange[w][l] = v;
  mlxh_warp_barrier[w]->arrive_and_wait();
  const float r = mlxh_exchange[w][l ^ off];
  mlxh_warp_barrier[w]->arrive_and_wait();
  return r;
}

inline int __shfl_xor_sync(unsigned int, int v, int off) {
  const unsigned int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  int r;
  std::memcpy(&mlxh_exchange[w][l], &v, 4);
  mlxh_warp_barrier[w]->arrive_and_wait();
  std::memcpy(&r, &mlxh_exchange[w][l ^ off], 4);
  mlxh_warp_barrier[w]->arrive_and_wait();
  return r;
}

inline float __shfl_sync(unsigned int, float v, int src) {
  const unsigned int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  mlxh_exchange[w][l] = v;
  mlxh_warp_barrier[w]->arrive_and_wait();
  const float r = mlxh_exchange[w][src & 31];
  mlxh_warp_barrier[w]->arrive_and_wait();
  return r;
}

inline int __shfl_sync(unsigned int, int v, int src) {
  const unsigned int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  int r;
  std::memcpy(&mlxh_exchange[w][l], &v, 4);
  mlxh_warp_barrier[w]->arrive_and_wait();
  std::memcpy(&r, &mlxh_exchange[w][src & 31], 4);
  mlxh_warp_barrier[w]->arrive_and_wait();
  return r;
}

// CUDA's integer min and max, for operands of mixed types (the common type's)
template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) { return a < b ? a : b; }
template <typename A, typename B>
inline std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }

inline bool __all_sync(unsigned int, bool p) {
  const unsigned int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  mlxh_exchange[w][l] = p ? 1.0f : 0.0f;
  mlxh_warp_barrier[w]->arrive_and_wait();
  bool all = true;
  for (int i = 0; i < 32; ++i) all = all && mlxh_exchange[w][i] != 0.0f;
  mlxh_warp_barrier[w]->arrive_and_wait();
  return all;
}

// The m16n8k16 tensor-core instruction d += a * b across a warp, its fragments laid out as the PTX ISA
// says (attention.cu, mlxi_mma): each lane's four results from the 16 products of its row and column,
// gathered from the lanes that hold them, summed exactly (double: 16-bit products are exact, and so is
// their sum for the values tests draw) and rounded once. The GPU's own rounding is not this (it is not
// published; mostly toward zero): the host checks the kernels' layout and steps, and that two paths agree,
// not the GPU's bits.
uint32_t mlxh_frag[32][32][6];
inline double mlxh_half_value(uint32_t bits, bool bf) {
  if (bf) return (double)__uint_as_float(bits << 16);
  __half h;
  h.bits = (uint16_t)bits;
  return (double)(float)h;
}
inline void mlxh_mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], bool bf) {
  const unsigned int w = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, t = l & 3;
  for (int i = 0; i < 4; ++i) mlxh_frag[w][l][i] = a[i];
  mlxh_frag[w][l][4] = b[0];
  mlxh_frag[w][l][5] = b[1];
  mlxh_warp_barrier[w]->arrive_and_wait();
  for (int e = 0; e < 4; ++e) {
    const unsigned int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
    double sum = d[e];
    for (unsigned int k = 0; k < 16; ++k) {
      const unsigned int half = k & 1, reg = (row >= 8) + 2 * (k >= 8), lane_k = (k % 8) / 2;
      const uint32_t av = mlxh_frag[w][(row % 8) * 4 + lane_k][reg] >> (16 * half);
      const uint32_t bv = mlxh_frag[w][col * 4 + lane_k][4 + (k >= 8)] >> (16 * half);
      sum += mlxh_half_value(av & 0xffffu, bf) * mlxh_half_value(bv & 0xffffu, bf);
    }
    d[e] = (float)sum;
  }
  mlxh_warp_barrier[w]->arrive_and_wait();
}

// Runs body(...) as gx x gy blocks of `threads` threads (a multiple of 32, at most 1,024), one block at
// a time, like the launch MLX makes of a custom kernel with that grid.
template <typename F>
void mlxh_launch(unsigned int gx, unsigned int gy, unsigned int threads, F body) {
  gridDim = {gx, gy, 1};
  blockDim = {threads, 1, 1};
  for (unsigned int by = 0; by < gy; ++by) {
    for (unsigned int bx = 0; bx < gx; ++bx) {
      std::barrier<> block((std::ptrdiff_t)threads);
      std::vector<std::barrier<>*> warps;
      for (unsigned int w = 0; w < threads / 32; ++w) warps.push_back(new std::barrier<>(32));
      mlxh_block_barrier = &block;
      for (unsigned int w = 0; w < threads / 32; ++w) mlxh_warp_barrier[w] = warps[w];
      std::vector<std::thread> pool;
      for (unsigned int t = 0; t < threads; ++t) {
        pool.emplace_back([=] {
          threadIdx = {t, 0, 0};
          blockIdx = {bx, by, 0};
          body();
        });
      }
      for (auto& th : pool) th.join();
      for (auto* w : warps) delete w;
    }
  }
}
