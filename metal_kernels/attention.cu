// mlxinfer's GPU attention arithmetic for MLX's CUDA backend (mx.fast.cuda_kernel), in one published
// order. The MLX backend sends every activation x activation product (`matmul`) and every softmax of
// attention scores (`softmax_rows`) on a CUDA GPU through the `matmul` and `softmax` kernels below, and
// the fused attention kernel calls the very same device functions, so the per-head reference and the
// fused path agree bit for bit for decode steps and prefill chunks alike. The order:
//
//   dot(a, b) over n terms (one warp of 32 lanes): lane l adds the products a[i]*b[i] for
//     i = l, l+32, l+64, ... in increasing i, each product rounded to float32 and then added (no fused
//     multiply-add: __fmul_rn, __fadd_rn); the 32 partial sums are then combined by a butterfly,
//     s += shfl_xor(s, off) for off = 16, 8, 4, 2, 1 (every lane ends with the same total).
//   softmax(x) over n values (one block of 256 threads = 8 warps): m = max(x) (exact in any order);
//     e_j = expf(x_j - m); thread t adds e_j for j = t, t+256, ... in increasing j; each warp combines
//     its 32 partials by the butterfly above; the 8 warp totals w_0..w_7 are combined by a butterfly
//     with off = 4, 2, 1; y_j = e_j / total (__fdiv_rn).
//
// The kernels by rows (attn_scores_rows, attn_context_rows) reach the same bits by a second route: one
// thread adds the 32 lane partials (or chain totals) itself, taking them in the butterfly's tree order
// (mlxi_chain_at), instead of calling mlxi_warp_total / mlxi_chain_tree.
//
// Input types: the attention kernels read q, k and v in the dtype MLX hands them (float, __nv_bfloat16
// or __half: the activations' and the KV cache's, --dtype and --kv-dtype; k and v also int8_t, a q8_0
// cache's packed rows) and widen every value to float32 as they load it (mlxi_f, mlxi_kv: exact for
// all), before any arithmetic; the order above is then the same for every input type, and so are the
// bits (the per-head reference widens its operands in the graph first, dequantize_q8_0 for q8_0).
// Scores and attention weights are float32; an attention's result is written in q's type (mlxi_put:
// rounded to nearest even once, as MLX's astype), where the per-head reference rounds its float32
// context too (the matmul, softmax and tanh kernels' outputs are float32).
//
// mlxinfer.kernels.published_dot / published_softmax_sum emulate this order in numpy float32 (the sums
// exactly; expf differs from numpy's exp in the last bit), and tests/test_kernels.py checks the kernels
// against the emulation on a CUDA GPU.
//@@HEADER
#define MLXI_THREADS 256
#define MLXI_WARPS 8
#define MLXI_MAX_D 256  // largest head dimension of the fused kernel (shared memory: 32 KiB)
#define MLXI_KPAD 8  // the tensor-core kernel's shared key and value rows: D + 8 16-bit values apart

// A value as float32 (exact: bfloat16 and float16 are subsets of float32).
__device__ __forceinline__ float mlxi_f(float x) {
  return x;
}
__device__ __forceinline__ float mlxi_f(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float mlxi_f(__half x) {
  return __half2float(x);
}

// v rounded to nearest even in the type a pointer p points to, read back as float32 (float: v itself),
// and the store of v in that type: what MLX's own kernels do with their T-typed intermediates and outputs.
__device__ __forceinline__ float mlxi_in(const float*, float v) {
  return v;
}
__device__ __forceinline__ float mlxi_in(const __nv_bfloat16*, float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}
__device__ __forceinline__ float mlxi_in(const __half*, float v) {
  return __half2float(__float2half_rn(v));
}
__device__ __forceinline__ void mlxi_put(float* p, float v) {
  *p = v;
}
__device__ __forceinline__ void mlxi_put(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16_rn(v);
}
__device__ __forceinline__ void mlxi_put(__half* p, float v) {
  *p = __float2half_rn(v);
}

// Value c of row r of a K/V store s whose rows hold w values, as float32. A float store (float,
// __nv_bfloat16, __half) holds a row as its w values; a q8_0 store (int8_t: --kv-dtype q8_0,
// mlxinfer/backends/mlx_kv.py) as w + w/16 bytes, llama.cpp's block_q8_0 laid out per row: the w values
// q as int8, then the float16 scale d of each block of 32 values, two bytes, low byte first (read
// bytewise: no alignment assumed). The value is d * q formed in float32, exact (d's 11 significant bits
// times q's 8 fit float32's 24): what the graph's dequantize_q8_0 forms, so the order above runs on the
// same float32 values from every store.
template <typename T>
__device__ __forceinline__ float mlxi_kv(const T* s, long r, long c, long w) {
  return mlxi_f(s[r * w + c]);
}
__device__ __forceinline__ float mlxi_kv(const int8_t* s, long r, long c, long w) {
  const int8_t* row = s + r * (w + w / 16);
  const int8_t* d = row + w + 2 * (c / 32);
  const float scale = __half2float(__ushort_as_half((unsigned short)((d[0] & 0xff) | (d[1] & 0xff) << 8)));
  return __fmul_rn(scale, (float)row[c]);
}

// Values c0, c0 + 1, ... of row r of a K/V store, indexed as a pointer is (mlxi_dot's operand).
template <typename T>
struct mlxi_kv_row {
  const T* s;
  long r, c0, w;
  __device__ __forceinline__ float operator[](long i) const {
    return mlxi_kv(s, r, c0 + i, w);
  }
};
template <typename T>
__device__ __forceinline__ mlxi_kv_row<T> mlxi_kv_row_at(const T* s, long r, long c0, long w) {
  return {s, r, c0, w};
}

// The warp's total of its lanes' partial sums: the butterfly s += shfl_xor(s, off), off = 16, 8, 4, 2, 1.
__device__ __forceinline__ float mlxi_warp_total(float s) {
  for (int off = 16; off > 0; off >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off));
  return s;
}

// a: a pointer; b: a pointer or a K/V row (mlxi_kv_row).
template <typename A, typename B>
__device__ __forceinline__ float mlxi_dot(const A* a, long sa, B b, long sb, int n, int lane) {
  float s = 0.0f;
  for (int i = lane; i < n; i += 32) {
    s = __fadd_rn(s, __fmul_rn(mlxi_f(a[(long)i * sa]), mlxi_f(b[(long)i * sb])));
  }
  return mlxi_warp_total(s);
}

// The block's max of its threads' values m (MLXI_THREADS threads; exact in any order); red: 8 floats of
// shared memory, free again when this returns.
__device__ __forceinline__ float mlxi_block_max(float m, int lane, int wid, float* red) {
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (lane == 0) red[wid] = m;
  __syncthreads();
  m = red[0];
  for (int w = 1; w < MLXI_WARPS; ++w) m = fmaxf(m, red[w]);
  __syncthreads();
  return m;
}

// The block's total of its threads' partial sums s in the published order: each warp's butterfly
// (16, 8, 4, 2, 1), then the 8 warp totals' butterfly (4, 2, 1); every thread gets the same bits. red as
// above; the caller synchronises before reusing it.
__device__ __forceinline__ float mlxi_block_total(float s, int lane, int wid, float* red) {
  s = mlxi_warp_total(s);
  if (lane == 0) red[wid] = s;
  __syncthreads();
  float total = red[lane & 7];
  for (int off = 4; off > 0; off >>= 1) total = __fadd_rn(total, __shfl_xor_sync(0xffffffffu, total, off));
  return total;
}

// The context kernels' chains: part[l * 8 + dd] (thread tid = l * 8 + dd) holds lane l's partial sum of
// value dd; the block combines them as the butterfly's tree over l (part[l] += part[l + off] for l < off,
// off = 16, 8, 4, 2, 1: what lane 0 of the butterfly computes), leaving each total in part[dd]. Called
// by the whole block (MLXI_THREADS threads); ends with a barrier.
__device__ __forceinline__ void mlxi_chain_tree(float* part, int tid) {
  const int l = tid >> 3;
  for (int off = 16; off > 0; off >>= 1) {
    __syncthreads();
    if (l < off) part[tid] = __fadd_rn(part[tid], part[tid + off * 8]);
  }
  __syncthreads();
}

// tanh of a float32 (soft-capping): CUDA's tanhf, the function MLX's own float32 tanh calls on CUDA
// (mlx/backend/cuda/device/unary_ops.cuh: cuda::std::tanh, which is __builtin_tanhf, CUDA's tanhf, under
// nvcc). MLX's tanh kernel is compiled with the toolkit that built MLX, ours by the NVRTC at run time,
// and the two tanhf need not agree to the last bit: so on a GPU the MLX backend's tanh primitive is the
// `tanh` kernel below, this very function, and the per-head reference, the graph override and the fused
// kernels compile one tanhf in one NVRTC.
__device__ __forceinline__ float mlxi_tanh(float x) {
  return tanhf(x);
}

