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
// mlxinfer.kernels.published_dot / published_softmax_sum emulate this order in numpy float32 (the sums
// exactly; expf differs from numpy's exp in the last bit), and tests/test_kernels.py checks the kernels
// against the emulation on a CUDA GPU.
//@@HEADER
#define MLXI_THREADS 256
#define MLXI_WARPS 8
#define MLXI_MAX_D 256  // largest head dimension of the fused kernel (shared memory: 32 KiB)

__device__ __forceinline__ float mlxi_dot(const float* a, long sa, const float* b, long sb, int n, int lane) {
  float s = 0.0f;
  for (int i = lane; i < n; i += 32) {
    s = __fadd_rn(s, __fmul_rn(a[(long)i * sa], b[(long)i * sb]));
  }
  for (int off = 16; off > 0; off >>= 1) {
    s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off));
  }
  return s;
}

// In-place softmax of x[0..n) by the whole block (MLXI_THREADS threads); red: 8 floats of shared memory.
__device__ __forceinline__ void mlxi_softmax(float* x, int n, int tid, float* red) {
  const int lane = tid & 31, wid = tid >> 5;
  float m = -INFINITY;
  for (int j = tid; j < n; j += MLXI_THREADS) m = fmaxf(m, x[j]);
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (lane == 0) red[wid] = m;
  __syncthreads();
  m = red[0];
  for (int w = 1; w < MLXI_WARPS; ++w) m = fmaxf(m, red[w]);
  __syncthreads();
  float s = 0.0f;
  for (int j = tid; j < n; j += MLXI_THREADS) {
    const float e = expf(__fsub_rn(x[j], m));
    x[j] = e;
    s = __fadd_rn(s, e);
  }
  for (int off = 16; off > 0; off >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off));
  if (lane == 0) red[wid] = s;
  __syncthreads();
  float total = red[lane & 7];
  for (int off = 4; off > 0; off >>= 1) total = __fadd_rn(total, __shfl_xor_sync(0xffffffffu, total, off));
  for (int j = tid; j < n; j += MLXI_THREADS) x[j] = __fdiv_rn(x[j], total);
  __syncthreads();
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
// q [N, H*D]; k, v [slots, CAP, KV*D]; out [N, H*D].
// dims = [CAP, H, KV, D, CAUSAL (0/1), WINDOW (0 = none), N]: run-time values, so one compiled kernel
// serves every model and every batch.
const long cap = dims[0];
const int H = dims[1], KV = dims[2], D = dims[3], CAUSAL = dims[4], WINDOW = dims[5];
const long items = (long)dims[6] * H;
const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
const long kvw = (long)KV * D;
const float sc = scale[0];
float* pr = p + (long)blockIdx.x * cap;
__shared__ float red[MLXI_WARPS];
__shared__ float part[32 * MLXI_MAX_D];
for (long item = blockIdx.x; item < items; item += gridDim.x) {
  const long r = item / H;
  const int h = item % H;
  const int S = row_len[r], pos = row_pos[r];
  const float* qh = q + r * H * D + h * D;
  const long base = (long)row_slot[r] * cap * kvw + (h / (H / KV)) * D;
  const float* kb = k + base;
  const float* vb = v + base;
  // 1. scores, scaled after the product, masked; 2. softmax: both in the published order.
  for (int j = wid; j < S; j += MLXI_WARPS) {
    const float s = __fmul_rn(mlxi_dot(qh, 1, kb + j * kvw, 1, D, lane), sc);
    const bool hidden = (CAUSAL && j > pos) || (WINDOW > 0 && j <= pos - WINDOW);
    if (lane == 0) pr[j] = hidden ? -INFINITY : s;
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
    for (int i = l; i < S; i += 32) s = __fadd_rn(s, __fmul_rn(pr[i], vb[(long)i * kvw + d]));
    part[idx] = s;
  }
  for (int off = 16; off > 0; off >>= 1) {
    __syncthreads();
    for (int idx = tid; idx < off * D; idx += MLXI_THREADS) part[idx] = __fadd_rn(part[idx], part[idx + off * D]);
  }
  __syncthreads();
  for (int d = tid; d < D; d += MLXI_THREADS) out[r * H * D + h * D + d] = part[d];
  __syncthreads();
}
