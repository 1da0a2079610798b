"""One file per architecture; `ARCHITECTURES` maps `general.architecture` to its loader."""

from ..errors import UnsupportedError
from . import llama, qwen3

ARCHITECTURES = {"llama": llama.load, "qwen3": qwen3.load}


def model_loader(g):
    """The loader for the file's architecture, or UnsupportedError."""
    arch = g.architecture
    loader = ARCHITECTURES.get(arch)
    if loader is None:
        raise UnsupportedError(
            f"{g.path}: architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return loader


def load_model(ops, g):
    return model_loader(g)(ops, g)
