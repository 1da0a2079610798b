"""Gemma 2 (GGUF architecture `gemma2`).

Differences from Llama: the embedding scaled by sqrt(hidden) (float32, as llama.cpp's `sqrtf(n_embd)`);
RMSNorm of the attention output and of the FFN output before each residual add (`post_attention_norm`,
`post_ffw_norm`); a GeGLU MLP (GELU, tanh approximation); the query scaled before attention by llama.cpp's
`f_attention_scale` (1/sqrt(head_dim); 1/sqrt(hidden/heads) for the 27B, told apart by its layer count,
as llama.cpp does: Gemma's `query_pre_attn_scalar` is not in the file), the scores then unscaled;
attention scores and final logits soft-capped, cap * tanh(x / cap) (`attn_logit_softcapping`, default
50; `final_logit_softcapping`, default 30); sliding-window layers (`attention.sliding_window`, default
4096) alternating with global ones, layer i windowed where i % 2 == 0, with `rope.freq_base_swa` (default
the global base); rotate-half RoPE; the output head is the embedding. Gemma's RMSNorm weights (1 + w)
are stored by llama.cpp's converter with the 1 added, so the norms are plain RMSNorm here.
"""

import numpy as np

from ..backend import AttentionSpec
from ..errors import UnsupportedError
from .layers import all_sum, gelu_mlp, output_logits, rms_norm, softcap
from .shard import Shard
from .spec import ModelArgs, load_weights

TRAITS = dict(rope_traditional=False, qk_norm=False, post_norms=True,
              swa=dict(pattern=2, window=4096), softcaps=dict(attn=50.0, final=30.0))
LAYERS_27B = 46  # llama.cpp's test for the 27B's query scale


def f32(x) -> float:
    return float(np.float32(x))


class Model:
    layers_27b = LAYERS_27B
    reads_output = False  # llama.cpp's gemma2 multiplies by the embedding whatever the file holds

    def __init__(self, ops, g, args: ModelArgs, shard: Shard | None = None):
        if not args.tied_output and not self.reads_output:
            raise UnsupportedError(f"{g.path}: tensor 'output.weight' is not supported for {args.arch}: its output "
                                   "head is the embedding (llama.cpp does not read it either)")
        self.args, self.shard = a, sh = args, shard or Shard.whole(args)
        self.w = load_weights(ops, g, args, sh)
        head_scale = a.head_dim if a.n_layers != self.layers_27b else a.hidden // a.n_heads
        self.q_scale = f32(np.float32(1.0) / np.sqrt(np.float32(head_scale)))
        self.embed_scale = f32(np.sqrt(np.float32(a.hidden)))
        self.specs = [AttentionSpec(sh.n_heads, sh.n_kv_heads, a.head_dim, 1.0, True,
                                    a.sliding_window if i < len(a.swa_layers) and a.swa_layers[i] else None,
                                    a.attn_softcap) for i in range(a.n_layers)]

    def rope_of(self, layer: int):
        """(base, factors) of a layer's RoPE: the sliding-window layers' base, the same scaling."""
        a = self.args
        return (a.rope_base_swa, a.rope_factors) if self.specs[layer].window else (a.rope_base, a.rope_factors)

    def queries_and_keys(self, ops, q, k, w, batch, layer: int):
        a, sp = self.args, self.specs[layer]
        base, factors = self.rope_of(layer)
        q = ops.rope(q, batch.positions, sp.n_heads, a.head_dim, base, traditional=False, factors=factors)
        k = ops.rope(k, batch.positions, sp.n_kv_heads, a.head_dim, base, traditional=False, factors=factors)
        return q, k

    def attention(self, ops, x, w, batch, cache, layer: int):
        q, k, v = ops.linear_group(x, w.attn_qkv, batch.rows)
        q, k = self.queries_and_keys(ops, q, k, w, batch, layer)
        q = ops.scale(q, self.q_scale)
        kv = cache.update(ops, layer, k, v, batch)
        out = ops.linear(ops.fused_attention(q, kv, batch, self.specs[layer]), w.attn_output, batch.rows)
        return all_sum(ops, out, self.shard)

    def __call__(self, ops, ids, batch, cache):
        """Logits of the batch's logit rows, [R, vocab]; writes the pass's keys and values to `cache`."""
        a, eps = self.args, self.args.rms_eps
        x = ops.scale(ops.gather_rows(self.w.token_embd, ids), self.embed_scale)
        for i, w in enumerate(self.w.layers):
            h = self.attention(ops, rms_norm(ops, x, w.attn_norm, eps), w, batch, cache, i)
            x = ops.add(x, rms_norm(ops, h, w.attn_post_norm, eps))
            h = gelu_mlp(ops, rms_norm(ops, x, w.ffn_norm, eps), w, batch.rows, self.shard)
            x = ops.add(x, rms_norm(ops, h, w.ffn_post_norm, eps))
            batch.layer_done(x)
        logits = output_logits(ops, x, self.w, batch, eps, self.shard, a.vocab_size)
        return logits if logits is None or not a.final_softcap else softcap(ops, logits, a.final_softcap)
