// mlxinfer's GPU attention arithmetic for MLX's Metal backend (mx.fast.metal_kernel): the same
// published order as attention.cu, written for Apple GPUs (simdgroups of 32 lanes).
//
// UNVERIFIED ON HARDWARE: no Apple GPU is available where this project is developed and tested, so
// these kernels have never run. What is checked without one: every kernel MLX would generate from this
// file parses with clang against a stand-in for Metal's headers, and fits Apple's limits (32 KB of
// threadgroup memory, 1,024 threads; tests/test_metal_build.py); the order below is read from this file
// and compared with the numpy emulation's (tests/test_metal_order.py). mlxinfer never uses the kernels
// silently: on first use in a process the MLX backend runs them against the per-head reference on every
// plan they run (`self_check_cases`), on the device, and falls back to the per-head reference itself
// (with a one-line warning) unless the bytes agree (`--kernel metal` skips the check). The order, as in
// attention.cu:
//
//   dot(a, b) over n terms (one simdgroup): lane l adds a[i]*b[i] for i = l, l+32, ... in increasing i,
//     each product rounded and then added (contraction into fma switched off below), then a butterfly
//     s += simd_shuffle_xor(s, off) for off = 16, 8, 4, 2, 1;
//   softmax(x) over n values (a threadgroup of 256 threads = 8 simdgroups): m = max(x); e_j =
//     precise::exp(x_j - m); thread t adds e_j for j = t, t+256, ...; butterfly within each simdgroup;
//     the 8 simdgroup totals by a butterfly with off = 4, 2, 1; y_j = e_j / total.
//
// Input types, as in attention.cu: fused_attention reads q, k and v in the dtype MLX hands them (float,
// bfloat16_t or float16_t: --dtype, --kv-dtype; k and v also int8_t, a q8_0 cache's packed rows: mlxi_kv)
// and widens every value to float before any arithmetic (exact for all), so the order above, and the
// bits, are those of float32 inputs; the matmul and softmax kernels take float (the backend widens their
// operands first). fused_attention writes its result in q's type (mlxi_put: rounded to nearest even
// once, as MLX's astype), where the per-head reference rounds its float context too.
//
// MLX's own Metal matmul and softmax (gemv.h, softmax.h) use other orders; that does not matter here,
// because on a GPU both attention paths call these kernels, never MLX's.
//@@HEADER
#include <metal_simdgroup>
#pragma clang fp contract(off)
#pragma clang fp reassociate(off)
#define MLXI_THREADS 256
#define MLXI_WARPS 8
#define MLXI_MAX_D 256
#define MLXI_PART_D 128  // fused_attention's context: head dimensions a pass (threadgroup memory 32 x this)

// v stored in the type p points to (float, bfloat16_t, float16_t), rounded to nearest even: MLX's astype.
template <typename T>
inline void mlxi_put(device T* p, float v) {
  *p = static_cast<T>(v);
}

// v rounded to nearest even in the type p points to, read back as float (float: v itself), as
// attention.cu's mlxi_in: what MLX's own kernels do with their T-typed intermediates.
template <typename T>
inline float mlxi_in(device T*, float v) {
  return float(static_cast<T>(v));
}

// The simdgroup's total of its lanes' partial sums: the butterfly s += simd_shuffle_xor(s, off), off = 16,
// 8, 4, 2, 1 (attention.cu's mlxi_warp_total).
inline float mlxi_simd_total(float s) {
  for (ushort off = 16; off > 0; off >>= 1) s = s + simd_shuffle_xor(s, off);
  return s;
}

