"""Correctness against llama.cpp (all-F32 weights, F32 KV cache), from committed fixtures."""

import io
import os
import re

import numpy as np
import pytest

import mlxinfer
from mlxinfer.backends import make_backend
from mlxinfer.batch import Batch
from mlxinfer.errors import GGUFError, RequestError, UnsupportedError
from mlxinfer.gguf_file import GGUFFile
from mlxinfer.inspect import describe
from mlxinfer.models import model_args, spec
from mlxinfer.synthetic import rewrite_gguf, write_synthetic_model
from mlxinfer.tracing import install_tracer

from .conftest import REFERENCE, write_empty_gguf
from .reference.specs import QWEN3_SYNTHETIC, synthetic_files

# Against llama.cpp on all-F32 copies, measured here (2026-11-30, both backends): synthetic Qwen3 within
# 2.5e-6, SmolLM2 within 9.4e-5 (logits up to 27). Bounds: about 4x the measured error, so that a wrong
# RMS epsilon or RoPE base (errors of 1e-4 and more on the synthetic model) fails.
# Llama 3 (rope_freqs.weight), the same with linear scaling, Qwen2 (Q/K/V biases), measured here
# (2026-12-01, both backends): within 3.6e-6 of llama.cpp (logits up to 4.4). What differs: the order of
# each dot product's sum (BLAS vs ggml) and the RoPE angles (float64 tables here, ggml's float32 powers).
# Bound 1.5e-5, about 4x.
# Phi-3 with its long and with its short RoPE factors and attention factor (2026-12-02, both backends):
# within 4.8e-6 (logits up to 5.0); Qwen3-MoE (8 experts, 2 a row) within 2.4e-6 (logits up to 4.6); bound 1.5e-5 as
# the other dense ones (a row routed to another expert than llama.cpp's would move its logits by ~1).
# Gemma 3 and Gemma 2 (synthetic, both backends, 2026-12-02): within 2.4e-4 of llama.cpp (logits up to
# 4.3 and 0.56), median over positions 1.4e-4. What differs beside the dense models' sums: llama.cpp's CPU
# GELU rounds each input to float16 and reads a float16 result from a table (ggml-cpu/vec.h,
# GGML_GELU_FP16), ~2^-11 relative on each of the FFN's 256 gate values a row, carried through the down
# product and post-FFN norm of each layer; we compute the tanh formula in float32 as Hugging Face does.
# Bound 1e-3, about 4x (a dropped soft-cap, a wrong embedding scale or window moves logits by 1e-2 and more).
LOGIT_ATOL = {"qwen3_synthetic": 1e-5, "smollm2": 4e-4, "llama3_synthetic": 1.5e-5,
              "llama3_linear_synthetic": 1.5e-5, "qwen2_synthetic": 1.5e-5, "gemma3_synthetic": 1e-3,
              "gemma2_synthetic": 1e-3, "phi3_synthetic": 1.5e-5, "phi3_short_synthetic": 1.5e-5,
              "qwen3moe_synthetic": 1.5e-5, "mixtral_synthetic": 1.5e-5}
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


@pytest.fixture(scope="module")
def new_arch_paths(tmp_path_factory):
    """The new architectures' synthetic files, as make_fixtures.py wrote them for llama.cpp."""
    return synthetic_files(str(tmp_path_factory.mktemp("arch")))


def ggml_gelu_numpy(x):
    """llama.cpp's CPU GELU (ggml-cpu/vec.h with GGML_GELU_FP16): the input rounded to float16 and looked
    up in a table of float16 results of the float32 formula; 0 at or below -10, x at or above 10."""
    x16 = x.astype(np.float16).astype(np.float32)
    inner = np.float32(0.7978845608028654) * x16 * (np.float32(1.0) + np.float32(0.044715) * x16 * x16)
    y = (np.float32(0.5) * x16 * (np.float32(1.0) + np.tanh(inner))).astype(np.float16).astype(np.float32)
    return np.where(x <= -10, np.float32(0), np.where(x >= 10, x, y))


