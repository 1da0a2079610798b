"""Tensor parallelism's shard plan: which slice of each weight a rank holds (Megatron-LM's split).

N ranks each hold a 1/N slice of every large weight and meet twice per layer in an all-sum
(`mlxinfer.collectives`):

    attention  Q, K, V rows of this rank's heads (column-parallel: no communication), attention on
               those heads with this rank's share of the KV cache, then the output projection's
               columns of the same heads (row-parallel) and one all-sum of the [N, hidden] result;
    MLP        gate and up rows of this rank's share of the FFN width, down's columns of the same
               share, one all-sum;
    output     rows of this rank's share of the vocabulary, then one all-gather of the logits.

Biases (Qwen2's Q/K/V) are cut with their matrices' rows: each rank adds the bias entries of its own
heads. The embedding table and the norm vectors are replicated (an embedding lookup reads a handful of rows;
sharding it would cost a third collective per pass). Heads are split by KV head, each rank taking
whole GQA groups, as evenly as the counts allow: SmolLM2's 3 KV heads over 2 ranks give 2 and 1 (6 and
3 query heads). Fewer KV heads than ranks is refused. The FFN width is split in whole quantization
blocks of `ffn_down` (its columns are its input dimension, where the blocks run); the vocabulary in
equal parts, the last padded with zero rows whose logits are dropped after the gather.

Each rank reads only its slices from the memory-mapped file, through `Shard.view` (a
`gguf_file.ShardedGGUF`). Every rank runs the same loop on the same prompt and samples from the same
gathered logits with the same seed, so all ranks choose the same tokens without exchanging them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gguf import GGML_QUANT_SIZES

from ..errors import RequestError
from ..gguf_file import GGUFFile, ShardedGGUF


def split(n: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """`n` (a multiple of `unit`) cut into `parts` contiguous ranges of whole units, as even as possible
    (the first ranges take the remainder)."""
    units, rem = divmod(n // unit, parts)
    out, start = [], 0
    for r in range(parts):
        stop = start + (units + (r < rem)) * unit
        out.append((start, stop))
        start = stop
    return out


@dataclass(frozen=True)
class Shard:
    """One rank's part of the model: its ranges of query heads, KV heads, FFN width and vocabulary.
    `Shard.whole(args)` is the single-process model (every range complete, no group)."""

    rank: int
    size: int
    group: object  # the mx.distributed group (None when size is 1)
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]  # this rank's rows of the output head
    vocab_rows: int  # rows every rank holds (vocab padded to a multiple of size)
    tensors: dict = field(default_factory=dict, repr=False)  # GGUF name -> (axis, start, stop, pad_to)
    vectors: dict = field(default_factory=dict, repr=False)  # GGUF name of a 1-D tensor -> (start, stop)

    @property
    def n_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @classmethod
    def whole(cls, args) -> "Shard":
        return cls(0, 1, None, (0, args.n_heads), (0, args.n_kv_heads), (0, args.ffn), (0, args.vocab_size),
                   args.vocab_size)

    @classmethod
    def plan(cls, g, args, rank: int, size: int, group=None) -> "Shard":
        """Rank `rank`'s shard of the model in GGUF file `g` (hyperparameters `args`) over `size` ranks;
        a one-line RequestError where the model cannot be split that way."""
        if size == 1:
            return cls.whole(args)
        if args.n_experts:
            raise RequestError(f"tensor parallelism does not split {args.arch}'s experts yet ({g.path}): run it on "
                               "one process")
        if args.fused:
            raise RequestError(f"tensor parallelism does not split {args.arch}'s fused attn_qkv and ffn_up matrices "
                               f"yet ({g.path}): run it on one process")
        if args.n_kv_heads < size:
            raise RequestError(
                f"tensor parallelism over {size} ranks needs at least {size} KV heads; {g.path} has "
                f"{args.n_heads} query heads and {args.n_kv_heads} KV heads"
            )
        group_size = args.n_heads // args.n_kv_heads
        kv = split(args.n_kv_heads, size)[rank]
        heads = (kv[0] * group_size, kv[1] * group_size)
        d = args.head_dim
        # Column cuts must fall on quantization block boundaries of every layer's tensor (files may mix
        # types across layers): the FFN is split in units of the largest ffn_down block, and the head
        # boundaries (whole GQA groups) are checked against every attn_output block.
        unit = 1
        for i in range(args.n_layers):
            t = g.tensor(f"blk.{i}.ffn_down.weight")
            unit = math.lcm(unit, GGML_QUANT_SIZES[t.ggml_type][0])
        if args.ffn % unit or args.ffn // unit < size:
            raise RequestError(f"{g.path}: FFN width {args.ffn} cannot be split over {size} ranks in whole "
                               f"quantization blocks of {unit} (ffn_down)")
        cuts = [k[0] * group_size * d for k in split(args.n_kv_heads, size)[1:]]
        for i in range(args.n_layers):
            t = g.tensor(f"blk.{i}.attn_output.weight")
            o_block = GGML_QUANT_SIZES[t.ggml_type][0]
            bad = [c for c in cuts if c % o_block]
            if bad:
                raise RequestError(f"{g.path}: blk.{i}.attn_output.weight ({t.ggml_type.name}, blocks of {o_block}) "
                                   f"cannot be cut by head at column {bad[0]} for {size} ranks")
        ffn = split(args.ffn, size, unit)[rank]
        rows = -(-args.vocab_size // size)
        vocab = (min(rank * rows, args.vocab_size), min((rank + 1) * rows, args.vocab_size))
        cut = {}
        for i in range(args.n_layers):
            b = f"blk.{i}."
            cut[b + "attn_q.weight"] = (0, heads[0] * d, heads[1] * d, None)
            cut[b + "attn_k.weight"] = (0, kv[0] * d, kv[1] * d, None)
            cut[b + "attn_v.weight"] = (0, kv[0] * d, kv[1] * d, None)
            cut[b + "attn_output.weight"] = (1, heads[0] * d, heads[1] * d, None)
            cut[b + "ffn_gate.weight"] = (0, ffn[0], ffn[1], None)
            cut[b + "ffn_up.weight"] = (0, ffn[0], ffn[1], None)
            cut[b + "ffn_down.weight"] = (1, ffn[0], ffn[1], None)
        cut["output.weight"] = (0, vocab[0], vocab[1], rows)
        vectors = {}
        if args.qkv_bias:
            for i in range(args.n_layers):
                b = f"blk.{i}."
                vectors[b + "attn_q.bias"] = (heads[0] * d, heads[1] * d)
                vectors[b + "attn_k.bias"] = vectors[b + "attn_v.bias"] = (kv[0] * d, kv[1] * d)
        return cls(rank, size, group, heads, kv, ffn, vocab, rows, cut, vectors)

    def view(self, g: GGUFFile):
        """The file as this rank's loaders see it (the file itself when nothing is sliced)."""
        return g if self.size == 1 else ShardView(g, self.tensors, self.vectors)


class ShardView(ShardedGGUF):
    """The sharded file, plus this rank's entries of the 1-D tensors that are cut (the biases of
    column-parallel products), which the vector loaders read through `dequantize`."""

    def __init__(self, g: GGUFFile, cuts: dict, vectors: dict):
        super().__init__(g, cuts)
        self.vectors = vectors

    def dequantize(self, name: str):
        cut = self.vectors.get(name)
        if cut is None:
            return ShardedGGUF.dequantize(self, name)
        return self.g.dequantize(name)[cut[0]:cut[1]]
