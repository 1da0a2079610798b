// mlxinfer fused attention, CUDA twin of fused_attention.metal, for mx.fast.cuda_kernel.
//
// One thread block per query head, decode (one query row). It reproduces, float for float, what the
// protocol's per-head default computes on MLX's CUDA backend:
//   scores = matmul(q_h, k_h^T)  -> MLX's gemv kernel: one warp per output; lane l accumulates
//                                   NPT_QK consecutive products per stride of 32*NPT_QK
//                                   (sum += m*v, contracted to FMA as nvcc does), then a
//                                   cooperative-groups warp reduce;
//   scores = scores * scale       -> one float multiply;
//   attn = softmax(scores)        -> MLX's CUDA softmax: BLOCK_DIM threads, 4 values per thread per
//                                   round, online max/normalizer with __expf, warp reduce, then a
//                                   second warp reduce over the warps' partials, 1/normalizer;
//   ctx = matmul(attn, v_h)       -> gemv again (B in transposed storage): one warp per output
//                                   dimension, NPT_PV consecutive products per lane per stride.
// Template parameters: H, KV, D, BLOCK_DIM (MLX's softmax block size for S), NPT_QK, NPT_PV.
// Inputs: q [1, H*D], k and v [S, KV*D], scale [1], seq [1] (S). Outputs: out [1, H*D], attn [H, S].
//@@HEADER
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
//@@BODY
namespace cg = cooperative_groups;
auto block = cg::this_thread_block();
auto warp = cg::tiled_partition<32>(block);
const int h = block.group_index().x;
const int tid = block.thread_rank();
const int lane = warp.thread_rank();
const int wid = warp.meta_group_rank();
const int nwarps = BLOCK_DIM / 32;
const int S = seq[0];
const int kv_h = h / (H / KV);
const int kvw = KV * D;
const float* qh = q + h * D;
float* p = attn + (size_t)h * S;

// 1. scores, in the gemv order, scaled after the dot product.
for (int j = wid; j < S; j += nwarps) {
  const float* kr = k + (size_t)j * kvw + kv_h * D;
  float sum = 0.0f;
  for (int col = NPT_QK * lane; col < D; col += 32 * NPT_QK) {
#pragma unroll
    for (int i = 0; i < NPT_QK; ++i) {
      sum += kr[col + i] * qh[col + i];
    }
  }
  sum = cg::reduce(warp, sum, cg::plus<float>());
  if (lane == 0) {
    p[j] = sum * scale[0];
  }
}
block.sync();

// 2. softmax, in MLX's order (online normalizer, 4 reads per thread per round).
const float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
float prevmax;
float maxval = cuda::std::numeric_limits<float>::lowest();
float normalizer = 0.0f;
const int rounds = (S + BLOCK_DIM * 4 - 1) / (BLOCK_DIM * 4);
for (int r = 0; r < rounds; r++) {
  const int index = r * BLOCK_DIM + tid;
  float vals[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    vals[i] = (4 * index + i) < S ? p[4 * index + i] : NEG_INF;
  }
  prevmax = maxval;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    maxval = cg::greater<float>()(maxval, vals[i]);
  }
  normalizer = normalizer * __expf(prevmax - maxval);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    normalizer = normalizer + __expf(vals[i] - maxval);
  }
}
prevmax = maxval;
maxval = cg::reduce(warp, maxval, cg::greater<float>());
normalizer = normalizer * __expf(prevmax - maxval);
normalizer = cg::reduce(warp, normalizer, cg::plus<float>());
__shared__ float local_max[32];
__shared__ float local_normalizer[32];
prevmax = maxval;
if (lane == 0) {
  local_max[wid] = maxval;
}
block.sync();
maxval = lane < nwarps ? local_max[lane] : NEG_INF;
maxval = cg::reduce(warp, maxval, cg::greater<float>());
normalizer = normalizer * __expf(prevmax - maxval);
if (lane == 0) {
  local_normalizer[wid] = normalizer;
}
block.sync();
normalizer = lane < nwarps ? local_normalizer[lane] : 0.0f;
normalizer = cg::reduce(warp, normalizer, cg::plus<float>());
normalizer = 1 / normalizer;
for (int r = 0; r < rounds; r++) {
  const int index = r * BLOCK_DIM + tid;
  float vals[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    vals[i] = (4 * index + i) < S ? p[4 * index + i] : 0.0f;
  }
#pragma unroll
  for (int i = 0; i < 4; i++) {
    vals[i] = __expf(vals[i] - maxval) * normalizer;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if ((4 * index + i) < S) {
      p[4 * index + i] = vals[i];
    }
  }
}
block.sync();

// 3. context, in the gemv order over the S cached rows.
for (int d = wid; d < D; d += nwarps) {
  const float* vc = v + kv_h * D + d;
  float sum = 0.0f;
  for (int col = NPT_PV * lane; col < S; col += 32 * NPT_PV) {
#pragma unroll
    for (int i = 0; i < NPT_PV; ++i) {
      sum += vc[(size_t)(col + i) * kvw] * p[col + i];
    }
  }
  sum = cg::reduce(warp, sum, cg::plus<float>());
  if (lane == 0) {
    out[h * D + d] = sum;
  }
}