def ggml_gelu_mlx(x):
    import mlx.core as mx

    x16 = x.astype(mx.float16).astype(mx.float32)
    y = (0.5 * x16 * (1.0 + mx.tanh(0.7978845608028654 * x16 * (1.0 + 0.044715 * x16 * x16)))).astype(mx.float16)
    return mx.where(x <= -10, 0.0, mx.where(x >= 10, x, y.astype(mx.float32)))


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
@pytest.mark.parametrize("name", ["gemma3_synthetic", "gemma2_synthetic"])
def test_gemma_differs_from_llama_cpp_by_its_gelu_table(new_arch_paths, name, backend, monkeypatch):
    """What makes Gemma's bound wider than the dense one is llama.cpp's float16 GELU table: with the
    backends' GELU replaced by that table (`ggml_gelu_numpy`/`_mlx`), the typical position (the median
    over positions of the largest logit error) comes within 5e-5 of llama.cpp (measured 1.2e-6 to 2e-5),
    against 1.4e-4 with the exact GELU. The largest errors stay near 1e-4 with the table: an input that
    differs from llama.cpp's by an ulp on the other side of a float16 rounding boundary moves its GELU by
    a float16 ulp (cpu and mlx, both float32 and within 7e-7 of each other with the exact GELU, differ by
    1.4e-4 with the table)."""
    from mlxinfer.backends.cpu import CPUBackend
    from mlxinfer.backends.mlx import MLXBackend

    monkeypatch.setattr(CPUBackend, "gelu", lambda self, x: ggml_gelu_numpy(x))
    monkeypatch.setattr(MLXBackend, "gelu", lambda self, x: ggml_gelu_mlx(x))
    ref = load_fixture(name)
    logits = mlxinfer.load(new_arch_paths[name], backend=backend).logits(ref["prompt_ids"].tolist())
    per_position = np.abs(logits - ref["prompt_logits"]).max(1)
    assert np.median(per_position) < 5e-5 and per_position.max() < LOGIT_ATOL[name]


# What each fixture's file must read as: (arch, Q/K/V biases, Llama 3 factors, linear scale, windowed
# layers, attention softcap, final softcap)
EXPECTED_ARGS = {
    "llama3_synthetic": ("llama", False, True, 1.0, (), None, None),
    "llama3_linear_synthetic": ("llama", False, True, 4.0, (), None, None),
    "qwen2_synthetic": ("qwen2", True, False, 1.0, (), None, None),
    "gemma3_synthetic": ("gemma3", False, False, 8.0, (True, True, False), None, None),
    "gemma2_synthetic": ("gemma2", False, False, 1.0, (True, False, True), 2.0, 1.0),
    "phi3_synthetic": ("phi3", False, True, 1.0, (), None, None),
    "phi3_short_synthetic": ("phi3", False, True, 1.0, (), None, None),
    "qwen3moe_synthetic": ("qwen3moe", False, False, 1.0, (), None, None),
    "mixtral_synthetic": ("llama", False, False, 1.0, (), None, None),
}


@pytest.mark.parametrize("backend,pipeline", BACKENDS, ids=["cpu", "mlx-pipelined", "mlx-sync"])
@pytest.mark.parametrize("name", list(EXPECTED_ARGS))
def test_new_architectures_match_llama_cpp(new_arch_paths, name, backend, pipeline):
    """Llama 3's RoPE factors (and linear scaling on top), Qwen2's biases, Gemma 3 and Gemma 2, against
    llama.cpp: every position's logits of a 70-token prompt within the bound, and 32 greedy tokens
    identical on three prompts (every token compared, near-ties included: ours chose as llama.cpp did at
    each). Gemma's bound is GELU's (LOGIT_ATOL; `test_gemma_differs_from_llama_cpp_by_its_gelu_table`)."""
    engine = mlxinfer.load(new_arch_paths[name], backend=backend, prefill_chunk=16)
    a = engine.args
    assert (a.arch, a.qkv_bias, a.rope_freqs is not None, a.rope_scale, a.swa_layers, a.attn_softcap,
            a.final_softcap) == EXPECTED_ARGS[name]
    gen = check_against_reference(engine, name, pipeline)
    ref = load_fixture(name)
    assert gen.token_ids == ref["greedy"].tolist() and len(gen.token_ids) == 32
    for k in (1, 2):
        ids = ref[f"prompt_ids_{k}"].tolist()
        assert engine.generate(ids, max_tokens=32).token_ids == ref[f"greedy_{k}"].tolist()