// A score from its dot product, in the per-head reference's operations: scaled after the product, then
// with a soft-cap (Gemma 2; cap 0: none) cap * tanh(s / cap) as scale(tanh(scale(s, inv)), cap), inv
// the float32 1/cap (backend.softcap_inverse), each product rounded once.
__device__ __forceinline__ float mlxi_score(float dot, float sc, float cap, float inv) {
  const float s = __fmul_rn(dot, sc);
  return cap != 0.0f ? __fmul_rn(mlxi_tanh(__fmul_rn(s, inv)), cap) : s;
}

// Whether key j is hidden from a query at position pos: past it (causal), or WINDOW or more before it.
__device__ __forceinline__ bool mlxi_hidden(long j, int pos, int causal, int window) {
  return (causal && j > pos) || (window > 0 && j <= pos - window);
}

// Thread tid's pass over the scores x[e * cap + j] of up to 4 heads e < nh, j = tid, tid + 256, ... < S
// in increasing j: f(e, j, x_j) for each, SU loads per head in flight before f sees them.
template <int SU, typename F>
__device__ __forceinline__ void mlxi_scores_pass(const float* x, long cap, int nh, int S, int tid, F f) {
  int j = tid;
  for (; j + (SU - 1) * MLXI_THREADS < S; j += SU * MLXI_THREADS) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (e < nh) {
        float t[SU];
#pragma unroll
        for (int u = 0; u < SU; ++u) t[u] = x[e * cap + j + u * MLXI_THREADS];
#pragma unroll
        for (int u = 0; u < SU; ++u) f(e, j + u * MLXI_THREADS, t[u]);
      }
    }
  }
  for (; j < S; j += MLXI_THREADS) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (e < nh) f(e, j, x[e * cap + j]);
    }
  }
}

// Butterfly-order position of the k-th chain a thread closes when it walks all 32 chains itself: the
// 5-bit reversal of k. Taken in this order, the tree over l (part[l] += part[l + off], off = 16, 8, 4,
// 2, 1) joins neighbours: after chain k, the pending left operands lvl[b] of the levels b where k has
// a 1 bit are added in (lvl[b] + x: the lower l on the left, as part[l] + part[l + off]), and x waits
// at the level of k's lowest 0 bit. After k = 31 x is the tree's total, the same bits as
// mlxi_chain_tree's part[0] and the warp butterfly's lane 0.
__host__ __device__ constexpr int mlxi_chain_at(int k) {
  return ((k & 1) << 4) | ((k & 2) << 2) | (k & 4) | ((k & 8) >> 2) | ((k & 16) >> 4);
}

// Chain (or lane) k's total x joins the tree of the 32, taken in mlxi_chain_at's order (see there);
// returns the tree's total after k = 31. k must be a compile-time constant (an unrolled loop).
__device__ __forceinline__ float mlxi_tree_join(float (&lvl)[5], float x, int k) {
#pragma unroll
  for (int b = 0; b < 5; ++b) {
    if ((k >> b) & 1) {
      x = __fadd_rn(lvl[b], x);
    } else {
      lvl[b] = x;
      break;
    }
  }
  return x;
}

// One thread's context for R rows r0 .. r0+R-1 (one sequence: one cache slot, S keys) and NH heads
// hb .. hb+NH-1, head dimensions d0 .. d0+3 (< D): out[r, h, d] = dot(p[r, h, :S], v[:S, d]) in the
// published order, the thread walking all 32 chains (keys i = l, l+32, ... in increasing i) in
// mlxi_chain_at's order and joining their totals as above. v: the store, v0: the slot's first row, c0:
// the KV head's first column; p [N, H, cap].
template <int R, int NH, int D, int UR, typename V, typename O>
__device__ __forceinline__ void mlxi_context_tile(const float* p, const V* v, long v0, long c0, long kvw, O* out,
                                                  long cap, long r0, int hb, int H, int d0, int S) {
  const float* pr[R][NH];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int e = 0; e < NH; ++e) pr[r][e] = p + ((r0 + r) * H + hb + e) * cap;
  }
  float lvl[R][NH][4][5];
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    const int l = mlxi_chain_at(k);
    float a[R][NH][4] = {};
#pragma unroll UR
    for (int i = l; i < S; i += 32) {
      float vv[4];
      if constexpr (sizeof(V) == 4 && D % 4 == 0) {  // float, 16-byte aligned: every offset is a multiple of 4
        const float4 t4 = *reinterpret_cast<const float4*>(v + (v0 + i) * kvw + c0 + d0);
        vv[0] = t4.x; vv[1] = t4.y; vv[2] = t4.z; vv[3] = t4.w;
      } else {
#pragma unroll
        for (int dd = 0; dd < 4; ++dd) vv[dd] = mlxi_kv(v, v0 + i, c0 + min(d0 + dd, D - 1), kvw);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int e = 0; e < NH; ++e) {
          const float pe = pr[r][e][i];
#pragma unroll
          for (int dd = 0; dd < 4; ++dd) a[r][e][dd] = __fadd_rn(a[r][e][dd], __fmul_rn(pe, vv[dd]));
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int e = 0; e < NH; ++e) {
#pragma unroll
        for (int dd = 0; dd < 4; ++dd) {
          const float x = mlxi_tree_join(lvl[r][e][dd], a[r][e][dd], k);
          if (k == 31 && d0 + dd < D) mlxi_put(out + (r0 + r) * H * D + (long)(hb + e) * D + d0 + dd, x);
        }
      }
    }
  }
}

// Chain l's values of keys i = l + 32 * (k0 + u), u < KU (0 past S), column c of store v whose slot
// starts at row v0: the context loop's loads.
template <int KU, typename V>
__device__ __forceinline__ void mlxi_chain_values(float* dst, const V* v, long v0, long c, long kvw, int l, long k0,
                                                  int S) {
#pragma unroll
  for (int u = 0; u < KU; ++u) {
    const long i = l + 32 * (k0 + u);
    dst[u] = (i < S) ? mlxi_kv(v, v0 + i, c, kvw) : 0.0f;
  }
}

// Attention weight p = e / total of a score x, e = expf(x - m): the softmax kernel's operations.
__device__ __forceinline__ float mlxi_weight(float x, float m, float total) {
  return __fdiv_rn(expf(__fsub_rn(x, m)), total);
}

// The scores of one whole step of attn_softmax_context's context loop: xv[q][e] = xp[e * cap + 256 * q],
// the score of key (chain l) k0 + 8 * q + dd for head e < nh (xp points at head 0's of key k0 + dd).
template <int KU>
__device__ __forceinline__ void mlxi_step_scores(float (&xv)[KU / 8][4], const float* xp, long cap, int nh) {
#pragma unroll
  for (int q8 = 0; q8 < KU / 8; ++q8) {
#pragma unroll
    for (int e = 0; e < 4; ++e) xv[q8][e] = e < nh ? xp[e * cap + 256 * q8] : 0.0f;
  }
}

// In-place softmax of x[0..n) by the whole block (MLXI_THREADS threads); red: 8 floats of shared memory.
__device__ __forceinline__ void mlxi_softmax(float* x, int n, int tid, float* red) {
  const int lane = tid & 31, wid = tid >> 5;
  float m = -INFINITY;
  for (int j = tid; j < n; j += MLXI_THREADS) m = fmaxf(m, x[j]);
  m = mlxi_block_max(m, lane, wid, red);
  float s = 0.0f;
  for (int j = tid; j < n; j += MLXI_THREADS) {
    const float e = expf(__fsub_rn(x[j], m));
    x[j] = e;
    s = __fadd_rn(s, e);
  }
  const float total = mlxi_block_total(s, lane, wid, red);
  for (int j = tid; j < n; j += MLXI_THREADS) x[j] = __fdiv_rn(x[j], total);
  __syncthreads();
}
// The split plan's scores (attn_scores, attn_short), key by key. Lane l's query values i = l + 32 t
// (t < NT; 0 past D) of the G heads of a KV head's group, whose first value is at qg, as float.
template <int G, int NT, int D, typename Q>
__device__ __forceinline__ void mlxi_group_queries(float (&qr)[G][NT], const Q* qg, int lane) {
#pragma unroll
  for (int hh = 0; hh < G; ++hh) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int i = lane + 32 * t;
      qr[hh][t] = i < D ? mlxi_f(qg[hh * D + i]) : 0.0f;
    }
  }
}

// Lane l's values i = l + 32 t of a key: columns col0 + i of store row `row` (rows kvw values wide), or
// 0 where it is not loaded (past the row's keys, or hidden) or i >= D.
template <int NT, int D, typename K>
__device__ __forceinline__ void mlxi_key_values(float (&kr)[NT], const K* k, long row, long col0, long kvw, bool load,
                                                int lane) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int i = lane + 32 * t;
    kr[t] = (load && i < D) ? mlxi_kv(k, row, col0 + i, kvw) : 0.0f;
  }
}

