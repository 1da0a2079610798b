"""`mlxinfer inspect FILE`: architecture, hyperparameters, tokenizer summary and the tensor table;
`mlxinfer inspect --kernels`: the GPU kernels' self-check on this machine, in one line."""

from __future__ import annotations

import re

import numpy as np

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
            lines.append(f"  {'name':<{w}}  {'type':<6}  {'shape':<18}  bytes")
            for t in sorted(g.tensors.values(), key=lambda t: natural_key(t.name)):
                lines.append(f"  {t.name:<{w}}  {t.type_name:<6}  {str(list(t.shape)):<18}  {t.nbytes}")
    return "\n".join(lines) + "\n"


def kernels_report() -> tuple[str, bool]:
    """(one line, passed): the MLX backend on this machine's GPU, its kernels run through their
    self-check (every plan they run, bit for bit against the per-head reference). The first thing to run
    on a Mac: the Metal kernels have never run on Apple hardware where mlxinfer is developed."""
    try:
        backend = make_backend("mlx", device="gpu")
    except ImportError as e:
        return f"kernels: MLX is not installed ({e}): nothing to check", False
    except MlxinferError as e:
        return f"kernels: {e}: nothing to check", False
    return backend.kernel_report()
