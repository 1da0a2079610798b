// mlxinfer fused attention for mx.fast.metal_kernel: the same algorithm as fused_attention_cuda.cu.
//
// UNVERIFIED ON HARDWARE: no Apple GPU is available where this project is developed and tested. The
// structure mirrors the CUDA twin step for step (one threadgroup per query head, decode):
//   1. scores: one simdgroup per cached key, each lane accumulating NPT_QK consecutive products per
//      stride of 32*NPT_QK, a simdgroup sum, then one multiply by the scale;
//   2. softmax: BLOCK_DIM threads, 4 values per thread per round, online max/normalizer, simdgroup
//      reductions, then a second reduction over the simdgroups' partials, 1/normalizer;
//   3. context: one simdgroup per output dimension, NPT_PV consecutive products per lane per stride.
// Byte identity with the per-head default on Metal additionally requires MLX's Metal gemv and softmax
// kernels to reduce in this order, which has not been checked on a Mac.
// Inputs: q [1, H*D], k and v [S, KV*D], scale [1], seq [1]. Outputs: out [1, H*D], attn [H, S].
//@@HEADER
#include <metal_simdgroup>
//@@BODY
const uint h = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint wid = simdgroup_index_in_threadgroup;
const int nwarps = BLOCK_DIM / 32;
const int S = seq[0];
const int kv_h = h / (H / KV);
const int kvw = KV * D;
device const float* qh = q + h * D;
device float* p = attn + h * S;

for (int j = wid; j < S; j += nwarps) {
  device const float* kr = k + j * kvw + kv_h * D;
  float sum = 0.0f;
  for (int col = NPT_QK * lane; col < D; col += 32 * NPT_QK) {
    for (int i = 0; i < NPT_QK; ++i) {
      sum = fma(kr[col + i], qh[col + i], sum);
    }
  }
  sum = simd_sum(sum);
  if (lane == 0) {
    p[j] = sum * scale[0];
  }
}
threadgroup_barrier(mem_flags::mem_device);

float prevmax;
float maxval = -FLT_MAX;
float normalizer = 0.0f;
const int rounds = (S + BLOCK_DIM * 4 - 1) / (BLOCK_DIM * 4);
for (int r = 0; r < rounds; r++) {
  const int index = r * BLOCK_DIM + tid;
  float vals[4];
  for (int i = 0; i < 4; ++i) {
    vals[i] = (4 * index + i) < S ? p[4 * index + i] : -INFINITY;
  }
  prevmax = maxval;
  for (int i = 0; i < 4; ++i) {
    maxval = max(maxval, vals[i]);
  }
  normalizer = normalizer * fast::exp(prevmax - maxval);
  for (int i = 0; i < 4; i++) {
    normalizer = normalizer + fast::exp(vals[i] - maxval);
  }
}
prevmax = maxval;
maxval = simd_max(maxval);
normalizer = normalizer * fast::exp(prevmax - maxval);
normalizer = simd_sum(normalizer);
threadgroup float local_max[32];
threadgroup float local_normalizer[32];
prevmax = maxval;
if (lane == 0) {
  local_max[wid] = maxval;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
maxval = (int)lane < nwarps ? local_max[lane] : -INFINITY;
maxval = simd_max(maxval);
normalizer = normalizer * fast::exp(prevmax - maxval);
if (lane == 0) {
  local_normalizer[wid] = normalizer;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
normalizer = (int)lane < nwarps ? local_normalizer[lane] : 0.0f;
normalizer = simd_sum(normalizer);
normalizer = 1 / normalizer;
for (int r = 0; r < rounds; r++) {
  const int index = r * BLOCK_DIM + tid;
  for (int i = 0; i < 4; ++i) {
    if ((4 * index + i) < S) {
      p[4 * index + i] = fast::exp(p[4 * index + i] - maxval) * normalizer;
    }
  }
}
threadgroup_barrier(mem_flags::mem_device);

for (int d = wid; d < D; d += nwarps) {
  device const float* vc = v + kv_h * D + d;
  float sum = 0.0f;
  for (int col = NPT_PV * lane; col < S; col += 32 * NPT_PV) {
    for (int i = 0; i < NPT_PV; ++i) {
      sum = fma(vc[(col + i) * kvw], p[col + i], sum);
    }
  }
  sum = simd_sum(sum);
  if (lane == 0) {
    out[h * D + d] = sum;
  }
}
