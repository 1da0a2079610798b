import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

from mlxinfer.errors import GGUFError, UnsupportedError
from mlxinfer.gguf_file import GGUFFile

from .conftest import QWEN2_VOCAB


def f16_bytes(values):
    return np.asarray(values, dtype=np.float16).view(np.uint8)


def random_kquant_rows(qtype, rows, row_len, rng):
    """Valid random K-quant blocks: random quants and scales, finite small f16 super-block scales."""
    n_blocks = row_len // 256
    if qtype == Q.Q4_K:
        b = rng.integers(0, 256, size=(rows, n_blocks, 144), dtype=np.uint8)
        b[..., 0:2] = f16_bytes(rng.uniform(0.001, 0.01, (rows, n_blocks))).reshape(rows, n_blocks, 2)
        b[..., 2:4] = f16_bytes(rng.uniform(0.001, 0.01, (rows, n_blocks))).reshape(rows, n_blocks, 2)
        return b.reshape(rows, -1)
    b = rng.integers(0, 256, size=(rows, n_blocks, 210), dtype=np.uint8)
    b[..., 208:210] = f16_bytes(rng.uniform(0.001, 0.01, (rows, n_blocks))).reshape(rows, n_blocks, 2)
    return b.reshape(rows, -1)


def ref_dequant_q4_k(block):
    """Q4_K, written from llama.cpp's block layout (dequantize_row_q4_K), one 144-byte block."""
    d, dmin = np.frombuffer(bytes(block[0:4]), dtype=np.float16).astype(np.float32)
    sc, qs = block[4:16], block[16:144]

    def scale_min(j):
        if j < 4:
            return sc[j] & 63, sc[j + 4] & 63
        return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)

    out = []
    for j in range(4):
        s1, m1 = scale_min(2 * j)
        s2, m2 = scale_min(2 * j + 1)
        q = qs[32 * j : 32 * j + 32]
        out += [d * s1 * (x & 0xF) - dmin * m1 for x in q]
        out += [d * s2 * (x >> 4) - dmin * m2 for x in q]
    return np.array(out, dtype=np.float32)


