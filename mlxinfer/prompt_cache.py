"""Prefix blocks on disk (`--prompt-cache-dir`): the paged KV cache's full prompt blocks kept across
restarts, so a prompt that starts like one served before (a long system prompt, a document) skips their
prefill after the server comes back.

One file per block: its keys and values for every layer (float32, exactly the cache's values), named by
SHA-256 of the cache's identity and every token up to the block's end. The identity
(`PagedKVCache`'s caller makes it: `Engine.prompt_cache_identity`) covers what decides the values: the
model file's digest, the engine's version, the backend and its kernels, the prefill chunk, the shapes;
so another model, backend or kernel set never reads these blocks (it looks up other names). A file is

    MAGIC (8 bytes) | its name's digest (32) | SHA-256 of the body (32) | body: [2, layers, block, width] float32

and is written to a temporary file in the directory and renamed over (atomic: a reader sees the whole
file or none). One that is truncated, corrupt or of another shape is a miss: one warning line, the file
removed, never an exception or a wrong value. The directory is bounded (`max_bytes`): after each write
the least recently used files (by modification time, which a hit refreshes) are removed until it fits.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile

import numpy as np

from .errors import RequestError

log = logging.getLogger("mlxinfer.prompt_cache")

MAGIC = b"MLXIKV1\0"
HEADER = len(MAGIC) + 32 + 32
SUFFIX = ".kvblock"


class DiskPrefixCache:
    def __init__(self, directory, max_bytes: int, identity: bytes, n_layers: int, block_size: int, width: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise RequestError(f"prompt cache size must be a positive number of bytes, got {max_bytes!r}")
        self.directory = os.fspath(directory)
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise RequestError(f"prompt cache directory {self.directory}: {e.strerror}") from None
        self.max_bytes, self.identity = max_bytes, identity
        self.shape = (2, n_layers, block_size, width)
        self.block_bytes = HEADER + 4 * int(np.prod(self.shape))
        self.hits = 0  # blocks read back

    def _name(self, prefix) -> bytes:
        """The digest that names the block ending the token list `prefix`."""
        return hashlib.sha256(self.identity + np.asarray(prefix, dtype="<i8").tobytes()).digest()

    def _path(self, name: bytes) -> str:
        return os.path.join(self.directory, name.hex() + SUFFIX)

    def has(self, prefix) -> bool:
        return os.path.exists(self._path(self._name(prefix)))

    def load(self, prefix) -> np.ndarray | None:
        """The [2, layers, block, width] keys and values of the block ending `prefix`, or None (a miss)."""
        name = self._name(prefix)
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                data = f.read(self.block_bytes + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("prompt cache: %s unreadable (%s): treated as a miss", path, e.strerror)
            return None
        body = data[HEADER:]
        problem = ("wrong size" if len(data) != self.block_bytes else "not a block file" if data[:8] != MAGIC
                   else "another block's name" if data[8:40] != name
                   else "corrupt (checksum)" if hashlib.sha256(body).digest() != data[40:72] else None)
        if problem:
            log.warning("prompt cache: %s is %s: removed, treated as a miss", path, problem)
            self._remove(path)
            return None
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        self.hits += 1
        return np.frombuffer(body, dtype="<f4").reshape(self.shape)

    def save(self, prefix, block: np.ndarray) -> None:
        """Keep the block ending `prefix` ([2, layers, block, width] float32), unless it is kept already."""
        name = self._name(prefix)
        path = self._path(name)
        if os.path.exists(path):
            return
        body = np.ascontiguousarray(block, dtype="<f4").tobytes()
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + name + hashlib.sha256(body).digest() + body)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("prompt cache: could not write %s (%s)", path, e.strerror)
            self._remove(tmp)
            return
        self._evict()

    def _evict(self) -> None:
        """Remove the least recently used block files until the directory holds at most max_bytes."""
        files = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(SUFFIX):
                try:
                    st = entry.stat()
                except OSError:
                    continue
                files.append((st.st_mtime_ns, st.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            self._remove(path)
            total -= size

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.remove(path)
        except OSError:
            pass
