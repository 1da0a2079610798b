"""The GPU self-check's verdicts, kept so that a kernel is checked once per machine, not once per process.

The MLX backend never runs its own GPU kernels unchecked: at first use on a device it runs
`verify_gpu_kernels` (every launch plan against the per-head reference, bit for bit) and falls back to
MLX's own ops and per-head attention if anything differs; the block kernels (`verify_block_kernels`, bit
for bit their published order) have a verdict of their own, so one family failing leaves the other on
(kind "cuda blocks" or "metal blocks", no KV dtype). The check compiles
every kernel form it launches (on CUDA all at once, into MLX's kernel cache: `cuda_jit`; about a minute on
a fresh H200, seconds once compiled), and a benchmark or a test suite starts many backends, so its
verdict is remembered: in this process, and on disk (`kernel-checks.json` in mlxinfer's cache), keyed by
everything that decides it: the digest of the kernel sources and of the Python that launches them and
holds the reference, MLX's version, the GPU kind and device name, and the dtypes. The same key gives
the same bits, so the verdict is reused; any change of code, MLX or GPU checks again. A damaged or
unwritable file only means checking again (one warning line when it cannot be written).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from functools import lru_cache
from pathlib import Path

from .. import cuda_jit
from ..model_source import cache_dir

_ROOT = Path(__file__).resolve().parent.parent  # the mlxinfer package
# what decides a verdict: the kernels, the code that launches them, the reference they are checked against
SOURCES = ("../metal_kernels", "kernels.py", "block_kernels.py", "cuda_jit.py", "backend.py", "backends/mlx.py",
           "backends/mlx_kv.py", "backends/mlx_weights.py", "kv_cache.py", "batch.py")
_VERDICTS: dict[str, str | None] = {}  # this process's


@lru_cache(maxsize=None)
def sources_digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        path = (_ROOT / name).resolve()
        files = sorted(p for p in path.iterdir() if p.suffix in (".cu", ".metal")) if path.is_dir() else [path]
        for f in files:
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def device_name(kind: str) -> str:
    """The GPU's name where MLX tells it (best effort: the key only needs to tell machines apart)."""
    import mlx.core as mx

    try:
        info = mx.device_info(mx.gpu)
        return str(info.get("device_name") or info.get("name") or "")
    except Exception:
        return ""


def key(kind: str, dtype: str, kv_dtype: str) -> str:
    import mlx.core as mx

    built = f" {cuda_jit.identity()}" if kind.startswith("cuda") else ""  # who compiled the kernels, and how
    return f"{sources_digest()} mlx {mx.__version__} {kind} {device_name(kind)!r} {dtype} {kv_dtype}{built}"


def _file() -> Path:
    return cache_dir() / "kernel-checks.json"


def _read() -> dict:
    try:
        data = json.loads(_file().read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def verdict(kind: str, dtype: str, kv_dtype: str, run, fresh: bool = False) -> str | None:
    """The self-check's verdict for this key (None: passed, else its one-line problem): remembered in
    this process or on disk, else (or with `fresh`) `run()` now and remembered."""
    k = key(kind, dtype, kv_dtype)
    if not fresh and k in _VERDICTS:
        return _VERDICTS[k]
    known = _read()
    if not fresh and k in known and isinstance(known[k], dict) and "problem" in known[k]:
        _VERDICTS[k] = known[k]["problem"]
        return _VERDICTS[k]
    _VERDICTS[k] = problem = run()
    known[k] = {"problem": problem}
    path = _file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        print(f"mlxinfer: warning: cannot keep the kernel self-check's verdict in {path} ({e.strerror}): "
              "it runs again in the next process", file=sys.stderr)
    return problem