// A key's score for one head, in the published order: lane l's chain of q * k over t in increasing
// order, then the butterfly (all 32 lanes call it), scaled and capped (mlxi_score); a key the row may
// not see is -INFINITY without its product (half a causal chunk's).
template <int NT, int D>
__device__ __forceinline__ float mlxi_key_score(const float (&qh)[NT], const float (&kh)[NT], bool hidden, int lane,
                                                float sc, float softcap, float softcap_inv) {
  if (hidden) return -INFINITY;
  float s = 0.0f;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (lane + 32 * t < D) s = __fadd_rn(s, __fmul_rn(qh[t], kh[t]));
  }
  return mlxi_score(mlxi_warp_total(s), sc, softcap, softcap_inv);
}

// attn_softmax_context's steps 1 and 2 (see there) for one block: (row, KV head g, head dimensions
// c*8 .. c*8+7). x: the scores of the group's first head, head g*G + e's at x + e * xcap (keys j < S);
// v: the value store, its slot's first row v0; out: the row's first result value; red, part: the
// block's shared memory. Called by the whole block (MLXI_THREADS threads). attn_short calls it too,
// its scores in shared memory.
template <int H, int KV, int D, int SU, int KU, int PF, int WS, typename V, typename O>
__device__ __forceinline__ void mlxi_softmax_context(const float* x, long xcap, const V* v, long v0, O* out, int g,
                                                     int c, int S, float* red, float* part) {
  constexpr int G = H / KV;
  static_assert(SU >= 1 && KU >= 8 && KU % 8 == 0 && (WS == 0 || WS == 1),
                "SU >= 1; KU a multiple of 8 (each thread computes one p of every 8 keys); WS 0 or 1");
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, l = tid >> 3, dd = tid & 7, d = c * 8 + dd;
  constexpr long kvw = (long)KV * D;
  const long vc = g * D + min(d, D - 1);  // this thread's column
  for (int h0 = 0; h0 < G; h0 += 4) {
    const int nh = min(4, G - h0);
    const float* xr = x + h0 * xcap;
    float vv[KU];  // PF: the first KU values of the chain are loaded now, in flight during step 1
    if (PF) mlxi_chain_values<KU>(vv, v, v0, vc, kvw, l, 0, S);
    float m[4], total[4];
    {  // 1. the softmax's max and total, per head
      float mx[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
      mlxi_scores_pass<SU>(xr, xcap, nh, S, tid, [&](int e, int, float t) { mx[e] = fmaxf(mx[e], t); });
      for (int e = 0; e < nh; ++e) m[e] = mlxi_block_max(mx[e], lane, wid, red);
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mlxi_scores_pass<SU>(xr, xcap, nh, S, tid, [&](int e, int, float t) { s[e] = __fadd_rn(s[e], expf(__fsub_rn(t, m[e]))); });
      for (int e = 0; e < nh; ++e) {
        total[e] = mlxi_block_total(s[e], lane, wid, red);
        __syncthreads();  // red is reused by the next head
      }
    }
    // 2. the context. 2a (WS = 1): whole steps, where every chain of the block has its next KU keys
    // (32 * (k0 + KU) <= S, the same for the whole block): no key is checked, the offsets are the
    // compiler's constants, and with PF the next step's values and scores load during this step's
    // arithmetic
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int whole = WS ? S / (32 * KU) : 0;
    long vr = v0 + l;                      // the row of chain l's key l + 32 * k0
    const float* xp = xr + l + 32 * dd;    // the score of key l + 32 * (k0 + dd), head 0
    float xv[KU / 8][4];                   // [group of 8 keys][head]: the scores this thread turns into p
    if (PF && whole > 0) mlxi_step_scores<KU>(xv, xp, xcap, nh);
    long k0 = 0;
    for (int it = 0; it < whole; ++it, k0 += KU, vr += 32L * KU, xp += 32 * KU) {
      float vn[KU], xn[KU / 8][4];
      const bool next = it + 1 < whole;  // PF: the next step is whole too (the same for the block)
      if (!PF) {
#pragma unroll
        for (int u = 0; u < KU; ++u) vv[u] = mlxi_kv(v, vr + 32L * u, vc, kvw);
        mlxi_step_scores<KU>(xv, xp, xcap, nh);
      } else if (next) {
#pragma unroll
        for (int u = 0; u < KU; ++u) vn[u] = mlxi_kv(v, vr + 32L * (KU + u), vc, kvw);
        mlxi_step_scores<KU>(xn, xp + 32 * KU, xcap, nh);
      }
      float pe[KU / 8][4];
#pragma unroll
      for (int q8 = 0; q8 < KU / 8; ++q8) {
#pragma unroll
        for (int e = 0; e < 4; ++e) pe[q8][e] = e < nh ? mlxi_weight(xv[q8][e], m[e], total[e]) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < KU; ++u) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pu = __shfl_sync(0xffffffffu, pe[u >> 3][e], (lane & ~7) | (u & 7));
          if (e < nh) acc[e] = __fadd_rn(acc[e], __fmul_rn(pu, vv[u]));
        }
      }
      if (PF && next) {
#pragma unroll
        for (int u = 0; u < KU; ++u) vv[u] = vn[u];
#pragma unroll
        for (int q8 = 0; q8 < KU / 8; ++q8) {
#pragma unroll
          for (int e = 0; e < 4; ++e) xv[q8][e] = xn[q8][e];
        }
      }
    }
    if (PF && whole > 0) mlxi_chain_values<KU>(vv, v, v0, vc, kvw, l, k0, S);  // the first values of 2b
    // 2b. the last steps, each key checked; the loop bound is the warp's (its chains l start at 4 * wid):
    // shuffles need all 32
    for (; 4L * wid + 32 * k0 < S; k0 += KU) {
      float vn[KU];  // PF: the next KU values, in flight during this step's arithmetic
      if (PF) mlxi_chain_values<KU>(vn, v, v0, vc, kvw, l, k0 + KU, S);
      else mlxi_chain_values<KU>(vv, v, v0, vc, kvw, l, k0, S);
      float pe[KU / 8][4];  // [group of 8 keys][head]: the p of key k0 + 8 * q + dd of chain l
#pragma unroll
      for (int q8 = 0; q8 < KU / 8; ++q8) {
        const long mine = l + 32 * (k0 + 8 * q8 + dd);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          pe[q8][e] = (e < nh && mine < S) ? mlxi_weight(xr[e * xcap + mine], m[e], total[e]) : 0.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const long i = l + 32 * (k0 + u);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pu = __shfl_sync(0xffffffffu, pe[u >> 3][e], (lane & ~7) | (u & 7));
          if (e < nh && i < S) acc[e] = __fadd_rn(acc[e], __fmul_rn(pu, vv[u]));
        }
      }
      if (PF) {
#pragma unroll
        for (int u = 0; u < KU; ++u) vv[u] = vn[u];
      }
    }
    for (int e = 0; e < nh; ++e) {
      part[tid] = acc[e];
      mlxi_chain_tree(part, tid);
      if (l == 0 && d < D) mlxi_put(out + (g * G + h0 + e) * D + d, part[tid]);
      __syncthreads();
    }
  }
}
// ---- The tensor-core order: 16-bit attention (--dtype bfloat16 / float16) on prefill chunks --------
// With 16-bit q, K and V (a cache in the activations' dtype), a sequence's chunk of PREFILL_ROWS rows
// or more takes a second published order, one that NVIDIA's tensor cores follow (issue 30):
//
//   mma_dot: a product's 16-bit operands (an attention weight rounded to nearest even first; q, K and V
//     are 16-bit values already) go to the m16n8k16 instruction (mma.sync, float32 accumulators) in
//     k-steps of 16 from k = 0 in increasing order, the accumulator starting at +0; a k-step whose
//     16 x 16 left operand (16 rows, aligned at multiples of 16 from the chunk's first row) is all
//     zeros is skipped. How the instruction adds its 16 products is not published, but on an H200 its
//     result for an element depends only on that element's products and accumulator, not on where in
//     the tile the element sits nor on the tile's other values, nor even on the products' order in k
//     (bench/probes/mma_order.py: 24,576 trials): so every kernel that presents the same k-steps gets
//     the same bits. The instruction is not exactly rounded (mostly toward zero, within a few ulps of
//     the sum's magnitude).
//   mma_softmax: m = max(x) (exact); e_j = expf(x_j - m); four chains, chain c adding e_j for the j with
//     (j mod 8) / 2 == c in increasing j; total = (c0 + c1) + (c2 + c3); y_j = e_j / total (__fdiv_rn).
//     The four chains are the four threads of a quad that hold a row of an m16n8 tile.
//
// mma_attention runs a chunk's heads in one launch with these two orders: a warp per 16 query rows
// of one head, its keys in steps of 16, three passes (the row maxima; the totals; the weights and the
// context), recomputing the scores each time (the same instructions on the same operands: the same bits).

// The m16n8k16 instruction, d += a * b (fragments as the PTX ISA lays them out: a0 rows g, k 2t..2t+1;
// a1 rows g+8; a2, a3 the same at k + 8; b0 k 2t..2t+1 of column g, b1 at k + 8; d0, d1 row g, columns
// 2t, 2t+1; d2, d3 row g+8; g = lane / 4, t = lane % 4). On the host (tests/cuda_host.h) a stand-in.
template <bool BF>
__device__ __forceinline__ void mlxi_mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef MLXH_HOST
  mlxh_mma(d, a, b, BF);
