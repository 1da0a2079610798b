"""Synthetic GGUF models with real shapes and random weights, written with `gguf.GGUFWriter`.

Tests and benchmarks use these: the same seed gives the same file, byte for byte, so a fixture computed
by a reference engine on one machine is checked on another by regenerating the file.

    python -m mlxinfer.synthetic out.gguf --arch qwen3 --layers 28 --hidden 1024 --ffn 3072 \
        --heads 16 --kv-heads 8 --head-dim 128 --vocab 151936 --type Q8_0
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from . import quants
from .gguf_file import GGUFFile
from .models import ARCHITECTURES
from .models.spec import BIAS, EMBEDDING, FACTORS, NORM, ModelArgs, tensors
from .tokenizer import byte_level_alphabet

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A few merges so BPE has work to do: (left, right) in byte-level form (Ġ is a space).
_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n"), ("e", "r"), ("o", "n"),
           ("Ġ", "a"), ("r", "e"), ("a", "t"), ("e", "n"), ("Ġ", "s"), ("o", "r"), ("i", "s")]


def synthetic_vocab(vocab_size: int):
    """(tokens, token_types, merges) with `vocab_size` entries: 256 bytes, some merges, filler tokens,
    and ChatML control tokens at the end (as Qwen's vocabulary has them)."""
    tokens = byte_level_alphabet() + [a + b for a, b in _MERGES]
    if vocab_size < len(tokens) + len(CONTROL_TOKENS):
        raise ValueError(f"vocab_size must be at least {len(tokens) + len(CONTROL_TOKENS)}")
    n_normal = len(tokens)
    n_filler = vocab_size - n_normal - len(CONTROL_TOKENS)
    tokens += [f"<|filler_{i}|>" for i in range(n_filler)] + CONTROL_TOKENS
    types = [1] * n_normal + [4] * n_filler + [3] * len(CONTROL_TOKENS)
    return tokens, types, [f"{a} {b}" for a, b in _MERGES]


@dataclass
class SyntheticSpec:
    arch: str = "qwen3"
    n_layers: int = 2
    hidden: int = 64
    ffn: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 320
    context_length: int = 4096
    tied_output: bool = True
    qtype: str = "F32"  # weight matrices; norms stay F32, the embedding takes qtype too; or a MIXES name
    rope_base: float = 1000000.0
    rms_eps: float = 1e-6
    seed: int = 0
    random_blocks: bool = False  # random quantized blocks of qtype, streamed (for 14B-class shapes)
    rope_freqs: tuple | None = None  # written as `rope_freqs.weight` (see llama3_rope_factors)
    rope_long_short: tuple | None = None  # Phi-3: written as `rope_factors_long/short.weight`
    n_experts: int = 0  # Qwen3-MoE: `expert_count`, `expert_used_count`, `expert_feed_forward_length`
    n_experts_used: int = 0
    ffn_expert: int = 0
    # Gemma's, written where given: `attention.sliding_window`, `attention.sliding_window_pattern` (a
    # period), `rope.freq_base_swa`, `attn_logit_softcapping`, `final_logit_softcapping`
    embedding_std: float = 1.0  # Gemma's embeddings are scaled up by sqrt(hidden): hidden**-0.5 keeps rows ~1
    sliding_window: int | None = None
    swa_pattern: int | None = None
    rope_base_swa: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None

    def args(self) -> ModelArgs:
        """The model spec's hyperparameters for this synthetic file (what decides its tensors)."""
        traits = {k: v for k, v in ARCHITECTURES[self.arch].TRAITS.items()
                  if k not in ("swa", "softcaps", "ignored", "moe")}
        return ModelArgs(self.arch, self.n_layers, self.hidden, self.ffn, self.n_heads, self.n_kv_heads,
                         self.head_dim, self.vocab_size, self.context_length, self.rms_eps, self.rope_base,
                         tied_output=self.tied_output, rope_freqs=self.rope_freqs,
                         rope_long_short=self.rope_long_short, n_experts=self.n_experts,
                         n_experts_used=self.n_experts_used, ffn_expert=self.ffn_expert, **traits)


def llama3_rope_factors(head_dim: int, base: float, factor: float = 8.0, low_freq_factor: float = 1.0,
                        high_freq_factor: float = 4.0, original_context: int = 8192) -> tuple:
    """Llama 3's `rope_freqs.weight` as llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel) computes
    it from the HF config's `rope_scaling` (rope_type llama3; the defaults are Llama 3.1's): pairs whose
    wavelength is below original_context / high_freq_factor keep their frequency (1), those above
    original_context / low_freq_factor are slowed by `factor`, and those between are interpolated."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / float(freq)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(float(np.float32(f)) for f in out)


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's `use_more_bits` (llama-quant.cpp): the first and last eighth of the layers and every
    third layer between get the larger type in the _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _mix(base: GGMLQuantizationType, more: GGMLQuantizationType):
    """A llama.cpp K-quant mix as its quantizer assigns types (llama_tensor_get_type, dense models whose
    rows are multiples of 256): the output head (the embedding when tied) Q6_K, `attn_v` and `ffn_down`
    `more` in the layers `_more_bits` picks, every other matrix `base`."""
    def qtype(name: str, layer: int | None, n_layers: int, is_head: bool) -> GGMLQuantizationType:
        if is_head:
            return GGMLQuantizationType.Q6_K
        if layer is not None and (".attn_v." in name or ".ffn_down." in name) and _more_bits(layer, n_layers):
            return more
        return base
    return qtype


Q = GGMLQuantizationType
# file-type names -> per-tensor type, for --random-blocks files shaped like what users download (the
# mix llama.cpp's quantizer gives; tests/test_quantized_files.py checks it against llama.cpp's own files)
MIXES = {"Q4_K_M": _mix(Q.Q4_K, Q.Q6_K), "Q5_K_M": _mix(Q.Q5_K, Q.Q6_K)}
MIX_FILE_TYPES = {"Q4_K_M": 15, "Q5_K_M": 17}  # llama_ftype: LLAMA_FTYPE_MOSTLY_Q4_K_M, _Q5_K_M


def _tensor(rng, shape, std):
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def _add(writer, name, data, qtype: GGMLQuantizationType):
    if qtype == GGMLQuantizationType.F32 or data.ndim == 1:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    else:
        writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)


def _norm_values(rng, n: int) -> np.ndarray:
    """A norm weight vector: 1 + 0.1 N(0, 1)."""
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _random_q8_0(rng, shape, std) -> np.ndarray:
    """Q8_0 blocks drawn directly, not quantized from floats: per 32 values an fp16 scale std/73.6 and
    32 uniform int8 quants (their std is ~73.6), so the values have about the asked std. Written this
    way a 15 GB Qwen3-14B-shaped file takes seconds instead of an hour of float quantization."""
    rows, cols = shape
    n_blocks = rows * cols // 32
    out = rng.integers(0, 256, size=(n_blocks, 34), dtype=np.uint8)
    out[:, :2] = np.full(n_blocks, std / 73.6, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    return out.reshape(rows, cols // 32 * 34)


def write_synthetic_model(path, spec: SyntheticSpec | None = None, **overrides) -> str:
    """Write a random-weight model of `spec`'s shape to `path`; returns the path."""
    spec = spec or SyntheticSpec()
    for k, v in overrides.items():
        setattr(spec, k, v)
    a = spec.arch
    if a not in ARCHITECTURES:
        raise ValueError(f"synthetic models are {', '.join(ARCHITECTURES)}, not {a!r}")
    if spec.qtype in MIXES and not spec.random_blocks:
        raise ValueError(f"{spec.qtype} (a mix of types) is written with random blocks only")
    qtype = GGMLQuantizationType.F16 if spec.qtype in MIXES else GGMLQuantizationType[spec.qtype]
    rng = np.random.default_rng(spec.seed)
    h, d = spec.hidden, spec.head_dim
    w = GGUFWriter(str(path), a)
    w.add_name(f"synthetic-{a}-{spec.n_layers}L-{h}")
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(h)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    if d != h // spec.n_heads:
        w.add_key_length(d)
        w.add_value_length(d)
    w.add_rope_freq_base(spec.rope_base)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    for key, value in (("attention.sliding_window", spec.sliding_window),
                       ("attention.sliding_window_pattern", spec.swa_pattern), ("expert_count", spec.n_experts or None),
                       ("expert_used_count", spec.n_experts_used or None),
                       ("expert_feed_forward_length", (spec.ffn_expert or None) if a != "llama" else None)):
        if value is not None:
            w.add_uint32(f"{a}.{key}", value)
    for key, value in (("rope.freq_base_swa", spec.rope_base_swa), ("attn_logit_softcapping", spec.attn_softcap),
                       ("final_logit_softcapping", spec.final_softcap)):
        if value is not None:
            w.add_float32(f"{a}.{key}", value)
    w.add_file_type(MIX_FILE_TYPES.get(spec.qtype, int(qtype) if qtype != GGMLQuantizationType.F32 else 0))
    tokens, types, merges = synthetic_vocab(spec.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(spec.vocab_size - 3)
    w.add_eos_token_id(spec.vocab_size - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)

    # Every tensor of the model spec, in file order: norms 1 + 0.1 N(0, 1), the embedding N(0, 1),
    # matrices N(0, 1/in_features), biases N(0, 0.5^2) (Qwen2's are of that order and larger), the RoPE
    # factors as given.
    if spec.random_blocks:
        if qtype == GGMLQuantizationType.F32:
            raise ValueError("random blocks are written for a quantized or 16-bit type, not F32")
        if spec.args().qkv_bias or spec.rope_freqs or spec.rope_long_short or spec.embedding_std != 1.0:
            raise ValueError("random blocks are written for matrices and norms only (no biases or RoPE factors)")
        return _write_random_blocks(w, spec, rng, str(path))
    for t, _, name, _, shape in tensors(spec.args()):
        if t.kind == NORM:
            data = _norm_values(rng, shape[0])
        elif t.kind == BIAS:
            data = _tensor(rng, shape, 0.5)
        elif t.kind == FACTORS:
            long_short = dict(zip(("rope_long", "rope_short"), spec.rope_long_short or ()))
            data = np.array(long_short.get(t.key, spec.rope_freqs), dtype=np.float32)
        else:
            data = _tensor(rng, shape, spec.embedding_std if t.kind == EMBEDDING else shape[-1] ** -0.5)
        _add(w, name, data, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _write_random_blocks(w: GGUFWriter, spec: SyntheticSpec, rng, path: str) -> str:
    """The tensors as random blocks of the spec's type, or of each tensor's type in a MIXES file
    (`_random_q8_0`, else `quants.random_blocks`; norms as usual), each made and written in turn: memory
    holds one tensor at a time."""
    args = spec.args()
    specs = list(tensors(args))
    mix = MIXES.get(spec.qtype, lambda *_: GGMLQuantizationType[spec.qtype])
    head = "output.weight" if not spec.tied_output else "token_embd.weight"
    types = {name: mix(name, layer, spec.n_layers, name == head) for t, layer, name, _, _ in specs if t.kind != NORM}
    for t, _, name, _, shape in specs:
        if t.kind == NORM:
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:  # matrices and [experts, out, in] stacks: rows of blocks
            block, size = GGML_QUANT_SIZES[types[name]]
            row = shape[-1] // block * size
            rows = int(np.prod(shape[:-1]))
            w.add_tensor_info(name, (*shape[:-1], row), np.dtype(np.uint8), rows * row, raw_dtype=types[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t, _, name, _, shape in specs:
        if t.kind == NORM:
            w.write_tensor_data(_norm_values(rng, shape[0]))
        else:
            std = 1.0 if t.kind == EMBEDDING else shape[-1] ** -0.5
            rows = int(np.prod(shape[:-1]))
            if types[name] == GGMLQuantizationType.Q8_0:
                w.write_tensor_data(_random_q8_0(rng, (rows, shape[-1]), std))
            else:
                w.write_tensor_data(quants.random_blocks(rng, types[name], rows, shape[-1], std=std))
    w.close()
    return path


def _add_metadata(w: GGUFWriter, key: str, v) -> None:
    """One metadata value, typed as our reader returned it."""
    from gguf import GGUFValueType as T

    if isinstance(v, np.ndarray):
        etype = {np.dtype(np.int32): T.INT32, np.dtype(np.float32): T.FLOAT32, np.dtype(np.uint32): T.UINT32,
                 np.dtype(np.int64): T.INT64, np.dtype(np.uint8): T.UINT8, np.dtype(np.bool_): T.BOOL}[v.dtype]
        w.add_key_value(key, v.tolist(), T.ARRAY, sub_type=etype)
    elif isinstance(v, bool):
        w.add_bool(key, v)
    elif isinstance(v, int):
        w.add_uint32(key, v) if 0 <= v < 2**32 else w.add_int64(key, v)
    elif isinstance(v, float):
        w.add_float32(key, v)
    elif isinstance(v, str):
        w.add_string(key, v)
    else:
        w.add_array(key, v)


def rewrite_gguf(src, dst, *, edits: dict | None = None, drop_tensors=(), tensors: bool = True,
                 f32: bool = False, add_tensors: dict | None = None) -> str:
    """Copy a GGUF file through the writer: metadata with `edits` applied (a value of None drops the
    key), tensors as stored (or dequantized to F32 with `f32`), minus `drop_tensors`, plus `add_tensors`
    (name -> float32 array); `tensors=False` writes a vocabulary-only file. Reference fixtures and
    malformed-file tests are made with it."""
    from gguf import GGMLQuantizationType as Q

    edits = edits or {}
    with GGUFFile(src) as g:
        w = GGUFWriter(str(dst), g.architecture)
        meta = {**g.metadata, **edits}
        for k, v in meta.items():
            if k != "general.architecture" and v is not None:
                _add_metadata(w, k, v)
        for name, t in (g.tensors.items() if tensors else ()):
            if name in drop_tensors:
                continue
            if f32 or t.ggml_type in (Q.F32, Q.F16):
                w.add_tensor(name, np.ascontiguousarray(g.dequantize(name), dtype=np.float32))
            else:
                rows = t.n_elements // t.shape[-1]
                w.add_tensor(name, np.array(g.raw(name)).reshape(rows, -1), raw_dtype=t.ggml_type)
        for name, data in (add_tensors or {}).items():
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return str(dst)


def write_f32_copy(src, dst) -> str:
    """A copy of a GGUF model with every tensor dequantized to F32 (same metadata): what a reference
    engine runs to compare against our dequantize-then-float32 arithmetic without its own quantized
    dot products."""
    return rewrite_gguf(src, dst, edits={"general.file_type": 0}, f32=True)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlxinfer.synthetic", description="Write a synthetic random-weight GGUF "
                                "model (a tied output head repeats its input's last token: --untied for varied text).")
    p.add_argument("path")
    p.add_argument("--arch", default="qwen3", choices=sorted(ARCHITECTURES))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--vocab", type=int, default=320)
    p.add_argument("--untied", action="store_true")
    p.add_argument("--type", default="F32", help="F32, F16, Q8_0, Q4_0, Q4_1, ..., or (with --random-blocks) "
                   f"a mix llama.cpp's quantizer makes: {', '.join(MIXES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama3-rope", action="store_true",
                   help="write rope_freqs.weight as Llama 3.1 ships it (factor 8, low/high 1/4, context 8192)")
    p.add_argument("--rope-base", type=float, default=None, help="rope.freq_base (default 1e6; 5e5 with --llama3-rope)")
    p.add_argument("--sliding-window", type=int, default=None, help="Gemma: attention.sliding_window")
    p.add_argument("--swa-pattern", type=int, default=None, help="Gemma: attention.sliding_window_pattern (a period)")
    p.add_argument("--rope-base-swa", type=float, default=None, help="Gemma: rope.freq_base_swa")
    p.add_argument("--attn-softcap", type=float, default=None, help="Gemma 2: attn_logit_softcapping")
    p.add_argument("--final-softcap", type=float, default=None, help="Gemma: final_logit_softcapping")
    p.add_argument("--experts", type=int, nargs=3, default=None, metavar=("N", "USED", "WIDTH"),
                   help="Qwen3-MoE (--arch qwen3moe) or Mixtral (--arch llama): experts, experts used per token, an "
                        "expert's FFN width (Mixtral's must equal --ffn)")
    p.add_argument("--random-blocks", action="store_true",
                   help="draw --type's blocks directly, random (fast, streamed; for large shapes)")
    a = p.parse_args(argv)
    if a.random_blocks and a.type == "F32":
        p.error("--random-blocks needs a quantized or 16-bit --type")
    if a.llama3_rope and a.arch != "llama":
        p.error("--llama3-rope is Llama 3's (--arch llama)")
    gemma = dict(sliding_window=a.sliding_window, swa_pattern=a.swa_pattern, rope_base_swa=a.rope_base_swa,
                 attn_softcap=a.attn_softcap, final_softcap=a.final_softcap)
    if not a.arch.startswith("gemma") and any(v is not None for v in gemma.values()):
        p.error("--sliding-window, --swa-pattern, --rope-base-swa and the soft-caps are Gemma's (--arch gemma2, gemma3)")
    if (a.arch == "qwen3moe" and a.experts is None) or (a.experts and a.arch not in ("qwen3moe", "llama")):
        p.error("--arch qwen3moe needs --experts N USED WIDTH (and only it and llama take them)")
    if a.experts and a.arch == "llama" and a.experts[2] != a.ffn:
        p.error("Mixtral (--arch llama --experts): an expert's width is --ffn")
    experts = dict(zip(("n_experts", "n_experts_used", "ffn_expert"), a.experts or (0, 0, 0)))
    base = a.rope_base or (500000.0 if a.llama3_rope else 1000000.0)
    factors = llama3_rope_factors(a.head_dim, base) if a.llama3_rope else None
    spec = SyntheticSpec(a.arch, a.layers, a.hidden, a.ffn, a.heads, a.kv_heads, a.head_dim, a.vocab,
                         tied_output=not a.untied, qtype=a.type, seed=a.seed, random_blocks=a.random_blocks,
                         rope_base=base, rope_freqs=factors, **gemma, **experts)
    if a.type not in MIXES and a.type not in GGMLQuantizationType.__members__:
        p.error(f"--type {a.type} is not a GGML type ({', '.join(GGMLQuantizationType.__members__)}) or a mix "
                f"({', '.join(MIXES)})")
    block = 256 if a.type in MIXES else GGML_QUANT_SIZES[GGMLQuantizationType[a.type]][0]
    widths = sorted({shape[-1] for *_, shape in tensors(spec.args()) if len(shape) == 2 and shape[-1] % block})
    if widths:
        p.error(f"--type {a.type} stores rows in blocks of {block} values: rows of {', '.join(map(str, widths))} "
                f"values (--hidden, --ffn, --heads x --head-dim) are not whole blocks")
    if not a.random_blocks and a.type not in MIXES and a.type != "F32":
        try:
            quantize(np.zeros((1, block), np.float32), GGMLQuantizationType[a.type])
        except NotImplementedError:
            p.error(f"--type {a.type}: gguf-py does not quantize it; write its blocks with --random-blocks")
    write_synthetic_model(a.path, spec)
    print(a.path)


if __name__ == "__main__":
    main()
