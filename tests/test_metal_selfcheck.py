"""The GPU kernels' self-check (`verify_gpu_kernels`, run on a Mac before the Metal kernels are used):
its cases cover every plan the kernels run, its failure paths give one warning line naming what
failed and its case, and the fallback then keeps fused attention byte-identical to the per-head
reference (it runs the reference's own products). Runs on MLX's CPU device: a kernel forced to
"metal" here fails as a kernel that does not build on a Mac would, with MLX's own error."""

import numpy as np
import pytest

import mlx.core as mx
from mlxinfer import kernels
from mlxinfer.backends.mlx import (SELF_CHECK_HEAD_DIMS, MLXBackend, check_case_inputs, gpu_kind, self_check_cases,
                                   verify_gpu_kernels)
from mlxinfer.kv_cache import KV_CACHES


def test_self_check_cases_cover_every_plan_the_metal_kernels_run():
    """One decode row and several; chunks of fewer and of 8+ rows; contexts under 8 keys (constant
    operands), past the softmax's 256 threads and past 1,024 keys, both with few rows (the graph override
    on Metal) and with many (the fused kernel); a window; every cache kind; every head size of the
    models here (SmolLM2 64, Qwen3 128) and both sides of the fused kernel's 128-wide context pass."""
    cases = self_check_cases()
    b = MLXBackend(device="cpu")
    b.kernel = "metal"
    graph, fused = set(), set()
    for d in SELF_CHECK_HEAD_DIMS:
        mine = [c for c in cases if c.spec.head_dim == d]
        rows = [t for c in mine for _, t in c.seqs]
        keys = [s for c in mine for s, _ in c.seqs]
        assert 1 in [len(c.seqs) for c in mine if all(t == 1 for _, t in c.seqs)]  # one decode row alone
        assert any(len(c.seqs) > 1 and all(t == 1 for _, t in c.seqs) for c in mine)  # several
        assert min(rows) == 1 and 1 < min(t for t in rows if t > 1) < 8 <= max(rows)
        assert min(keys) < kernels.METAL_CONSTANT_BELOW and max(keys) > 1024 and any(256 < s <= 1024 for s in keys)
        assert any(c.spec.window for c in mine) and {c.kv for c in mine} == set(KV_CACHES)
        assert any(c.spec.softcap and any(t == 1 for _, t in c.seqs) for c in mine)  # soft-capped decode rows
        assert any(c.spec.softcap and any(t > 8 for _, t in c.seqs) for c in mine)  # and chunks
        for c in mine:
            _, view, batch = check_case_inputs(b, c)
            (graph if b._pass_needs_graph(batch, c.spec) else fused).add(c.label)
    assert graph and fused
    assert {64, 128} <= set(SELF_CHECK_HEAD_DIMS)
    assert any(d > 128 for d in SELF_CHECK_HEAD_DIMS) and any(d % 32 for d in SELF_CHECK_HEAD_DIMS)


@pytest.mark.parametrize("dtype,kv_dtype", [("float32", None), ("bfloat16", None), ("bfloat16", "q8_0")])
def test_self_check_passes_every_case_on_mlx_cpu(dtype, kv_dtype):
    """On MLX's CPU (graph attention, MLX's products) every case is bit for bit the reference, in each
    dtype and over a q8_0 cache (its cases of whole 32-value rows): the check's own inputs and comparisons
    are sound, so a failure on a Mac is the kernel's."""
    assert verify_gpu_kernels(MLXBackend(device="cpu", dtype=dtype, kv_dtype=kv_dtype)) is None


def _forced_metal():
    """An MLX CPU backend told that the Metal kernels are selected: every kernel launch then raises MLX's
    own '[metal_kernel] No Metal back-end.', as a kernel that cannot be built on a Mac raises."""
    b = MLXBackend(device="cpu")
    b.gpu_kernels = b.kernel = "metal"
    return b


