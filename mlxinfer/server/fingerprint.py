"""`system_fingerprint`: one string that changes when what decides a server's outputs changes, so that a
client can tell when the same request may give other tokens: the model file (its digest,
`GGUFFile.digest`: size, header and last MiB of tensor data), the engine's version and the kernels that
run it.
"""

import hashlib

from .. import __version__
from ..backends import kernel_checks


def system_fingerprint(engine) -> str:
    """"fp_" and 16 hex digits of SHA-256 over the model file's digest, the version, the kernels' sources
    (`kernel_checks.sources_digest`), the backend (its kernels, attention and threads: BLAS reductions split
    by thread count) and the KV cache kind."""
    h = hashlib.sha256(engine.gguf.digest())
    backend = engine.backend
    for part in (__version__, kernel_checks.sources_digest(), backend.describe(), backend.attention, engine.kv,
                 str(getattr(backend, "kernel", None)), str(engine.shard.size)):
        h.update(b"\0" + part.encode())
    return "fp_" + h.hexdigest()[:16]
