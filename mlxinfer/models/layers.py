"""The blocks of a decoder-only transformer, written against the Backend protocol.

Every step is one backend op, so the tracing backend sees the whole forward pass. Activations are the
batch's packed rows ([N, cols], see `mlxinfer.batch`); products with weights pass the batch's row
groups so that a backend can keep each sequence's floats independent of its neighbours. Matrices that
multiply the same rows (Q, K, V; gate, up) are one `linear_group` call: one product where the backend
can put them side by side (MLX), one `linear` each by default.

RMSNorm is the backend's composite op `rms_norm`: by default sum_squares_rows, scale by 1/n, add eps,
rsqrt, mul_rows, hadamard with the weight row (`Backend.rms_norm`); MLX fuses it.

Under tensor parallelism (`mlxinfer.models.shard`) each rank holds a slice of every product; `all_sum`
joins the partial sums of a row-parallel product and `output_logits` gathers the vocabulary shards.
With one rank (`shard.size == 1`) neither adds an op.

A pre-norm block begins and ends with a composite op: its norm and the products after it,
`rms_norm_linear_group`, and its output product and the residual connection, `linear_add`
(`output_product` with a residual); a SwiGLU FFN block is one composite op, `swiglu_ffn`. By default
each is its ops apart; on a GPU, for decode rows, the norm and its products are one launch, and so are
the activation, the down product and the residual add (MLX's block kernels multiply the values their
norm and SwiGLU kernels write, and write the residual plus the product: the same bits).
"""

from __future__ import annotations

import numpy as np


def rms_norm(ops, x, weight, eps: float):
    """x * rsqrt(mean(x^2) + eps) * weight, row by row (the backend's composite op; its default is
    built from the primitives, see Backend.rms_norm)."""
    return ops.rms_norm(x, weight, eps)


def all_sum(ops, x, shard):
    """The sum over ranks of a row-parallel product's partial results (x itself on one rank)."""
    return x if shard.size == 1 else ops.all_sum(x, shard.group)


def output_product(ops, x, w, groups, shard, residual):
    """residual + x @ w summed over the ranks (a row-parallel product: attention's output, the FFN's
    down): on one rank one `linear_add`, which a backend may do in one launch; across ranks the sum
    over them first, then the residual."""
    if shard.size == 1:
        return ops.linear_add(x, w, residual, groups)
    return ops.add(residual, all_sum(ops, ops.linear(x, w, groups), shard))


def swiglu_block(ops, x, w, eps: float, groups, shard):
    """x + down(silu(gate(h)) * up(h)) for h = rms_norm(x) (`ffn_norm`), the FFN summed over the ranks'
    shares of its width: the residual stream after a pre-norm SwiGLU block. On one rank the backend's
    composite `swiglu_ffn` (on a GPU two launches for decode rows: the norm with gate and up, then SwiGLU
    with the down product and the residual; SwiGLU apart for a large down weight); across ranks the sum
    over them first, then the residual."""
    if shard.size == 1:
        return ops.swiglu_ffn(x, w.ffn_norm, eps, w.ffn_gate_up, w.ffn_down, groups)
    gate, up = ops.rms_norm_linear_group(x, w.ffn_norm, eps, w.ffn_gate_up, groups)
    return output_product(ops, ops.hadamard(ops.silu(gate), up), w.ffn_down, groups, shard, residual=x)


def gelu_mlp(ops, x, w, groups, shard):
    """down(gelu(gate(x)) * up(x)) (Gemma's GeGLU, tanh approximation), summed over the ranks' shares."""
    gate, up = ops.linear_group(x, w.ffn_gate_up, groups)
    return all_sum(ops, ops.linear(ops.hadamard(ops.gelu(gate), up), w.ffn_down, groups), shard)


def moe_mlp(ops, x, w, groups, used: int):
    """A mixture of SwiGLU experts: the router `ffn_gate_inp` gives each row one logit per expert, the
    backend's `moe_mlp` takes the `used` most probable, weights them by their softmax probabilities
    normalized to sum 1 and adds their outputs (llama.cpp's build_moe_ffn with softmax gating and
    normalized weights: Qwen3-MoE, Mixtral)."""
    logits = ops.linear(x, w.ffn_gate_inp, groups)
    return ops.moe_mlp(x, logits, (w.ffn_gate_exps, w.ffn_up_exps, w.ffn_down_exps), used, groups)


def softcap(ops, x, cap: float):
    """cap * tanh(x / cap), as llama.cpp computes it: scale by the float32 1/cap, tanh, scale by cap."""
    return ops.scale(ops.tanh(ops.scale(x, float(np.float32(1.0) / np.float32(cap)))), cap)


def output_logits(ops, x, w, batch, eps: float, shard, vocab: int):
    """Final norm and output head, applied only to the rows whose logits the pass needs (the last row
    of each sequence that samples, or every row when the batch asks for all): [R, vocab], or None
    when no row needs logits (a pass of mid-prompt chunks)."""
    if batch.n_logit_rows == 0:
        return None
    if not batch.logits_of_every_row:
        x = ops.gather_rows(x, batch.logit_rows)
    logits = ops.linear(rms_norm(ops, x, w.output_norm, eps), w.output, batch.logit_groups)
    return logits if shard.size == 1 else ops.all_gather_cols(logits, shard.group, vocab)