#else
  if (BF) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}

// A float32 rounded to nearest even as the 16-bit type's bits.
template <bool BF>
__device__ __forceinline__ uint32_t mlxi_round16(float x) {
  return BF ? (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(x)) : (uint32_t)__half_as_ushort(__float2half_rn(x));
}

// Two 16-bit values as one fragment register, the first in the low half.
__device__ __forceinline__ uint32_t mlxi_pair(uint32_t lo, uint32_t hi) {
  return lo | (hi << 16);
}

// Whether a warp's 16 x 16 left operand is all zeros (either sign): that k-step is skipped.
__device__ __forceinline__ bool mlxi_zero_step(const uint32_t (&a)[4]) {
  return __all_sync(0xffffffffu, ((a[0] | a[1] | a[2] | a[3]) & 0x7fff7fffu) == 0u);
}

// The row maximum and the softmax total of a quad's four chains (mma_softmax's order).
__device__ __forceinline__ float mlxi_quad_max(float m) {
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  return fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
}
__device__ __forceinline__ float mlxi_quad_total(float c) {
  c = __fadd_rn(c, __shfl_xor_sync(0xffffffffu, c, 1));
  return __fadd_rn(c, __shfl_xor_sync(0xffffffffu, c, 2));
}

// One head's scores for 16 query rows (the warp's; q fragments qa, zero k-steps in zmask) and the 16 keys
// j0 .. j0+15 (two m16n8 tiles, s[n][e]: key j0 + 8n + 2t + (e & 1), row g or g+8 for e < 2 or not), as
// the reference forms them: mma_dot over D, then the score (mlxi_score), hidden keys and keys past S at
// -inf. kt: those keys' rows in shared memory (row stride D + MLXI_KPAD; zeros past S).
template <bool BF, int D>
__device__ __forceinline__ void mlxi_mma_scores(float (&s)[2][4], const uint32_t (&qa)[D / 16][4], unsigned zmask,
                                                const uint16_t* kt, long S, long j0, int g, int t, int pl, int ph,
                                                int causal, int window, float sc, float cap, float inv) {
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const uint32_t* kr = reinterpret_cast<const uint32_t*>(kt + (8 * n + g) * (D + MLXI_KPAD) + 2 * t);
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      if ((zmask >> kk) & 1u) continue;
      const uint32_t b[2] = {kr[8 * kk], kr[8 * kk + 4]};
      mlxi_mma<BF>(d, qa[kk], b);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const long j = j0 + 8 * n + 2 * t + (e & 1);
      const int pos = e < 2 ? pl : ph;
      s[n][e] = (j >= S || mlxi_hidden(j, pos, causal, window)) ? -INFINITY : mlxi_score(d[e], sc, cap, inv);
    }
  }
}

// A block's copy of keys (or values) j0 .. j0 + KT - 1 of a sequence's [S, kw] rows, columns c0 .. c0+D-1,
// into shared memory (row stride D + MLXI_KPAD: the fragment reads then fall in distinct banks), 16 bytes
// a load, all of a thread's loads in flight at once; rows past S are zeros.
template <int D, int KT>
__device__ __forceinline__ void mlxi_stage(uint16_t* dst, const uint16_t* src, long kw, long c0, long S, long j0, int tid,
                                           int threads) {
  constexpr int CHUNKS = D / 8;  // 16-byte pieces of a row
  for (int i = tid; i < KT * CHUNKS; i += threads) {
    const int r = i / CHUNKS, c = i % CHUNKS;
    uint4 v = {0u, 0u, 0u, 0u};
    if (j0 + r < S) v = *reinterpret_cast<const uint4*>(src + (j0 + r) * kw + c0 + 8 * c);
    *reinterpret_cast<uint4*>(dst + r * (D + MLXI_KPAD) + 8 * c) = v;
  }
}

