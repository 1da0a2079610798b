"""mlxinfer: LLM inference from GGUF files on Apple's MLX, with a numpy reference backend.

    import mlxinfer
    engine = mlxinfer.load()                       # default model, best backend here
    print(engine.generate("The capital of France is", max_tokens=16).text)
"""

import os

# OpenBLAS's idle threads spin for 2^28 cycles (~0.1 s) after each product before they sleep, and on
# the cpu backend the attention softmax runs on our own threads right after the score product: the
# spinning thread took a core from it (a [3, 320, 8000] block: 7 ms alone, 12-15 ms right after a
# product). 2^12 cycles instead: prefill of 4,000 tokens 15.1 -> 13.1 s here, decode unchanged. Read
# by OpenBLAS when numpy loads, so it applies where mlxinfer is imported first (the CLI always);
# a value already in the environment wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")

from .errors import GGUFError, MlxinferError, RequestError, UnsupportedError  # noqa: E402
from .engine import Engine, load  # noqa: E402
from .loop import FinishEvent, Generation, TokenEvent  # noqa: E402
from .tokenizer import GGUFTokenizer, load_tokenizer  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "FinishEvent",
    "Generation",
    "GGUFError",
    "GGUFTokenizer",
    "MlxinferError",
    "RequestError",
    "TokenEvent",
    "UnsupportedError",
    "load",
    "load_tokenizer",
    "__version__",
]
