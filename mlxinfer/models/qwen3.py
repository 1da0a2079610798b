"""Qwen3 (GGUF architecture `qwen3`).

Differences from Llama: RMSNorm of each query and key head before RoPE (`attn_q_norm`, `attn_k_norm`,
weights of length head_dim), rotate-half RoPE on the GGUF layout as stored (Qwen GGUFs are not
permuted), head_dim from `qwen3.attention.key_length` (128 in Qwen3-0.6B, while hidden/heads = 64),
output head tied to the embedding unless `output.weight` is present.
"""

from ..backend import AttentionSpec
from .layers import output_logits, output_product, swiglu_block
from .shard import Shard
from .spec import ModelArgs, load_weights

TRAITS = dict(rope_traditional=False, qk_norm=True)


class Model:
    def __init__(self, ops, g, args: ModelArgs, shard: Shard | None = None):
        self.args, self.shard = args, shard or Shard.whole(args)
        self.w = load_weights(ops, g, args, self.shard)
        self.spec = AttentionSpec.standard(self.shard.n_heads, self.shard.n_kv_heads, args.head_dim)

    def attention(self, ops, x, w, batch, cache, layer: int):
        """x + attention(rms_norm(x)): the residual stream after the layer's attention block."""
        a, sp, groups = self.args, self.spec, batch.rows
        q, k, v = ops.rms_norm_linear_group(x, w.attn_norm, a.rms_eps, w.attn_qkv, groups)
        q, k = ops.qk_norm_rope(q, k, w.attn_q_norm, w.attn_k_norm, batch.positions, sp.n_heads, sp.n_kv_heads,
                                a.head_dim, a.rms_eps, a.rope_base, traditional=False, factors=a.rope_factors)
        kv = cache.update(ops, layer, k, v, batch)
        return output_product(ops, ops.fused_attention(q, kv, batch, sp), w.attn_output, groups, self.shard, residual=x)

    def __call__(self, ops, ids, batch, cache):
        """Logits of the batch's logit rows, [R, vocab]; writes the pass's keys and values to `cache`."""
        a = self.args
        x = ops.gather_rows(self.w.token_embd, ids)
        for i, w in enumerate(self.w.layers):
            x = self.attention(ops, x, w, batch, cache, i)
            x = swiglu_block(ops, x, w, a.rms_eps, batch.rows, self.shard)
            batch.layer_done(x)
        return output_logits(ops, x, self.w, batch, a.rms_eps, self.shard, a.vocab_size)
