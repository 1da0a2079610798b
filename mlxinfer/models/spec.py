"""The GGUF model spec: hyperparameters, tensor names and shapes, and their validation, in one place.

The models load their weights through it, the synthetic writer writes files from it, and
`mlxinfer/peers.py` maps it to mlx-lm's (Hugging Face) names. An architecture adds its traits (RoPE layout,
per-head q/k norms) and, where it has extra tensors, entries in `LAYER_TENSORS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import numpy as np

from ..errors import GGUFError, UnsupportedError
from ..gguf_file import ShardedGGUF

MATRIX, NORM, EMBEDDING, BIAS, FACTORS = "matrix", "norm", "embedding", "bias", "factors"
MAX_CONTEXT = 2**31 - 1  # positions are int32 wherever a cache or a kernel indexes them
FUSED = "fused"  # a matrix of several products' rows, loaded as their group through `fused_view`
EXPERTS = "experts"  # a [experts, out, in] stack (`Backend.load_experts`)


@dataclass
class ModelArgs:
    """Hyperparameters of the decoder-only architectures, read from `{arch}.*` GGUF keys."""

    arch: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    rope_traditional: bool  # interleaved pairs (Llama GGUF) vs rotate-half (Qwen)
    qk_norm: bool
    tied_output: bool
    qkv_bias: bool = False  # biases added to the Q, K and V products (Qwen2)
    reads_rope_freqs: bool = False  # the architecture applies `rope_freqs.weight` (llama.cpp's llama does)
    rope_freqs: tuple | None = None  # that tensor's values: per-pair divisors of the RoPE frequencies
    rope_scale: float = 1.0  # linear RoPE scaling's factor: every frequency divided by it
    fused: bool = False  # Phi-3: Q, K, V in one `attn_qkv` matrix, gate and up in one `ffn_up` (gate first)
    rope_long_short: tuple | None = None  # Phi-3's (long, short) RoPE factors (`rope_factors_long/short.weight`)
    rope_original_context: int = 0  # the long factors apply where context_length exceeds it, as llama.cpp
    rope_attn_factor: float = 1.0  # every rotation's cos and sin multiplied by it (`rope.scaling.attn_factor`)
    n_experts: int = 0  # Qwen3-MoE: experts per layer (`expert_count`; 0: a dense FFN)
    n_experts_used: int = 0  # experts each row takes (`expert_used_count`)
    ffn_expert: int = 0  # an expert's FFN width (`expert_feed_forward_length`, else ffn / experts used)
    post_norms: bool = False  # Gemma: RMSNorm of the attention and FFN outputs before each residual add
    sliding_window: int | None = None  # keys a sliding-window layer's query sees, itself included
    swa_layers: tuple = ()  # per layer, True where it attends within `sliding_window` (empty: none does)
    rope_base_swa: float | None = None  # the sliding-window layers' RoPE base
    attn_softcap: float | None = None  # attention scores capped to cap * tanh(score / cap) (Gemma 2)
    final_softcap: float | None = None  # logits capped the same way
    extra_keys: frozenset = field(default=frozenset(), repr=False, compare=False)  # `{arch}.` keys read besides READ_KEYS
    rope_factors: tuple | None = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        """`rope_factors`: what divides each rotary pair's frequency (`Backend.rope`'s `factors`), Llama 3's
        factors times the linear scaling factor; None where every one is 1. Computed once: the forward
        pass hands it to every rope call."""
        self.rope_factors = None
        if self.rope_long_short is not None:  # llama.cpp: long where its context exceeds the original one
            self.rope_freqs = self.rope_long_short[self.context_length <= self.rope_original_context]
        if self.rope_freqs is not None or self.rope_scale != 1.0:
            freqs = self.rope_freqs or (1.0,) * (self.head_dim // 2)
            self.rope_factors = tuple(f * self.rope_scale for f in freqs)

    @classmethod
    def from_gguf(cls, g, *, rope_traditional: bool, qk_norm: bool, qkv_bias: bool = False,
                  reads_rope_freqs: bool = False, post_norms: bool = False, swa: dict | None = None,
                  softcaps: dict | None = None, fused: bool = False, ignored: dict | None = None,
                  moe: bool | str = False) -> "ModelArgs":
        """`swa` (architectures with sliding-window layers): llama.cpp's defaults for what the file may
        leave out, `pattern` (every pattern-th layer global, the others windowed), `window` (None: no
        sliding window unless the file gives one) and `base_swa` (None: the global base). `fused`: Phi-3's
        fused matrices and its long/short RoPE factors with their attention factor. `ignored`: `{arch}.`
        keys the architecture reads and does not apply, with the reason (llama.cpp ignores them too).
        `moe`: a mixture-of-experts FFN (`_experts`): True always (an expert's width
        `expert_feed_forward_length`, else ffn / experts used, as llama.cpp's qwen3moe), "optional" where
        the file has `expert_count` (llama: Mixtral, each expert feed_forward_length wide).
        `softcaps`: the soft-cappings the architecture applies, `attn` and/or `final`, each with its default (None:
        off unless the file gives it); the keys of those it does not apply are refused
        (`check_nothing_unread`)."""
        a = g.architecture

        def req(key):
            v = g.require(f"{a}.{key}", int)
            if v <= 0:
                raise GGUFError(f"{g.path}: {a}.{key} = {v} must be positive")
            return v

        n_heads = req("attention.head_count")
        n_kv = g.get(f"{a}.attention.head_count_kv", n_heads, int)
        hidden = req("embedding_length")
        if n_kv <= 0 or n_heads % n_kv:
            raise GGUFError(
                f"{g.path}: {a}.attention.head_count {n_heads} is not a multiple of head_count_kv {n_kv}"
            )
        head_dim = g.get(f"{a}.attention.key_length", hidden // n_heads, int)
        value_dim = g.get(f"{a}.attention.value_length", head_dim, int)
        if value_dim != head_dim:
            raise GGUFError(f"{g.path}: key_length {head_dim} != value_length {value_dim} is not supported")
        if head_dim <= 0 or head_dim % 2:
            raise GGUFError(f"{g.path}: head dimension {head_dim!r} must be a positive even number")
        rope_dims = g.get(f"{a}.rope.dimension_count", head_dim, int)
        if rope_dims != head_dim:
            raise GGUFError(f"{g.path}: partial rotary embedding ({a}.rope.dimension_count {rope_dims} "
                            f"!= head dim {head_dim}) is not supported")
        emb = g.tensor("token_embd.weight")
        if len(emb.shape) != 2 or emb.shape[1] != hidden:
            raise GGUFError(
                f"{g.path}: tensor 'token_embd.weight' has shape {list(emb.shape)}, expected [vocab, {hidden}]"
            )
        vocab = emb.shape[0]
        meta_vocab = g.get(f"{a}.vocab_size", None, int)
        if meta_vocab is not None and meta_vocab != vocab:
            raise GGUFError(f"{g.path}: {a}.vocab_size {meta_vocab} != token_embd.weight rows {vocab}")
        eps = g.require(f"{a}.attention.layer_norm_rms_epsilon", float)
        base = g.get(f"{a}.rope.freq_base", 10000.0, (int, float))
        for key, value in (("attention.layer_norm_rms_epsilon", eps), ("rope.freq_base", base)):
            if not math.isfinite(value) or value <= 0:
                raise GGUFError(f"{g.path}: {a}.{key} = {value!r} is not a positive finite number")
        n_layers = req("block_count")
        window, swa_layers, base_swa = _sliding_window(g, n_layers, base, swa) if swa else (None, (), None)
        caps = {kind: _softcap(g, f"{kind}_logit_softcapping", default) for kind, default in (softcaps or {}).items()}
        extra = (SWA_KEYS if swa else ()) + tuple(f"{kind}_logit_softcapping" for kind in caps) + tuple(ignored or ())
        ctx = req("context_length")
        if ctx > MAX_CONTEXT:  # (refused here, at load: no cache could index its positions)
            raise GGUFError(f"{g.path}: {a}.context_length = {ctx} is past the {MAX_CONTEXT} positions a KV cache "
                            "can index (int32)")
        ffn = req("feed_forward_length")
        optional = moe == "optional"
        moe = moe is True or (optional and f"{a}.expert_count" in g.metadata)
        experts = _experts(g, ffn, ffn if optional else None) if moe else (0, 0, 0)
        extra += MOE_KEYS if moe else ()
        long_short = _rope_long_short(g, head_dim) if fused else None
        rope_scale, attn_factor = _rope_scale(g, attn_factor=long_short is not None)
        return cls(
            arch=a,
            n_layers=n_layers,
            hidden=hidden,
            ffn=ffn,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            vocab_size=vocab,
            context_length=ctx,
            rms_eps=float(eps),
            rope_base=float(base),
            rope_traditional=rope_traditional,
            qk_norm=qk_norm,
            tied_output="output.weight" not in g.tensors,
            qkv_bias=qkv_bias,
            reads_rope_freqs=reads_rope_freqs,
            rope_freqs=_rope_freqs(g, head_dim) if reads_rope_freqs and "rope_freqs.weight" in g.tensors else None,
            rope_scale=rope_scale,
            fused=fused,
            rope_long_short=long_short,
            rope_original_context=g.get(f"{a}.rope.scaling.original_context_length", ctx, int),
            rope_attn_factor=attn_factor,
            n_experts=experts[0],
            n_experts_used=experts[1],
            ffn_expert=experts[2],
            post_norms=post_norms,
            sliding_window=window,
            swa_layers=swa_layers,
            rope_base_swa=base_swa,
            attn_softcap=caps.get("attn"),
            final_softcap=caps.get("final"),
            extra_keys=frozenset(extra),
        )


SWA_KEYS = ("attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa")


MOE_KEYS = ("expert_count", "expert_used_count", "expert_feed_forward_length")


def _experts(g, ffn: int, width: int | None = None) -> tuple[int, int, int]:
    """(experts, experts used per row, an expert's FFN width), as llama.cpp reads them: the width given
    (llama), else `expert_feed_forward_length`, else ffn / experts used (qwen3moe)."""
    a = g.architecture
    n, used = g.require(f"{a}.expert_count", int), g.require(f"{a}.expert_used_count", int)
    if not 0 < used <= n:
        raise GGUFError(f"{g.path}: {a}.expert_used_count {used} must be between 1 and expert_count {n}")
    given = g.get(f"{a}.expert_feed_forward_length", 0, int)
    if width and given and given != width:
        raise GGUFError(f"{g.path}: {a}.expert_feed_forward_length {given} differs from the experts' width "
                        f"{width} ({a}'s experts are feed_forward_length wide)")
    width = width or given or ffn // used
    if width <= 0:
        raise GGUFError(f"{g.path}: {a}.expert_feed_forward_length {width} must be positive")
    return n, used, width


def _sliding_window(g, n_layers: int, base: float, defaults: dict):
    """(window, which layers use it, their RoPE base) as llama.cpp reads them: `attention.sliding_window`
    (absent or 0: no windowed layer, unless the architecture has a default), `sliding_window_pattern`
    either one flag per layer or a period n (layer i windowed unless i % n == n - 1; 0: every layer),
    `rope.freq_base_swa` (absent: the architecture's default, or the global base)."""
    a = g.architecture
    window = g.get(f"{a}.attention.sliding_window", defaults.get("window"), int)
    if window is not None and window < 0:
        raise GGUFError(f"{g.path}: {a}.attention.sliding_window = {window} is negative")
    pattern = g.metadata.get(f"{a}.attention.sliding_window_pattern", defaults["pattern"])
    if isinstance(pattern, (bool, np.bool_)) or not isinstance(pattern, (int, np.integer)):
        flags = np.asarray(pattern)
        if flags.dtype.kind not in "biu" or flags.shape != (n_layers,):
            raise GGUFError(f"{g.path}: {a}.attention.sliding_window_pattern must be a period or {n_layers} "
                            f"booleans (one per layer), not {_short(pattern)}")
        layers = tuple(bool(f) for f in flags)  # nonzero: windowed, as llama.cpp reads it
    else:
        if pattern < 0:
            raise GGUFError(f"{g.path}: {a}.attention.sliding_window_pattern = {pattern} is negative")
        layers = tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers))
    if not window:
        return None, (), None
    base_swa = g.get(f"{a}.rope.freq_base_swa", defaults.get("base_swa") or base, (int, float))
    if not math.isfinite(base_swa) or base_swa <= 0:
        raise GGUFError(f"{g.path}: {a}.rope.freq_base_swa = {base_swa!r} is not a positive finite number")
    return int(window), layers, float(base_swa)


def _softcap(g, key: str, default):
    """A soft-capping value (`{arch}.{key}`, else the architecture's default); 0 or absent: none."""
    a = g.architecture
    cap = g.get(f"{a}.{key}", default, (int, float))
    if cap is not None and (not math.isfinite(cap) or cap < 0):
        raise GGUFError(f"{g.path}: {a}.{key} = {cap!r} is not a positive finite number")
    return float(cap) if cap else None


# llama.cpp's `rope.scaling.type` values: what each asks of the forward pass. "linear" (llama.cpp's
# default when the key is absent) divides every frequency by `rope.scaling.factor`; the others are refused.
ROPE_SCALING = {"none": "no scaling", "linear": "linear", "yarn": "YaRN", "longrope": "LongRoPE"}


def _rope_scale(g, attn_factor: bool = False) -> tuple[float, float]:
    """(the linear RoPE scaling factor, the attention factor), read as llama.cpp reads them:
    `rope.scaling.factor` (or the old `rope.scale_linear`), 0 or absent meaning 1; scaling types other
    than none and linear refused; `rope.scaling.attn_factor` (absent: 1) refused unless `attn_factor`
    (Phi-3 with its long/short factors: ggml multiplies each rotation's cos and sin by it)."""
    a = g.architecture
    kind = g.get(f"{a}.rope.scaling.type", "linear", str)
    if kind not in ("none", "linear"):
        what = ROPE_SCALING.get(kind, "unknown")
        raise UnsupportedError(f"{g.path}: metadata {a}.rope.scaling.type = {kind!r} ({what} RoPE scaling) is not "
                               "supported: only linear scaling is applied")
    factor = g.get(f"{a}.rope.scaling.factor", None, (int, float))
    if factor is None:
        factor = g.get(f"{a}.rope.scale_linear", 0.0, (int, float))
    if not math.isfinite(factor) or factor < 0:
        raise GGUFError(f"{g.path}: {a}.rope.scaling.factor = {factor!r} is not a positive finite number")
    factor = float(factor) or 1.0
    if kind == "none" and factor != 1.0:
        raise UnsupportedError(f"{g.path}: metadata {a}.rope.scaling.factor = {factor} contradicts "
                               f"{a}.rope.scaling.type = 'none'")
    attn = g.get(f"{a}.rope.scaling.attn_factor", 1.0, (int, float))
    if attn != 1.0 and not attn_factor:
        raise UnsupportedError(f"{g.path}: metadata {a}.rope.scaling.attn_factor = {attn} is not supported: the "
                               "forward pass does not scale the rotation")
    if not math.isfinite(attn) or attn <= 0:
        raise GGUFError(f"{g.path}: {a}.rope.scaling.attn_factor = {attn!r} is not a positive finite number")
    return factor, float(attn)


def _rope_long_short(g, head_dim: int) -> tuple | None:
    """Phi-3's `rope_factors_long.weight` and `rope_factors_short.weight` (both or neither)."""
    names = ("rope_factors_long.weight", "rope_factors_short.weight")
    present = [n in g.tensors for n in names]
    if not any(present):
        return None
    if not all(present):
        raise GGUFError(f"{g.path}: tensor {names[present.index(False)]!r} is missing (Phi-3's RoPE factors come in pairs)")
    return tuple(_factors(g, n, head_dim) for n in names)


def _rope_freqs(g, head_dim: int) -> tuple:
    """Llama 3's `rope_freqs.weight`: head_dim/2 positive finite divisors of the RoPE frequencies."""
    return _factors(g, "rope_freqs.weight", head_dim)


def _factors(g, name: str, head_dim: int) -> tuple:
    """A RoPE factors tensor: head_dim/2 positive finite divisors of the frequencies."""
    t = g.tensor(name)
    if tuple(t.shape) != (head_dim // 2,):
        raise GGUFError(f"{g.path}: tensor {name!r} has shape {list(t.shape)}, expected [{head_dim // 2}] "
                        "(one factor per rotary pair)")
    values = np.asarray(g.dequantize(name), dtype=np.float32).reshape(-1)
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise GGUFError(f"{g.path}: tensor {name!r} holds a factor that is not a positive finite number")
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class TensorSpec:
    key: str  # attribute name in the loaded weights (per layer for layer tensors)
    gguf: str  # GGUF tensor name; "{i}" is the layer index
    hf: str  # Hugging Face / mlx-lm parameter name
    kind: str  # MATRIX, NORM or EMBEDDING
    shape: Callable[[ModelArgs], tuple]  # GGUF shape in numpy order ([out, in] for matrices)
    when: Callable[[ModelArgs], bool] = lambda a: True


GLOBAL_TENSORS = (
    TensorSpec("token_embd", "token_embd.weight", "model.embed_tokens.weight", EMBEDDING,
               lambda a: (a.vocab_size, a.hidden)),
    TensorSpec("output_norm", "output_norm.weight", "model.norm.weight", NORM, lambda a: (a.hidden,)),
    TensorSpec("output", "output.weight", "lm_head.weight", MATRIX, lambda a: (a.vocab_size, a.hidden),
               when=lambda a: not a.tied_output),
    # Read into ModelArgs.rope_freqs, not loaded onto the backend; Hugging Face computes it from the config
    TensorSpec("rope_freqs", "rope_freqs.weight", "", FACTORS, lambda a: (a.head_dim // 2,),
               when=lambda a: a.rope_freqs is not None and a.rope_long_short is None),
    TensorSpec("rope_long", "rope_factors_long.weight", "", FACTORS, lambda a: (a.head_dim // 2,),
               when=lambda a: a.rope_long_short is not None),
    TensorSpec("rope_short", "rope_factors_short.weight", "", FACTORS, lambda a: (a.head_dim // 2,),
               when=lambda a: a.rope_long_short is not None),
)
LAYER_TENSORS = (
    TensorSpec("attn_norm", "blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight", NORM,
               lambda a: (a.hidden,)),
    TensorSpec("attn_q", "blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight", MATRIX,
               lambda a: (a.n_heads * a.head_dim, a.hidden), when=lambda a: not a.fused),
    TensorSpec("attn_k", "blk.{i}.attn_k.weight", "model.layers.{i}.self_attn.k_proj.weight", MATRIX,
               lambda a: (a.n_kv_heads * a.head_dim, a.hidden), when=lambda a: not a.fused),
    TensorSpec("attn_v", "blk.{i}.attn_v.weight", "model.layers.{i}.self_attn.v_proj.weight", MATRIX,
               lambda a: (a.n_kv_heads * a.head_dim, a.hidden), when=lambda a: not a.fused),
    TensorSpec("attn_qkv", "blk.{i}.attn_qkv.weight", "model.layers.{i}.self_attn.qkv_proj.weight", FUSED,
               lambda a: ((a.n_heads + 2 * a.n_kv_heads) * a.head_dim, a.hidden), when=lambda a: a.fused),
    TensorSpec("attn_q_bias", "blk.{i}.attn_q.bias", "model.layers.{i}.self_attn.q_proj.bias", BIAS,
               lambda a: (a.n_heads * a.head_dim,), when=lambda a: a.qkv_bias),
    TensorSpec("attn_k_bias", "blk.{i}.attn_k.bias", "model.layers.{i}.self_attn.k_proj.bias", BIAS,
               lambda a: (a.n_kv_heads * a.head_dim,), when=lambda a: a.qkv_bias),
    TensorSpec("attn_v_bias", "blk.{i}.attn_v.bias", "model.layers.{i}.self_attn.v_proj.bias", BIAS,
               lambda a: (a.n_kv_heads * a.head_dim,), when=lambda a: a.qkv_bias),
    TensorSpec("attn_output", "blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight", MATRIX,
               lambda a: (a.hidden, a.n_heads * a.head_dim)),
    TensorSpec("attn_q_norm", "blk.{i}.attn_q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight", NORM,
               lambda a: (a.head_dim,), when=lambda a: a.qk_norm),
    TensorSpec("attn_k_norm", "blk.{i}.attn_k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight", NORM,
               lambda a: (a.head_dim,), when=lambda a: a.qk_norm),
    TensorSpec("attn_post_norm", "blk.{i}.post_attention_norm.weight",
               "model.layers.{i}.post_attention_layernorm.weight", NORM, lambda a: (a.hidden,),
               when=lambda a: a.post_norms),
    TensorSpec("ffn_norm", "blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight", NORM,
               lambda a: (a.hidden,)),
    TensorSpec("ffn_gate", "blk.{i}.ffn_gate.weight", "model.layers.{i}.mlp.gate_proj.weight", MATRIX,
               lambda a: (a.ffn, a.hidden), when=lambda a: not a.fused and not a.n_experts),
    TensorSpec("ffn_up", "blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.up_proj.weight", MATRIX,
               lambda a: (a.ffn, a.hidden), when=lambda a: not a.fused and not a.n_experts),
    TensorSpec("ffn_gate_up", "blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.gate_up_proj.weight", FUSED,
               lambda a: (2 * a.ffn, a.hidden), when=lambda a: a.fused),
    TensorSpec("ffn_down", "blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight", MATRIX,
               lambda a: (a.hidden, a.ffn), when=lambda a: not a.n_experts),
    TensorSpec("ffn_gate_inp", "blk.{i}.ffn_gate_inp.weight", "model.layers.{i}.mlp.gate.weight", MATRIX,
               lambda a: (a.n_experts, a.hidden), when=lambda a: a.n_experts),
    TensorSpec("ffn_gate_exps", "blk.{i}.ffn_gate_exps.weight", "model.layers.{i}.mlp.experts.gate_proj.weight",
               EXPERTS, lambda a: (a.n_experts, a.ffn_expert, a.hidden), when=lambda a: a.n_experts),
    TensorSpec("ffn_up_exps", "blk.{i}.ffn_up_exps.weight", "model.layers.{i}.mlp.experts.up_proj.weight",
               EXPERTS, lambda a: (a.n_experts, a.ffn_expert, a.hidden), when=lambda a: a.n_experts),
    TensorSpec("ffn_down_exps", "blk.{i}.ffn_down_exps.weight", "model.layers.{i}.mlp.experts.down_proj.weight",
               EXPERTS, lambda a: (a.n_experts, a.hidden, a.ffn_expert), when=lambda a: a.n_experts),
    TensorSpec("ffn_post_norm", "blk.{i}.post_ffw_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight",
               NORM, lambda a: (a.hidden,), when=lambda a: a.post_norms),
)

# Layer matrices that multiply the same activations, loaded as one handle (`Backend.load_weight_group`)
# and multiplied by `linear_group`: key of the group -> keys of its matrices, in output order.
WEIGHT_GROUPS = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_gate_up": ("ffn_gate", "ffn_up")}


def fused_view(g, args: ModelArgs):
    """The file with each fused matrix (Phi-3's `attn_qkv`, `ffn_up` holding gate then up) readable as
    the matrices of its group, by their usual names: their rows of the fused tensor."""
    q, kv, cuts, sources = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, {}, {}
    for i in range(args.n_layers):
        b = f"blk.{i}."
        for name, start, stop, src in (("attn_q", 0, q, "attn_qkv"), ("attn_k", q, q + kv, "attn_qkv"),
                                       ("attn_v", q + kv, q + 2 * kv, "attn_qkv"), ("ffn_gate", 0, args.ffn, "ffn_up"),
                                       ("ffn_up", args.ffn, 2 * args.ffn, "ffn_up")):
            cuts[f"{b}{name}.weight"] = (0, start, stop, None)
            sources[f"{b}{name}.weight"] = f"{b}{src}.weight"
    return ShardedGGUF(g, cuts, sources)


def tensors(args: ModelArgs):
    """(TensorSpec, layer index or None, gguf name, hf name, shape) of every tensor the model reads,
    in llama.cpp's file order: the embedding, layer by layer, then the final norm and output head
    (lazily: a hostile block_count costs nothing)."""
    first, *last = [t for t in GLOBAL_TENSORS if t.when(args)]
    yield first, None, first.gguf, first.hf, first.shape(args)
    for i in range(args.n_layers):
        for t in LAYER_TENSORS:
            if t.when(args):
                yield t, i, t.gguf.format(i=i), t.hf.format(i=i), t.shape(args)
    for t in last:
        yield t, None, t.gguf, t.hf, t.shape(args)


def check_shapes(g, args: ModelArgs) -> None:
    """Every tensor the forward pass reads exists with the shape the hyperparameters imply
    (checked lazily: a hostile block_count fails at the first missing layer, allocating nothing)."""
    for _, _, name, _, shape in tensors(args):
        t = g.tensor(name)
        if tuple(t.shape) != shape:
            raise GGUFError(
                f"{g.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)} "
                f"from the model's hyperparameters"
            )


# What a file may hold besides the tensors the spec reads: `{arch}.` keys the loader reads
# (ModelArgs.from_gguf) or that change nothing at their neutral value, and namespaces the forward pass
# does not compute with (names and licenses, the vocabulary, which the tokenizer reads, how the file was
# quantized or split). Anything else is refused (`check_nothing_unread`).
READ_KEYS = frozenset(("block_count", "context_length", "embedding_length", "feed_forward_length",
                       "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
                       "attention.key_length", "attention.value_length", "rope.freq_base", "rope.dimension_count",
                       "vocab_size", "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear",
                       "rope.scaling.attn_factor",
                       # YaRN's alone (its type is refused): no effect on linear or no scaling in llama.cpp
                       "rope.scaling.original_context_length", "rope.scaling.finetuned"))
NEUTRAL_KEYS = {"rope.freq_scale": (1, 1.0)}
IRRELEVANT_PREFIXES = ("general.", "tokenizer.", "quantize.", "split.")
KNOWN_UNSUPPORTED = {"rope_freqs.weight": "Llama 3's RoPE frequency factors, which this architecture does not apply"}


def check_nothing_unread(g, args: ModelArgs) -> None:
    """Every tensor and metadata key of the file is read by the loader or changes nothing: a file that
    asks for what the forward pass does not do (Llama 3's RoPE factors, RoPE scaling, another
    architecture's tensors) is refused in one line instead of generating wrong text."""
    read = {name for _, _, name, _, _ in tensors(args)}
    extra = sorted(set(g.tensors) - read, key=lambda n: (n not in KNOWN_UNSUPPORTED, n))
    if extra:
        what = KNOWN_UNSUPPORTED.get(extra[0], "not read by the forward pass")
        raise UnsupportedError(f"{g.path}: tensor {extra[0]!r} ({what}) is not supported: without it the "
                               "model would give wrong text")
    prefix = f"{args.arch}."
    for key, value in g.metadata.items():
        if key.startswith(IRRELEVANT_PREFIXES):
            continue
        name = key[len(prefix):] if key.startswith(prefix) else None
        if name in READ_KEYS or name in args.extra_keys or (name in NEUTRAL_KEYS and value in NEUTRAL_KEYS[name]):
            continue
        raise UnsupportedError(f"{g.path}: metadata {key} = {_short(value)} is not supported: the forward pass "
                               "does not apply it")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def load_weights(ops, g, args: ModelArgs, shard=None) -> SimpleNamespace:
    """The model's weights on `ops`: `w.token_embd`, `w.output_norm`, `w.output` (the output head; the
    embedding matrix when tied) and `w.layers[i].attn_norm` ... named by the spec's keys, except the
    matrices of a `WEIGHT_GROUPS` entry: one handle under the group's key (`w.layers[i].attn_qkv`). With a
    tensor-parallel `shard` (mlxinfer.models.shard) the weight matrices are read through the shard's view
    of the file: only this rank's slice of each; the embedding and the norms whole."""
    check_shapes(g, args)
    check_nothing_unread(g, args)
    sharded = shard is not None and shard.size > 1
    view = shard.view(g) if sharded else fused_view(g, args) if args.fused else g
    loaders = {MATRIX: lambda g_, n: ops.load_weight(view, n), NORM: ops.load_vector,
               EXPERTS: ops.load_experts,
               BIAS: lambda g_, n: ops.load_vector(view, n), EMBEDDING: ops.load_embedding}
    w = SimpleNamespace(layers=[SimpleNamespace() for _ in range(args.n_layers)])
    grouped = {k: group for group, keys in WEIGHT_GROUPS.items() for k in keys}
    names = {}  # layer -> {key: gguf name} of its grouped matrices
    for t, i, name, _, _ in tensors(args):
        if t.kind == FACTORS:  # in args.rope_freqs already
            continue
        if t.kind == FUSED:  # its group's matrices, by their names in the fused view
            for key in WEIGHT_GROUPS[t.key]:
                names.setdefault(i, {})[key] = f"blk.{i}.{key}.weight"
            continue
        if i is not None and t.key in grouped:
            names.setdefault(i, {})[t.key] = name
            continue
        setattr(w if i is None else w.layers[i], t.key, loaders[t.kind](g, name))
    for i, layer in names.items():
        for group, keys in WEIGHT_GROUPS.items():
            if all(k in layer for k in keys):  # (a MoE layer has no gate and up)
                setattr(w.layers[i], group, ops.load_weight_group(view, [layer[k] for k in keys]))
    if args.tied_output:
        w.output = ops.load_weight(view, "output.weight" if sharded else "token_embd.weight")
    return w
