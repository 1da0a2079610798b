// The CUDA subset metal_kernels/blocks.cu and attention.cu use, on the host (tests/cuda_host.py): a kernel
// body compiled by g++ runs as one fiber per CUDA thread (`mlxh_swap` below), a block at a time in one OS thread,
// so that the kernels' indexing, tiles, barriers and warp shuffles run where no GPU is. A fiber runs until
// it waits at a barrier, then the next one runs; a barrier some thread of the block never reaches (a
// divergent __syncthreads, a shuffle in a branch) stops the launch with a message, where a GPU would hang
// or be undefined. The float intrinsics are IEEE float32 operations
// rounded to nearest, as CUDA's __fmul_rn & co. are (built with -ffp-contract=off: no fma unless asked);
// subnormals are kept, as on the GPU without -ftz. Not a CUDA emulator: what blocks.cu needs, no more.
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
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
mlxh_dim3 threadIdx, blockIdx, gridDim, blockDim;  // the running fiber's (set as it is resumed)

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
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
// CUDA's rsqrtf is within 2 ulp of 1/sqrt(x), not published bit for bit: the host's is the rounded 1/sqrt(x)
// (as its expf, sinf, cosf are glibc's): kernels using these are bounded against the host, not matched.
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, 4);
  return u;
}
// CUDA's byte permute (PRMT's default mode): byte i of the result is byte (s >> 4 i) & 7 of the eight
// bytes of y:x (x's four first); the selector's sign bit (8) is not used here.
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const unsigned long long both = ((unsigned long long)y << 32) | x;
  unsigned int r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned int)((both >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
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

// Switching fibers. On x86-64 a few instructions save what a function call must keep (callee-saved
// registers, the float control words) and swap stack pointers; glibc's swapcontext, the fallback
// elsewhere (or with -DMLXH_UCONTEXT), also saves the signal mask: a system call at every switch.
#if defined(__x86_64__) && !defined(MLXH_UCONTEXT)
struct mlxh_context {
  void* sp = nullptr;
};
extern "C" void mlxh_switch(void** save, void* load);
asm(R"(
  .text
  .globl mlxh_switch
  .hidden mlxh_switch
  .type mlxh_switch, @function
mlxh_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mlxh_switch, .-mlxh_switch
)");
inline void mlxh_swap(mlxh_context& from, mlxh_context& to) { mlxh_switch(&from.sp, to.sp); }
// a context whose first switch "returns" into entry(), on a 16-byte aligned stack as after a call
inline void mlxh_make(mlxh_context& c, char* stack, size_t size, void (*entry)()) {
  uintptr_t top = (uintptr_t)(stack + size) & ~(uintptr_t)15;
  void** slot = (void**)(top - 16);
  slot[1] = nullptr;                    // (above it: no caller)
  *slot = (void*)entry;                 // the address `ret` jumps to
  for (int r = 1; r <= 6; ++r) slot[-r] = nullptr;  // rbp, rbx, r12-r15
  uint32_t* words = (uint32_t*)(slot - 7);  // mxcsr and the x87 control word: the caller's
  asm volatile("stmxcsr %0" : "=m"(words[0]));
  asm volatile("fnstcw %0" : "=m"(words[1]));
  c.sp = (void*)(slot - 7);
}
#else
struct mlxh_context {
  ucontext_t uc;
};
inline void mlxh_swap(mlxh_context& from, mlxh_context& to) { swapcontext(&from.uc, &to.uc); }
inline void mlxh_make(mlxh_context& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

// The fibers of a block: each runs until it waits at a barrier (`mlxh_yield` back to the launch's loop).
struct mlxh_fiber {
  mlxh_context ctx;
  bool done = false;
};
mlxh_context mlxh_loop;
std::vector<mlxh_fiber> mlxh_fibers;
unsigned int mlxh_running = 0;
bool mlxh_progress = false;  // a barrier arrival or a fiber's end since the loop's last sweep
inline void mlxh_yield() { mlxh_swap(mlxh_fibers[mlxh_running].ctx, mlxh_loop); }

// A barrier of `expected` threads: each arrival waits (yields) until the last one opens a new generation.
struct mlxh_barrier {
  unsigned int expected = 0, count = 0;
  unsigned long generation = 0;
  void arrive_and_wait() {
    const unsigned long g = generation;
    mlxh_progress = true;
    if (++count == expected) {
      count = 0;
      ++generation;
      return;
    }
    while (generation == g) mlxh_yield();
  }
};

// A block's barrier and each warp's exchange (every thread of a block, and of a warp, reaches each).
mlxh_barrier mlxh_block_barrier;
mlxh_barrier mlxh_warp_barrier[32];
uint32_t mlxh_exchange[32][32];

inline void __syncthreads() { mlxh_block_barrier.arrive_and_wait(); }

// The kernels' warp collectives take the whole warp (mask 0xffffffff); a partial mask is not modelled.
inline void mlxh_full_warp(unsigned int mask) {
  if (mask != 0xffffffffu) {
    std::fprintf(stderr, "cuda_host: a warp collective with mask %#x (only whole warps are modelled)\n", mask);
    std::abort();
  }
}

// lane `src(l)` of the warp's value of `v`, for every lane l (the shuffles below)
template <typename T>
inline T mlxh_shuffle(unsigned int mask, T v, unsigned int src) {
  static_assert(sizeof(T) == 4);
  mlxh_full_warp(mask);
  const unsigned int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  T r;
  std::memcpy(&mlxh_exchange[w][l], &v, 4);
  mlxh_warp_barrier[w].arrive_and_wait();
  std::memcpy(&r, &mlxh_exchange[w][src & 31], 4);
  mlxh_warp_barrier[w].arrive_and_wait();
  return r;
}
inline float __shfl_xor_sync(unsigned int m, float v, int off) { return mlxh_shuffle(m, v, (threadIdx.x & 31) ^ off); }
inline int __shfl_xor_sync(unsigned int m, int v, int off) { return mlxh_shuffle(m, v, (threadIdx.x & 31) ^ off); }
inline float __shfl_sync(unsigned int m, float v, int src) { return mlxh_shuffle(m, v, src); }
inline int __shfl_sync(unsigned int m, int v, int src) { return mlxh_shuffle(m, v, src); }

// CUDA's integer min and max, for operands of mixed types (the common type's)
template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) { return a < b ? a : b; }
template <typename A, typename B>
inline std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }

inline bool __all_sync(unsigned int mask, bool p) {
  mlxh_full_warp(mask);
  const unsigned int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  mlxh_exchange[w][l] = p ? 1u : 0u;
  mlxh_warp_barrier[w].arrive_and_wait();
  bool all = true;
  for (int i = 0; i < 32; ++i) all = all && mlxh_exchange[w][i] != 0u;
  mlxh_warp_barrier[w].arrive_and_wait();
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
  mlxh_warp_barrier[w].arrive_and_wait();
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
  mlxh_warp_barrier[w].arrive_and_wait();
}

// Runs body(...) as gx x gy blocks of `threads` threads (a multiple of 32, at most 1,024), one block at
// a time, like the launch MLX makes of a custom kernel with that grid: the block's fibers in turn, each
// until it waits or ends, sweep after sweep; a sweep in which no thread arrived anywhere or ended is a
// barrier that cannot open (some thread never reaches it): the launch stops the process with a message.
// Blocks alternate the order their fibers run in (0 to n-1, then n-1 to 0), so that a read of another
// thread's write with no barrier between them fails in one of the two (a GPU gives no order at all).
constexpr size_t MLXH_STACK = 256 * 1024;  // a fiber's stack (the kernels' per-thread arrays live there)
std::function<void()> mlxh_body;
inline void mlxh_fiber_main() {
  mlxh_body();
  mlxh_fibers[mlxh_running].done = true;
  mlxh_progress = true;
  mlxh_yield();  // never resumed
}

template <typename F>
void mlxh_launch(unsigned int gx, unsigned int gy, unsigned int threads, F body) {
  gridDim = {gx, gy, 1};
  blockDim = {threads, 1, 1};
  mlxh_body = body;
  static std::unique_ptr<char[]> stacks;  // (untouched pages: no memory until a fiber uses them)
  static unsigned int stacks_for = 0;
  if (stacks_for < threads) stacks.reset(new char[threads * MLXH_STACK]), stacks_for = threads;
  mlxh_fibers.assign(threads, mlxh_fiber{});
  for (unsigned int by = 0; by < gy; ++by) {
    for (unsigned int bx = 0; bx < gx; ++bx) {
      blockIdx = {bx, by, 0};
      mlxh_block_barrier = mlxh_barrier{threads};
      for (unsigned int w = 0; w < 32; ++w) mlxh_warp_barrier[w] = mlxh_barrier{32};
      for (unsigned int t = 0; t < threads; ++t) {
        mlxh_fiber& f = mlxh_fibers[t];
        f.done = false;
        mlxh_make(f.ctx, stacks.get() + t * MLXH_STACK, MLXH_STACK, mlxh_fiber_main);
      }
      for (unsigned int left = threads; left;) {
        mlxh_progress = false;
        const bool reversed = (bx + by * gx) & 1;
        for (unsigned int i = 0; i < threads; ++i) {
          const unsigned int t = reversed ? threads - 1 - i : i;
          if (mlxh_fibers[t].done) continue;
          mlxh_running = t;
          threadIdx = {t, 0, 0};
          mlxh_swap(mlxh_loop, mlxh_fibers[t].ctx);
          left -= mlxh_fibers[t].done;
        }
        if (left && !mlxh_progress) {
          std::fprintf(stderr, "cuda_host: block (%u, %u): a barrier %u of its threads wait at never opens\n",
                       bx, by, left);
          std::abort();
        }
      }
    }
  }
}