def ref_dequant_q6_k(block):
    """Q6_K, written from llama.cpp's block layout (dequantize_row_q6_K), one 210-byte block."""
    ql, qh = block[0:128].astype(np.int32), block[128:192].astype(np.int32)
    sc = block[192:208].view(np.int8).astype(np.int32)
    d = np.frombuffer(bytes(block[208:210]), dtype=np.float16).astype(np.float32)[0]
    y = np.zeros(256, dtype=np.float32)
    for n in range(2):
        L, H, S, Y = ql[64 * n :], qh[32 * n :], sc[8 * n :], 128 * n
        for l in range(32):
            i = l // 16
            y[Y + l] = d * S[i] * (((L[l] & 0xF) | ((H[l] & 3) << 4)) - 32)
            y[Y + l + 32] = d * S[i + 2] * (((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) - 32)
            y[Y + l + 64] = d * S[i + 4] * (((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32)
            y[Y + l + 96] = d * S[i + 6] * (((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32)
    return y


@pytest.fixture(scope="module")
def typed_file(tmp_path_factory):
    """One GGUF holding a [3, 512] tensor of every required type, and the float data behind them."""
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("types") / "types.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("test.count", 3)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    expected = {}
    w.add_tensor("f32", x)
    expected["f32"] = (x, 0.0)
    for name, qt, tol in [("f16", Q.F16, 2e-3), ("bf16", Q.BF16, 2e-2), ("q8_0", Q.Q8_0, 0.03),
                          ("q4_0", Q.Q4_0, 0.35), ("q4_1", Q.Q4_1, 0.3)]:
        w.add_tensor(name, quantize(x, qt), raw_dtype=qt)
        expected[name] = (x, tol)
    for name, qt, ref in [("q4_k", Q.Q4_K, ref_dequant_q4_k), ("q6_k", Q.Q6_K, ref_dequant_q6_k)]:
        raw = random_kquant_rows(qt, 3, 512, rng)
        w.add_tensor(name, raw, raw_dtype=qt)
        bsz = raw.shape[1] // 2
        expected[name] = (np.stack([np.concatenate([ref(r[:bsz]), ref(r[bsz:])]) for r in raw]), 1e-6)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path), expected


def test_every_required_tensor_type_reads_back(typed_file):
    path, expected = typed_file
    with GGUFFile(path) as g:
        assert g.metadata["test.count"] == 3
        assert {t.type_name for t in g.tensors.values()} == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}
        for name, (want, tol) in expected.items():
            got = g.dequantize(name)
            assert got.shape == (3, 512) and got.dtype == np.float32
            assert np.max(np.abs(got - want)) <= tol * max(1.0, np.max(np.abs(want))), name


def test_tensor_index_sizes_and_offsets(typed_file):
    path, _ = typed_file
    with GGUFFile(path) as g:
        t = g.tensor("q8_0")
        assert t.shape == (3, 512) and t.nbytes == 3 * 16 * 34
        assert t.offset % g.alignment == 0 and t.offset >= g.data_offset
        assert g.tensor("q4_k").nbytes == 3 * 2 * 144
        assert g.tensor("q6_k").nbytes == 3 * 2 * 210


def test_tensor_data_is_memory_mapped_not_copied(typed_file):
    path, _ = typed_file
    with GGUFFile(path) as g:
        raw = g.raw("q4_1")
        assert not raw.flags.owndata and not raw.flags.writeable
        assert g.dequantize("f32").base is not None  # F32 is a view of the mapping


def test_vocab_metadata_types(tmp_path):
    with GGUFFile(QWEN2_VOCAB) as g:
        assert g.architecture == "qwen2"
        assert len(g.metadata["tokenizer.ggml.tokens"]) == 151936
        assert g.metadata["tokenizer.ggml.token_type"].dtype == np.int32
        assert g.metadata["qwen2.rope.freq_base"] == 1000000.0
        assert g.tensors == {}


def test_not_gguf_and_missing_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(GGUFError, match=r"x.gguf: not a GGUF file \(magic b'PK\\x03\\x04'"):
        GGUFFile(p)
    with pytest.raises(GGUFError, match="nope.gguf: no such file"):
        GGUFFile(tmp_path / "nope.gguf")


def test_unreadable_file(tmp_path, monkeypatch):
    """A file the user may not read (EACCES: root reads any file, so the refusal is simulated)."""
    from mlxinfer import gguf_file

    p = tmp_path / "locked.gguf"
    p.write_bytes(b"GGUF" + b"\0" * 100)

    def refuse(path, mode="r", *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(gguf_file, "open", refuse, raising=False)
    with pytest.raises(GGUFError, match="locked.gguf: cannot read it: Permission denied"):
        GGUFFile(p)


def test_unsupported_version(tmp_path):
    p = tmp_path / "v9.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 9, 0, 0))
    with pytest.raises(GGUFError, match="unsupported GGUF version 9"):
        GGUFFile(p)


def test_unsupported_tensor_type_is_reported_on_use(tmp_path):
    p = tmp_path / "iq.gguf"  # IQ2_XXS: a type llama.cpp's 2-bit presets write, not read here
    w = GGUFWriter(str(p), "llama")
    w.add_tensor("w", np.zeros((2, 66), dtype=np.uint8), raw_dtype=Q.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(p) as g:
        assert g.tensor("w").shape == (2, 256)
        with pytest.raises(UnsupportedError, match="tensor 'w' has type IQ2_XXS, which mlxinfer does not support"):
            g.dequantize("w")
        with pytest.raises(GGUFError, match="missing tensor 'nope'"):
            g.tensor("nope")


def test_signed_metadata_reads_signed(tmp_path):
    """INT8/16/32/64 scalars and arrays keep their sign (an INT8 -1 is not 255), unsigned ones stay unsigned."""
    p = tmp_path / "signed.gguf"
    w = GGUFWriter(str(p), "llama")
    w.add_int8("t.i8", -1)
    w.add_uint8("t.u8", 255)
    w.add_int16("t.i16", -300)
    w.add_int32("t.i32", -70000)
    w.add_int64("t.i64", -(1 << 40))
    from gguf import GGUFValueType

    w.add_key_value("t.i8s", [-128, -1, 127], GGUFValueType.ARRAY, sub_type=GGUFValueType.INT8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with GGUFFile(p) as g:
        m = g.metadata
        assert (m["t.i8"], m["t.u8"], m["t.i16"], m["t.i32"], m["t.i64"]) == (-1, 255, -300, -70000, -(1 << 40))
        assert [int(x) for x in m["t.i8s"]] == [-128, -1, 127]
