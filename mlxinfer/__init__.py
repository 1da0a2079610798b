"""mlxinfer: LLM inference from GGUF files on Apple's MLX, with a numpy reference backend.

    import mlxinfer
    engine = mlxinfer.load()                       # default model, best backend here
    print(engine.generate("The capital of France is", max_tokens=16).text)
"""

from .errors import GGUFError, MlxinferError, RequestError, UnsupportedError
from .generate import Engine, Generation, load
from .tokenizer import GGUFTokenizer, load_tokenizer

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "Generation",
    "GGUFError",
    "GGUFTokenizer",
    "MlxinferError",
    "RequestError",
    "UnsupportedError",
    "load",
    "load_tokenizer",
    "__version__",
]