// Value c of row r of a K/V store s whose rows hold w values, as float, as in attention.cu: a float
// store (float, bfloat16_t, float16_t; `device` or `constant`) holds a row as its w values; a q8_0 store
// (int8_t, always `device`: a row is 34 bytes or more) as w + w/16 bytes, the w values q as int8, then
// the float16 scale d of each block of 32 values, two bytes, low byte first. d * q is formed in float,
// exact: what the graph's dequantize_q8_0 forms.
template <typename P>
inline float mlxi_kv(P s, long r, long c, long w) {
  return float(s[r * w + c]);
}
inline float mlxi_kv(const device int8_t* s, long r, long c, long w) {
  const device int8_t* row = s + r * (w + w / 16);
  const device int8_t* d = row + w + 2 * (c / 32);
  const float scale = float(as_type<float16_t>(ushort((d[0] & 0xff) | (d[1] & 0xff) << 8)));
  return scale * float(row[c]);
}

// Values c0, c0 + 1, ... of row r of a K/V store, indexed as a pointer is (mlxi_dot's operand).
template <typename P>
struct mlxi_kv_row {
  P s;
  long r, c0, w;
  float operator[](long i) const {
    return mlxi_kv(s, r, c0 + i, w);
  }
};
template <typename P>
inline mlxi_kv_row<P> mlxi_kv_row_at(P s, long r, long c0, long w) {
  return {s, r, c0, w};
}

// A and B: `device` or `constant` pointers (MLX passes an input of fewer than 8 elements as `constant`)
// to float, bfloat16_t or float16_t, each value widened to float before the product; B also a K/V row
// (mlxi_kv_row).
template <typename A, typename B>
inline float mlxi_dot(A a, long sa, B b, long sb, int n, uint lane) {
  float s = 0.0f;
  for (int i = lane; i < n; i += 32) {
    const float prod = float(a[(long)i * sa]) * float(b[(long)i * sb]);
    s = s + prod;
  }
  for (ushort off = 16; off > 0; off >>= 1) {
    s = s + simd_shuffle_xor(s, off);
  }
  return s;
}

// tanh of a float (soft-capping): metal::precise::tanh, what MLX's own Metal tanh calls
// (mlx/backend/metal/kernels/unary_ops.h). MLX's is compiled into its metallib when MLX is built, ours
// when the kernel is first used; so, as on CUDA, the MLX backend's tanh primitive on a GPU is the `tanh`
// kernel below, this very function, for the reference and the fused kernel alike.
inline float mlxi_tanh(float x) {
  return metal::precise::tanh(x);
}

// A score from its dot product, as attention.cu's mlxi_score: scaled after the product, then with a
// soft-cap (cap 0: none) scale(tanh(scale(s, inv)), cap), inv the float32 1/cap.
inline float mlxi_score(float dot, float sc, float cap, float inv) {
  const float s = dot * sc;
  return cap != 0.0f ? mlxi_tanh(s * inv) * cap : s;
}

