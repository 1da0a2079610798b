"""Tensor parallelism's process group and collectives, over MLX's own distributed layer (`mx.distributed`).

N processes (ranks), started by `mlx.launch` (NCCL between CUDA GPUs, the TCP ring between CPUs or Macs),
each hold a slice of the model (`mlxinfer.models.shard`) and meet in `all_sum` after each row-parallel
product and in `all_gather_cols` after the output head. Both backends call these: the MLX backend keeps
them in its graph; the numpy backend goes through MLX arrays for them.

MLX is imported inside the functions: the numpy backend runs without it on a single process.
"""

from __future__ import annotations

import os

import numpy as np

from .errors import RequestError, UnsupportedError


def launched() -> bool:
    """True inside a process started by mlx.launch (it sets the rank for every backend)."""
    return "MLX_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ


def require_distributed() -> None:
    import mlx.core as mx

    if not mx.distributed.is_available():
        raise UnsupportedError("this MLX build has no distributed backend (mx.distributed is unavailable)")


def join(tp: int):
    """This process's (rank, group) in a tensor-parallel run over `tp` ranks, or a one-line RequestError
    saying how to start one."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise RequestError(f"tp must be a positive integer, got {tp!r}")
    if tp == 1:
        return 0, None
    import mlx.core as mx

    require_distributed()
    group = mx.distributed.init() if launched() else None
    if group is None or group.size() != tp:
        found = 1 if group is None else group.size()
        raise RequestError(
            f"tp={tp} needs {tp} processes started by mlx.launch (this run has {found}): "
            f"`mlxinfer generate --tp {tp} ...` starts them, or `mlx.launch -n {tp} -- <your script>`"
        )
    return group.rank(), group


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


def through_mlx(collective, x: np.ndarray, *args) -> np.ndarray:
    """A collective on a numpy array: through an MLX array and back (the numpy backend's collectives)."""
    import mlx.core as mx

    return np.array(collective(mx.array(x), *args))


def agree_seed(seed: int, rank: int, group) -> int:
    """The seed every rank of a tensor-parallel run uses: rank 0's (ranks draw random seeds apart), by
    one all-sum in which the other ranks contribute 0."""
    import mlx.core as mx

    mine = mx.array(np.array([seed if rank == 0 else 0], dtype=np.uint64).view(np.uint32))
    return int(np.array(all_sum(mine, group)).view(np.uint64)[0])
