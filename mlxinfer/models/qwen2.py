"""Qwen2 (GGUF architecture `qwen2`; Qwen2, Qwen2.5, Qwen2.5-Coder and the DeepSeek-R1 Qwen distills).

Differences from Llama: biases on the query, key and value products (`attn_q.bias`, `attn_k.bias`,
`attn_v.bias`; none on the output projection), added after the products as llama.cpp does
(`ggml_add(mul_mat(wq, x), bq)`); rotate-half RoPE on the GGUF layout as stored (Qwen GGUFs are not
permuted). No q/k norm (that is Qwen3's); output head tied to the embedding unless `output.weight` is
present (Qwen2.5-0.5B ties it, 7B does not).
"""

from ..backend import AttentionSpec
from .layers import output_logits, output_product, swiglu_block
from .shard import Shard
from .spec import ModelArgs, load_weights

TRAITS = dict(rope_traditional=False, qk_norm=False, qkv_bias=True)


class Model:
    def __init__(self, ops, g, args: ModelArgs, shard: Shard | None = None):
        self.args, self.shard = args, shard or Shard.whole(args)
        self.w = load_weights(ops, g, args, self.shard)
        self.spec = AttentionSpec.standard(self.shard.n_heads, self.shard.n_kv_heads, args.head_dim)

    def attention(self, ops, x, w, batch, cache, layer: int):
        """x + attention(rms_norm(x)): the residual stream after the layer's attention block."""
        a, sp, groups = self.args, self.spec, batch.rows
        q, k, v = ops.rms_norm_linear_group(x, w.attn_norm, a.rms_eps, w.attn_qkv, groups)
        q, k, v = ops.add(q, w.attn_q_bias), ops.add(k, w.attn_k_bias), ops.add(v, w.attn_v_bias)
        q = ops.rope(q, batch.positions, sp.n_heads, a.head_dim, a.rope_base, traditional=False,
                     factors=a.rope_factors)
        k = ops.rope(k, batch.positions, sp.n_kv_heads, a.head_dim, a.rope_base, traditional=False,
                     factors=a.rope_factors)
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
