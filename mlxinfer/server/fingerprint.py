"""`system_fingerprint`: one string that changes when what decides a server's outputs changes, so that a
client can tell when the same request may give other tokens: the model file, the engine's version and
the kernels that run it.

The file is not hashed whole (a 70B file would take minutes at startup): its size, its header (the
metadata and tensor table, everything before the tensor data, up to HEAD_BYTES) and its last TAIL_BYTES
of tensor data, which a re-quantization or a fine-tune with the same metadata changes too.
"""

import hashlib
import os

from .. import __version__

HEAD_BYTES = 64 << 20  # a vocabulary of 150,000 tokens and its merges are ~10 MB of metadata
TAIL_BYTES = 1 << 20


def system_fingerprint(engine) -> str:
    """"fp_" and 16 hex digits of SHA-256 over the file's size, head and tail, the version, the backend
    (its kernels, attention and threads: BLAS reductions split by thread count) and the KV cache kind."""
    h = hashlib.sha256()
    size = os.path.getsize(engine.path)
    with open(engine.path, "rb") as f:
        h.update(f.read(min(engine.gguf.data_offset, HEAD_BYTES)))
        f.seek(max(engine.gguf.data_offset, size - TAIL_BYTES))
        h.update(f.read(TAIL_BYTES))
    backend = engine.backend
    for part in (str(size), __version__, backend.describe(), backend.attention, engine.kv,
                 str(getattr(backend, "kernel", None)), str(engine.shard.size)):
        h.update(b"\0" + part.encode())
    return "fp_" + h.hexdigest()[:16]
