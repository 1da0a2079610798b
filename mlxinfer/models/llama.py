"""Llama (GGUF architecture `llama`; SmolLM2 among others).

llama.cpp's converter permutes the rows of `attn_q` and `attn_k` so that each head's rotary pairs are
interleaved, (x[2i], x[2i+1]), instead of HF's halves (x[i], x[i + d/2]). We read the file as stored and
apply the matching interleaved RoPE (`rope_traditional=True`), exactly as llama.cpp does; no un-permute.
No q/k norm; output head tied to the embedding unless `output.weight` is present.
"""

from .layers import DecoderModel, TransformerArgs


def load(ops, g) -> DecoderModel:
    args = TransformerArgs.from_gguf(g, rope_traditional=True, qk_norm=False)
    return DecoderModel(ops, g, args)
