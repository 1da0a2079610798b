"""A corpus of malformed GGUF files, each made from one valid small model by a targeted edit, with the
message mlxinfer must give for it.

    python3 -m tests.malformed OUT_DIR      # writes every case as OUT_DIR/<name>.gguf

`cases(valid_bytes)` yields Case(name, data, stage, pattern): `stage` is "parse" when opening the file
must fail, "load" when the file parses but loading the model must fail.
"""

from __future__ import annotations

import os
import re
import struct
import sys
from dataclasses import dataclass

import numpy as np

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass
class Case:
    name: str
    data: bytes
    stage: str  # "parse" or "load"
    pattern: str  # regular expression the one-line error must match


@dataclass
class Layout:
    """Byte positions of a GGUF file's sections, found by an independent walk of the format."""

    kv: list  # (key, entry_start, value_type_pos, value_pos, entry_end)
    tensors: list  # (name, entry_start, ndims_pos, type_pos, offset_pos, entry_end)
    info_end: int
    data_start: int
    data: dict  # name -> (abs_start, nbytes)


def _skip_value(b: bytes, pos: int, vtype: int) -> int:
    if vtype in _SCALAR_SIZES:
        return pos + _SCALAR_SIZES[vtype]
    if vtype == 8:
        (n,) = struct.unpack_from("<Q", b, pos)
        return pos + 8 + n
    (etype, count) = struct.unpack_from("<IQ", b, pos)
    pos += 12
    for _ in range(count):
        pos = _skip_value(b, pos, etype)
    return pos


