"""The models and prompts of the reference fixtures (shared by make_fixtures.py and the tests)."""

from mlxinfer.synthetic import SyntheticSpec

# head_dim 48 != hidden / heads = 128 / 4 = 32, untied output head, GQA 2.
QWEN3_SYNTHETIC = SyntheticSpec(arch="qwen3", n_layers=3, hidden=128, ffn=256, n_heads=4, n_kv_heads=2,
                                head_dim=48, vocab_size=384, tied_output=False, qtype="F32", seed=1234)
QWEN3_PROMPT_IDS = [1, 17, 250, 99, 3, 300, 42, 42, 7, 128, 255, 64]
SMOLLM2_PROMPT = "The capital of France is"
