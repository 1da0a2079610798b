"""The models and prompts of the reference fixtures (shared by make_fixtures.py and the tests)."""

from mlxinfer.synthetic import SyntheticSpec, llama3_rope_factors

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