def test_new_architectures_cpu_and_mlx_agree(new_arch_paths):
    """The two backends on the same file: within twice the bound against llama.cpp (each is within it)."""
    ids = load_fixture("llama3_synthetic")["prompt_ids"].tolist()
    for name, path in new_arch_paths.items():
        cpu, gpu = (mlxinfer.load(path, backend=b).logits(ids) for b in ("cpu", "mlx"))
        assert np.max(np.abs(cpu - gpu)) < 2 * LOGIT_ATOL[name]


def test_llama3_factors_divide_the_frequencies(new_arch_paths):
    """The rope op with the file's factors, against the rotation written out in float64: pair j of a
    head at position p turns by p * base**(-2j/d) / factors[j] (llama.cpp's freq_factors), on both
    backends. Error model: float32 angles of up to 300 rad are off by ~1e-5 rad."""
    with GGUFFile(new_arch_paths["llama3_linear_synthetic"]) as g:
        a = model_args(g)
    d, f = a.head_dim, np.array(a.rope_factors)
    assert f.min() == 4.0 and f.max() == 32.0  # factors 1..8, times the linear 4
    rng = np.random.default_rng(0)
    x, pos = rng.standard_normal((5, 2 * d), dtype=np.float32), np.array([0, 1, 7, 40, 300])
    ang = pos[:, None] * (a.rope_base ** (-np.arange(0, d, 2) / d) / f)[None, :]
    xh = x.reshape(5, 2, d).astype(np.float64)
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    want = np.empty_like(xh)
    want[..., 0::2] = xh[..., 0::2] * c - xh[..., 1::2] * s
    want[..., 1::2] = xh[..., 1::2] * c + xh[..., 0::2] * s
    for name in ("cpu", "mlx"):
        ops = make_backend(name)
        got = ops.to_numpy(ops.rope(ops.from_numpy(x), ops.index_array(pos), 2, d, a.rope_base, True, a.rope_factors))
        np.testing.assert_allclose(got, want.reshape(5, 2 * d), rtol=0, atol=1e-4)


