"""Correctness against llama.cpp (all-F32 weights, F32 KV cache), from committed fixtures."""

import os
import re

import numpy as np
import pytest

import mlxinfer
from mlxinfer.batch import Batch
from mlxinfer.errors import GGUFError, UnsupportedError
from mlxinfer.synthetic import write_synthetic_model

from .conftest import REFERENCE, write_empty_gguf
from .reference.specs import QWEN3_SYNTHETIC

# Against llama.cpp on all-F32 copies, measured here (2026-11-30, both backends): synthetic Qwen3 within
# 2.5e-6, SmolLM2 within 9.4e-5 (logits up to 27). Bounds: about 4x the measured error, so that a wrong
# RMS epsilon or RoPE base (errors of 1e-4 and more on the synthetic model) fails.
LOGIT_ATOL = {"qwen3_synthetic": 1e-5, "smollm2": 4e-4}
TIE_GAP = 1e-3


def load_fixture(name):
    return dict(np.load(os.path.join(REFERENCE, name + ".npz")))


def greedy_agrees(ours, ref, gaps, eos):
    """Token-identical until EOS or the first step whose top-2 gap in the reference is < TIE_GAP."""
    for i, want in enumerate(ref):
        if gaps[i] < TIE_GAP:
            return True
        if want == eos:
            return i == len(ours)  # we stopped exactly there
        if i >= len(ours) or ours[i] != want:
            return False
    return True


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return write_synthetic_model(tmp_path_factory.mktemp("q3") / "qwen3.gguf", QWEN3_SYNTHETIC)


def check_against_reference(engine, name, pipeline=True):
    """Prompt logits within the measured bound; greedy tokens as llama.cpp's, alone (pipelined or not)
    and inside a batch of three with other prompts."""
    ref = load_fixture(name)
    ids = ref["prompt_ids"].tolist()
    logits = engine.logits(ids)
    assert logits.dtype == np.float32 and logits.shape == ref["prompt_logits"].shape
    assert np.max(np.abs(logits - ref["prompt_logits"])) < LOGIT_ATOL[name]
    engine.pipeline = pipeline
    gen = engine.generate(ids, max_tokens=len(ref["greedy"]))
    assert greedy_agrees(gen.token_ids, ref["greedy"].tolist(), ref["top2_gap"], int(ref["eos"]))
    batch = engine.generate_batch([ids[:2], ids, ids[1:]], max_tokens=len(ref["greedy"]))
    assert batch[1].token_ids == gen.token_ids
    return gen


BACKENDS = [("cpu", True), ("mlx", True), ("mlx", False)]


@pytest.mark.parametrize("backend,pipeline", BACKENDS, ids=["cpu", "mlx-pipelined", "mlx-sync"])
def test_synthetic_qwen3_matches_llama_cpp(qwen3_path, backend, pipeline):
    engine = mlxinfer.load(qwen3_path, backend=backend, prefill_chunk=5)
    a = engine.args
    assert a.head_dim != a.hidden // a.n_heads and not a.tied_output
    gen = check_against_reference(engine, "qwen3_synthetic", pipeline)
    assert len(gen.token_ids) == 48  # never hit a near-tie: all 48 compared


@pytest.mark.parametrize("backend,pipeline", BACKENDS, ids=["cpu", "mlx-pipelined", "mlx-sync"])
def test_smollm2_matches_llama_cpp(smollm2_path, backend, pipeline):
    engine = mlxinfer.load(smollm2_path, backend=backend)
    ref_ids = load_fixture("smollm2")["prompt_ids"].tolist()
    assert engine.tokenizer.encode("The capital of France is", add_special=True, parse_special=True) == ref_ids
    gen = check_against_reference(engine, "smollm2", pipeline)
    assert gen.text.startswith(" Paris")
    assert gen.finish_reason == "stop"


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_and_per_head_attention_are_byte_identical_end_to_end(synthetic, arch):
    path = synthetic(arch=arch, n_layers=2, hidden=96, ffn=160, n_heads=6, n_kv_heads=2, head_dim=32,
                     vocab_size=400, seed=5)
    fused = mlxinfer.load(path, backend="cpu", attention="fused")
    per_head = mlxinfer.load(path, backend="cpu", attention="per-head")
    ids = list(range(3, 40))
    assert np.array_equal(fused.logits(ids).view(np.uint32), per_head.logits(ids).view(np.uint32))
    a = fused.generate(ids[:5], max_tokens=64)
    b = per_head.generate(ids[:5], max_tokens=64)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 10