def test_a_kernel_that_raises_fails_the_self_check_in_one_line_naming_it(capsys):
    b = _forced_metal()
    problem = b.check_kernels()
    assert problem == "RuntimeError: [metal_kernel] No Metal back-end. (the matmul and softmax kernels)"
    assert b.fallback == problem and b.kernel == "graph" and b.gpu_kernels is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mlxinfer: warning: the attention kernels failed their self-check ({problem}); using MLX's "
                   "own ops and per-head attention (pass --kernel to force the kernels)"]
    b.device = "gpu"  # (what describe and the report say on a Mac)
    assert b.describe() == "mlx (gpu, float32, per-head (the kernels failed their self-check) attention, MLX ops)"
    line, passed = b.kernel_report()
    assert not passed and line.startswith(f"kernels: metal: self-check FAILED ({problem}); mlxinfer uses MLX's own ops")


def test_a_qk_norm_rope_kernel_that_cannot_be_built_sends_qwen3s_norms_to_mx_fast(monkeypatch, tmp_path, capsys):
    """On a Metal GPU the qk_norm_rope kernel (never run where it was written) is checked at first use,
    its verdict kept as the self-check's; one that cannot be built (here MLX's own 'No Metal back-end')
    fails the check in one line, and Qwen3's norms and RoPE then take mx.fast's kernels: the same values
    as the protocol's default, no launch of the kernel. The attention kernels' verdict is their own."""
    from mlxinfer.backend import Backend

    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path))
    b = _forced_metal()
    b.device = "gpu"  # (as on a Mac: the checks run and their verdicts are kept)
    b.check_kernels()
    assert b.qk_fallback == "RuntimeError: [metal_kernel] No Metal back-end. (the qk_norm_rope kernel)"
    err = capsys.readouterr().err.strip().splitlines()
    assert f"mlxinfer: warning: the qk_norm_rope kernel failed its check ({b.qk_fallback}); Qwen3's norms and " \
           "RoPE use mx.fast's kernels" in err
    assert "metal qk_norm_rope" in (tmp_path / "kernel-checks.json").read_text()
    line, passed = b.kernel_report()
    assert not passed and f"qk_norm_rope: check FAILED ({b.qk_fallback}), mx.fast's kernels" in line
    b.gpu_kernels = "metal"  # (the attention kernels failed too; the switch is qk_norm_rope's own)
    x = mx.array(np.random.default_rng(0).standard_normal((3, 4 * 64)).astype(np.float32))
    w = mx.ones((64,))
    args = (x, x[:, :128], w, w, mx.array([0, 5, 9]), 4, 2, 64, 1e-6, 1e6, False)
    for got, want in zip(b.qk_norm_rope(*args), Backend.qk_norm_rope(b, *args)):
        np.testing.assert_array_equal(np.array(got), np.array(want))


def test_a_fused_kernel_that_raises_is_named_with_its_case(monkeypatch, capsys):
    """Products and softmax fine, the fused kernel failing to build (MLX's message for the 32,800-byte
    threadgroup the kernel once declared): the line names the error and the first case it met."""
    b = MLXBackend(device="cpu")
    b.kernel = "metal"

    def fails(*args, **kwargs):
        raise ValueError("[metal_kernel] Threadgroup memory size (32800) exceeds the maximum (32768).\nmore")

    monkeypatch.setattr(kernels, "fused_attention", fails)
    problem = b.check_kernels()
    first = self_check_cases()[0]
    assert problem == f"ValueError: [metal_kernel] Threadgroup memory size (32800) exceeds the maximum (32768). ({first})"
    assert str(first) == "head_dim 64, one decode row over 1 key, prealloc cache"
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_wrong_fused_kernel_is_named_with_its_case(monkeypatch):
    """A fused kernel wrong only past 256 keys (a dropped last key) is caught by the case that reaches it."""
    b = MLXBackend(device="cpu")
    real = b._graph_attention

    def wrong(q, kv, batch, spec, *seqs):
        out = real(q, kv, batch, spec, *seqs)
        return out + (batch.max_kv_len > 256) * 1e-3 if batch.max_kv_len is not None else out

    monkeypatch.setattr(b, "_graph_attention", wrong)
    problem = verify_gpu_kernels(b)
    assert problem.startswith("fused attention kernel differs from the per-head reference in ")
    assert problem.endswith("(head_dim 64, one decode row over 300 keys, prealloc cache)")


