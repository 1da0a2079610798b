"""The models and prompts of the reference fixtures (shared by make_fixtures.py and the tests)."""

import os

from mlxinfer.synthetic import SyntheticSpec, llama3_rope_factors, rewrite_gguf, write_synthetic_model

# head_dim 48 != hidden / heads = 128 / 4 = 32, untied output head, GQA 2.
QWEN3_SYNTHETIC = SyntheticSpec(arch="qwen3", n_layers=3, hidden=128, ffn=256, n_heads=4, n_kv_heads=2,
                                head_dim=48, vocab_size=384, tied_output=False, qtype="F32", seed=1234)
QWEN3_PROMPT_IDS = [1, 17, 250, 99, 3, 300, 42, 42, 7, 128, 255, 64]
SMOLLM2_PROMPT = "The capital of France is"

# Llama 3: rope_freqs.weight from the llama3 formula (factor 8, low/high frequency factors 1/4, original
# context 8192), base 500000; head_dim 64 gives 15 pairs at 1, 3 interpolated, 14 at 8. GQA 2, untied head (a tied one with random weights repeats the last token).
LLAMA3_SYNTHETIC = SyntheticSpec(arch="llama", n_layers=3, hidden=256, ffn=384, n_heads=4, n_kv_heads=2,
                                 head_dim=64, vocab_size=384, tied_output=False, rope_base=500000.0, rms_eps=1e-5, seed=3131,
                                 rope_freqs=llama3_rope_factors(64, 500000.0))
# The same file with linear RoPE scaling on top (llama.cpp applies both: frequency / factor / 4).
LINEAR_ROPE_EDITS = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
# Qwen2: Q/K/V biases, rotate-half RoPE, base 1e6, untied head, GQA 2.
QWEN2_SYNTHETIC = SyntheticSpec(arch="qwen2", n_layers=3, hidden=128, ffn=256, n_heads=4, n_kv_heads=2,
                                head_dim=32, vocab_size=384, tied_output=False, rope_base=1000000.0, seed=2525)
# Three prompts for the new architectures' fixtures: the first (every position's logits) long enough
# that the slowed RoPE pairs turn measurably (70 positions).
SYNTHETIC_PROMPTS = [[(7 * i + 3) % 380 for i in range(70)], [1, 17, 250, 99, 3, 300, 42], [255, 4, 4, 4, 128]]

# Gemma 3: q/k norms, head_dim 48 != 128 / 4, window 8 on layers 0 and 1 (pattern 3: every third layer
# global) with their own RoPE base 10000, the global layer at base 1e6 with linear scaling 8 (the 4B-27B
# files' scaling, global layers only), untied head (llama.cpp reads output.weight for gemma3; a tied head
# with random weights repeats the last token). Softcapping: none (Gemma 3 has none).
GEMMA3_SYNTHETIC = SyntheticSpec(arch="gemma3", n_layers=3, hidden=128, ffn=256, n_heads=4, n_kv_heads=2,
                                 head_dim=48, vocab_size=384, tied_output=False, rope_base=1000000.0, seed=3335,
                                 sliding_window=8, swa_pattern=3, rope_base_swa=10000.0)