def test_phi3_reads_its_fused_matrices_and_factors(new_arch_paths):
    """Phi-3: the fused matrices read as Q, K, V (rows in that order) and gate, up (gate first); the
    long factors where the context (4096) exceeds the original one (64), the short ones where not (8192);
    the attention factor read; `inspect` lists the fused tensors; tensor parallelism refuses in one line."""
    from mlxinfer.models.shard import Shard

    from .reference.specs import PHI3_SYNTHETIC

    with GGUFFile(new_arch_paths["phi3_synthetic"]) as g:
        a = model_args(g)
        long, short = (tuple(float(np.float32(f)) for f in fs) for fs in PHI3_SYNTHETIC.rope_long_short)
        assert a.fused and a.rope_factors == long and a.rope_attn_factor == float(np.float32(2 ** 0.5))
        view = spec.fused_view(g, a)
        qkv, up = g.dequantize("blk.1.attn_qkv.weight"), g.dequantize("blk.1.ffn_up.weight")
        assert np.array_equal(view.dequantize("blk.1.attn_k.weight"), qkv[128:192])
        assert np.array_equal(view.dequantize("blk.1.attn_v.weight"), qkv[192:])
        assert np.array_equal(view.dequantize("blk.1.ffn_gate.weight"), up[:256])
        assert np.array_equal(view.dequantize("blk.1.ffn_up.weight"), up[256:])
        with pytest.raises(RequestError, match="tensor parallelism does not split phi3's fused attn_qkv and ffn_up"):
            Shard.plan(g, a, 0, 2)
    with GGUFFile(new_arch_paths["phi3_short_synthetic"]) as g:
        assert model_args(g).rope_factors == short
    text = describe(new_arch_paths["phi3_synthetic"])
    assert "architecture: phi3" in text and re.search(r"blk\.0\.attn_qkv\.weight\s+F32\s+\[256, 128\]", text)
    assert re.search(r"rope_factors_long\.weight\s+F32\s+\[16\]", text)


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_moe_mlp_routes_each_row_to_its_top_k_experts(backend):
    """`moe_mlp` against the mixture written out in float64: softmax over the router logits, the k most
    probable experts (the lower expert first on a tie: rows 0 and 1 tie experts 2 and 5), their
    probabilities normalized to sum 1, each expert's SwiGLU weighted and added. Error model: float32
    products of 16 and 24 terms and a softmax: ~1e-6 relative; bound 1e-5 on outputs of order 1."""
    rng = np.random.default_rng(7)
    n, e, k, h, f = 6, 6, 3, 16, 24
    x = rng.standard_normal((n, h), dtype=np.float32)
    logits = rng.standard_normal((n, e), dtype=np.float32)
    logits[:2, 5] = logits[:2, 2] = 3.0
    gate, up = (rng.standard_normal((e, f, h), dtype=np.float32) * 0.25 for _ in range(2))
    down = rng.standard_normal((e, h, f), dtype=np.float32) * 0.2
    p = np.exp(logits - logits.max(1, keepdims=True)).astype(np.float64)
    p /= p.sum(1, keepdims=True)
    want = np.zeros((n, h))
    for r in range(n):
        top = sorted(range(e), key=lambda j: (-p[r, j], j))[:k]
        assert r > 1 or top[:2] == [2, 5]
        for j in top:
            g, u = gate[j] @ x[r].astype(np.float64), up[j] @ x[r].astype(np.float64)
            want[r] += p[r, j] / p[r, top].sum() * (down[j] @ (g / (1 + np.exp(-g)) * u))
    ops = make_backend(backend)
    stacks = _Stacks({"g": gate, "u": up, "d": down})
    experts = tuple(ops.load_experts(stacks, name) for name in ("g", "u", "d"))
    got = ops.to_numpy(ops.moe_mlp(ops.from_numpy(x), ops.from_numpy(logits), experts, k, [(0, 2), (2, n)]))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


class _Stacks(dict):
    """Expert stacks by name, read as `load_experts` reads a GGUF file (`tensor`, `dequantize`), F32."""

    path = "stacks"
    dequantize = dict.__getitem__

    def tensor(self, name):
        from types import SimpleNamespace

        from gguf import GGMLQuantizationType

        return SimpleNamespace(shape=self[name].shape, ggml_type=GGMLQuantizationType.F32)


@pytest.mark.parametrize("name,arch,width", [("qwen3moe_synthetic", "qwen3moe", 64), ("mixtral_synthetic", "llama", 96)])
def test_moe_in_inspect_the_tracer_and_tp(new_arch_paths, name, arch, width):
    """Qwen3-MoE and Mixtral: `inspect` lists the router and the expert stacks; the tracer counts one
    `moe_mlp` a layer and five products a layer (Q, K, V, output, router) plus the head; tensor
    parallelism refuses it in one line."""
    from mlxinfer.models.shard import Shard

    path = new_arch_paths[name]
    text = describe(path)
    assert f"architecture: {arch}" in text and "  expert_used_count: 2" in text
    assert re.search(rf"blk\.2\.ffn_down_exps\.weight\s+F32\s+\[8, 128, {width}\]", text)
    L, counts = traced_counts(path)
    assert [(c["moe_mlp"], c["linear"], c["add"]) for c in counts] == [(L, 5 * L + 1, 2 * L)] * 2
    with GGUFFile(path) as g:
        with pytest.raises(RequestError, match=f"tensor parallelism does not split {arch}'s experts yet"):
            Shard.plan(g, model_args(g), 0, 2)


def test_mixtral_expert_width_is_the_ffn_width(new_arch_paths, tmp_path):
    """llama.cpp's llama reads an expert as feed_forward_length wide: a file whose
    expert_feed_forward_length says otherwise is refused in one line, not read with one width or the other."""
    bad = rewrite_gguf(new_arch_paths["mixtral_synthetic"], tmp_path / "bad.gguf",
                       edits={"llama.expert_feed_forward_length": 64})
    with pytest.raises(GGUFError, match="expert_feed_forward_length 64 differs from the experts' width 96"):
        mlxinfer.load(bad, backend="cpu")


