"""Starting a tensor-parallel run: `mlxinfer generate --tp N` re-runs itself as N local ranks under
`mlx.launch`, each rank records its exit status, and the parent exits non-zero if any rank failed
(mlx.launch itself returns 0 when ranks fail)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

from .collectives import require_distributed
from .errors import RequestError
from .gguf_file import GGUFFile
from .model_source import resolve_model
from .models import model_args
from .models.shard import Shard


def check_split(model, tp: int) -> None:
    """Refuse (one-line error) a model that cannot be split over `tp` ranks, or whose tensors hold an inf
    or NaN scale or value (`GGUFFile.check_finite`), before starting them: each rank checks only the rows
    it reads, and one failing alone would leave the others waiting at a collective."""
    with GGUFFile(resolve_model(model)) as g:
        Shard.plan(g, model_args(g), 0, tp)
        for name in g.tensors:
            g.check_finite(name)


def default_backend(device: str | None = None) -> str:
    """mlx.launch's backend for local ranks: NCCL where MLX runs on a CUDA GPU, else the TCP ring."""
    import mlx.core as mx

    return "nccl" if mx.cuda.is_available() and device != "cpu" else "ring"


def free_ports(n: int, host: str = "127.0.0.1") -> int:
    """A port P with P .. P + n - 1 free on `host` now: mlx.launch's ring listens on consecutive ports
    from its --starting-port (32323 unless told) and NCCL's coordinator on --nccl-port, so two local runs
    started at once on the defaults would join each other's ranks. (A port taken between this check and
    the ranks' bind fails their start: an error, never another run's ranks.)"""
    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
            return True

    for _ in range(64):
        with socket.socket() as s:
            s.bind((host, 0))
            first = s.getsockname()[1]
        if first + n <= 65536 and all(free(p) for p in range(first, first + n)):
            return first
    raise RequestError(f"no {n} consecutive free ports on {host} for the tensor-parallel ranks")


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
    require_distributed()
    launcher = shutil.which("mlx.launch")
    cmd = [launcher] if launcher else [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]
    backend = default_backend(device)
    cmd += ["-n", str(tp), "--backend", backend]
    # ports of this run's own (the launcher's defaults are fixed: two runs at once would meet)
    cmd += ["--nccl-port", str(free_ports(1))] if backend == "nccl" else ["--starting-port", str(free_ports(tp))]
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