def test_the_fallback_keeps_fused_attention_byte_identical_to_the_reference(monkeypatch):
    """After a failed self-check, fused attention runs the reference's own products (never the batched
    graph, whose products on a Metal GPU can take another GEMM than the reference's one-head products):
    byte-identical on every self-check case, decode rows and chunks, every cache kind."""
    b = _forced_metal()
    b.check_kernels()
    assert b.fallback

    def refuse(*args):
        raise AssertionError("the fallback used the batched graph products")

    monkeypatch.setattr(b, "_graph_attention", refuse)
    monkeypatch.setattr(kernels, "fused_attention", refuse)
    for case in self_check_cases(head_dims=(64,)):
        q, view, batch = check_case_inputs(b, case)
        fused = b.to_numpy(b.fused_attention(q, view, batch, case.spec))
        ref = b.to_numpy(b.per_head_attention(q, view, batch, case.spec))
        assert np.array_equal(fused.view(np.uint32), ref.view(np.uint32)), case
        assert np.isfinite(ref).all()


def test_inspect_kernels_on_a_machine_without_a_gpu():
    from mlxinfer.inspect import kernels_report

    line, passed = kernels_report()
    if mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available()):
        pytest.skip("this machine has an MLX GPU: tests/test_mlx_backend.py runs the check itself")
    assert not passed and line == "kernels: --device gpu: MLX has no GPU here (neither Metal nor CUDA is available): nothing to check"


@pytest.mark.parametrize("failing", ["", "q8_0"])  # ("": neither)
def test_inspect_kernels_checks_a_q8_0_cache_too(monkeypatch, failing):
    """`inspect --kernels` runs the self-check over the default cache and over a q8_0 cache (whose kernels
    read packed int8 rows: a verdict of its own); a failure over either fails the report, named in its
    one line. (Stand-in backends: no GPU here.)"""
    from mlxinfer import inspect

    class Checked:
        def __init__(self, kv_dtype):
            self.fallback = "kernel differs" if kv_dtype == failing else None

        def kernel_report(self):
            return "kernels: cuda: self-check " + ("FAILED" if self.fallback else "passed"), self.fallback is None

    made = []
    monkeypatch.setattr(inspect, "make_backend", lambda name, device, kv_dtype=None: made.append(kv_dtype) or Checked(kv_dtype))
    line, passed = inspect.kernels_report()
    assert made == [None, "q8_0"] and passed is (not failing)
    want = "FAILED (kernel differs)" if failing else "passed"
    assert line == f"kernels: cuda: self-check passed; over a q8_0 KV cache: {want}"


@pytest.mark.skipif(gpu_kind() is None, reason="needs an MLX GPU (Metal or CUDA); this machine has none")
@pytest.mark.parametrize("dtype,kv_dtype", [("float32", None), ("bfloat16", None), ("float32", "q8_0"), ("bfloat16", "q8_0")])
def test_self_check_passes_on_this_gpu(dtype, kv_dtype):
    """The whole self-check on the device, with its kernels forced (on CUDA: every launch plan too), in
    float32 and bfloat16 and over q8_0 caches (the kernels reading the packed int8 rows)."""
    b = MLXBackend(device="gpu", kernel=gpu_kind(), dtype=dtype, kv_dtype=kv_dtype)
    assert verify_gpu_kernels(b) is None