def test_gemma_in_inspect(new_arch_paths):
    """`inspect` shows Gemma's keys (window, caps) and its extra tensors (post norms, q/k norms)."""
    text = describe(new_arch_paths["gemma2_synthetic"])
    assert "architecture: gemma2" in text and "  attn_logit_softcapping: 2.0" in text
    assert "  attention.sliding_window: 8" in text and re.search(r"blk\.2\.post_ffw_norm\.weight\s+F32\s+\[128\]", text)
    text = describe(new_arch_paths["gemma3_synthetic"])
    assert "architecture: gemma3" in text and "  rope.freq_base_swa: 10000.0" in text
    assert re.search(r"blk\.1\.attn_q_norm\.weight\s+F32\s+\[48\]", text)
    assert re.search(r"blk\.0\.post_attention_norm\.weight\s+F32\s+\[128\]", text)


def test_new_architectures_in_inspect_and_the_tracer(new_arch_paths):
    """`inspect` lists what the architecture adds (the factors tensor, the biases); the tracer counts
    Qwen2's three bias adds a layer beside the two residual adds, and two rope calls a layer."""
    text = describe(new_arch_paths["llama3_synthetic"])
    assert "architecture: llama" in text and re.search(r"rope_freqs\.weight\s+F32\s+\[32\]", text)
    text = describe(new_arch_paths["qwen2_synthetic"])
    assert "architecture: qwen2" in text and re.search(r"blk\.2\.attn_v\.bias\s+F32\s+\[64\]", text)
    for name, adds in (("llama3_synthetic", 2), ("qwen2_synthetic", 5)):
        L, counts = traced_counts(new_arch_paths[name])
        assert len(counts) == 2
        for c in counts:
            assert c["add"] == adds * L and c["rope"] == 2 * L and c["linear"] == 7 * L + 1


def traced_counts(path):
    """(layers, the traced op counts of each pass) of a prompt of 3 tokens and 2 generated, cpu backend."""
    engine = mlxinfer.load(path, backend="cpu")
    tracer = install_tracer(engine, stream=io.StringIO())
    counts = []

    def end(pass_name):
        counts.append(dict(tracer.counts))
        tracer.end_pass(pass_name)

    engine.generate([3, 4, 5], max_tokens=2, on_forward=end)
    return engine.args.n_layers, counts


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
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
    from mlxinfer.models import load_model

    path = synthetic(arch="llama", n_layers=2)
    g = GGUFFile(path)
    del g.tensors["blk.1.ffn_up.weight"]
    with pytest.raises(GGUFError, match="missing tensor 'blk.1.ffn_up.weight'"):
        load_model(CPUBackend(), g)