def layout(b: bytes) -> Layout:
    _, _, n_t, n_kv = struct.unpack_from("<4sIQQ", b, 0)
    pos, kv = 24, []
    for _ in range(n_kv):
        start = pos
        (n,) = struct.unpack_from("<Q", b, pos)
        key = b[pos + 8 : pos + 8 + n].decode()
        tpos = pos + 8 + n
        (vtype,) = struct.unpack_from("<I", b, tpos)
        end = _skip_value(b, tpos + 4, vtype)
        kv.append((key, start, tpos, tpos + 4, end))
        pos = end
    tensors = []
    for _ in range(n_t):
        start = pos
        (n,) = struct.unpack_from("<Q", b, pos)
        name = b[pos + 8 : pos + 8 + n].decode()
        ndims_pos = pos + 8 + n
        (nd,) = struct.unpack_from("<I", b, ndims_pos)
        type_pos = ndims_pos + 4 + 8 * nd
        tensors.append((name, start, ndims_pos, type_pos, type_pos + 4, type_pos + 12))
        pos = type_pos + 12
    data_start = (pos + 31) // 32 * 32
    data = {}
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for name, _, ndims_pos, type_pos, offset_pos, _ in tensors:
        (nd,) = struct.unpack_from("<I", b, ndims_pos)
        dims = struct.unpack_from(f"<{nd}Q", b, ndims_pos + 4)
        (t,) = struct.unpack_from("<I", b, type_pos)
        (off,) = struct.unpack_from("<Q", b, offset_pos)
        bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType(t)]
        data[name] = (data_start + off, int(np.prod(dims)) // bs * ts)
    return Layout(kv, tensors, pos, data_start, data)


def _patch(b: bytes, pos: int, fmt: str, *values) -> bytes:
    out = bytearray(b)
    struct.pack_into(fmt, out, pos, *values)
    return bytes(out)


def _find_kv(lay, key):
    return next(e for e in lay.kv if e[0] == key)


def _find_tensor(lay, name):
    return next(e for e in lay.tensors if e[0] == name)


def cases(b: bytes):
    lay = layout(b)
    first_kv, last_t = lay.kv[0], lay.tensors[-1]
    emb = "token_embd.weight"
    emb_start, emb_bytes = lay.data[emb]

    # truncation at every section boundary and inside each section
    cuts = {
        "empty": 0, "magic-only": 4, "mid-version": 6, "header-no-counts": 8, "mid-tensor-count": 12,
        "header-only": 24, "mid-first-key": first_kv[1] + 10, "after-first-key": first_kv[2],
        "mid-first-value": first_kv[3] + 2, "after-metadata": lay.kv[-1][4],
        "mid-tensor-info": lay.tensors[0][1] + 12, "after-tensor-info": lay.info_end,
        "mid-tensor-data": emb_start + emb_bytes // 2, "before-last-byte": len(b) - 1,
    }
    for name, at in cuts.items():
        pattern = r"not a GGUF file|truncated|passes the end of the file|cannot fit"
        yield Case(f"truncated-{name}", b[:at], "parse", pattern)

    yield Case("bad-magic", b"GGML" + b[4:], "parse", r"not a GGUF file \(magic b'GGML'")
    yield Case("version-99", _patch(b, 4, "<I", 99), "parse", r"unsupported GGUF version 99")
    yield Case("version-1", _patch(b, 4, "<I", 1), "parse", r"unsupported GGUF version 1")
    yield Case("tensor-count-2^40", _patch(b, 8, "<Q", 1 << 40), "parse", r"tensor count 1099511627776 cannot fit")
    yield Case("metadata-count-2^40", _patch(b, 16, "<Q", 1 << 40), "parse",
               r"metadata count 1099511627776 cannot fit")
    pad = b"\0" * (32 << 17)  # room enough that only the cap on entries refuses the count
    yield Case("tensor-count-2^17", _patch(b, 8, "<Q", 1 << 17) + pad, "parse",
               r"tensor count 131072 is more than mlxinfer reads \(65536\)")
    yield Case("metadata-count-2^17", _patch(b, 16, "<Q", 1 << 17) + pad, "parse",
               r"metadata count 131072 is more than mlxinfer reads \(65536\)")
    yield Case("key-length-past-eof", _patch(b, first_kv[1], "<Q", len(b) * 4), "parse",
               r"metadata key #0 needs \d+ bytes.*left|truncated")
    tokens = _find_kv(lay, "tokenizer.ggml.tokens")
    yield Case("string-array-length-2^40", _patch(b, tokens[3] + 4, "<Q", 1 << 40), "parse",
               r"'tokenizer.ggml.tokens': array of 1099511627776 STRING cannot fit")
    yield Case("string-length-past-eof", _patch(b, tokens[3] + 12, "<Q", 1 << 50), "parse",
               r"'tokenizer.ggml.tokens' item 0: string length \d+ passes the end of the file")
    types = _find_kv(lay, "tokenizer.ggml.token_type")
    yield Case("numeric-array-length-2^40", _patch(b, types[3] + 4, "<Q", 1 << 40), "parse",
               r"'tokenizer.ggml.token_type': array of 1099511627776 INT32 needs \d+ bytes")
    yield Case("unknown-value-type", _patch(b, first_kv[2], "<I", 77), "parse", r"unknown value type 77")
    yield Case("unknown-array-element-type", _patch(b, tokens[3], "<I", 99), "parse", r"unknown value type 99")

    t_emb = _find_tensor(lay, emb)
    yield Case("tensor-offset-past-eof", _patch(b, t_emb[4], "<Q", len(b) * 2 // 32 * 32), "parse",
               r"tensor 'token_embd.weight' data .* passes the end of the file")
    yield Case("tensor-offset-misaligned", _patch(b, last_t[4], "<Q", struct.unpack_from("<Q", b, last_t[4])[0] + 4),
               "parse", r"offset \d+ is not aligned to 32 bytes")
    second = lay.tensors[1]
    yield Case("tensors-overlap", _patch(b, second[4], "<Q", struct.unpack_from("<Q", b, t_emb[4])[0]), "parse",
               r"overlap in the file")
    yield Case("unknown-tensor-type", _patch(b, t_emb[3], "<I", 250), "parse",
               r"tensor 'token_embd.weight' has unknown type 250")
    yield Case("tensor-dims-0", _patch(b, t_emb[2], "<I", 0), "parse", r"has 0 dimensions")
    yield Case("tensor-dims-9", _patch(b, t_emb[2], "<I", 9), "parse", r"has 9 dimensions")
    yield Case("tensor-huge-shape", _patch(b, t_emb[2] + 4, "<Q", 1 << 62), "parse",
               r"passes the end of the file|not a multiple")
    yield Case("unsupported-tensor-type", _patch(b, _find_tensor(lay, "blk.0.ffn_up.weight")[3], "<I", 39), "load",
               r"tensor 'blk.0.ffn_up.weight' has type MXFP4, which mlxinfer does not support")

    heads = _find_kv(lay, "qwen3.attention.head_count")
    yield Case("head-count-inconsistent", _patch(b, heads[3], "<I", 2), "load",
               r"tensor 'blk.0.attn_[qkv].weight' has shape \[\d+, \d+\], expected \[\d+, \d+\]")
    kvh = _find_kv(lay, "qwen3.attention.head_count_kv")
    yield Case("head-count-kv-not-divisor", _patch(b, kvh[3], "<I", 3), "load",
               r"head_count 4 is not a multiple of head_count_kv 3")
    blocks = _find_kv(lay, "qwen3.block_count")
    yield Case("block-count-2^31", _patch(b, blocks[3], "<I", 1 << 31), "load",
               r"missing tensor 'blk.2.attn_norm.weight'")
    yield Case("missing-required-tensor", b.replace(b"blk.1.ffn_down.weight", b"blk.1.ffn_dowX.weight"), "load",
               r"missing tensor 'blk.1.ffn_down.weight'")
    eps = _find_kv(lay, "qwen3.attention.layer_norm_rms_epsilon")
    yield Case("rms-eps-nan", _patch(b, eps[3], "<f", float("nan")), "load",
               r"qwen3.attention.layer_norm_rms_epsilon = nan is not a positive finite number")
    yield Case("vocab-size-differs-from-embedding", rewrite(b, extra_token=True), "load",
               r"tokenizer has 321 tokens but token_embd.weight has 320 rows")
    norm_start, _ = lay.data["blk.1.attn_norm.weight"]
    yield Case("nan-in-norm", _patch(b, norm_start + 8, "<f", float("nan")), "load",
               r"tensor 'blk.1.attn_norm.weight' \(F32\) has an inf or NaN value: value 2$")
    yield Case("inf-in-norm", _patch(b, lay.data["output_norm.weight"][0], "<f", float("inf")), "load",
               r"tensor 'output_norm.weight' \(F32\) has an inf or NaN value: value 0$")
    for key, v in (("tokenizer.ggml.bos_token_id", 100000), ("tokenizer.ggml.eos_token_id", 320)):
        yield Case(f"{key.split('.')[-1].replace('_', '-')}-out-of-range", _patch(b, _find_kv(lay, key)[3], "<I", v),
                   "load", rf"{key} = {v} is not a token id in \[0, 320\)")
    for key in ("feed_forward_length", "context_length", "embedding_length"):
        yield Case(f"{key.replace('_', '-')}-0", _patch(b, _find_kv(lay, f"qwen3.{key}")[3], "<I", 0), "load",
                   rf"qwen3.{key} = 0 must be positive")
    yield Case("partial-rope-dims", rewrite(b, edits={"qwen3.rope.dimension_count": 8}), "load",
               r"partial rotary embedding \(qwen3.rope.dimension_count 8 != head dim 16\) is not supported")
    yield Case("value-length-differs", rewrite(b, edits={"qwen3.attention.key_length": 16,
                                                          "qwen3.attention.value_length": 8}), "load",
               r"key_length 16 != value_length 8 is not supported")
    yield Case("head-dim-odd", rewrite(b, edits={"qwen3.attention.key_length": 15, "qwen3.attention.value_length": 15}),
               "load", r"head dimension 15 must be a positive even number")
    # metadata of the wrong type: an array, a string or a bool where a number, a flag or a name belongs
    yield Case("duplicate-key", b.replace(b"general.file_type", b"qwen3.block_count", 1), "parse",
               r"duplicate metadata key 'qwen3.block_count'")
    yield Case("alignment-bool", rewrite(b, edits={"general.alignment": True}), "parse",
               r"metadata key 'general.alignment' should be int, found bool")
    for name, key, value, want, found in (
            ("key-length-array", "qwen3.attention.key_length", [16, 16], "int", "an array"),
            ("head-count-kv-array", "qwen3.attention.head_count_kv", [2, 2], "int", "an array"),
            ("rope-dims-string", "qwen3.rope.dimension_count", "16", "int", "str"),
            ("vocab-size-array", "qwen3.vocab_size", [320], "int", "an array"),
            ("freq-base-bool", "qwen3.rope.freq_base", True, "int or float", "bool"),
            ("tokenizer-model-array", "tokenizer.ggml.model", ["gpt2", "gpt2"], "str", "an array"),
            ("tokenizer-pre-int", "tokenizer.ggml.pre", 7, "str", "int"),
            ("add-bos-array", "tokenizer.ggml.add_bos_token", [True, False], "bool", "an array"),
            ("eos-bool", "tokenizer.ggml.eos_token_id", True, "int", "bool"),
            ("chat-template-int", "tokenizer.chat_template", 5, "str", "int")):
        yield Case(name, rewrite(b, edits={key: value}), "load",
                   rf"metadata key '{re.escape(key)}' should be {want}, found {found}")
    yield Case("token-type-strings", rewrite(b, edits={"tokenizer.ggml.token_type": ["x"] * 320}), "load",
               r"metadata key 'tokenizer.ggml.token_type' should be an integer array")


def rewrite(b: bytes, extra_token: bool = False, edits: dict | None = None) -> bytes:
    """The same model written again with the gguf writer, with an edit a byte patch cannot make."""
    import tempfile

    from mlxinfer.gguf_file import GGUFFile
    from mlxinfer.synthetic import rewrite_gguf

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "src.gguf"), os.path.join(tmp, "dst.gguf")
        with open(src, "wb") as f:
            f.write(b)
        edits = dict(edits or {})
        if extra_token:
            with GGUFFile(src) as g:
                edits["tokenizer.ggml.tokens"] = g.metadata["tokenizer.ggml.tokens"] + ["<|extra|>"]
                edits["tokenizer.ggml.token_type"] = np.append(g.metadata["tokenizer.ggml.token_type"], np.int32(1))
        rewrite_gguf(src, dst, edits=edits)
        with open(dst, "rb") as f:
            return f.read()


def valid_model_bytes(tmp_dir: str) -> bytes:
    from mlxinfer.synthetic import write_synthetic_model

    path = write_synthetic_model(os.path.join(tmp_dir, "valid.gguf"), arch="qwen3", n_layers=2, hidden=64, ffn=96,
                                 n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=320, seed=0)
    with open(path, "rb") as f:
        return f.read()


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for c in cases(valid_model_bytes(out_dir)):
        with open(os.path.join(out_dir, c.name + ".gguf"), "wb") as f:
            f.write(c.data)
        print(f"{c.name}.gguf  ({c.stage}: /{c.pattern}/)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "malformed")