inline void mlxi_softmax(device float* x, int n, uint tid, threadgroup float* red) {
  const uint lane = tid & 31, wid = tid >> 5;
  float m = -INFINITY;
  for (int j = tid; j < n; j += MLXI_THREADS) m = metal::max(m, x[j]);
  for (ushort off = 16; off > 0; off >>= 1) m = metal::max(m, simd_shuffle_xor(m, off));
  if (lane == 0) red[wid] = m;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  m = red[0];
  for (int w = 1; w < MLXI_WARPS; ++w) m = metal::max(m, red[w]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float s = 0.0f;
  for (int j = tid; j < n; j += MLXI_THREADS) {
    const float e = metal::precise::exp(x[j] - m);
    x[j] = e;
    s = s + e;
  }
  for (ushort off = 16; off > 0; off >>= 1) s = s + simd_shuffle_xor(s, off);
  if (lane == 0) red[wid] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = red[lane & 7];
  for (ushort off = 4; off > 0; off >>= 1) total = total + simd_shuffle_xor(total, off);
  for (int j = tid; j < n; j += MLXI_THREADS) x[j] = metal::precise::divide(x[j], total);
  threadgroup_barrier(mem_flags::mem_device);
}
//@@BODY matmul
const long B = dims[0], M = dims[1], N = dims[2], K = dims[3], G = dims[4];
const uint lane = thread_index_in_simdgroup;
const long w = ((long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x)
    * MLXI_WARPS + simdgroup_index_in_threadgroup;
if (w < B * M * N) {
  const long j = w % N, i = (w / N) % M, b = w / (N * M);
  const float s = mlxi_dot(a + (b * M + i) * K, 1, bt + ((b / G) * N + j) * K, 1, (int)K, lane);
  if (lane == 0) out[w] = s;
}
//@@BODY softmax
const long n = dims[1];
const long r = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
threadgroup float red[MLXI_WARPS];
device float* y = out + r * n;
for (long j = tid; j < n; j += MLXI_THREADS) y[j] = x[r * n + j];
threadgroup_barrier(mem_flags::mem_device);
mlxi_softmax(y, (int)n, tid, red);
//@@BODY fused_attention
// As in attention.cu: work items (row, head), blocks striding over them, scores in the block's own
// scratch row, context by lane partials over consecutive columns, then the butterfly as a tree, up to
// MLXI_PART_D head dimensions a pass (the same chains and tree for every dimension, in any pass).
// scales = [the scale, the soft-cap (0: none), its float32 inverse].
const long cap = dims[0];
const int H = dims[1], KV = dims[2], D = dims[3], CAUSAL = dims[4], WINDOW = dims[5];
const long items = (long)dims[6] * H;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup, wid = simdgroup_index_in_threadgroup;
const long kvw = (long)KV * D;
const float sc = scales[0], softcap = scales[1], softcap_inv = scales[2];
device float* pr = p + (long)threadgroup_position_in_grid.x * cap;
threadgroup float red[MLXI_WARPS];
threadgroup float part[32 * MLXI_PART_D];  // 16 KB: Apple GPUs give a threadgroup 32 KB
for (long item = threadgroup_position_in_grid.x; item < items; item += threadgroups_per_grid.x) {
  const long r = item / H;
  const int h = item % H;
  const int S = row_len[r], pos = row_pos[r];
  const auto qh = q + r * H * D + h * D;  // device or constant pointers, as MLX passes them
  const long row0 = (long)row_slot[r] * cap, c0 = (long)(h / (H / KV)) * D;  // the slot's first row, the KV head's first column
  for (int j = wid; j < S; j += MLXI_WARPS) {
    const float s = mlxi_score(mlxi_dot(qh, 1, mlxi_kv_row_at(k, row0 + j, c0, kvw), 1, D, lane), sc, softcap,
                               softcap_inv);
    const bool hidden = (CAUSAL && j > pos) || (WINDOW > 0 && j <= pos - WINDOW);
    if (lane == 0) pr[j] = hidden ? -INFINITY : s;
  }
  threadgroup_barrier(mem_flags::mem_device);
  mlxi_softmax(pr, S, tid, red);
  for (int d0 = 0; d0 < D; d0 += MLXI_PART_D) {  // head dimensions d0 .. d0 + dn - 1
    const int dn = metal::min(D - d0, MLXI_PART_D);
    for (int idx = tid; idx < 32 * dn; idx += MLXI_THREADS) {
      const int l = idx / dn, d = d0 + idx % dn;
      float s = 0.0f;
      for (int i = l; i < S; i += 32) {
        const float prod = pr[i] * mlxi_kv(v, row0 + i, c0 + d, kvw);
        s = s + prod;
      }
      part[idx] = s;
    }
    for (int off = 16; off > 0; off >>= 1) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int idx = tid; idx < off * dn; idx += MLXI_THREADS) part[idx] = part[idx] + part[idx + off * dn];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int d = tid; d < dn; d += MLXI_THREADS) mlxi_put(out + r * H * D + h * D + d0 + d, part[d]);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // part is rewritten by the next pass
  }
  threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
}//@@BODY tanh
// out[i] = tanh(x[i]) (i < dims[0]): the MLX backend's tanh primitive on a GPU, mlxi_tanh.
const long i = (long)thread_position_in_grid.y * threads_per_grid.x + thread_position_in_grid.x;
if (i < dims[0]) out[i] = mlxi_tanh(x[i]);
//@@BODY qk_norm_rope
// attention.cu's qk_norm_rope for Metal: Qwen3's q_norm / k_norm then rotate-half RoPE of a pass's queries
// q [N, H*D] and keys k [N, KV*D] in one launch, with weights wq, wk [D] and each row's position row_pos
// [N] -> qo, ko, all of one type T (float, bfloat16_t or float16_t: the activations'). One simdgroup per
// (row, head), the queries' heads first; lane l holds d = l + 32i, so with D a multiple of 64 each
// rotated pair (d, d + D/2) sits in one lane. The same operations, roundings and order as the CUDA
// kernel: each lane's squares in increasing i, each product rounded then added, the butterfly
// (mlxi_simd_total); x * rsqrt(sum / D + eps) rounded to T, times the weight rounded to T; theta = pos *
// exp2(-(d / (D/2)) * log2(base)); x1 cos - x2 sin, x1 sin + x2 cos in float from those T values, rounded
// to T. Each device's functions are MLX's own kernels' on it: here (MLX's Metal rms_norm and rope, built
// without fast math, as MLX builds a custom kernel) precise::rsqrt, exp2, a correctly rounded division and
// metal::fast::cos and sin, where CUDA calls rsqrtf, exp2f, cosf and sinf; so the two devices' bits may
// differ, and on each the kernel's differ from mx.fast's only by the sum of squares' order: checked against
// them at first use (`verify_qk_norm_rope`). Template arguments H, KV, D; EPS_BITS and LOG2_BASE_BITS:
// float bits.
constexpr int E = D / 32, HALF = E / 2, HALF_D = D / 2;
const float eps = as_type<float>(EPS_BITS), log2_base = as_type<float>(LOG2_BASE_BITS);
const uint lane = thread_index_in_simdgroup;
const long w = ((long)threadgroup_position_in_grid.y * threadgroups_per_grid.x + threadgroup_position_in_grid.x)
    * MLXI_WARPS + simdgroup_index_in_threadgroup;