def decode_logits(engine, ids, n_prefill):
    """Logits of positions n_prefill.. computed one decode pass at a time after a prefill of n_prefill."""
    ops, cache = engine.backend, engine.new_cache()
    slot = cache.alloc()
    rows = []
    for start, n in [(0, n_prefill)] + [(i, 1) for i in range(n_prefill, len(ids))]:
        batch = Batch(ops, [slot], [start], [n])
        cache.reserve(batch)
        rows.append(ops.to_numpy(engine.model(ops, ops.index_array(ids[start:start + n]), batch, cache)))
    return np.concatenate(rows[1:])


@pytest.mark.parametrize("kv", ["prealloc", "basic"])
def test_decode_with_cache_matches_full_prefill(synthetic, kv):
    """Logits of position i from one decode step after the cache holds 0..i-1 equal the prefill's row i,
    within what two BLAS paths give. Error model: a decode row's products go to OpenBLAS's gemv, a
    prefill chunk's to its gemm, which sum each dot product (at most ffn = 128 terms here) in another
    order; each reassociation moves a result by a few ulps of its magnitude, carried through two layers
    to logits of magnitude up to ~48. Measured: at most 3.5 ulps of the largest logit (1.34e-5 at 47.6)
    with OPENBLAS_CORETYPE unset, Haswell, SkylakeX, Zen, Prescott and Sandybridge (each picks other
    kernels). Bound: 16 ulps of the largest logit (~4.5x)."""
    path = synthetic(arch="qwen3", n_layers=2, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=32, seed=3)
    e = mlxinfer.load(path, backend="cpu", kv=kv)
    ids = [5, 9, 200, 31, 77, 12]
    full = e.logits(ids)
    ulp = np.spacing(np.abs(full).max())
    np.testing.assert_allclose(decode_logits(e, ids, 3), full[3:], rtol=0, atol=16 * ulp)


def test_unsupported_architecture(tmp_path):
    p = write_empty_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(UnsupportedError, match="architecture 'gpt2' is not supported"):
        mlxinfer.load(p, backend="cpu")


def test_missing_tensor_is_named(tmp_path, synthetic):
    from mlxinfer.backends.cpu import CPUBackend
    from mlxinfer.gguf_file import GGUFFile
    from mlxinfer.models import load_model

    path = synthetic(arch="llama", n_layers=2)
    g = GGUFFile(path)
    del g.tensors["blk.1.ffn_up.weight"]
    with pytest.raises(GGUFError, match="missing tensor 'blk.1.ffn_up.weight'"):
        load_model(CPUBackend(), g)


def test_what_the_forward_pass_does_not_apply_is_refused(synthetic, tmp_path):
    """Nothing a file asks for is ignored: Llama 3's RoPE factors (`rope_freqs.weight`, which a Llama 3.x
    file carries and a loader that skips it decodes with every rotation off), RoPE scaling, or a tensor
    the architecture's forward pass does not read are one-line UnsupportedErrors naming it; keys at their
    neutral value and the irrelevant namespaces load."""
    from mlxinfer.synthetic import rewrite_gguf

    src = synthetic(arch="llama", n_layers=1, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16,
                    vocab_size=320)
    cases = [
        (dict(add_tensors={"rope_freqs.weight": np.ones(8)}), "tensor 'rope_freqs.weight' (Llama 3's RoPE"),
        (dict(add_tensors={"blk.0.attn_q.bias": np.zeros(64)}), "tensor 'blk.0.attn_q.bias' (not read"),
        (dict(edits={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 8.0}),
         "metadata llama.rope.scaling"),
        (dict(edits={"llama.expert_count": 8}), "metadata llama.expert_count = 8 is not supported"),
    ]
    for i, (kw, fragment) in enumerate(cases):
        path = rewrite_gguf(src, tmp_path / f"bad{i}.gguf", **kw)
        with pytest.raises(UnsupportedError, match=re.escape(fragment)):
            mlxinfer.load(path, backend="cpu")
    fine = rewrite_gguf(src, tmp_path / "fine.gguf", edits={"llama.rope.scaling.type": "none",
                                                             "general.url": "x", "quantize.imatrix.file": "y"})
    assert mlxinfer.load(fine, backend="cpu").generate([5, 6], max_tokens=2).token_ids
