"""The exception types mlxinfer raises for bad input.

Every error a user can cause (a missing or malformed file, an unsupported model, a bad request) is an
`MlxinferError`; the CLI prints its message on one line and exits with status 1.
"""


class MlxinferError(Exception):
    """Base class: a problem with the user's input, reported in one line."""


class GGUFError(MlxinferError, ValueError):
    """The file is not a well-formed GGUF file, or it lacks what the model needs."""


class UnsupportedError(MlxinferError):
    """The file is valid but uses an architecture, tokenizer or tensor type mlxinfer does not implement."""


class RequestError(MlxinferError, ValueError):
    """A generation request that cannot be served (empty prompt, too long for the context, bad option)."""
