"""Gemma 3 (GGUF architecture `gemma3`): Gemma 2's block (`mlxinfer.models.gemma2`) with these differences.

RMSNorm of each query and key head before RoPE (`attn_q_norm`, `attn_k_norm`, as Qwen3); no attention
soft-capping, final soft-capping only where the file gives it; sliding-window layers only where the file
gives `attention.sliding_window`, five of every six (layer i windowed unless i % 6 == 5, or the file's
`sliding_window_pattern`), with their own RoPE base (`rope.freq_base_swa`, default 10000) and no RoPE
scaling (the linear factor of the 4B-27B files applies to the global layers only, as llama.cpp's
`rope_freq_scale_train_swa` = 1); the 27B's query scale told apart by 62 layers.
"""

from . import gemma2

TRAITS = dict(rope_traditional=False, qk_norm=True, post_norms=True,
              swa=dict(pattern=6, window=None, base_swa=10000.0), softcaps=dict(final=None))


class Model(gemma2.Model):
    layers_27b = 62
    reads_output = True  # `output.weight` where the file has one (llama.cpp's gemma3 reads it)

    def rope_of(self, layer: int):
        a = self.args
        return (a.rope_base_swa, None) if self.specs[layer].window else (a.rope_base, a.rope_factors)

    def queries_and_keys(self, ops, q, k, w, batch, layer: int):
        a, sp = self.args, self.specs[layer]
        base, factors = self.rope_of(layer)
        return ops.qk_norm_rope(q, k, w.attn_q_norm, w.attn_k_norm, batch.positions, sp.n_heads, sp.n_kv_heads,
                                a.head_dim, a.rms_eps, base, traditional=False, factors=factors)
