"""Qwen3-MoE (GGUF architecture `qwen3moe`; Qwen3-30B-A3B, Qwen3-235B-A22B).

Differences from Qwen3: the FFN is a mixture of experts. The router `ffn_gate_inp` gives each row one
logit per expert; `Backend.moe_mlp` takes the `expert_used_count` experts of largest softmax probability,
weights them by those probabilities normalized to sum 1, and adds their SwiGLU outputs (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`: [experts, out, in] stacks, in the file's type on MLX (`ExpertStack`),
float32 on the cpu backend), as llama.cpp's build_moe_ffn does for this architecture (softmax gating,
normalized weights, no scale). Tensor parallelism refuses it in one line (models/shard.py).
"""

from .layers import moe_mlp, output_logits, rms_norm
from .qwen3 import Model as Qwen3

TRAITS = dict(rope_traditional=False, qk_norm=True, moe=True)


class Model(Qwen3):
    def __call__(self, ops, ids, batch, cache):
        """Logits of the batch's logit rows, [R, vocab]; writes the pass's keys and values to `cache`."""
        a = self.args
        x = ops.gather_rows(self.w.token_embd, ids)
        for i, w in enumerate(self.w.layers):
            x = self.attention(ops, x, w, batch, cache, i)
            x = ops.add(x, moe_mlp(ops, rms_norm(ops, x, w.ffn_norm, a.rms_eps), w, batch.rows, a.n_experts_used))
            batch.layer_done(x)
        return output_logits(ops, x, self.w, batch, a.rms_eps, self.shard, a.vocab_size)
