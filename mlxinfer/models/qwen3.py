"""Qwen3 (GGUF architecture `qwen3`).

Differences from Llama: RMSNorm of each query and key head before RoPE (`attn_q_norm`, `attn_k_norm`,
weights of length head_dim), rotate-half RoPE on the GGUF layout as stored (Qwen GGUFs are not
permuted), head_dim from `qwen3.attention.key_length` (128 in Qwen3-0.6B, while hidden/heads = 64),
output head tied to the embedding unless `output.weight` is present.
"""

from .layers import DecoderModel, TransformerArgs


def load(ops, g) -> DecoderModel:
    args = TransformerArgs.from_gguf(g, rope_traditional=False, qk_norm=True)
    return DecoderModel(ops, g, args)
