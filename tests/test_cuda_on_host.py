"""attention.cu's kernels run on the host (tests/cuda_host.py: g++, a fiber per CUDA thread, one block
at a time), so that their indexing and order are checked without a GPU:
- every launch plan (the split plan's two- and three-launch forms, the latter with the context by rows,
  and the one-launch kernel), float32 and bfloat16, over the preallocated, paged and windowed stores, with
  GQA, a soft-cap and a sliding window, for a decode row beside a 66-row chunk: MLX's override on an MLX
  backend made to take the CUDA path, against the per-head reference (whose products and softmax are the
  published-order kernels, on the host too), bit for bit;
- the qk_norm_rope kernel against mx.fast's RMSNorm and RoPE;
- every architecture through the engine's CUDA path (the model's files as the GPU would run them, the
  compiled step aside): logits against llama.cpp's, fused = per-head bit for bit, greedy tokens.
What the host cannot show: the GPU's compiler and memory system, and CUDA's own sinf/cosf/expf (the
host's are glibc's)."""

import os
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlxinfer import kernels
from mlxinfer.backend import AttentionSpec
from mlxinfer.backends.mlx import attention_results
from mlxinfer.engine import Engine
from mlxinfer.testing import AttentionCase, assert_matches_default, case_batch

from . import cuda_host

pytestmark = pytest.mark.skipif(not cuda_host.available(), reason="needs g++ (C++20) to run the kernels on the host")

PLANS = {"split, two launches": dict(split=True, two=True, rows=False),
         "split, one launch for short caches": dict(split=True, two=True, rows=False, short=True),
         "split, three launches": dict(split=True, two=False, rows=False),
         "split, three launches, context by rows": dict(split=True, two=False, rows=True),
         "one-launch": dict(split=False, two=False, rows=False)}
WANT = {"split, two launches": {"attn_scores", "attn_softmax_context"},
         "split, one launch for short caches": {"attn_short"},
        "split, three launches": {"attn_scores", "attn_softmax", "attn_context"},
        "split, three launches, context by rows": {"attn_scores_rows", "attn_softmax", "attn_context_rows"},
        "one-launch": {"fused_attention"}}


@pytest.fixture(scope="module")
def host_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda_host")


