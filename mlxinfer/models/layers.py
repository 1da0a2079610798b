"""The pieces of a decoder-only transformer, written against the Backend protocol.

Every step is one backend op, so the tracing backend sees the whole forward pass:
RMSNorm = sum_squares_rows, scale by 1/n, add eps, rsqrt, mul_rows, hadamard with the weight row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import GGUFError


@dataclass
class TransformerArgs:
    """Hyperparameters shared by the decoder-only architectures, read from `{arch}.*` GGUF keys."""

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

    @classmethod
    def from_gguf(cls, g, *, rope_traditional: bool, qk_norm: bool) -> "TransformerArgs":
        a = g.architecture

        def req(key):
            return g.require(f"{a}.{key}", int)

        n_heads = req("attention.head_count")
        n_kv = g.get(f"{a}.attention.head_count_kv", n_heads)
        hidden = req("embedding_length")
        if not isinstance(n_kv, int) or n_heads <= 0 or n_kv <= 0 or n_heads % n_kv:
            raise GGUFError(
                f"{g.path}: {a}.attention.head_count {n_heads} is not a multiple of head_count_kv {n_kv}"
            )
        head_dim = g.get(f"{a}.attention.key_length", hidden // n_heads)
        value_dim = g.get(f"{a}.attention.value_length", head_dim)
        if value_dim != head_dim:
            raise GGUFError(f"{g.path}: key_length {head_dim} != value_length {value_dim} is not supported")
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise GGUFError(f"{g.path}: head dimension {head_dim!r} must be a positive even number")
        rope_dims = g.get(f"{a}.rope.dimension_count", head_dim)
        if rope_dims != head_dim:
            raise GGUFError(f"{g.path}: partial rotary embedding ({a}.rope.dimension_count {rope_dims} "
                            f"!= head dim {head_dim}) is not supported")
        emb = g.tensor("token_embd.weight")
        if len(emb.shape) != 2 or emb.shape[1] != hidden:
            raise GGUFError(
                f"{g.path}: tensor 'token_embd.weight' has shape {list(emb.shape)}, expected [vocab, {hidden}]"
            )
        vocab = emb.shape[0]
        meta_vocab = g.get(f"{a}.vocab_size")
        if meta_vocab is not None and meta_vocab != vocab:
            raise GGUFError(f"{g.path}: {a}.vocab_size {meta_vocab} != token_embd.weight rows {vocab}")
        eps = g.require(f"{a}.attention.layer_norm_rms_epsilon", float)
        base = g.get(f"{a}.rope.freq_base", 10000.0)
        for key, value in (("attention.layer_norm_rms_epsilon", eps), ("rope.freq_base", base)):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise GGUFError(f"{g.path}: {a}.{key} = {value!r} is not a positive finite number")
        return cls(
            arch=a,
            n_layers=req("block_count"),
            hidden=hidden,
            ffn=req("feed_forward_length"),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            vocab_size=vocab,
            context_length=req("context_length"),
            rms_eps=float(eps),
            rope_base=float(base),
            rope_traditional=rope_traditional,
            qk_norm=qk_norm,
            tied_output="output.weight" not in g.tensors,
        )

    def expected_shapes(self):
        """(tensor name, shape) of every tensor the forward pass reads, layer by layer."""
        h, d = self.hidden, self.head_dim
        yield "output_norm.weight", (h,)
        if not self.tied_output:
            yield "output.weight", (self.vocab_size, h)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            yield p + "attn_norm.weight", (h,)
            yield p + "attn_q.weight", (self.n_heads * d, h)
            yield p + "attn_k.weight", (self.n_kv_heads * d, h)
            yield p + "attn_v.weight", (self.n_kv_heads * d, h)
            yield p + "attn_output.weight", (h, self.n_heads * d)
            if self.qk_norm:
                yield p + "attn_q_norm.weight", (d,)
                yield p + "attn_k_norm.weight", (d,)
            yield p + "ffn_norm.weight", (h,)
            yield p + "ffn_gate.weight", (self.ffn, h)
            yield p + "ffn_up.weight", (self.ffn, h)
            yield p + "ffn_down.weight", (h, self.ffn)

    def check_shapes(self, g) -> None:
        """Every tensor the forward pass reads exists with the shape the hyperparameters imply
        (checked lazily: a hostile block_count fails at the first missing layer, allocating nothing)."""
        for name, shape in self.expected_shapes():
            t = g.tensor(name)
            if tuple(t.shape) != shape:
                raise GGUFError(
                    f"{g.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)} "
                    f"from the model's hyperparameters"
                )


@dataclass
class LayerWeights:
    attn_norm: object
    wq: object
    wk: object
    wv: object
    wo: object
    ffn_norm: object
    w_gate: object
    w_up: object
    w_down: object
    q_norm: object = None
    k_norm: object = None


def load_norm(ops, g, name):
    """A norm weight vector, refused if it holds NaN or Inf (it would silently poison every logit)."""
    if not np.all(np.isfinite(g.dequantize(name))):
        raise GGUFError(f"{g.path}: tensor {name!r} contains NaN or Inf")
    return ops.load_vector(g, name)


def load_layers(ops, g, args: TransformerArgs) -> list[LayerWeights]:
    layers = []
    for i in range(args.n_layers):
        p = f"blk.{i}."
        layers.append(
            LayerWeights(
                attn_norm=load_norm(ops, g, p + "attn_norm.weight"),
                wq=ops.load_weight(g, p + "attn_q.weight"),
                wk=ops.load_weight(g, p + "attn_k.weight"),
                wv=ops.load_weight(g, p + "attn_v.weight"),
                wo=ops.load_weight(g, p + "attn_output.weight"),
                ffn_norm=load_norm(ops, g, p + "ffn_norm.weight"),
                w_gate=ops.load_weight(g, p + "ffn_gate.weight"),
                w_up=ops.load_weight(g, p + "ffn_up.weight"),
                w_down=ops.load_weight(g, p + "ffn_down.weight"),
                q_norm=load_norm(ops, g, p + "attn_q_norm.weight") if args.qk_norm else None,
                k_norm=load_norm(ops, g, p + "attn_k_norm.weight") if args.qk_norm else None,
            )
        )
    return layers


def rms_norm(ops, x, weight, eps: float):
    """x * rsqrt(mean(x^2) + eps) * weight, row by row."""
    n = x.shape[1]
    mean_sq = ops.scale(ops.sum_squares_rows(x), 1.0 / n)
    inv = ops.rsqrt(ops.add_scalar(mean_sq, eps))
    return ops.hadamard(ops.mul_rows(x, inv), weight)


def head_rms_norm(ops, x, weight, n_heads: int, head_dim: int, eps: float):
    """RMSNorm of each head's slice of [T, n_heads*head_dim] rows (Qwen3's q_norm / k_norm)."""
    t = x.shape[0]
    y = rms_norm(ops, ops.reshape(x, t * n_heads, head_dim), weight, eps)
    return ops.reshape(y, t, n_heads * head_dim)


def attention(ops, args: TransformerArgs, w: LayerWeights, x, cache, layer: int):
    """Self-attention of [T, hidden] rows at positions cache.offset.. ; appends K, V to the cache."""
    h, kv, d = args.n_heads, args.n_kv_heads, args.head_dim
    q = ops.matmul(x, w.wq)
    k = ops.matmul(x, w.wk)
    v = ops.matmul(x, w.wv)
    if w.q_norm is not None:
        q = head_rms_norm(ops, q, w.q_norm, h, d, args.rms_eps)
        k = head_rms_norm(ops, k, w.k_norm, kv, d, args.rms_eps)
    pos = cache.offset
    q = ops.rope(q, h, d, pos, args.rope_base, args.rope_traditional)
    k = ops.rope(k, kv, d, pos, args.rope_base, args.rope_traditional)
    keys, values = cache.update(layer, k, v)
    ctx = ops.fused_attention(q, keys, values, h, kv, d)
    return ops.matmul(ctx, w.wo)


def swiglu_mlp(ops, w: LayerWeights, x):
    gate = ops.silu(ops.matmul(x, w.w_gate))
    up = ops.matmul(x, w.w_up)
    return ops.matmul(ops.hadamard(gate, up), w.w_down)


class DecoderModel:
    """A decoder-only transformer: embedding, `n_layers` pre-norm blocks (attention + SwiGLU MLP),
    final norm, output head. The per-architecture files say what differs and build one of these."""

    def __init__(self, ops, g, args: TransformerArgs):
        args.check_shapes(g)
        self.args = args
        self.embed = ops.load_embedding(g, "token_embd.weight")
        self.layers = load_layers(ops, g, args)
        self.norm = load_norm(ops, g, "output_norm.weight")
        self.head = ops.load_weight(g, "token_embd.weight" if args.tied_output else "output.weight")

    def forward(self, ops, ids: list[int], cache, all_logits: bool = False):
        """Logits [T, vocab] for `ids` at positions cache.offset.. (only the last row unless
        `all_logits`), updating the cache."""
        a = self.args
        x = ops.gather_rows(self.embed, ids)
        for i, w in enumerate(self.layers):
            x = ops.add(x, attention(ops, a, w, rms_norm(ops, x, w.attn_norm, a.rms_eps), cache, i))
            x = ops.add(x, swiglu_mlp(ops, w, rms_norm(ops, x, w.ffn_norm, a.rms_eps)))
        cache.advance(len(ids))
        if not all_logits and len(ids) > 1:
            x = ops.slice_rows(x, len(ids) - 1, len(ids))
        return ops.matmul(rms_norm(ops, x, self.norm, a.rms_eps), self.head)