if (w < (long)row_pos_shape[0] * (H + KV)) {  // w is the simdgroup's: all its lanes take the shuffles below
  const long r = w / (H + KV);
  const int h = w % (H + KV);
  const bool is_q = h < H;
  const long at = is_q ? (r * H + h) * D : (r * KV + h - H) * D;
  const auto x = (is_q ? q : k) + at;
  const auto wt = is_q ? wq : wk;
  const auto y = (is_q ? qo : ko) + at;
  float v[E];
  float ss = 0.0f;
  for (int i = 0; i < E; ++i) {
    v[i] = float(x[lane + 32 * i]);
    const float sq = v[i] * v[i];
    ss = ss + sq;
  }
  const float inv = metal::precise::rsqrt(metal::precise::divide(mlxi_simd_total(ss), float(D)) + eps);
  for (int i = 0; i < E; ++i) v[i] = mlxi_in(y, float(wt[lane + 32 * i]) * mlxi_in(y, v[i] * inv));
  const float L = float(row_pos[r]);
  for (int i = 0; i < HALF; ++i) {
    const int d = lane + 32 * i;
    const float theta = L * metal::precise::exp2(-metal::precise::divide(float(d), float(HALF_D)) * log2_base);
    const float c = metal::fast::cos(theta), s = metal::fast::sin(theta);  // (MLX's Metal rope's)
    const float x1 = v[i], x2 = v[i + HALF];
    mlxi_put(y + d, x1 * c - x2 * s);
    mlxi_put(y + d + HALF_D, x1 * s + x2 * c);
  }
}