@pytest.mark.parametrize("kv", ["prealloc", "paged", "windowed"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_every_launch_plan_is_the_reference_on_the_host(plan, dtype, kv, host_dir, monkeypatch):
    launched = cuda_host.launch_on_host(host_dir, monkeypatch)
    p = PLANS[plan]
    monkeypatch.setattr(kernels, "SPLIT_MAX_ITEMS", 10**9 if p["split"] else 0)
    monkeypatch.setattr(kernels, "SPLIT_MAX_SCRATCH", 10**18 if p["split"] else 0)
    monkeypatch.setattr(kernels, "TWO_LAUNCH_ROWS", 10**9 if p["two"] else 0)
    monkeypatch.setattr(kernels, "TWO_LAUNCH_MAX_KEYS", 10**18 if p["two"] else 0)
    monkeypatch.setattr(kernels, "ROWS_MIN", 1 if p["rows"] else 10**9)
    monkeypatch.setattr(kernels, "ROWS_MAX_KEYS_PER_ROW", 10**9)
    monkeypatch.setattr(kernels, "SHORT_MAX_ROWS", 10**9 if p.get("short") else 0)
    b = cuda_host.cuda_path(dtype)
    rng = np.random.default_rng(5)
    # groups of 5 heads (taken 4 at a time); attn_short (its rows: decode rows, a short chunk) also over
    # two KV heads of 40 values (a lane's second chunk of 32 partly past the head)
    h, kv_heads, d, rows = (10, 2, 40, [1, 7]) if p.get("short") else (5, 1, 16, [1, 66])
    spec = replace(AttentionSpec.standard(h, kv_heads, d, window=20), softcap=2.0)
    keys, values = ([rng.standard_normal((s, kv_heads * d), dtype=np.float32) * 3 for s in (90, 70)] for _ in range(2))
    case = AttentionCase(rng.standard_normal((sum(rows), h * d), dtype=np.float32), keys, values, rows, spec)
    assert_matches_default(b, case, kv=kv)  # the result in the dtype, as a model runs it
    with attention_results(b, mx.float32):  # and every bit of the order, not only what survives the dtype's rounding
        assert_matches_default(b, case, kv=kv)
        q, view, batch = case_batch(b, case, kv)
        assert b.fused_attention_override(q, view, batch, spec).dtype == mx.float32
    assert WANT[plan] <= set(launched), launched


def kernel_angles(positions, head_dim: int, base: float) -> np.ndarray:
    """The qk_norm_rope kernel's float32 angles, [rows, head_dim/2]: L * exp2f(-(d / (D/2)) * log2f(base)),
    each operation in float32 as attention.cu writes it (exp2f taken correctly rounded: glibc's is within
    0.502 ulp)."""
    d = np.arange(head_dim // 2, dtype=np.float32)
    arg = -(d / np.float32(head_dim // 2)) * np.float32(kernels._log2f(base))
    inv_freq = np.exp2(arg.astype(np.float64)).astype(np.float32)
    return np.asarray(positions, np.float32)[:, None] * inv_freq[None, :]


def _kernel_cases(b, launched, seed: int, dtype=None):
    """test_mlx_backend's qk_norm_rope cases (q, k and their weights cast to `dtype` where given) through
    the backend `b` on the host: for each shape the kernel serves (one launch),
    (args, (q out, k out), cos, sin at the kernel's angles [rows, 1, head_dim/2]); the others must take
    mx.fast's path (no launch) and are not yielded."""
    from .test_mlx_backend import _qk_norm_rope_cases

    for args in _qk_norm_rope_cases(b, np.random.default_rng(seed)):
        if dtype is not None:
            args = tuple(a.astype(dtype) for a in args[:4]) + args[4:]
        del launched[:]
        got = b.qk_norm_rope(*args)
        pos, dim, base, traditional = args[4], args[7], args[9], args[10]
        if not kernels.qk_norm_rope_fits(dim, traditional):
            assert launched == []
            continue
        assert launched == ["qk_norm_rope"]
        theta = kernel_angles(np.array(pos), dim, base).astype(np.float64)[:, None, :]
        yield args, got, np.cos(theta), np.sin(theta)


def test_qk_norm_rope_kernel_on_the_host(host_dir, monkeypatch):
    """kernels.qk_norm_rope (the queries' and keys' per-head RMSNorm and rotate-half RoPE in one launch)
    against the same in float64 at the kernel's own float32 angles (`kernel_angles`): at position 40,000
    an angle's last bit moves the output by ~4e-3, so the angles are the part emulated and the rest is
    bounded. Error model: the float32 sum of squares, 1/sqrt, two products and the rotation's two
    products and a sum, each within an ulp or two, and glibc's sinf/cosf within one: ~8 ulps of outputs
    up to ~10; measured 6.2e-7 (this VM, 2026-12-05), bound 2.5e-6. The cases include a head whose
    mean square epsilon dominates and an all-zero head. Each row does not depend on the other rows of
    the pass; shapes the kernel does not serve take mx.fast's path (no launch). 16-bit activations: the
    next test."""
    launched = cuda_host.launch_on_host(host_dir, monkeypatch)
    b = cuda_host.cuda_path()
    for args, got, c, sn in _kernel_cases(b, launched, 2):
        q, k, wq, wk, pos, heads, kv, dim, eps, base, traditional = args
        for g, x, w, n in ((got[0], q, wq, heads), (got[1], k, wk, kv)):
            xh = np.array(x).astype(np.float64).reshape(-1, n, dim)
            v = xh / np.sqrt((xh * xh).mean(-1, keepdims=True) + eps) * np.array(w).astype(np.float64)
            x1, x2 = v[..., :dim // 2], v[..., dim // 2:]
            want = np.concatenate([x1 * c - x2 * sn, x1 * sn + x2 * c], -1).reshape(g.shape)
            np.testing.assert_allclose(np.array(g), want, rtol=0, atol=2.5e-6)
        last = q.shape[0] - 1
        alone = b.qk_norm_rope(q[last:], k[last:], wq, wk, pos[last:], heads, kv, dim, eps, base, traditional)
        for g, one in zip(got, alone):
            np.testing.assert_array_equal(np.array(g)[last:], np.array(one))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_qk_norm_rope_kernel_in_16_bits_on_the_host(dtype, host_dir, monkeypatch):
    """The qk_norm_rope kernel on 16-bit q, k and weights (the activations' type): one launch, outputs of
    that type, mx.fast's three roundings to it (the normalized value, its product by the weight, the
    rotated value). Against the same in float64 at the kernel's angles with those roundings emulated:
    the float32 parts (sum of squares, 1/sqrt, sinf/cosf) can move a value across a rounding boundary
    (`rope16_bound`: 4u (|x1| + |x2|) + 2u |out|, u = 2^-8 bfloat16, 2^-11 float16); nearly all values
    come out the emulation's bits (at least 99%; measured 19,968 of 19,968 bfloat16, 19,967 float16,
    this VM, 2026-12-05). (Not against mx.fast on this CPU: MLX's CPU rope in 16 bits rounds cos and
    sin to the type and multiplies in it; its CUDA kernel, which this one follows, computes
    in float32 and rounds once. On a GPU, tests/test_mlx_backend.py compares the two.) Each row does not
    depend on the others; q and k with weights of another type take mx.fast's path."""
    from .test_mlx_backend import _qk_norm_rope_cases, rope16_bound
    from .test_tensor_core_order import round16

    mdt = getattr(mx, dtype)
    u = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
    launched = cuda_host.launch_on_host(host_dir, monkeypatch)
    b = cuda_host.cuda_path(dtype)
    same = total = 0
    for args, got, c, sn in _kernel_cases(b, launched, 3, mdt):
        q, k, wq, wk, pos, heads, kv, dim, eps, base, traditional = args
        for g, x, w, n in ((got[0], q, wq, heads), (got[1], k, wk, kv)):
            assert g.dtype == mdt and g.shape == x.shape
            xh = np.array(x.astype(mx.float32)).astype(np.float64).reshape(-1, n, dim)
            normed = round16(xh / np.sqrt((xh * xh).mean(-1, keepdims=True) + eps), dtype)
            v = round16(normed * np.array(w.astype(mx.float32)).astype(np.float64), dtype)
            x1, x2 = v[..., :dim // 2], v[..., dim // 2:]
            exact = np.concatenate([x1 * c - x2 * sn, x1 * sn + x2 * c], -1)
            want = round16(exact, dtype)
            g = np.array(g.astype(mx.float32)).astype(np.float64)
            assert np.all(np.abs(g - want.reshape(g.shape)) <= rope16_bound(exact.reshape(g.shape), dim, u))
            same += int((g == want.reshape(g.shape)).sum())
            total += g.size
        last = q.shape[0] - 1
        alone = b.qk_norm_rope(q[last:], k[last:], wq, wk, pos[last:], heads, kv, dim, eps, base, traditional)
        for g, one in zip(got, alone):
            np.testing.assert_array_equal(np.array(g.astype(mx.float32))[last:], np.array(one.astype(mx.float32)))
    assert same >= 0.99 * total, f"{same} of {total} values are the emulation's bits"
    # q and k of the type with float32 weights (types the kernel does not mix): mx.fast's path, its bits
    from mlxinfer.backend import Backend

    args = next(_qk_norm_rope_cases(b, np.random.default_rng(4)))
    args = (args[0].astype(mdt), args[1].astype(mdt)) + args[2:]
    del launched[:]
    got, want = b.qk_norm_rope(*args), Backend.qk_norm_rope(b, *args)
    assert launched == []
    for g, w in zip(got, want):
        assert np.array_equal(np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32)))
    print(f"{dtype}: {same} of {total} values the emulation's bits ({100 * same / total:.1f}%)")


# -- every architecture through the engine's CUDA path ------------------------------------------------

@pytest.fixture(scope="module")
def arch_files(tmp_path_factory):
    from mlxinfer.synthetic import rewrite_gguf, write_synthetic_model

    from .reference.specs import GEMMA3_EDITS, GEMMA3_SYNTHETIC, QWEN3_SYNTHETIC, synthetic_files

    tmp = tmp_path_factory.mktemp("archs")
    files = synthetic_files(str(tmp))
    files["qwen3_synthetic"] = write_synthetic_model(tmp / "qwen3.gguf", QWEN3_SYNTHETIC)
    # head_dim 64: the qk_norm_rope kernel's shapes (the fixtures' 48 take mx.fast's path)
    files["qwen3_d64"] = write_synthetic_model(tmp / "qwen3_d64.gguf", replace(QWEN3_SYNTHETIC, head_dim=64))
    g3 = write_synthetic_model(tmp / "gemma3_d64_plain.gguf", replace(GEMMA3_SYNTHETIC, head_dim=64))
    files["gemma3_d64"] = rewrite_gguf(g3, tmp / "gemma3_d64.gguf", edits=GEMMA3_EDITS)
    return files


# Every architecture's fixture; CI runs one of each attention shape (MLXINFER_HOST_PLANS=1 runs all, and
# every one-row form below): Qwen3's q/k norms, Llama 3's factors, Gemma 3's and Gemma 2's windows (Gemma
# 2's soft-cap, in both caches), an MoE router's softmax. The others differ from these outside attention.
ALL = os.environ.get("MLXINFER_HOST_PLANS") == "1"
ARCHS = ["qwen3_synthetic", "llama3_synthetic", "gemma3_synthetic", "gemma2_synthetic", "qwen3moe_synthetic"]
MORE_ARCHS = ["llama3_linear_synthetic", "qwen2_synthetic", "phi3_synthetic", "phi3_short_synthetic", "mixtral_synthetic"]


@pytest.mark.parametrize("name,kv", [(n, "prealloc") for n in ARCHS] + [("gemma2_synthetic", "paged")]
                         + [pytest.param(n, "prealloc", marks=pytest.mark.skipif(not ALL, reason="MLXINFER_HOST_PLANS=1"))
                            for n in MORE_ARCHS])
def test_every_architecture_on_the_cuda_path_on_the_host(name, kv, arch_files, host_dir, monkeypatch):
    """The engine on an MLX backend that takes the CUDA path (attention, its products and softmax, the
    soft-cap's tanh on attention.cu's kernels, run on the host), eager: the prompt's logits within
    test_models' bound of llama.cpp's, the per-head reference's bit for bit, and 8 greedy tokens of each
    fixture prompt (three, or qwen3_synthetic's one), generated together as one batch, llama.cpp's, by the
    per-head engine and the fused one through the compiled decode step's code (its decode rows, over a
    short preallocated store, on `attn_short`)."""
    from .test_models import LOGIT_ATOL, load_fixture

    launched = cuda_host.launch_on_host(host_dir, monkeypatch)
    ref = load_fixture(name)
    keys = [k for k in ("", "_1", "_2") if f"prompt_ids{k}" in ref]  # (qwen3_synthetic has one prompt)
    prompts = [ref[f"prompt_ids{k}"].tolist() for k in keys]
    want = [ref[f"greedy{k}"][:8].tolist() for k in keys]
    logits = {}
    for attention in ("fused", "per-head"):
        del launched[:]
        engine = Engine(arch_files[name], cuda_host.cuda_path(attention=attention), kv=kv, prefill_chunk=16)
        engine.compile_decode = False  # (eager: the compiled step's code comes next)
        logits[attention] = engine.logits(prompts[0])
        kinds = {"fused": {"attn_scores", "attn_softmax_context"}, "per-head": {"matmul", "softmax"}}[attention]
        assert kinds | ({"tanh"} if name == "gemma2_synthetic" else set()) <= set(launched), set(launched)
    assert np.max(np.abs(logits["fused"] - ref["prompt_logits"])) < LOGIT_ATOL[name]
    assert np.array_equal(logits["fused"], logits["per-head"])
    assert [g.token_ids for g in engine.generate_batch(prompts, max_tokens=8)] == want  # (per-head)
    # fused: the compiled decode step's own code (Batch.traced_decode, the cache's step inputs, the next
    # step's index arrays made on the device) with mx.compile off, so that the host kernels run inside it
    engine = Engine(arch_files[name], cuda_host.cuda_path(), kv=kv, prefill_chunk=16)
    del launched[:]
    steps = []
    step = engine.decode_step._step
    engine.decode_step._step = lambda *a: steps.append(a) or step(*a)
    mx.disable_compile()
    try:
        assert [g.token_ids for g in engine.generate_batch(prompts, max_tokens=8)] == want
    finally:
        mx.enable_compile()
    assert len(steps) == 7  # every decode pass but the prefill's token
    if kv == "prealloc":  # decode rows over a short store: the two-launch form in one launch
        assert launched.count("attn_short") >= len(steps), set(launched)  # (a layer's, each step)


@pytest.mark.parametrize("name", ["qwen3_d64", "gemma3_d64"])
def test_qk_norm_rope_kernel_in_a_model_on_the_host(name, arch_files, host_dir, monkeypatch):
    """Qwen3 and Gemma 3 with head_dim 64, where the CUDA path takes the qk_norm_rope kernel (Gemma 3's
    windowed layers at their own RoPE base; its global layer, linearly scaled, takes mx.fast's path):
    logits within 1e-5 of the cpu backend's (measured 3.1e-6 and 1.4e-6, logits up to 4.1, this VM,
    2026-12-05; the kernel's sum of squares is in another order than mx.fast's) and the same 8 greedy
    tokens."""
    import mlxinfer

    launched = cuda_host.launch_on_host(host_dir, monkeypatch)
    ids = [(7 * i + 3) % 380 for i in range(40)]
    engine = Engine(arch_files[name], cuda_host.cuda_path(), prefill_chunk=16)
    engine.compile_decode = False
    got = engine.logits(ids)
    a = engine.args
    kernel_layers = sum(a.swa_layers) if a.arch == "gemma3" else a.n_layers
    assert launched.count("qk_norm_rope") == -(-len(ids) // 16) * kernel_layers > 0  # a launch a layer a pass
    cpu = mlxinfer.load(arch_files[name], backend="cpu")
    want = cpu.logits(ids)
    assert np.max(np.abs(got - want)) < 1e-5
    assert engine.generate(ids, max_tokens=8).token_ids == cpu.generate(ids, max_tokens=8).token_ids


@pytest.mark.parametrize("form", [f if f in (kernels.ONE_ROW_FORM, kernels.ONE_ROW_LONG_FORM) else
                                  pytest.param(f, marks=pytest.mark.skipif(not ALL, reason="MLXINFER_HOST_PLANS=1"))
                                  for f in kernels.ONE_ROW_FORMS], ids=lambda f: "".join(f"{k}{v}" for k, v in f))
def test_every_one_row_form_on_the_host(form, host_dir, monkeypatch):
    """The one-row decode forms over long caches (whole 32-key steps from 1,024 keys, prefetching above
    4,096: the default decode of a long context), bit for bit the one-launch kernel on the host
    (test_mlx_backend's `check_one_row_form`, which a GPU runs too); CI runs the two forms decode takes."""
    from .test_mlx_backend import check_one_row_form

    launched = cuda_host.launch_on_host(host_dir, monkeypatch)
    check_one_row_form(form)
    assert {"attn_scores", "attn_softmax_context", "fused_attention"} <= set(launched)