@pytest.mark.parametrize("failing", ["blocks", "attention"])
def test_one_kernel_family_failing_leaves_the_other_on(monkeypatch, tmp_path, capsys, failing):
    """The attention kernels and each block kernel have a self-check and a verdict each: a failing block
    kernel turns off only its own types (their products on MLX's own ops; the other block kernels and
    the attention kernels kept), a failing attention kernel only attention's, each in one warning line;
    the verdicts are remembered apart, and a product reaches a block kernel exactly while its kernel
    stands. (Stand-in verdicts on MLX's CPU: the backend told it is on a GPU.)"""
    from mlxinfer import block_kernels, quants
    from mlxinfer.backends import kernel_checks
    from mlxinfer.backends import mlx as mlx_mod
    from mlxinfer.backends.mlx_weights import to_device

    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_checks, "_VERDICTS", {})
    monkeypatch.setattr(mlx_mod, "self_check_cases", lambda: [])
    runs = []
    block_problem = "the Q4_K block kernel differs from its published order in 3 of 40 values (1 rows, float32)"
    product_problem = "matmul kernel differs from the reference product by 0.1"
    monkeypatch.setattr(mlx_mod, "_check_block_products", lambda b, kernel=None: runs.append(kernel) or (
        block_problem if failing == "blocks" and kernel == "affine_matvec" else None))
    monkeypatch.setattr(mlx_mod, "_check_products",
                        lambda b: runs.append("attention") or (product_problem if failing == "attention" else None))
    launched = []
    monkeypatch.setattr(block_kernels, "product", lambda kind, x, w: launched.append(w.qtype) or w.product(x))

    def gpu_backend():
        b = MLXBackend(device="cpu")
        b.device, b.block_kind = "gpu", "cuda"
        return b

    b = gpu_backend()
    problem = b.check_kernels()
    err = capsys.readouterr().err.strip().splitlines()
    assert runs == ["attention", *block_kernels.kernel_names()] and len(err) == 1
    affine = ", ".join(t.name for t in block_kernels.types_of("affine_matvec"))
    if failing == "blocks":
        assert problem is None and b.fallback is None and b.block_kind == "cuda" and b.block_fallback == block_problem
        assert err[0] == (f"mlxinfer: warning: a block kernel failed its self-check ({block_problem}); {affine} "
                          "products use MLX's own ops")
        assert f"({affine} products on MLX's: their block kernel failed its self-check)" in b.describe()
        line, passed = b.kernel_report()
        assert not passed and line.startswith("kernels: graph: self-check passed")
        assert line.endswith(f"; block kernels: self-check FAILED ({block_problem}), {affine} products on MLX's own ops")
    else:
        assert problem == product_problem == b.fallback and b.block_kind == "cuda" and b.block_fallback is None
        assert err[0].startswith(f"mlxinfer: warning: the attention kernels failed their self-check ({product_problem})")
        assert b.describe().endswith("attention, MLX ops (cuda block kernels))")
    rng = np.random.default_rng(1)
    for qtype in (quants.Q.Q8_0, quants.Q.Q6_K):
        raw = quants.random_blocks(rng, qtype, 40, 512)
        w = to_device(qtype, quants.split(raw, qtype, 40, 512), (40, 512))
        b.linear(mx.array(rng.standard_normal((1, 512), dtype=np.float32)), w)
    assert launched == ([quants.Q.Q6_K] if failing == "blocks" else [quants.Q.Q8_0, quants.Q.Q6_K])
    again = gpu_backend()  # a second backend in this process: every verdict remembered, nothing runs again
    runs.clear()
    again.check_kernels()
    assert runs == [] and (again.block_types, again.fallback) == (b.block_types, b.fallback)


def test_a_failing_model_check_falls_back_in_one_line(capsys):
    """The check in a model's own shape (`check_model`) fails as the self-check does: one warning line
    naming the kernel's failure and that it was in the model's shape, then MLX's ops and per-head
    attention; without GPU kernels (the CPU) it checks nothing."""
    from mlxinfer.backend import AttentionSpec

    spec = AttentionSpec.standard(16, 8, 128)
    assert MLXBackend(device="cpu").check_model([spec]) is None
    b = _forced_metal()
    b.checked = "metal"  # (as after a self-check that passed)
    problem = b.check_model([spec])
    assert problem and "in the model's shape" in problem and "No Metal back-end" in problem
    assert b.gpu_kernels is None and b.kernel == "graph" and b.fallback == problem
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "failed their self-check" in err[0]


def test_the_engine_checks_its_models_attention_shapes(synthetic, monkeypatch):
    """Loading a model hands its backend the model's attention specs before any pass."""
    import mlxinfer

    seen = []
    monkeypatch.setattr(MLXBackend, "check_model", lambda self, specs: seen.append(list(specs)))
    engine = mlxinfer.load(synthetic(), backend="mlx", device="cpu")
    assert seen == [engine.specs] and set(engine.specs) == {engine.model.spec}  # (a spec per layer)
