"""Tensor parallelism over `mx.distributed`: which slice of each weight a rank holds, and how it gets it.

N processes (ranks), started by `mlx.launch` (NCCL between GPUs, ring over TCP between CPUs or Macs),
each hold a 1/N slice of every large weight and meet twice per layer in an all-sum, as in Megatron-LM:

    attention  Q, K, V rows of this rank's heads (column-parallel: no communication), attention on
               those heads with this rank's share of the KV cache, then the output projection's
               columns of the same heads (row-parallel) and one all-sum of the [N, hidden] result;
    MLP        gate and up rows of this rank's share of the FFN width, down's columns of the same
               share, one all-sum;
    output     rows of this rank's share of the vocabulary, then one all-gather of the logits.

The embedding table and the norm vectors are replicated (an embedding lookup reads a handful of rows;
sharding it would cost a third collective per pass). Heads are split by KV head, each rank taking
whole GQA groups, as evenly as the counts allow: SmolLM2's 3 KV heads over 2 ranks give 2 and 1 (6 and
3 query heads). Fewer KV heads than ranks is refused. The FFN width is split in whole quantization
blocks of `ffn_down` (its columns are its input dimension, where the blocks run); the vocabulary in
equal parts, the last padded with zero rows whose logits are dropped after the gather.

Each rank reads only its slices from the memory-mapped file: `ShardedGGUF` presents the file to a
backend's loaders with every sliced tensor cut to the rank's rows or column blocks (rows are a
zero-copy view of the map; column blocks are copied row by row, touching only their own pages).

Every rank runs the same engine loop on the same prompt and samples from the same gathered logits with
the same seed, so all ranks choose the same tokens without exchanging them; a random seed is agreed
by an all-sum of rank 0's choice.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES

from .errors import RequestError, UnsupportedError
from .gguf_file import GGUFFile, TensorInfo


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
        return cls(rank, size, group, heads, kv, ffn, vocab, rows, cut)

    def view(self, g: GGUFFile):
        """The file as this rank's loaders see it (the file itself when nothing is sliced)."""
        return g if self.size == 1 else ShardedGGUF(g, self.tensors)


