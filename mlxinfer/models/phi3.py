"""Phi-3 (GGUF architecture `phi3`; Phi-3/3.5 mini and medium, Phi-4 with full rotary dimensions).

Differences from Llama: Q, K and V in one matrix `attn_qkv` and gate and up in one `ffn_up` (gate rows
first), read as their groups' matrices through `spec.fused_view`; rotate-half RoPE; the queries scaled by
1/sqrt(head_dim) before attention (llama.cpp's order), the scores then unscaled. Files of the 128k
models carry `rope_factors_long/short.weight`: the long ones where the context exceeds
`rope.scaling.original_context_length` (llama.cpp decides by its context; ours is the file's), and
`rope.scaling.attn_factor`, by which ggml multiplies each rotation's cos and sin (here the rotated
queries and keys). `attention.sliding_window` is read and not applied: llama.cpp disables Phi-3's window
(ggml-org/llama.cpp#13676), and so do we, to compute what it computes. Tensor parallelism refuses the
fused matrices (models/shard.py).
"""

import numpy as np

from ..backend import AttentionSpec
from . import llama
from .layers import output_product
from .spec import ModelArgs

TRAITS = dict(rope_traditional=False, qk_norm=False, fused=True,
              ignored={"attention.sliding_window": "llama.cpp disables Phi-3's sliding window"})


class Model(llama.Model):
    """Llama's decoder loop (`llama.Model.__call__`) with Phi-3's attention."""

    def __init__(self, ops, g, args: ModelArgs, shard=None):
        super().__init__(ops, g, args, shard)
        self.spec = AttentionSpec(self.shard.n_heads, self.shard.n_kv_heads, args.head_dim, 1.0)
        self.q_scale = float(np.float32(1.0) / np.sqrt(np.float32(args.head_dim)))

    def rope(self, ops, x, heads, batch):
        a = self.args
        x = ops.rope(x, batch.positions, heads, a.head_dim, a.rope_base, traditional=False, factors=a.rope_factors)
        return x if a.rope_attn_factor == 1.0 else ops.scale(x, a.rope_attn_factor)

    def attention(self, ops, x, w, batch, cache, layer: int):
        """x + attention(rms_norm(x)) (llama.Model.attention's contract)."""
        sp, groups = self.spec, batch.rows
        q, k, v = ops.rms_norm_linear_group(x, w.attn_norm, self.args.rms_eps, w.attn_qkv, groups)
        q = ops.scale(self.rope(ops, q, sp.n_heads, batch), self.q_scale)
        k = self.rope(ops, k, sp.n_kv_heads, batch)
        kv = cache.update(ops, layer, k, v, batch)
        return output_product(ops, ops.fused_attention(q, kv, batch, sp), w.attn_output, groups, self.shard, residual=x)
