"""Backend registry: `make_backend(name, attention, device, kernel, ..., dtype, kv_dtype)` builds the backend
a user asked for.
Each backend checks its own options and reports its configuration with `describe()`."""

from __future__ import annotations

from ..backend import ATTENTION_PATHS, Backend
from ..errors import RequestError
from .cpu import CPUBackend

BACKENDS = ("auto", "cpu", "mlx")
__all__ = ["ATTENTION_PATHS", "BACKENDS", "make_backend", "mlx_gpu_available"]


def mlx_gpu_available() -> bool:
    try:  # MLX is imported only where it is asked for: the numpy backend runs without it
        from .mlx import gpu_kind
    except ImportError:
        return False
    return gpu_kind() is not None


def make_backend(name: str = "auto", attention: str = "fused", device: str | None = None,
                 kernel: str | None = None, threads: int | None = None, ranks: int = 1, dtype: str | None = None,
                 kv_dtype: str | None = None) -> Backend:
    if name not in BACKENDS:
        raise RequestError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "auto":  # MLX where it has a GPU, or where a GPU was asked for (MLX then says if it has none)
        name = "mlx" if mlx_gpu_available() or device == "gpu" else "cpu"
    if name == "cpu":
        if device not in (None, "cpu"):
            raise RequestError(f"the cpu backend runs on the CPU only (asked for device {device!r})")
        if kernel is not None:
            raise RequestError(f"--kernel {kernel} selects an MLX attention kernel; the cpu backend has its own")
        for option, value in (("--dtype", dtype), ("--kv-dtype", kv_dtype)):
            if value not in (None, "float32"):
                raise RequestError(f"{option} {value}: the cpu backend computes and stores float32 only "
                                   "(--backend mlx)")
        return CPUBackend(attention=attention, threads=threads, ranks=ranks)
    from .mlx import MLXBackend  # (imports MLX)

    return MLXBackend(attention=attention, device=device, kernel=kernel, threads=threads, ranks=ranks, dtype=dtype,
                      kv_dtype=kv_dtype)