def test_what_the_forward_pass_does_not_apply_is_refused(synthetic, tmp_path):
    """Nothing a file asks for is ignored: RoPE factors on an architecture that does not apply them
    (`rope_freqs.weight` on qwen2/qwen3), RoPE scaling other than linear (YaRN, LongRoPE), a rotation
    scale, or a tensor the architecture's forward pass does not read are one-line UnsupportedErrors
    naming it; malformed factors are GGUFErrors; keys at their neutral value, linear scaling and the
    irrelevant namespaces load."""
    src = synthetic(arch="llama", n_layers=1, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16,
                    vocab_size=320)
    qwen2 = synthetic(arch="qwen2", n_layers=1, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16,
                      vocab_size=320)
    cases = [
        (qwen2, dict(add_tensors={"rope_freqs.weight": np.ones(8)}), UnsupportedError,
         "tensor 'rope_freqs.weight' (Llama 3's RoPE frequency factors, which this architecture does not apply)"),
        (src, dict(add_tensors={"rope_freqs.weight": np.ones(4)}), GGUFError,
         "tensor 'rope_freqs.weight' has shape [4], expected [8]"),
        (src, dict(add_tensors={"rope_freqs.weight": np.array([1, 1, 1, 0, 1, 1, 1, 1.0])}), GGUFError,
         "'rope_freqs.weight' holds a factor that is not a positive finite number"),
        (src, dict(add_tensors={"blk.0.attn_q.bias": np.zeros(64)}), UnsupportedError,
         "tensor 'blk.0.attn_q.bias' (not read"),
        (src, dict(edits={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}), UnsupportedError,
         "metadata llama.rope.scaling.type = 'yarn' (YaRN RoPE scaling) is not supported"),
        (qwen2, dict(edits={"qwen2.rope.scaling.type": "longrope"}), UnsupportedError,
         "metadata qwen2.rope.scaling.type = 'longrope' (LongRoPE RoPE scaling) is not supported"),
        (src, dict(edits={"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 2.0}), UnsupportedError,
         "llama.rope.scaling.factor = 2.0 contradicts llama.rope.scaling.type = 'none'"),
        (src, dict(edits={"llama.rope.scaling.attn_factor": 0.5}), UnsupportedError,
         "metadata llama.rope.scaling.attn_factor = 0.5 is not supported"),
        (qwen2, dict(edits={"qwen2.expert_count": 8}), UnsupportedError, "metadata qwen2.expert_count = 8 is not supported"),
        (src, dict(edits={"llama.expert_count": 8}), GGUFError, "missing metadata key 'llama.expert_used_count'"),
    ]
    for i, (base, kw, error, fragment) in enumerate(cases):
        path = rewrite_gguf(base, tmp_path / f"bad{i}.gguf", **kw)
        with pytest.raises(error, match=re.escape(fragment)):
            mlxinfer.load(path, backend="cpu")
    # Gemma, Phi-3, Qwen3-MoE: what one family reads, the others refuse; malformed keys and factors
    g2 = synthetic(arch="gemma2", n_layers=2, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16,
                   vocab_size=320, sliding_window=4)
    g3 = synthetic(arch="gemma3", n_layers=2, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16,
                   vocab_size=320, sliding_window=4)
    gemma_cases = [
        (g3, dict(edits={"gemma3.attn_logit_softcapping": 50.0}), UnsupportedError,
         "metadata gemma3.attn_logit_softcapping = 50.0 is not supported"),
        (src, dict(edits={"llama.final_logit_softcapping": 30.0}), UnsupportedError,
         "metadata llama.final_logit_softcapping = 30.0 is not supported"),
        (src, dict(edits={"llama.attention.sliding_window": 4096}), UnsupportedError,
         "metadata llama.attention.sliding_window = 4096 is not supported"),
        (g2, dict(add_tensors={"output.weight": np.zeros((320, 64))}), UnsupportedError,
         "tensor 'output.weight' is not supported for gemma2: its output head is the embedding"),
        (g3, dict(add_tensors={"blk.0.attn_q.bias": np.zeros(64)}), UnsupportedError, "tensor 'blk.0.attn_q.bias'"),
        (g2, dict(edits={"gemma2.attention.sliding_window_pattern": np.array([1, 0, 1], dtype=np.int32)}), GGUFError,
         "gemma2.attention.sliding_window_pattern must be a period or 2 booleans"),
        (g2, dict(edits={"gemma2.attn_logit_softcapping": float("nan")}), GGUFError,
         "gemma2.attn_logit_softcapping = nan is not a positive finite number"),
    ]
    phi3 = synthetic(arch="phi3", n_layers=1, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16,
                     vocab_size=320, rope_long_short=((1.0,) * 8, (1.0,) * 8))
    gemma_cases += [
        (phi3, dict(drop_tensors=("rope_factors_short.weight",)), GGUFError,
         "tensor 'rope_factors_short.weight' is missing (Phi-3's RoPE factors come in pairs)"),
        (src, dict(add_tensors={"rope_factors_long.weight": np.ones(8)}), UnsupportedError,
         "tensor 'rope_factors_long.weight' (not read by the forward pass)"),
        (phi3, dict(edits={"phi3.rope.scaling.attn_factor": -1.0}), GGUFError,
         "phi3.rope.scaling.attn_factor = -1.0 is not a positive finite number"),
    ]
    moe = synthetic(arch="qwen3moe", n_layers=1, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16,
                    vocab_size=320, n_experts=4, n_experts_used=2, ffn_expert=32)
    gemma_cases += [
        (moe, dict(edits={"qwen3moe.expert_weights_scale": 2.5}), UnsupportedError,
         "metadata qwen3moe.expert_weights_scale = 2.5 is not supported"),
        (moe, dict(edits={"qwen3moe.expert_used_count": 5}), GGUFError,
         "qwen3moe.expert_used_count 5 must be between 1 and expert_count 4"),
    ]
    for i, (base, kw, error, fragment) in enumerate(gemma_cases):
        path = rewrite_gguf(base, tmp_path / f"gemma{i}.gguf", **kw)
        with pytest.raises(error, match=re.escape(fragment)):
            mlxinfer.load(path, backend="cpu")
    # the file's per-layer flags and llama.cpp's defaults: Gemma 2's 4096 window and caps 50 / 30 when absent
    flags = rewrite_gguf(g2, tmp_path / "flags.gguf", edits={
        "gemma2.attention.sliding_window_pattern": np.array([False, True]), "gemma2.attention.sliding_window": None})
    a = mlxinfer.load(flags, backend="cpu").args
    assert (a.swa_layers, a.sliding_window, a.attn_softcap, a.final_softcap) == ((False, True), 4096, 50.0, 30.0)
    fine = rewrite_gguf(src, tmp_path / "fine.gguf", edits={"llama.rope.scaling.type": "none",
                                                             "general.url": "x", "quantize.imatrix.file": "y"})
    assert mlxinfer.load(fine, backend="cpu").generate([5, 6], max_tokens=2).token_ids
    # linear scaling applies (by the old key too): the factor divides every frequency
    for edits in ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 8.0},
                  {"llama.rope.scale_linear": 8.0}):
        e = mlxinfer.load(rewrite_gguf(src, tmp_path / "linear.gguf", edits=edits), backend="cpu")
        assert e.args.rope_factors == (8.0,) * 8


