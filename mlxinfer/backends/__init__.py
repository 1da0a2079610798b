"""Backend registry: `make_backend(name, attention)` builds the backend a user asked for."""

from __future__ import annotations

from ..backend import Backend, use_per_head_attention
from ..errors import RequestError

BACKENDS = ("auto", "cpu", "mlx")
ATTENTION_PATHS = ("fused", "per-head")


def mlx_gpu_available() -> bool:
    try:
        from .mlx import gpu_kind
    except ImportError:
        return False
    return gpu_kind() is not None


def make_backend(name: str = "auto", attention: str = "fused", device: str | None = None,
                 kernel: str | None = None) -> Backend:
    if name not in BACKENDS:
        raise RequestError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if attention not in ATTENTION_PATHS:
        raise RequestError(f"unknown attention path {attention!r} (choose from {', '.join(ATTENTION_PATHS)})")
    if name == "auto":
        name = "mlx" if mlx_gpu_available() else "cpu"
    if name == "cpu":
        if device not in (None, "cpu"):
            raise RequestError(f"the cpu backend runs on the CPU only (asked for device {device!r})")
        if kernel is not None:
            raise RequestError(f"--kernel {kernel} selects an MLX attention kernel; the cpu backend has its own")
        from .cpu import CPUBackend

        backend = CPUBackend()
    else:
        from .mlx import MLXBackend

        backend = MLXBackend(device=device, kernel=kernel)
    if attention == "per-head":
        use_per_head_attention(backend)
    return backend
