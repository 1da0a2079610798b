"""One file per architecture; `ARCHITECTURES` maps `general.architecture` to its module, which has
`TRAITS` (what `ModelArgs` needs to know of it) and `Model` (its forward pass)."""

from ..errors import UnsupportedError
from . import gemma2, gemma3, llama, phi3, qwen2, qwen3, qwen3moe
from .spec import ModelArgs

ARCHITECTURES = {"gemma2": gemma2, "gemma3": gemma3, "llama": llama, "phi3": phi3, "qwen2": qwen2, "qwen3": qwen3, "qwen3moe": qwen3moe}


def architecture(g):
    """The module of the file's architecture, or UnsupportedError."""
    arch = g.architecture
    module = ARCHITECTURES.get(arch)
    if module is None:
        raise UnsupportedError(
            f"{g.path}: architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return module


def model_args(g) -> ModelArgs:
    return ModelArgs.from_gguf(g, **architecture(g).TRAITS)


def load_model(ops, g):
    """Read the hyperparameters, check every tensor's shape, load the weights onto `ops`."""
    return architecture(g).Model(ops, g, model_args(g))
