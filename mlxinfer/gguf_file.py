"""GGUF reading: header, typed metadata, tensor index and memory-mapped tensor data.

Why not `gguf.GGUFReader`: it builds a numpy memmap view for every part of every metadata field, so the
152k-token vocabulary (two string arrays of ~150k entries each) costs hundreds of thousands of tiny numpy
objects: ~50 s on `ggml-vocab-qwen2.gguf`. This reader walks the metadata once with `struct` over one
`mmap` (string arrays become one Python list, numeric arrays one `np.frombuffer`) and takes well under a
second on the same file. Types, block sizes and dequantisation still come from the `gguf` package.

The file is untrusted: every length, count, offset and shape is checked against the bytes that are
actually there before anything is allocated, and every problem raises `GGUFError` naming the file.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize as _gguf_dequantize

from . import quants
from .errors import GGUFError, UnsupportedError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_ARRAY_NESTING = 4
MAX_ENTRIES = 1 << 16  # tensors, and metadata keys, a file may declare: real checkpoints hold a few
# thousand tensors at most (a Llama-3 405B GGUF: ~1,140), and every entry costs a few hundred bytes of
# Python objects, so a file of a million tiny tensors would take ~20x its size in memory to list

# Scalar value types: struct format and size.
_SCALARS = {
    GGUFValueType.UINT8: ("<B", 1, np.uint8),
    GGUFValueType.INT8: ("<b", 1, np.int8),
    GGUFValueType.UINT16: ("<H", 2, np.uint16),
    GGUFValueType.INT16: ("<h", 2, np.int16),
    GGUFValueType.UINT32: ("<I", 4, np.uint32),
    GGUFValueType.INT32: ("<i", 4, np.int32),
    GGUFValueType.FLOAT32: ("<f", 4, np.float32),
    GGUFValueType.BOOL: ("<?", 1, np.bool_),
    GGUFValueType.UINT64: ("<Q", 8, np.uint64),
    GGUFValueType.INT64: ("<q", 8, np.int64),
    GGUFValueType.FLOAT64: ("<d", 8, np.float64),
}

# Tensor types this engine reads. Dequantisation of each is `gguf.quants.dequantize`, which is
# llama.cpp's own reference code ported to numpy.
SUPPORTED_TENSOR_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.IQ4_NL,
    GGMLQuantizationType.IQ4_XS,
)


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor index. `shape` is in numpy (row-major) order: GGUF's `ne` reversed."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    """Bounds-checked reads from a buffer; every read that would pass the end raises GGUFError."""

    def __init__(self, buf, path: str):
        self.buf = buf
        self.pos = 0
        self.end = len(buf)
        self.path = path

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.end:
            raise self.fail(
                f"truncated: {what} needs {n} bytes at offset {self.pos}, file has {self.end - self.pos} left"
            )

    def unpack(self, fmt: str, size: int, what: str):
        self.need(size, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None


def _value_type(c: _Cursor, raw: int, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise c.fail(f"metadata key {key!r}: unknown value type {raw}") from None


def typed_value(meta: dict, key: str, kind: type | tuple[type, ...], default: Any = None,
                source: str = "<metadata>") -> Any:
    """meta[key] if it is of `kind` (a type or a tuple of types; a bool only where `kind` names bool),
    `default` when the key is absent. A file's metadata is untrusted: an array or a string where a
    number belongs is a GGUFError naming the key, not a numpy error three calls later."""
    if key not in meta:
        return default
    v = meta[key]
    if isinstance(v, np.generic):  # numpy scalars of a hand-built dict
        v = v.item()
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not (bool in kinds if isinstance(v, bool) else isinstance(v, kinds)):
        found = "an array" if isinstance(v, (list, np.ndarray)) else type(v).__name__
        want = " or ".join(k.__name__ for k in kinds)
        raise GGUFError(f"{source}: metadata key {key!r} should be {want}, found {found}")
    return v


def _read_value(c: _Cursor, vtype: GGUFValueType, key: str, depth: int = 0) -> Any:
    if vtype in _SCALARS:
        fmt, size, _ = _SCALARS[vtype]
        return c.unpack(fmt, size, f"value of {key!r}")
    if vtype == GGUFValueType.STRING:
        return c.string(f"value of {key!r}")
    # ARRAY
    if depth >= MAX_ARRAY_NESTING:
        raise c.fail(f"metadata key {key!r}: arrays nested deeper than {MAX_ARRAY_NESTING}")
    etype = _value_type(c, c.u32(f"array type of {key!r}"), key)
    count = c.u64(f"array length of {key!r}")
    remaining = c.end - c.pos
    if etype in _SCALARS:
        _, size, dtype = _SCALARS[etype]
        if count * size > remaining:
            raise c.fail(
                f"metadata key {key!r}: array of {count} {etype.name} needs {count * size} bytes, "
                f"file has {remaining} left"
            )
        arr = np.frombuffer(c.buf, dtype=dtype, count=count, offset=c.pos).copy()
        c.pos += count * size
        return arr
    # Strings (8-byte length each) and nested arrays (12-byte header each): bound the count first.
    min_size = 8 if etype == GGUFValueType.STRING else 12
    if count * min_size > remaining:
        raise c.fail(
            f"metadata key {key!r}: array of {count} {etype.name} cannot fit in the {remaining} bytes left"
        )
    if etype == GGUFValueType.STRING:
        return _read_string_array(c, count, key)
    return [_read_value(c, etype, key, depth + 1) for _ in range(count)]


def _read_string_array(c: _Cursor, count: int, key: str) -> list[str]:
    # The hot loop of vocabulary loading: local names, no per-item bounds helper.
    buf, pos, end = c.buf, c.pos, c.end
    unpack_from = struct.unpack_from
    out = [None] * count
    for i in range(count):
        if pos + 8 > end:
            c.pos = pos
            raise c.fail(f"truncated: metadata key {key!r} item {i} of {count} passes the end of the file")
        n = unpack_from("<Q", buf, pos)[0]
        pos += 8
        if n > end - pos:
            c.pos = pos
            raise c.fail(
                f"metadata key {key!r} item {i}: string length {n} passes the end of the file"
            )
        out[i] = str(buf[pos : pos + n], "utf-8", "replace")
        pos += n
    c.pos = pos
    return out


class GGUFFile:
    """A parsed GGUF file: `.metadata` (dict), `.tensors` (name -> TensorInfo), tensor data by mmap.

    Tensor bytes are never read until `raw(name)` / `dequantize(name)` is called, and then only that
    tensor's pages are touched.
    """

    DIGEST_HEAD = 64 << 20  # a vocabulary of 150,000 tokens and its merges are ~10 MB of metadata
    DIGEST_TAIL = 1 << 20

    def digest(self) -> bytes:
        """SHA-256 of the file's size, its header (the metadata and tensor table, up to DIGEST_HEAD) and its
        last DIGEST_TAIL bytes of tensor data, which a re-quantization or a fine-tune with the same metadata
        changes too: what tells one model file from another without reading it whole (a 70B file would
        take minutes)."""
        h = hashlib.sha256()
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            h.update(f.read(min(self.data_offset, self.DIGEST_HEAD)))
            f.seek(max(self.data_offset, size - self.DIGEST_TAIL))
            h.update(f.read(self.DIGEST_TAIL))
        h.update(str(size).encode())
        return h.digest()

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._finite: set = set()  # (tensor, rows) `check_finite` passed
        if not os.path.exists(self.path):
            raise GGUFError(f"{self.path}: no such file")
        if os.path.isdir(self.path):
            raise GGUFError(f"{self.path}: is a directory, not a GGUF file")
        size = os.path.getsize(self.path)
        if size < 4:
            raise GGUFError(f"{self.path}: not a GGUF file (only {size} bytes)")
        try:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:  # unreadable (permissions), or not a file mmap can map
            raise GGUFError(f"{self.path}: cannot read it: {e.strerror or e}") from None
        self._buf = memoryview(self._mmap)
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        buf, self._buf = getattr(self, "_buf", None), None
        if buf is not None:
            buf.release()
        mm = getattr(self, "_mmap", None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # numpy views still alive: let the GC unmap it
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- parsing -------------------------------------------------------------------------------
    def _parse(self) -> None:
        c = _Cursor(self._buf, self.path)
        magic = bytes(self._buf[:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        c.pos = 4
        self.version = c.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            raise GGUFError(
                f"{self.path}: unsupported GGUF version {self.version} (supported: 2, 3)"
            )
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        # Each metadata entry takes at least 8+4 bytes, each tensor entry at least 8+4+8+4+8.
        if n_kv * 12 > c.end - c.pos:
            raise GGUFError(f"{self.path}: metadata count {n_kv} cannot fit in a {c.end}-byte file")
        if n_tensors * 32 > c.end - c.pos:
            raise GGUFError(f"{self.path}: tensor count {n_tensors} cannot fit in a {c.end}-byte file")
        for what, n in (("metadata count", n_kv), ("tensor count", n_tensors)):
            if n > MAX_ENTRIES:
                raise GGUFError(f"{self.path}: {what} {n} is more than mlxinfer reads ({MAX_ENTRIES})")

        meta: dict[str, Any] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            if key in meta:  # llama.cpp's gguf reader refuses these too
                raise c.fail(f"duplicate metadata key {key!r}")
            vtype = _value_type(c, c.u32(f"value type of {key!r}"), key)
            meta[key] = _read_value(c, vtype, key)
        self.metadata = meta

        align = typed_value(meta, "general.alignment", int, DEFAULT_ALIGNMENT, str(self.path))
        if align <= 0 or align & (align - 1) or align > 1 << 20:
            raise GGUFError(f"{self.path}: general.alignment {align!r} is not a power of two")
        self.alignment = align

        entries = []
        for i in range(n_tensors):
            name = c.string(f"name of tensor #{i}")
            n_dims = c.u32(f"dimension count of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
            ne = [c.u64(f"shape of tensor {name!r}") for _ in range(n_dims)]
            raw_type = c.u32(f"type of tensor {name!r}")
            offset = c.u64(f"offset of tensor {name!r}")
            entries.append((name, ne, raw_type, offset))

        data_start = (c.pos + align - 1) // align * align
        self.data_offset = data_start
        file_size = c.end
        tensors: dict[str, TensorInfo] = {}
        for name, ne, raw_type, offset in entries:
            if name in tensors:
                raise GGUFError(f"{self.path}: tensor {name!r} appears twice in the tensor index")
            try:
                gtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name!r} has unknown type {raw_type}") from None
            if any(d == 0 for d in ne):
                raise GGUFError(f"{self.path}: tensor {name!r} has a zero dimension {ne}")
            block, type_size = GGML_QUANT_SIZES[gtype]
            if ne[0] % block:
                raise GGUFError(
                    f"{self.path}: tensor {name!r} row length {ne[0]} is not a multiple of "
                    f"{gtype.name}'s block size {block}"
                )
            n = 1
            for d in ne:
                n *= d
            nbytes = n // block * type_size
            if offset % align:
                raise GGUFError(
                    f"{self.path}: tensor {name!r} offset {offset} is not aligned to {align} bytes"
                )
            start = data_start + offset
            if start + nbytes > file_size:
                raise GGUFError(
                    f"{self.path}: tensor {name!r} data [{start}, {start + nbytes}) passes the end of "
                    f"the file ({file_size} bytes)"
                )
            tensors[name] = TensorInfo(name, tuple(reversed(ne)), gtype, start, nbytes)
        by_offset = sorted(tensors.values(), key=lambda t: t.offset)
        for a, b in zip(by_offset, by_offset[1:]):
            if a.offset + a.nbytes > b.offset:
                raise GGUFError(f"{self.path}: tensors {a.name!r} and {b.name!r} overlap in the file")
        self.tensors = tensors

    # -- metadata helpers ----------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return self.require("general.architecture", str)

    def get(self, key: str, default: Any = None, kind: type | tuple[type, ...] | None = None) -> Any:
        """The key's value, `default` when absent; with `kind`, checked as `typed_value` does."""
        if kind is None:
            return self.metadata.get(key, default)
        return typed_value(self.metadata, key, kind, default, str(self.path))

    def require(self, key: str, kind: type | tuple[type, ...] = (int, float)) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: missing metadata key {key!r}")
        return typed_value(self.metadata, key, kind, None, str(self.path))

    # -- tensor data ---------------------------------------------------------------------------
    def tensor(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path}: missing tensor {name!r}")
        return t

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file (no copy)."""
        t = self.tensor(name)
        return np.frombuffer(self._mmap, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in numpy order (a fresh array, or a view for F32)."""
        t = self.tensor(name)
        if t.ggml_type not in SUPPORTED_TENSOR_TYPES:
            raise UnsupportedError(
                f"{self.path}: tensor {name!r} has type {t.type_name}, which mlxinfer does not support "
                f"(supported: {', '.join(x.name for x in SUPPORTED_TENSOR_TYPES)})"
            )
        self.check_finite(name)
        raw = self.raw(name)
        if t.ggml_type == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(t.shape)
        if t.ggml_type == GGMLQuantizationType.F16:
            return raw.view(np.float16).astype(np.float32).reshape(t.shape)
        rows = raw.reshape(-1, t.nbytes // (t.n_elements // t.shape[-1]))
        return _gguf_dequantize(rows, t.ggml_type).astype(np.float32, copy=False).reshape(t.shape)

    CHECK_BYTES = 1 << 24  # `check_finite` reads this many bytes of rows at a time

    def check_finite(self, name: str, rows: tuple[int, int] | None = None) -> None:
        """Refuse a tensor with an inf or NaN scale (a quantized block's fp16 d, dmin or m) or value (F32,
        F16, BF16) in one line naming it, its type and the first such block or value, in the file's
        rows (`quants.nonfinite`): every logit it reached would be one too. `rows`: only rows [a, b)
        (of the rows over all leading axes). Read CHECK_BYTES at a time, once (the loaders call it
        before using a tensor's bytes)."""
        if (name, rows) in self._finite or (name, None) in self._finite:
            return
        t = self.tensor(name)
        raw = self.raw(name)
        n = t.n_elements // t.shape[-1]
        row_bytes = t.nbytes // n
        first, end = rows or (0, n)
        step = max(1, self.CHECK_BYTES // row_bytes)
        for r0 in range(first, end, step):
            part = raw[r0 * row_bytes:min(end, r0 + step) * row_bytes]
            bad = quants.nonfinite(part.reshape(-1, row_bytes), t.ggml_type)
            if bad.any():
                r, i = np.unravel_index(int(np.argmax(bad)), bad.shape)
                at = [int(v) for v in np.unravel_index(r0 + int(r), t.shape[:-1])] if len(t.shape) > 1 else []
                where = "".join(f" of {what} {v}" for what, v in zip(("row", "expert")[:len(at)], at[::-1]))
                what, unit = (("value", "value") if t.ggml_type in (GGMLQuantizationType.F32, *quants.HALF_TYPES)
                              else ("scale", "block"))
                raise GGUFError(f"{self.path}: tensor {name!r} ({t.type_name}) has an inf or NaN {what}: "
                                f"{unit} {int(i)}{where}")
        self._finite.add((name, rows))


class ShardedGGUF:
    """A GGUF file whose sliced tensors read as this rank's slice: `tensor(name)` has the slice's shape,
    `raw(name)` its bytes, `dequantize(name)` its floats; other tensors read as in the file.
    `output.weight` of a model with a tied output head is the embedding's rows; `sources` names other
    tensors read from another one's rows (Phi-3's attn_q/k/v from its fused attn_qkv, with their cuts)."""

    dequantize = GGUFFile.dequantize  # the file's dequantizer, over this view's tensor() and raw()

    def __init__(self, g: GGUFFile, cuts: dict, sources: dict | None = None):
        self.g, self.cuts, self.path = g, cuts, g.path
        self.metadata, self.tensors = g.metadata, g.tensors
        self.sources = sources or {}

    def get(self, key, default=None, kind=None):
        return self.g.get(key, default, kind)

    def require(self, key, kind=(int, float)):
        return self.g.require(key, kind)

    def check_finite(self, name: str) -> None:
        """The file's check (`GGUFFile.check_finite`) of what this tensor reads (a cut of whole rows: those
        rows only; of columns: every row), named and its rows counted as the file has them."""
        cut = self.cuts.get(name)
        rows = tuple(cut[1:3]) if cut is not None and cut[0] == 0 else None
        self.g.check_finite(self._source(name), rows)

    def _source(self, name: str) -> str:
        if name == "output.weight" and "output.weight" not in self.g.tensors:
            return "token_embd.weight"
        return self.sources.get(name, name)

    def tensor(self, name: str) -> TensorInfo:
        t = self.g.tensor(self._source(name))
        cut = self.cuts.get(name)
        if cut is None:
            return t
        axis, start, stop, pad_to = cut
        rows, cols = t.shape
        block, block_bytes = GGML_QUANT_SIZES[t.ggml_type]
        if axis == 0:
            n = pad_to or (stop - start)
            return TensorInfo(name, (n, cols), t.ggml_type, t.offset, n * (cols // block) * block_bytes)
        return TensorInfo(name, (rows, stop - start), t.ggml_type, t.offset,
                          rows * ((stop - start) // block) * block_bytes)

    def raw(self, name: str) -> np.ndarray:
        src = self._source(name)
        cut = self.cuts.get(name)
        if cut is None:
            return self.g.raw(src)
        t = self.g.tensor(src)
        axis, start, stop, pad_to = cut
        rows, cols = t.shape
        block, block_bytes = GGML_QUANT_SIZES[t.ggml_type]
        row_bytes = cols // block * block_bytes
        if axis == 0:  # whole rows: a view of the map, padded with zero rows (zero in every type) if asked
            part = self.g.raw(src)[start * row_bytes: stop * row_bytes]
            if pad_to and pad_to > stop - start:
                part = np.concatenate([part, np.zeros((pad_to - (stop - start)) * row_bytes, np.uint8)])
            return part
        # column blocks of every row: only these bytes of each row are read
        full = self.g.raw(src).reshape(rows, row_bytes)
        return np.ascontiguousarray(full[:, start // block * block_bytes: stop // block * block_bytes]).reshape(-1)