GEMMA3_EDITS = {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
# Gemma 2: window 8 on layers 0 and 2 (the default pattern 2), RoPE base 10000 on them and 1e6 on layer 1,
# attention soft-capping 2 and final 1 (small enough that the synthetic model's scores and logits bend),
# tied head (gemma2's always is) with embeddings of std 0.15 hidden**-0.5 (scaled by sqrt(hidden), rows
# ~0.15: larger ones make every token's own embedding dominate the tied head and the text repeat it);
# logits up to ~0.6, bent by the final cap 1.
GEMMA2_SYNTHETIC = SyntheticSpec(arch="gemma2", n_layers=3, hidden=128, ffn=256, n_heads=4, n_kv_heads=2,
                                 head_dim=48, vocab_size=384, tied_output=True, rope_base=1000000.0, seed=2222,
                                 sliding_window=8, rope_base_swa=10000.0, attn_softcap=2.0, final_softcap=1.0,
                                 embedding_std=0.15 * 128 ** -0.5)

# Phi-3: fused attn_qkv and ffn_up (gate rows first), rotate-half RoPE with long and short factors (16
# pairs: long 1..16, short 1..1.3, as the 128k models' orders of magnitude) and the attention factor the
# converter writes for them, sqrt(1 + ln(scale) / ln(original context)) with scale 4096 / 64; the long
# factors apply (context 4096 > 64, as llama.cpp's 512 > 64). The same file with original context 8192
# takes the short ones (both engines). A sliding window llama.cpp ignores. Untied head.
PHI3_SYNTHETIC = SyntheticSpec(arch="phi3", n_layers=3, hidden=128, ffn=256, n_heads=4, n_kv_heads=2, head_dim=32,
                               vocab_size=384, tied_output=False, rope_base=10000.0, rms_eps=1e-5, seed=3030,
                               rope_long_short=(tuple(1.0 + j for j in range(16)), tuple(1.0 + 0.02 * j for j in range(16))))
PHI3_EDITS = {"phi3.rope.scaling.original_context_length": 64, "phi3.rope.scaling.attn_factor": 2.0 ** 0.5,
              "phi3.attention.sliding_window": 2047,
              "general.name": "synthetic-p-3"}  # a name with "phi3" makes llama.cpp look for Phi-3's "</s>"
PHI3_SHORT_EDITS = {**PHI3_EDITS, "phi3.rope.scaling.original_context_length": 8192}

# Qwen3-MoE: Qwen3's attention (q/k norms, head_dim 48 != 128 / 4), 8 experts of width 64, 2 per row;
# untied head. feed_forward_length (256) is written as the converter does and not used.
QWEN3MOE_SYNTHETIC = SyntheticSpec(arch="qwen3moe", n_layers=3, hidden=128, ffn=256, n_heads=4, n_kv_heads=2,
                                   head_dim=48, vocab_size=384, tied_output=False, seed=4041, n_experts=8,
                                   n_experts_used=2, ffn_expert=64)

# Mixtral (llama with `expert_count`): interleaved RoPE, base 1e6, 8 experts each feed_forward_length (96)
# wide, 2 per row, GQA 2, untied head.
MIXTRAL_SYNTHETIC = SyntheticSpec(arch="llama", n_layers=3, hidden=128, ffn=96, n_heads=4, n_kv_heads=2, head_dim=32,
                                  vocab_size=384, tied_output=False, rope_base=1000000.0, rms_eps=1e-5, seed=5151,
                                  n_experts=8, n_experts_used=2, ffn_expert=96)


def synthetic_files(tmp):
    """The new architectures' all-F32 synthetic files with llama.cpp's names, by fixture name: Llama 3
    (rope_freqs.weight), the same file with linear RoPE scaling on top, Qwen2 (Q/K/V biases), Gemma 3,
    Gemma 2, Phi-3 with its long and with its short factors, Qwen3-MoE, Mixtral (the specs above say what each exercises). The tests write the same files."""
    l3 = write_synthetic_model(os.path.join(tmp, "llama3.gguf"), LLAMA3_SYNTHETIC)
    g3 = write_synthetic_model(os.path.join(tmp, "gemma3_plain.gguf"), GEMMA3_SYNTHETIC)
    p3 = write_synthetic_model(os.path.join(tmp, "phi3_plain.gguf"), PHI3_SYNTHETIC)
    return {"llama3_synthetic": l3,
            "llama3_linear_synthetic": rewrite_gguf(l3, os.path.join(tmp, "llama3_linear.gguf"), edits=LINEAR_ROPE_EDITS),
            "qwen2_synthetic": write_synthetic_model(os.path.join(tmp, "qwen2.gguf"), QWEN2_SYNTHETIC),
            "gemma3_synthetic": rewrite_gguf(g3, os.path.join(tmp, "gemma3.gguf"), edits=GEMMA3_EDITS),
            "gemma2_synthetic": write_synthetic_model(os.path.join(tmp, "gemma2.gguf"), GEMMA2_SYNTHETIC),
            "phi3_synthetic": rewrite_gguf(p3, os.path.join(tmp, "phi3.gguf"), edits=PHI3_EDITS),
            "phi3_short_synthetic": rewrite_gguf(p3, os.path.join(tmp, "phi3_short.gguf"), edits=PHI3_SHORT_EDITS),
            "qwen3moe_synthetic": write_synthetic_model(os.path.join(tmp, "qwen3moe.gguf"), QWEN3MOE_SYNTHETIC),
            "mixtral_synthetic": write_synthetic_model(os.path.join(tmp, "mixtral.gguf"), MIXTRAL_SYNTHETIC)}