def _layer_done_files():
    from .reference import specs

    return {"qwen3": specs.QWEN3_SYNTHETIC, "llama3_synthetic": specs.LLAMA3_SYNTHETIC, "qwen2_synthetic": specs.QWEN2_SYNTHETIC,
            "gemma3_synthetic": specs.GEMMA3_SYNTHETIC, "gemma2_synthetic": specs.GEMMA2_SYNTHETIC,
            "phi3_synthetic": specs.PHI3_SYNTHETIC, "qwen3moe_synthetic": specs.QWEN3MOE_SYNTHETIC,
            "mixtral_synthetic": specs.MIXTRAL_SYNTHETIC}


def test_the_layer_output_test_covers_every_architecture():
    """Every architecture mlxinfer loads is among the files the next test runs (a new one must join it)."""
    from mlxinfer.models import ARCHITECTURES

    assert {spec.arch for spec in _layer_done_files().values()} == set(ARCHITECTURES)


@pytest.mark.parametrize("name", list(_layer_done_files()))
def test_every_architecture_hands_each_layer_output_to_the_pass(name, new_arch_paths, qwen3_path, monkeypatch):
    """Each model reports each layer's output once, in order (`Batch.layer_done`: where the loop may
    start a long pass a few layers at a time, `loop.PACE_LAYERS`): as many as it has layers, each its own."""
    from mlxinfer.batch import Batch

    path = qwen3_path if name == "qwen3" else new_arch_paths[name]
    engine = mlxinfer.load(path, backend="cpu")
    seen = []
    monkeypatch.setattr(Batch, "layer_done", lambda self, x: seen.append((self, np.array(x, copy=True))))
    engine.logits([1, 17, 250, 99, 3])
    n_layers = engine.model.args.n_layers
    assert len(seen) == n_layers and all(b is seen[0][0] for b, _ in seen)
    assert len({x.tobytes() for _, x in seen}) == n_layers  # (each layer's own output, not one repeated)
