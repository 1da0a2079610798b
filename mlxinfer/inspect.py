"""`mlxinfer inspect FILE`: architecture, hyperparameters, tokenizer summary and the tensor table;
`mlxinfer inspect --kernels`: the GPU kernels' self-check on this machine, in one line."""

from __future__ import annotations

import re

import numpy as np

from . import quants
from .backends import make_backend
from .errors import MlxinferError
from .gguf_file import GGUFFile
from .tokenizer import GGUFTokenizer


def natural_key(name: str):
    """Sort key that orders numbers by value: blk.2 before blk.10."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name)]


def _short(v) -> str:
    if isinstance(v, np.ndarray):
        return f"[{v.dtype} x {v.size}]"
    if isinstance(v, list):
        return f"[{len(v)} items]"
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _storage_summary(tensors) -> list[str]:
    """Per type: how the MLX backend keeps its matrices (`quants.storage`) and the bytes they take in
    the file and in memory (vectors, the norms, are float32 there)."""
    by_type: dict = {}
    for t in tensors:
        kind = quants.storage(t.ggml_type) if len(t.shape) == 2 else "float32 (vectors)"
        n, f, m = by_type.get((t.type_name, kind), (0, 0, 0))
        by_type[(t.type_name, kind)] = (n + 1, f + t.nbytes, m + quants.memory_bytes(t.ggml_type, t.shape))
    lines = ["MLX storage by type:"]
    for (name, kind), (n, f, m) in sorted(by_type.items()):
        lines.append(f"  {name:<6}  {n:>4} tensors  {f / 1e6:10.2f} MB in the file, {m / 1e6:10.2f} MB in memory ({kind})")
    f, m = sum(v[1] for v in by_type.values()), sum(v[2] for v in by_type.values())
    lines.append(f"  all     {len(tensors):>4} tensors  {f / 1e6:10.2f} MB in the file, {m / 1e6:10.2f} MB in memory "
                 f"({m / f:.3f}x)" if f else "  (no tensor bytes)")
    return lines


def describe(path) -> str:
    lines = []
    with GGUFFile(path) as g:
        arch = g.get("general.architecture", "?")
        lines.append(f"file: {path}")
        lines.append(f"gguf version: {g.version}, {len(g.metadata)} metadata keys, {len(g.tensors)} tensors")
        lines.append(f"architecture: {arch}")
        if g.get("general.name"):
            lines.append(f"name: {g.get('general.name')}")
        lines.append("")
        lines.append("hyperparameters:")
        for k, v in g.metadata.items():
            if k.startswith(f"{arch}."):
                lines.append(f"  {k[len(arch) + 1:]}: {_short(v)}")
        lines.append("")
        if "tokenizer.ggml.model" in g.metadata:
            try:
                lines.append("tokenizer: " + GGUFTokenizer.from_metadata(g.metadata, source=str(path)).summary())
            except MlxinferError as e:
                lines.append(f"tokenizer: unavailable ({e})")
        else:
            lines.append("tokenizer: none")
        lines.append("")
        total = sum(t.nbytes for t in g.tensors.values())
        lines.append(f"tensors ({len(g.tensors)}, {total / 1e6:.1f} MB):")
        if g.tensors:
            w = max(len(n) for n in g.tensors)
            lines.append(f"  {'name':<{w}}  {'type':<6}  {'shape':<18}  {'bytes':>12}  {'MLX bytes':>12}")
            for t in sorted(g.tensors.values(), key=lambda t: natural_key(t.name)):
                lines.append(f"  {t.name:<{w}}  {t.type_name:<6}  {str(list(t.shape)):<18}  {t.nbytes:>12}  "
                             f"{quants.memory_bytes(t.ggml_type, t.shape):>12}")
            lines.append("")
            lines.extend(_storage_summary(g.tensors.values()))
    return "\n".join(lines) + "\n"


def kernels_report() -> tuple[str, bool]:
    """(one line, passed): the MLX backend on this machine's GPU, its kernels run through their
    self-check (every plan they run, bit for bit against the per-head reference), over a cache of the
    default dtype and over a q8_0 cache (the kernels then read packed int8 rows: a check, and a verdict,
    of its own). The first thing to run on a Mac: the Metal kernels have never run on Apple hardware
    where mlxinfer is developed."""
    try:
        backend = make_backend("mlx", device="gpu")
        q8 = make_backend("mlx", device="gpu", kv_dtype="q8_0")
    except ImportError as e:
        return f"kernels: MLX is not installed ({e}): nothing to check", False
    except MlxinferError as e:
        return f"kernels: {e}: nothing to check", False
    line, passed = backend.kernel_report()
    _, q8_passed = q8.kernel_report()
    return f"{line}; over a q8_0 KV cache: {'passed' if q8_passed else f'FAILED ({q8.fallback})'}", passed and q8_passed