class ShardedGGUF:
    """A GGUF file whose sliced tensors read as this rank's slice: `tensor(name)` has the slice's shape,
    `raw(name)` its bytes, `dequantize(name)` its floats; other tensors read as in the file.
    `output.weight` of a model with a tied output head is the embedding's rows."""

    dequantize = GGUFFile.dequantize  # the file's dequantizer, over this view's tensor() and raw()

    def __init__(self, g: GGUFFile, cuts: dict):
        self.g, self.cuts, self.path = g, cuts, g.path
        self.metadata, self.tensors = g.metadata, g.tensors

    def get(self, key, default=None, kind=None):
        return self.g.get(key, default, kind)

    def require(self, key, kind=(int, float)):
        return self.g.require(key, kind)

    def _source(self, name: str) -> str:
        if name == "output.weight" and "output.weight" not in self.g.tensors:
            return "token_embd.weight"
        return name

    def tensor(self, name: str) -> TensorInfo:
        t = self.g.tensor(self._source(name))
        cut = self.cuts.get(name)
        if cut is None:
            return t
        axis, start, stop, pad_to = cut
        rows, cols = t.shape
        block, block_bytes = GGML_QUANT_SIZES[t.ggml_type]
        if axis == 0:
            n = pad_to or (stop - start)
            return TensorInfo(name, (n, cols), t.ggml_type, t.offset, n * (cols // block) * block_bytes)
        return TensorInfo(name, (rows, stop - start), t.ggml_type, t.offset,
                          rows * ((stop - start) // block) * block_bytes)

    def raw(self, name: str) -> np.ndarray:
        src = self._source(name)
        cut = self.cuts.get(name)
        if cut is None:
            return self.g.raw(src)
        t = self.g.tensor(src)
        axis, start, stop, pad_to = cut
        rows, cols = t.shape
        block, block_bytes = GGML_QUANT_SIZES[t.ggml_type]
        row_bytes = cols // block * block_bytes
        if axis == 0:  # whole rows: a view of the map, padded with zero rows (zero in every type) if asked
            part = self.g.raw(src)[start * row_bytes: stop * row_bytes]
            if pad_to and pad_to > stop - start:
                part = np.concatenate([part, np.zeros((pad_to - (stop - start)) * row_bytes, np.uint8)])
            return part
        # column blocks of every row: only these bytes of each row are read
        full = self.g.raw(src).reshape(rows, row_bytes)
        return np.ascontiguousarray(full[:, start // block * block_bytes: stop // block * block_bytes]).reshape(-1)


# -- collectives (on mx arrays; the backends' all_sum and all_gather_cols) ----------------------------
def all_sum(x, group):
    """The elementwise sum of the mx array `x` over the ranks of `group`, on every rank."""
    import mlx.core as mx

    return mx.distributed.all_sum(x, group=group)


def all_gather_cols(x, group, cols: int):
    """[R, C] on each rank -> [R, cols]: the ranks' columns side by side in rank order, the first `cols`
    kept (the output head's vocabulary shards; the last rank's padding is dropped)."""
    import mlx.core as mx

    r, c = x.shape
    parts = mx.reshape(mx.distributed.all_gather(x, group=group), (-1, r, c))
    return mx.reshape(mx.transpose(parts, (1, 0, 2)), (r, -1))[:, :cols]


# -- processes --------------------------------------------------------------------------------------
def launched() -> bool:
    """True inside a process started by mlx.launch (it sets the rank for every backend)."""
    return "MLX_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ


def join(tp: int):
    """This process's (rank, group) in a tensor-parallel run over `tp` ranks, or a one-line RequestError
    saying how to start one."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise RequestError(f"tp must be a positive integer, got {tp!r}")
    if tp == 1:
        return 0, None
    import mlx.core as mx

    _require_distributed()
    group = mx.distributed.init() if launched() else None
    if group is None or group.size() != tp:
        found = 1 if group is None else group.size()
        raise RequestError(
            f"tp={tp} needs {tp} processes started by mlx.launch (this run has {found}): "
            f"`mlxinfer generate --tp {tp} ...` starts them, or `mlx.launch -n {tp} -- <your script>`"
        )
    return group.rank(), group


def check_split(model, tp: int) -> None:
    """Refuse (one-line error) a model that cannot be split over `tp` ranks, before starting them."""
    from .model_source import resolve_model
    from .models import model_args

    with GGUFFile(resolve_model(model)) as g:
        Shard.plan(g, model_args(g), 0, tp)


def default_backend(device: str | None = None) -> str:
    """mlx.launch's backend for local ranks: NCCL where MLX runs on a CUDA GPU, else the TCP ring."""
    import mlx.core as mx

    return "nccl" if mx.cuda.is_available() and device != "cpu" else "ring"


STATUS_DIR = "MLXINFER_TP_STATUS_DIR"  # where each rank of a relaunched run leaves its exit status


def record_status(rc: int) -> None:
    """In a rank started by `relaunch`: leave this rank's exit status for the parent."""
    where = os.environ.get(STATUS_DIR)
    if where and "MLX_RANK" in os.environ:
        with open(os.path.join(where, f"rank{int(os.environ['MLX_RANK'])}"), "w") as f:
            f.write(str(rc))


def relaunch(tp: int, argv: list[str], device: str | None = None) -> int:
    """Run `python -m mlxinfer <argv>` as `tp` local ranks under mlx.launch (stdin closed: a prompt from
    stdin is passed as a file); returns 0 only if every rank exited 0 (mlx.launch itself returns 0 when
    ranks fail). NVLink multicast (NVLS) stays off unless the caller set NCCL_NVLS_ENABLE."""
    import tempfile

    _require_distributed()
    launcher = shutil.which("mlx.launch")
    cmd = [launcher] if launcher else [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]
    cmd += ["-n", str(tp), "--backend", default_backend(device)]
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory(prefix="mlxinfer-tp-") as status:
        env[STATUS_DIR] = status
        for key in ("NCCL_NVLS_ENABLE", "OPENBLAS_NUM_THREADS", STATUS_DIR):
            if key in env:
                cmd += ["--env", f"{key}={env[key]}"]
        cmd += ["--", sys.executable, "-m", "mlxinfer", *argv]
        launcher_rc = subprocess.call(cmd, env=env, stdin=subprocess.DEVNULL)
        codes = []
        for r in range(tp):
            try:
                with open(os.path.join(status, f"rank{r}")) as f:
                    codes.append(int(f.read().strip() or 1))
            except (OSError, ValueError):
                codes.append(1)  # killed, or never got as far as recording
    return next((c for c in codes if c), launcher_rc)


def _require_distributed() -> None:
    import mlx.core as mx

    if not mx.distributed.is_available():
        raise UnsupportedError("this MLX build has no distributed backend (mx.distributed is unavailable)")
