"""The MLX backend: exact weight repacking, agreement with the CPU reference, and byte identity of
every fused-attention override that can run here against the per-head default on the same device."""

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from hypothesis import given, settings

import mlx.core as mx
import mlxinfer
from mlxinfer.backends.mlx import GROUP, REPACK, MLXBackend, gpu_kind
from mlxinfer.errors import RequestError
from mlxinfer.testing import assert_matches_default, attention_inputs

from .reference.specs import QWEN3_SYNTHETIC


def override_backends():
    """(id, backend or None, reason) for every override of the MLX backend: run what can run here."""
    gpu = gpu_kind()
    yield "graph-cpu", lambda: MLXBackend(device="cpu", kernel="graph"), None
    for kind in ("cuda", "metal"):
        reason = None if gpu == kind else f"needs an MLX {kind} GPU (this machine has {gpu or 'no GPU'})"
        yield f"{kind}-kernel", (lambda k=kind: MLXBackend(device="gpu", kernel=k)), reason
    reason = None if gpu else "needs an MLX GPU"
    yield "graph-gpu", lambda: MLXBackend(device="gpu", kernel="graph"), reason


OVERRIDES = [pytest.param(make, id=name, marks=[pytest.mark.skip(reason=why)] if why else [])
             for name, make, why in override_backends()]


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_repack_is_exact(qtype):
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((6, 256)).astype(np.float32) * 3
    raw = quantize(x, qtype)
    repack, bits = REPACK[qtype]
    w, s, b = repack(raw.reshape(-1), 6, 256)
    got = mx.dequantize(mx.array(w), mx.array(s), mx.array(b), group_size=GROUP, bits=bits)
    want = dequantize(raw, qtype)
    assert np.array_equal(np.array(got), want)


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    from mlxinfer.synthetic import write_synthetic_model

    return write_synthetic_model(tmp_path_factory.mktemp("q3") / "q3.gguf", QWEN3_SYNTHETIC)


def test_mlx_logits_match_cpu_reference_on_synthetic_qwen3(qwen3_path):
    ids = [1, 17, 250, 99, 3, 300, 42, 42, 7]
    a = mlxinfer.load(qwen3_path, backend="cpu").logits(ids)
    b = mlxinfer.load(qwen3_path, backend="mlx").logits(ids)
    assert np.max(np.abs(a - b)) < 1e-3


def test_mlx_logits_match_cpu_reference_on_smollm2(smollm2_path):
    cpu = mlxinfer.load(smollm2_path, backend="cpu")
    ml = mlxinfer.load(smollm2_path, backend="mlx")
    assert any(type(w).__name__ == "QuantizedWeight" for w in vars(ml.model.layers[0]).values())
    ids = cpu.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    assert np.max(np.abs(cpu.logits(ids) - ml.logits(ids))) < 1e-3
    assert ml.generate("The capital of France is", max_tokens=4).text.startswith(" Paris")


def test_q4_k_and_f16_weights_are_dequantized_not_misread(tmp_path):
    """K-quants go through gguf's dequantisation, never mx.load (which mis-decodes Q4_K)."""
    from tests.test_gguf import random_kquant_rows
    from gguf import GGUFWriter

    rng = np.random.default_rng(0)
    p = tmp_path / "k.gguf"
    w = GGUFWriter(str(p), "llama")
    w.add_tensor("q4k", random_kquant_rows(Q.Q4_K, 4, 512, rng), raw_dtype=Q.Q4_K)
    w.add_tensor("f16", rng.standard_normal((4, 512)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from mlxinfer.gguf_file import GGUFFile

    g = GGUFFile(p)
    b = MLXBackend(device="cpu")
    x = rng.standard_normal((2, 512)).astype(np.float32)
    for name in ("q4k", "f16"):
        got = np.array(b.matmul(b.from_numpy(x), b.load_weight(g, name)))
        np.testing.assert_allclose(got, x @ g.dequantize(name).T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make", OVERRIDES)
@settings(max_examples=int(os.environ.get("MLXINFER_PROPERTY_EXAMPLES", 60)), deadline=None)
@given(case=attention_inputs())
def test_fused_attention_override_is_byte_identical(make, case):
    assert_matches_default(make(), case)


@pytest.mark.parametrize("make", OVERRIDES)
def test_full_model_fused_vs_per_head_bitwise(make, qwen3_path):
    """Synthetic Qwen3: logits bitwise equal, greedy text identical for 64 tokens."""
    from mlxinfer.backend import use_per_head_attention

    fused = mlxinfer.Engine(qwen3_path, make(), "fused")
    per_head = mlxinfer.Engine(qwen3_path, use_per_head_attention(make()), "per-head")
    ids = [1, 17, 250, 99, 3, 300, 42, 42, 7, 128, 255, 64]
    assert np.array_equal(fused.logits(ids).view(np.uint32), per_head.logits(ids).view(np.uint32))
    a, b = fused.generate(ids, max_tokens=64), per_head.generate(ids, max_tokens=64)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 64


def test_device_gpu_without_gpu_is_a_clear_error():
    if gpu_kind():
        pytest.skip("this machine has an MLX GPU")
    with pytest.raises(RequestError, match="--device gpu: MLX has no GPU here"):
        MLXBackend(device="gpu")


def test_pipelined_greedy_equals_synchronous(qwen3_path, monkeypatch):
    engine = mlxinfer.load(qwen3_path, backend="mlx")
    assert hasattr(engine.backend, "async_argmax") and engine.pipeline
    piped = engine.generate([1, 17, 250, 99], max_tokens=24)
    engine.pipeline = False
    sync = engine.generate([1, 17, 250, 99], max_tokens=24)
    assert piped.token_ids == sync.token_ids and len(piped.token_ids) == 24
    assert len(piped.metrics.forward_ms) == 24
    # stopping at an end-of-generation token works the same when the next step is already queued
    monkeypatch.setattr(engine.tokenizer, "eog_ids", frozenset({sync.token_ids[5]}))
    engine.pipeline = True
    stopped = engine.generate([1, 17, 250, 99], max_tokens=24)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == sync.token_ids[: sync.token_ids.index(sync.token_ids[5])]