//@@BODY matmul
// out[b, i, j] = dot(a[b, i, :], bt[b / G, j, :]); a [B, M, K], bt [B/G, N, K]; dims = [B, M, N, K, G].
// One warp per output, 8 warps per block.
const long B = dims[0], M = dims[1], N = dims[2], K = dims[3], G = dims[4];
const int lane = threadIdx.x & 31;
const long w = ((long)blockIdx.y * gridDim.x + blockIdx.x) * MLXI_WARPS + (threadIdx.x >> 5);
if (w < B * M * N) {
  const long j = w % N, i = (w / N) % M, b = w / (N * M);
  const float s = mlxi_dot(a + (b * M + i) * K, 1, bt + ((b / G) * N + j) * K, 1, (int)K, lane);
  if (lane == 0) out[w] = s;
}
//@@BODY softmax
// out[r, :] = softmax(x[r, :]); x [R, n]; dims = [R, n]. One block per row.
const long n = dims[1];
const long r = blockIdx.x;
__shared__ float red[MLXI_WARPS];
float* y = out + r * n;
for (long j = threadIdx.x; j < n; j += MLXI_THREADS) y[j] = x[r * n + j];
__syncthreads();
mlxi_softmax(y, (int)n, threadIdx.x, red);
//@@BODY fused_attention
// A batch's attention, decode rows and prefill chunks alike. Work item (r, h) is one query row r and
// one head h: the row's sequence lives in cache slot row_slot[r], holds row_len[r] keys and values
// (this pass's included), and the query sits at position row_pos[r]. Each block takes work items
// blockIdx.x, blockIdx.x + gridDim.x, ... and keeps the row's scores in its own row of the scratch
// output p [gridDim.x, CAP], so the scratch is sized by the grid, not by the batch.
// q [N, H*D]; k, v [slots, CAP, KV*D]; out [N, H*D]; scales = [the scale, the soft-cap (0: none), its
// float32 inverse]. dims = [CAP, H, KV, D, CAUSAL (0/1), WINDOW (0 = none), N]: run-time values, so one
// compiled kernel serves every model and every batch.
const long cap = dims[0];
const int H = dims[1], KV = dims[2], D = dims[3], CAUSAL = dims[4], WINDOW = dims[5];
const long items = (long)dims[6] * H;
const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
const long kvw = (long)KV * D;
const float sc = scales[0], softcap = scales[1], softcap_inv = scales[2];
float* pr = p + (long)blockIdx.x * cap;
__shared__ float red[MLXI_WARPS];
__shared__ float part[32 * MLXI_MAX_D];
for (long item = blockIdx.x; item < items; item += gridDim.x) {
  const long r = item / H;
  const int h = item % H;
  const int S = row_len[r], pos = row_pos[r];
  const auto* qh = q + r * H * D + h * D;
  const long row0 = (long)row_slot[r] * cap, c0 = (long)(h / (H / KV)) * D;  // the slot's first row, the KV head's first column
  // 1. scores, scaled after the product (soft-capped), masked; 2. softmax: both in the published order.
  for (int j = wid; j < S; j += MLXI_WARPS) {
    const float s = mlxi_score(mlxi_dot(qh, 1, mlxi_kv_row_at(k, row0 + j, c0, kvw), 1, D, lane), sc, softcap,
                               softcap_inv);
    if (lane == 0) pr[j] = mlxi_hidden(j, pos, CAUSAL, WINDOW) ? -INFINITY : s;
  }
  __syncthreads();
  mlxi_softmax(pr, S, tid, red);
  // 3. context: out[d] = dot(p, v[:, d]) in the published order, laid out for coalesced reads:
  // part[l][d] is lane l's partial sum (s = l, l+32, ... in increasing s), computed by threads that
  // take consecutive d; then the butterfly's result, as a tree over l (part[l] += part[l + off] for
  // l < off, off = 16, 8, 4, 2, 1: what lane 0 of the butterfly computes).
  for (int idx = tid; idx < 32 * D; idx += MLXI_THREADS) {
    const int l = idx / D, d = idx % D;
    float s = 0.0f;
    for (int i = l; i < S; i += 32) s = __fadd_rn(s, __fmul_rn(pr[i], mlxi_kv(v, row0 + i, c0 + d, kvw)));
    part[idx] = s;
  }
  for (int off = 16; off > 0; off >>= 1) {
    __syncthreads();
    for (int idx = tid; idx < off * D; idx += MLXI_THREADS) part[idx] = __fadd_rn(part[idx], part[idx + off * D]);
  }
  __syncthreads();
  for (int d = tid; d < D; d += MLXI_THREADS) mlxi_put(out + r * H * D + h * D + d, part[d]);
  __syncthreads();
}
//@@BODY attn_scores
// Split attention, step 1 (few query rows over long caches: decode; short prefill chunks). Then either
// attn_softmax_context (two launches: decode) or attn_softmax and attn_context (three: many rows). The same arithmetic as
// fused_attention, spread over the GPU: p[r, h, j] = the scaled, masked score of row r, head h against
// key j < row_len[r], for every head of one KV head's group (its key is read once per group).
// Block b takes keys kb*64 .. kb*64+63 of (row r, KV head g), b = (r*KV + g)*nkb + kb; warp w takes
// keys w, w+8, ..., w+56 of them, loading all 8 before the dot products (mlxi_dot's order, from
// registers: lane l adds its terms i = l, l+32, ... in increasing i, then the butterfly).
// q [N, H*D]; k [slots, CAP, KV*D]; p [N, H, CAP]. The split kernels take the attention's shape as
// compile-time constants (H, KV, D, CAUSAL, WINDOW, SCALE_BITS: the scale's float32 bits, SOFTCAP_BITS
// and SOFTCAP_INV_BITS: the soft-cap's (0: none) and its float32 inverse's; mlxi_score), the capacity
// and row count from the inputs' shapes: no small arrays to move per launch.
const long cap = k_shape[1], n = q_shape[0];
constexpr int G = H / KV, NT = (D + 31) / 32;
const float sc = __int_as_float(SCALE_BITS);
const float softcap = __int_as_float(SOFTCAP_BITS), softcap_inv = __int_as_float(SOFTCAP_INV_BITS);
const long nkb = (cap + 63) / 64;
const long blk = (long)blockIdx.y * gridDim.x + blockIdx.x;
const long kb = blk % nkb, rg = blk / nkb;
const long r = rg / KV;
const int g = rg % KV;
const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
if (r < n) {
  const long S = row_len[r];
  const int pos = row_pos[r];
  constexpr long kvw = (long)KV * D;
  const long row0 = (long)row_slot[r] * cap;  // the slot's first row
  float qr[G][NT], kr[8][NT];
  mlxi_group_queries<G, NT, D>(qr, q + r * H * D + (long)g * G * D, lane);
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const long j = kb * 64 + wid + 8 * u;
    mlxi_key_values<NT, D>(kr[u], k, row0 + j, g * D, kvw, j < S && !mlxi_hidden(j, pos, CAUSAL, WINDOW), lane);
  }
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const long j = kb * 64 + wid + 8 * u;
    if (j < S) {  // the same for every lane of the warp: the butterfly has all 32
      const bool hidden = mlxi_hidden(j, pos, CAUSAL, WINDOW);
#pragma unroll
      for (int hh = 0; hh < G; ++hh) {
        const float x = mlxi_key_score<NT, D>(qr[hh], kr[u], hidden, lane, sc, softcap, softcap_inv);
        if (lane == 0) p[(r * H + (long)g * G + hh) * cap + j] = x;
      }
    }
  }
}
//@@BODY attn_softmax_context
// Split attention, two-launch form (decode), step 2: the softmax and the context. Block b = ((r*KV + g)*nd + c) takes head
// dimensions c*8 .. c*8+7 of KV head g for row r, for the group's heads up to 4 at a time:
// 1. the heads' scores x[r, h, :S] (S = row_len[r]) give each head's max m (exact in any order) and
//    total in mlxi_softmax's order (thread t's chain of e_j = expf(x_j - m), j = t, t+256, ... in
//    increasing j; the block butterflies), as the softmax kernel computes them: every block of the
//    (row, KV head) computes the same m and total. Each thread has SU of its loads per head in
//    flight before it uses them (the adds stay in the chain's order);
// 2. out[r, h, d] = dot(p[:S], v[:S, d]) in the published order, p_i = e_i / total computed on the
//    fly with the softmax's operations (the bits the softmax kernel writes): thread (l, dd) = (tid / 8,
//    tid % 8) keeps lane l's partial sums (i = l, l+32, ... in increasing i) for up to 4 heads,
//    reading v[i, d] once for all of them, KU keys of its chain at a time (KU loads in flight); the 8
//    threads of one l (dd = 0..7, one warp) share the exponentials: for each 8 consecutive keys of
//    chain l, thread dd computes key dd's p and the warp shuffles them. The 32 partials per head are
//    then combined as a tree over l (part[l] += part[l + off] for l < off, off = 16, 8, 4, 2, 1: what
//    lane 0 of the butterfly computes), exactly as fused_attention does.
// x [N, H, CAP] (attn_scores' output); v [slots, CAP, KV*D]; compile-time H, KV, D as attn_scores', and
// the loads in flight SU (1 or 8) and KU (8 or 32): more for one row, whose 128 blocks leave the GPU
// waiting on memory, fewer for several rows, whose blocks share the SMs (kernels.split_unroll); PF
// (0 or 1): whether the values are prefetched, the chain's first KU before step 1 and each next KU
// during the current KU's arithmetic; WS (0 or 1): whether the context loop takes whole steps without
// checks first (2a in mlxi_softmax_context, which runs steps 1 and 2). The forms (kernels.split_unroll)
// change no operation and no order.
const long cap = x_shape[2], n = x_shape[0];
constexpr int G = H / KV, nd = (D + 7) / 8;
const long blk = (long)blockIdx.y * gridDim.x + blockIdx.x;
const int c = blk % nd;
const long rg = blk / nd;
const long r = rg / KV;
const int g = rg % KV;
__shared__ float red[MLXI_WARPS];
__shared__ float part[MLXI_THREADS];
if (r < n) {  // the same for the whole block
  mlxi_softmax_context<H, KV, D, SU, KU, PF, WS>(x + (r * H + (long)g * G) * cap, cap, v, (long)row_slot[r] * cap,
                                                 out + r * H * D, g, c, row_len[r], red, part);
}
//@@BODY attn_short
// Split attention, one-launch form for short caches (decode rows over at most SK keys:
// kernels.uses_short). Block b = ((r*KV + g)*nd + c), as attn_softmax_context's, first computes the
// scores of its (row r, KV head g) itself, attn_scores' arithmetic key by key (warp w takes keys w,
// w+8, ... < S, four of them loaded before their products; mlxi_key_score, as attn_scores), into
// shared memory, then runs attn_softmax_context's steps
// on them (mlxi_softmax_context): the same bits as the two launches, one launch fewer. Each of the nd
// blocks of a (row, KV head) computes the same scores: nd times the scores' work, which over short
// caches (up to ~80 keys) costs about what the launch it saves does, and more as the keys grow
// (docs/performance.md; kernels.SHORT_MAX_KEYS).
// q [N, H*D]; k, v [slots, CAP, KV*D]; compile-time H, KV, D, CAUSAL, WINDOW and the scale and soft-cap
// bits as attn_scores', SU, KU, PF, WS as attn_softmax_context's, and SK, the keys a head's row of
// shared scores holds (at least CAP: G * SK floats a block).
const long cap = k_shape[1], n = q_shape[0];
constexpr int G = H / KV, nd = (D + 7) / 8, NT = (D + 31) / 32;
constexpr long kvw = (long)KV * D;
const float sc = __int_as_float(SCALE_BITS);
const float softcap = __int_as_float(SOFTCAP_BITS), softcap_inv = __int_as_float(SOFTCAP_INV_BITS);
const long blk = (long)blockIdx.y * gridDim.x + blockIdx.x;
const int c = blk % nd;
const long rg = blk / nd;
const long r = rg / KV;
const int g = rg % KV;
const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
__shared__ float xs[G * SK];
__shared__ float red[MLXI_WARPS];
__shared__ float part[MLXI_THREADS];
if (r < n) {  // the same for the whole block
  const int S = row_len[r];
  const int pos = row_pos[r];
  const long row0 = (long)row_slot[r] * cap;  // the slot's first row
  float qr[G][NT];
  mlxi_group_queries<G, NT, D>(qr, q + r * H * D + (long)g * G * D, lane);
  for (int j0 = wid; j0 < S; j0 += 4 * MLXI_WARPS) {  // the same for every lane of the warp
    float kr[4][NT];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int j = j0 + MLXI_WARPS * u;
      mlxi_key_values<NT, D>(kr[u], k, row0 + j, g * D, kvw, j < S && !mlxi_hidden(j, pos, CAUSAL, WINDOW), lane);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int j = j0 + MLXI_WARPS * u;
      if (j < S) {
        const bool hidden = mlxi_hidden(j, pos, CAUSAL, WINDOW);
#pragma unroll
        for (int hh = 0; hh < G; ++hh) {
          const float x = mlxi_key_score<NT, D>(qr[hh], kr[u], hidden, lane, sc, softcap, softcap_inv);
          if (lane == 0) xs[hh * SK + j] = x;
        }
      }
    }
  }
  __syncthreads();
  mlxi_softmax_context<H, KV, D, SU, KU, PF, WS>(xs, SK, v, row0, out + r * H * D, g, c, S, red, part);
}
//@@BODY attn_softmax
// Split attention, three-launch form, step 2: one block per (row r, head h) turns its scores x[r, h, :S], S =
// row_len[r], into attention weights: mlxi_softmax's arithmetic (the max, thread t's chain of
// exponentials j = t, t+256, ... in increasing j, the butterflies, the division), reading x 8 loads
// at a time (mlxi_scores_pass; mlxi_softmax works in place, so each of its loads waits for the store
// before it).
// x, out [N, H, CAP].
const long cap = x_shape[2];
const long rh = blockIdx.x;
const int S = row_len[rh / x_shape[1]];
const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
constexpr int T = MLXI_THREADS;
const float* xr = x + rh * cap;
float* y = out + rh * cap;
__shared__ float red[MLXI_WARPS];
float m = -INFINITY;
mlxi_scores_pass<8>(xr, cap, 1, S, tid, [&](int, int, float v) { m = fmaxf(m, v); });
m = mlxi_block_max(m, lane, wid, red);
float s = 0.0f;
mlxi_scores_pass<8>(xr, cap, 1, S, tid, [&](int, int j, float v) {
  const float e = expf(__fsub_rn(v, m));
  y[j] = e;
  s = __fadd_rn(s, e);
});
const float total = mlxi_block_total(s, lane, wid, red);
for (int j = tid; j < S; j += T) y[j] = __fdiv_rn(y[j], total);  // this thread's own values
//@@BODY attn_context
// Split attention, three-launch form, step 3: out[r, h, d] = dot(p[r, h, :S], v[:S, d]) in the published order. Block
// b = ((r*KV + g)*nd + c) takes head dimensions c*8 .. c*8+7 of KV head g for row r; thread (l, dd) =
// (tid / 8, tid % 8) keeps lane l's partial sums (s = l, l+32, ... in increasing s) for up to 4 heads
// of the group at once, reading v[s, d] once for all of them (16 keys' loads in flight); the 32
// partials per head are then combined as a tree over l (part[l] += part[l + off] for l < off, off =
// 16, 8, 4, 2, 1: what lane 0 of the butterfly computes), exactly as fused_attention does.
// p [N, H, CAP]; v [slots, CAP, KV*D]; compile-time H, KV, D as attn_scores'.
const long cap = p_shape[2], n = p_shape[0];
constexpr int G = H / KV, nd = (D + 7) / 8;
const long blk = (long)blockIdx.y * gridDim.x + blockIdx.x;
const int c = blk % nd;
const long rg = blk / nd;
const long r = rg / KV;
const int g = rg % KV;
const int tid = threadIdx.x, l = tid >> 3, d = c * 8 + (tid & 7);
__shared__ float part[MLXI_THREADS];
if (r < n) {
  const long S = row_len[r];
  constexpr long kvw = (long)KV * D;
  const long v0 = (long)row_slot[r] * cap, vc = g * D + d;  // the slot's first row, this thread's column
  for (int h0 = 0; h0 < G; h0 += 4) {
    const int nh = min(4, G - h0);
    const float* pr = p + (r * H + (long)g * G + h0) * cap;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (d < D) {
      long i = l;
      for (; i + 15 * 32 < S; i += 16 * 32) {  // 16 keys' loads in flight, then the adds in the chain's order
        float vv[16];
#pragma unroll
        for (int u = 0; u < 16; ++u) vv[u] = mlxi_kv(v, v0 + i + u * 32, vc, kvw);
#pragma unroll
        for (int u = 0; u < 16; ++u) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (e < nh) acc[e] = __fadd_rn(acc[e], __fmul_rn(pr[e * cap + i + u * 32], vv[u]));
          }
        }
      }
      for (; i < S; i += 32) {
        const float vi = mlxi_kv(v, v0 + i, vc, kvw);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (e < nh) acc[e] = __fadd_rn(acc[e], __fmul_rn(pr[e * cap + i], vi));
        }
      }
    }
    for (int e = 0; e < nh; ++e) {
      part[tid] = acc[e];
      mlxi_chain_tree(part, tid);
      if (l == 0 && d < D) mlxi_put(out + r * H * D + (g * G + h0 + e) * D + d, part[tid]);
      __syncthreads();
    }
  }
}
//@@BODY attn_context_rows
// Split attention, three-launch form, step 3 for passes whose sequences bring many rows (prefill
// chunks): the same bits as attn_context, without shared memory or barriers. Warp w takes rows r0 =
// 2 * (w / (KV * DC)) and r0 + 1, KV head g = (w / DC) % KV and head dimensions c * 128 .. c * 128 + 127
// (c = w % DC); lane l of it dimensions c * 128 + 4l .. +3, for the group's heads NHB (1 or 2) at a
// time (mlxi_context_tile: each thread walks all 32 chains itself, UR keys of a chain unrolled, so
// p[r, h, i] is one address for the whole warp and v[i, d..d+3] one 16-byte load per lane). Two rows share their loads of v when they
// belong to one sequence (one slot, one length); otherwise each row runs alone.
// p [N, H, CAP]; v [slots, CAP, KV*D]; compile-time H, KV, D as attn_scores'.
const long cap = p_shape[2], n = p_shape[0];
constexpr int G = H / KV, DC = (D + 127) / 128;
constexpr long kvw = (long)KV * D;
const long w = ((long)blockIdx.y * gridDim.x + blockIdx.x) * MLXI_WARPS + (threadIdx.x >> 5);
const int c = w % DC;
const int g = (w / DC) % KV;
const long r0 = 2 * (w / ((long)DC * KV));
const int d0 = c * 128 + (threadIdx.x & 31) * 4;
if (r0 < n && d0 < D) {  // no barriers or shuffles below: idle lanes may leave
  const bool pair = r0 + 1 < n && row_slot[r0 + 1] == row_slot[r0] && row_len[r0 + 1] == row_len[r0];
  for (long r = r0; r < r0 + (pair ? 1 : min(2L, n - r0)); ++r) {
    const long v0 = (long)row_slot[r] * cap;  // the slot's first row
    const int S = row_len[r];
#pragma unroll
    for (int h0 = 0; h0 < G; h0 += NHB) {
      if (pair) {
        if (h0 + 2 <= G && NHB == 2) mlxi_context_tile<2, 2, D, UR>(p, v, v0, g * D, kvw, out, cap, r, g * G + h0, H, d0, S);
        else mlxi_context_tile<2, 1, D, UR>(p, v, v0, g * D, kvw, out, cap, r, g * G + h0, H, d0, S);
      } else {
        if (h0 + 2 <= G && NHB == 2) mlxi_context_tile<1, 2, D, UR>(p, v, v0, g * D, kvw, out, cap, r, g * G + h0, H, d0, S);
        else mlxi_context_tile<1, 1, D, UR>(p, v, v0, g * D, kvw, out, cap, r, g * G + h0, H, d0, S);
      }
    }
  }
}
//@@BODY attn_scores_rows
// Split attention, step 1 for passes whose sequences bring many rows (prefill chunks): the same bits as
// attn_scores, a tile of up to 32 rows of one sequence x 32 keys x one KV head per block. The host
// cuts each sequence's rows into tiles (tiles[2t], tiles[2t+1]: first row, rows <= 32). Block b =
// (tile * KV + g) * nkt + kt stages keys kt*32 .. kt*32+31 of KV head g and, two heads at a time, the
// tile's queries in shared memory, laid out by the dot's lanes ([lane l][term t]: i = l + 32t); warp w
// takes rows 4w .. 4w+3, lane j key kt*32 + j, for both heads: 8 dot products a thread, each summed
// as mlxi_dot sums it: lane l's terms in increasing t, then the butterfly's tree over l, the thread
// taking the 32 lanes' partials in mlxi_chain_at's order (what a warp's shuffles add, added here in
// registers). Scaled after the product (and soft-capped: mlxi_score); a key hidden from a row gets -INFINITY (whole tiles of hidden
// keys without products). Head dimensions up to 128 (NT <= 4).
// q [N, H*D]; k [slots, CAP, KV*D]; tiles [2 * tiles]; p [N, H, CAP]; compile-time H, KV, D as attn_scores'.
const long cap = k_shape[1];
constexpr int G = H / KV, NT = (D + 31) / 32;
static_assert(NT <= 4, "attn_scores_rows holds head dimensions up to 128");
constexpr long kvw = (long)KV * D;
const float sc = __int_as_float(SCALE_BITS);
const float softcap = __int_as_float(SOFTCAP_BITS), softcap_inv = __int_as_float(SOFTCAP_INV_BITS);
const long nkt = (cap + 31) / 32;
const long blk = (long)blockIdx.y * gridDim.x + blockIdx.x;
const long kt = blk % nkt, tg = blk / nkt;
const int g = tg % KV;
const long tile = tg / KV;
const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
// 48 KiB of static shared memory: the static limit, no room for more
__shared__ float4 ks[32 * 32];      // [l][key]: the key's terms t = 0..3 at i = l + 32t
__shared__ float4 qs[32 * 2 * 32];  // [row][head][l]
if (tile < tiles_shape[0] / 2) {  // the same for the whole block
  const long r0 = tiles[2 * tile];
  const int nr = tiles[2 * tile + 1];
  const int S = row_len[r0], slot = row_slot[r0];
  const long j0 = kt * 32;
  if (j0 < S) {
    // every row of the tile has the same S and slot (one sequence); positions grow by one a row (Batch
    // lays each sequence's rows at consecutive positions, batch.py; the skip below relies on it)
    const int pos0 = row_pos[r0], posn = row_pos[r0 + nr - 1];
    // whether some key of this tile is seen by a row at a position in [pos0, posn] (rows of one
    // sequence's chunk: consecutive positions); where none is, the tile's scores are -INFINITY
    bool any = false;
    for (long j = j0; j < min(j0 + 32, (long)S); ++j) {
      any = any || !(mlxi_hidden(j, posn, CAUSAL, 0) || mlxi_hidden(j, pos0, 0, WINDOW));
    }
    const long row0 = (long)slot * cap;  // the slot's first row
    if (any) {
      // a warp writes 32 consecutive floats (8 keys x 4 terms of one l): no bank conflicts
      for (int idx = tid; idx < 32 * 32 * 4; idx += MLXI_THREADS) {
        const int t = idx & 3, l = (idx >> 5) & 31, key = (idx >> 10) * 8 + ((idx >> 2) & 7), d = l + 32 * t;
        const long j = j0 + key;
        reinterpret_cast<float*>(ks)[(l * 32 + key) * 4 + t] = (j < S && d < D) ? mlxi_kv(k, row0 + j, g * D + d, kvw) : 0.0f;
      }
    }
    const long j = j0 + lane;
    for (int hb = 0; hb < G; hb += 2) {
      if (any) {
        __syncthreads();  // qs of the previous heads read
        for (int idx = tid; idx < 32 * 2 * 128; idx += MLXI_THREADS) {  // as ks: 8 l x 4 terms a warp
          const int t = idx & 3, l = ((idx >> 5) & 3) * 8 + ((idx >> 2) & 7), re = idx >> 7, d = l + 32 * t;
          const int row = re >> 1, e = re & 1;
          const bool ok = row < nr && hb + e < G && d < D;
          reinterpret_cast<float*>(qs)[(re * 32 + l) * 4 + t] =
              ok ? mlxi_f(q[(r0 + row) * H * D + (long)(g * G + hb + e) * D + d]) : 0.0f;
        }
        __syncthreads();
      }
      float lvl[4][2][5], tot[4][2];
#pragma unroll
      for (int kk = 0; kk < 32; ++kk) {
        const int l = mlxi_chain_at(kk);
        if (any) {
          const float4 kv4 = ks[l * 32 + lane];
          const float kt4[4] = {kv4.x, kv4.y, kv4.z, kv4.w};
#pragma unroll
          for (int rr = 0; rr < 4; ++rr) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float4 q4 = qs[((wid * 4 + rr) * 2 + e) * 32 + l];
              const float qt4[4] = {q4.x, q4.y, q4.z, q4.w};
              float x = 0.0f;
#pragma unroll
              for (int t = 0; t < NT; ++t) {
                if (l + 32 * t < D) x = __fadd_rn(x, __fmul_rn(qt4[t], kt4[t]));
              }
              x = mlxi_tree_join(lvl[rr][e], x, kk);
              if (kk == 31) tot[rr][e] = x;
            }
          }
        }
      }
      if (j < S) {
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const int row = wid * 4 + rr;
          if (row < nr) {
            const int pos = row_pos[r0 + row];
            const bool hidden = mlxi_hidden(j, pos, CAUSAL, WINDOW);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if (hb + e < G) {
                p[((r0 + row) * H + (long)g * G + hb + e) * cap + j] = (hidden || !any) ? -INFINITY : mlxi_score(tot[rr][e], sc, softcap, softcap_inv);
              }
            }
          }
        }
      }
    }
  }
}
//@@BODY tanh
// out[i] = tanh(x[i]) (float32, i < dims[0]): the MLX backend's tanh primitive on a GPU (soft-capping),
// mlxi_tanh, the function the attention kernels cap their scores with. One thread a value.
const long i = ((long)blockIdx.y * gridDim.x + blockIdx.x) * MLXI_THREADS + threadIdx.x;
if (i < dims[0]) out[i] = mlxi_tanh(x[i]);
//@@BODY qk_norm_rope
// Not attention's arithmetic but its inputs: Qwen3's q_norm / k_norm then RoPE (rotate-half) of a pass's
// queries q [N, H*D] and keys k [N, KV*D] in one launch (the MLX backend's qk_norm_rope on CUDA; a decode
// step's graph has one node here instead of eight a layer), with weights wq, wk [D] and each row's position
// row_pos [N] -> qo, ko. q, k, the weights and the outputs are of one type T (float, __nv_bfloat16 or
// __half: the activations'). One warp per (row, head), the queries' heads first; lane l holds d = l + 32i,
// so with D a multiple of 64 each rotated pair (d, d + D/2) sits in one lane. The same operations as
// mx.fast.rms_norm then mx.fast.rope (MLX 0.32's CUDA kernels: x * rsqrt(sum(x^2) / D + eps) in float32
// rounded to T, times the weight rounded to T; theta = pos * exp2(-(d / (D/2)) * log2(base)),
// x1 cos - x2 sin, x1 sin + x2 cos in float32 from those T values, rounded to T), except the order of the
// sum of squares: each lane's terms in increasing i, rounded products, then the butterfly
// (mlxi_warp_total). Compile-time H, KV, D; EPS_BITS and LOG2_BASE_BITS: float32 bits.
constexpr int E = D / 32, HALF = E / 2;
const float eps = __int_as_float(EPS_BITS), log2_base = __int_as_float(LOG2_BASE_BITS);
const int lane = threadIdx.x & 31;
const long w = ((long)blockIdx.y * gridDim.x + blockIdx.x) * MLXI_WARPS + (threadIdx.x >> 5);
if (w < (long)row_pos_shape[0] * (H + KV)) {  // w is the warp's: all its lanes take the shuffles below
  const long r = w / (H + KV);
  const int h = w % (H + KV);
  const bool is_q = h < H;
  const long at = is_q ? (r * H + h) * D : (r * KV + h - H) * D;
  const auto* x = (is_q ? q : k) + at;
  const auto* wt = is_q ? wq : wk;
  auto* y = (is_q ? qo : ko) + at;
  float v[E];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    v[i] = mlxi_f(x[lane + 32 * i]);
    ss = __fadd_rn(ss, __fmul_rn(v[i], v[i]));
  }
  const float inv = rsqrtf(__fadd_rn(__fdiv_rn(mlxi_warp_total(ss), (float)D), eps));
