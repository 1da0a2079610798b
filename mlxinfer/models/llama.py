"""Llama (GGUF architecture `llama`; SmolLM2 among others).

llama.cpp's converter permutes the rows of `attn_q` and `attn_k` so that each head's rotary pairs are
interleaved, (x[2i], x[2i+1]), instead of HF's halves (x[i], x[i + d/2]). We read the file as stored and
apply the matching interleaved RoPE (`traditional=True`), exactly as llama.cpp does; no un-permute.
No q/k norm; output head tied to the embedding unless `output.weight` is present. Llama 3.x files carry
`rope_freqs.weight` (the llama3 RoPE scaling, computed by llama.cpp's converter from the HF config's
factor, low/high frequency factors and original context): each rotary pair's frequency divided by its
factor, as ggml's rope does with `freq_factors` (`ModelArgs.rope_factors`, with linear scaling folded in).
A file with `llama.expert_count` (Mixtral) has a mixture of experts for its FFN, routed as Qwen3-MoE's
(softmax, the top `expert_used_count`, weights normalized; llama.cpp's build_moe_ffn for llama), each
expert `feed_forward_length` wide.
"""

from ..backend import AttentionSpec
from .layers import moe_mlp, output_logits, output_product, rms_norm, swiglu_block
from .shard import Shard
from .spec import ModelArgs, load_weights

TRAITS = dict(rope_traditional=True, qk_norm=False, reads_rope_freqs=True, moe="optional")


class Model:
    def __init__(self, ops, g, args: ModelArgs, shard: Shard | None = None):
        self.args, self.shard = args, shard or Shard.whole(args)
        self.w = load_weights(ops, g, args, self.shard)
        self.spec = AttentionSpec.standard(self.shard.n_heads, self.shard.n_kv_heads, args.head_dim)

    def attention(self, ops, x, w, batch, cache, layer: int):
        """x + attention(rms_norm(x)): the residual stream after the layer's attention block."""
        a, sp, groups = self.args, self.spec, batch.rows
        q, k, v = ops.rms_norm_linear_group(x, w.attn_norm, a.rms_eps, w.attn_qkv, groups)
        q = ops.rope(q, batch.positions, sp.n_heads, a.head_dim, a.rope_base, traditional=True,
                     factors=a.rope_factors)
        k = ops.rope(k, batch.positions, sp.n_kv_heads, a.head_dim, a.rope_base, traditional=True,
                     factors=a.rope_factors)
        kv = cache.update(ops, layer, k, v, batch)
        return output_product(ops, ops.fused_attention(q, kv, batch, sp), w.attn_output, groups, self.shard, residual=x)

    def ffn(self, ops, x, w, groups):
        """x + the FFN of rms_norm(x): the residual stream after the layer's FFN block."""
        a = self.args
        if a.n_experts:  # Mixtral
            return ops.add(x, moe_mlp(ops, rms_norm(ops, x, w.ffn_norm, a.rms_eps), w, groups, a.n_experts_used))
        return swiglu_block(ops, x, w, a.rms_eps, groups, self.shard)

    def __call__(self, ops, ids, batch, cache):
        """Logits of the batch's logit rows, [R, vocab]; writes the pass's keys and values to `cache`."""
        a = self.args
        x = ops.gather_rows(self.w.token_embd, ids)
        for i, w in enumerate(self.w.layers):
            x = self.attention(ops, x, w, batch, cache, i)
            x = self.ffn(ops, x, w, batch.rows)
            batch.layer_done(x)
        return output_logits(ops, x, self.w, batch, a.rms_eps, self.shard, a.vocab_size)