#pragma unroll
  for (int i = 0; i < E; ++i) v[i] = mlxi_in(y, __fmul_rn(mlxi_f(wt[lane + 32 * i]), mlxi_in(y, __fmul_rn(v[i], inv))));
  const float L = (float)row_pos[r];
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const int d = lane + 32 * i;
    const float theta = L * exp2f(-((float)d / (float)(D / 2)) * log2_base);
    const float c = cosf(theta), s = sinf(theta);
    const float x1 = v[i], x2 = v[i + HALF];
    mlxi_put(y + d, x1 * c - x2 * s);
    mlxi_put(y + d + D / 2, x1 * s + x2 * c);
  }
}
//@@BODY mma_matmul
// out[b, i, j] = mma_dot(a[b, i, :], bt[b / G, j, :]); a float32 [B, M, K] (rounded to the 16-bit type as it
// is read: exact for values of that type), bt [B/G, N, K] 16-bit bits; dims = [B, M, N, K, G]. One warp
// per 16 x 8 tile of the output.
const long B = dims[0], M = dims[1], N = dims[2], K = dims[3], G = dims[4];
const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
const long tm = (M + 15) / 16, tn = (N + 7) / 8;
const long w = ((long)blockIdx.y * gridDim.x + blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
if (w < B * tm * tn) {
  const long b = w / (tm * tn), i0 = (w / tn) % tm * 16, j0 = w % tn * 8;
  const float* A = a + b * M * K;
  const uint16_t* Bt = bt + (b / G) * N * K;
  const long il = i0 + g, ih = il + 8, j = j0 + g;
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (long k0 = 0; k0 < K; k0 += 16) {
    uint32_t fa[4], fb[2];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const long i = (q & 1) ? ih : il, k = k0 + 2 * t + 8 * (q >> 1);
      fa[q] = mlxi_pair(i < M && k < K ? mlxi_round16<BF>(A[i * K + k]) : 0u,
                        i < M && k + 1 < K ? mlxi_round16<BF>(A[i * K + k + 1]) : 0u);
    }
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const long k = k0 + 2 * t + 8 * q;
      fb[q] = mlxi_pair(j < N && k < K ? Bt[j * K + k] : 0u, j < N && k + 1 < K ? Bt[j * K + k + 1] : 0u);
    }
    if (mlxi_zero_step(fa)) continue;
    mlxi_mma<BF>(d, fa, fb);
  }
  float* o = out + b * M * N;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const long i = e < 2 ? il : ih, jj = j0 + 2 * t + (e & 1);
    if (i < M && jj < N) o[i * N + jj] = d[e];
  }
}
//@@BODY mma_softmax
// out[r, :] = softmax(x[r, :]) in mma_softmax's order; x [R, n]; dims = [R, n]. A quad of threads a row,
// thread c the chain of the columns j with (j mod 8) / 2 == c.
const long R = dims[0], n = dims[1];
const long tid = ((long)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
const long r = tid >> 2;
const int c = (int)(tid & 3);
const bool live = r < R;  // (a quad past the last row still takes part in the shuffles)
const float* xr = x + (live ? r : 0) * n;
float m = -INFINITY;
for (long j = 2 * c; j < n; j += 8) {
  m = fmaxf(m, xr[j]);
  if (j + 1 < n) m = fmaxf(m, xr[j + 1]);
}
m = mlxi_quad_max(m);
float s = 0.0f;
for (long j = 2 * c; j < n; j += 8) {
  s = __fadd_rn(s, expf(__fsub_rn(xr[j], m)));
  if (j + 1 < n) s = __fadd_rn(s, expf(__fsub_rn(xr[j + 1], m)));
}
const float total = mlxi_quad_total(s);
if (live) {
  for (long j = 2 * c; j < n; j += 8) {
    out[r * n + j] = __fdiv_rn(expf(__fsub_rn(xr[j], m)), total);
    if (j + 1 < n) out[r * n + j + 1] = __fdiv_rn(expf(__fsub_rn(xr[j + 1], m)), total);
  }
}
//@@BODY mma_attention
// One sequence's prefill chunk, every head, in the tensor-core order: q [T, H*D], k and v [S, KV*D] (the
// sequence's cached rows, this chunk's included), 16-bit bits; pos [T] the rows' positions; scales =
// [scale, cap, 1/cap]; dims = [T, S, H, KV, causal, window]; template BF (bfloat16, else float16), D.
// A block of 4 warps takes one head and 64 rows, warp w rows 16 w .. 16 w + 15 of them: the reference's
// steps 3-7 per head (mma_matmul, scale, soft-cap, mask, mma_softmax, mma_matmul) in three passes over
// the keys the block's rows can see, KT keys at a time staged in shared memory by the whole block: the
// row maxima; the totals; the weights (rounded to 16 bits) times V. A warp computes only the steps of 16
// keys its own rows can see (the others are all -inf for its rows: no change to a maximum, a total or
// an accumulator), in increasing order.
constexpr int KT = D <= 128 ? 64 : 32;
__shared__ __align__(16) uint16_t ks[KT * (D + MLXI_KPAD)];
__shared__ __align__(16) uint16_t vs[KT * (D + MLXI_KPAD)];
__shared__ int span[8];
const long T = dims[0], S = dims[1];
const int H = dims[2], KV = dims[3], causal = dims[4], window = dims[5];
const float sc = scales[0], cap = scales[1], inv = scales[2];
const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, g = lane >> 2, t = lane & 3;
const long blocks_per_head = (T + 63) / 64;
const long blk = (long)blockIdx.y * gridDim.x + blockIdx.x;
const bool in_grid = blk < blocks_per_head * H;  // (a 2-D grid rounds the block count up: the rest idle along)
const int h = in_grid ? (int)(blk / blocks_per_head) : 0, kvh = h / (H / KV);
const long qw = (long)H * D, kw = (long)KV * D, rl = (blk % blocks_per_head) * 64 + 16 * wid + g, rh = rl + 8;
const bool vl = in_grid && rl < T, vh = in_grid && rh < T;
const int pl = vl ? pos[rl] : 0, ph = vh ? pos[rh] : 0;
// the keys any of the warp's rows sees, [lo, hi] (none: hi < lo), then the block's
int most = vl ? (vh && ph > pl ? ph : pl) : -1, least = vl ? (vh && ph < pl ? ph : pl) : 0x7fffffff;
for (int off = 16; off > 0; off >>= 1) {
  const int a = __shfl_xor_sync(0xffffffffu, most, off), b = __shfl_xor_sync(0xffffffffu, least, off);
  most = a > most ? a : most;
  least = b < least ? b : least;
}
const long hi = most < 0 ? -1 : (causal && most < S - 1 ? (long)most : S - 1);
const long lo = most < 0 ? 0 : (window > 0 && least - window + 1 > 0 ? (long)least - window + 1 : 0);
if (lane == 0) {
  span[wid] = (int)hi;
  span[4 + wid] = (int)lo;
}
__syncthreads();
long bhi = -1, blo = S;
for (int i = 0; i < 4; ++i) {
  if (span[i] >= span[4 + i]) {
    bhi = span[i] > bhi ? span[i] : bhi;
    blo = span[4 + i] < blo ? span[4 + i] : blo;
  }
}
blo = blo / KT * KT;
uint32_t qa[D / 16][4];
unsigned zmask = 0;
const uint16_t* ql = q + (vl ? rl : 0) * qw + (long)h * D + 2 * t;
const uint16_t* qh = q + (vh ? rh : 0) * qw + (long)h * D + 2 * t;
#pragma unroll
for (int kk = 0; kk < D / 16; ++kk) {
  qa[kk][0] = vl ? mlxi_pair(ql[16 * kk], ql[16 * kk + 1]) : 0u;
  qa[kk][1] = vh ? mlxi_pair(qh[16 * kk], qh[16 * kk + 1]) : 0u;
  qa[kk][2] = vl ? mlxi_pair(ql[16 * kk + 8], ql[16 * kk + 9]) : 0u;
  qa[kk][3] = vh ? mlxi_pair(qh[16 * kk + 8], qh[16 * kk + 9]) : 0u;
  if (mlxi_zero_step(qa[kk])) zmask |= 1u << kk;
}
const long c0 = (long)kvh * D, first = lo / 16 * 16;
float s[2][4];
float ml = -INFINITY, mh = -INFINITY, cl = 0.0f, ch = 0.0f, tl = 0.0f, th = 0.0f;
float o[D / 8][4];
#pragma unroll
for (int dn = 0; dn < D / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
for (int pass = 0; pass < 3; ++pass) {
  for (long k0 = blo; k0 <= bhi; k0 += KT) {
    __syncthreads();  // (the previous tile's readers are done)
    mlxi_stage<D, KT>(ks, k, kw, c0, S, k0, tid, 128);
    if (pass == 2) mlxi_stage<D, KT>(vs, v, kw, c0, S, k0, tid, 128);
    __syncthreads();
    for (int sub = 0; sub < KT / 16; ++sub) {
      const long j0 = k0 + 16 * sub;
      if (j0 < first || j0 > hi) continue;  // (warp-uniform: none of the warp's rows sees these keys)
      mlxi_mma_scores<BF, D>(s, qa, zmask, ks + 16 * sub * (D + MLXI_KPAD), S, j0, g, t, pl, ph, causal, window,
                             sc, cap, inv);
      if (pass == 0) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          ml = fmaxf(ml, fmaxf(s[n][0], s[n][1]));
          mh = fmaxf(mh, fmaxf(s[n][2], s[n][3]));
        }
      } else if (pass == 1) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          if (vl) cl = __fadd_rn(__fadd_rn(cl, expf(__fsub_rn(s[n][0], ml))), expf(__fsub_rn(s[n][1], ml)));
          if (vh) ch = __fadd_rn(__fadd_rn(ch, expf(__fsub_rn(s[n][2], mh))), expf(__fsub_rn(s[n][3], mh)));
        }
      } else {
        uint32_t p[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const bool live = e < 2 ? vl : vh;
            p[n][e] = live ? mlxi_round16<BF>(__fdiv_rn(expf(__fsub_rn(s[n][e], e < 2 ? ml : mh)), e < 2 ? tl : th)) : 0u;
          }
        }
        const uint32_t pa[4] = {mlxi_pair(p[0][0], p[0][1]), mlxi_pair(p[0][2], p[0][3]), mlxi_pair(p[1][0], p[1][1]),
                                mlxi_pair(p[1][2], p[1][3])};
        if (mlxi_zero_step(pa)) continue;
        const uint16_t* va = vs + (16 * sub + 2 * t) * (D + MLXI_KPAD) + g;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
          const uint32_t b[2] = {mlxi_pair(va[8 * dn], va[(D + MLXI_KPAD) + 8 * dn]),
                                 mlxi_pair(va[8 * (D + MLXI_KPAD) + 8 * dn], va[9 * (D + MLXI_KPAD) + 8 * dn])};
          mlxi_mma<BF>(o[dn], pa, b);
        }
      }
    }
  }
  if (pass == 0) {
    ml = mlxi_quad_max(ml);
    mh = mlxi_quad_max(mh);
  } else if (pass == 1) {
    tl = mlxi_quad_total(cl);
    th = mlxi_quad_total(ch);
  }
}
auto* ol = out + rl * qw + (long)h * D + 2 * t;
auto* oh = out + rh * qw + (long)h * D + 2 * t;
#pragma unroll
for (int dn = 0; dn < D / 8; ++dn) {
  if (vl) {
    mlxi_put(ol + 8 * dn, o[dn][0]);
    mlxi_put(ol + 8 * dn + 1, o[dn][1]);
  }
  if (vh) {
    mlxi_put(oh + 8 * dn, o[dn][2]);
    mlxi_put(oh + 8 * dn + 1, o[dn][3]);
  }
}
