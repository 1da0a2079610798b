"""16-bit prefill chunks on MLX's own fused attention (issue 30): on CUDA, with q and the KV cache of one
16-bit type, a sequence's chunk of PREFILL_ROWS rows or more whose head size cuDNN takes (a multiple of 8
up to 128) and that has no soft-cap runs `mx.fast.scaled_dot_product_attention`: one call a head in the
per-head reference (`MLXBackend.per_head_sequence`), one call over every head in the fused override. The
contract holds where MLX's kernel gives a head the same bits in both calls; the self-check
(`verify_sdpa`) asks the device before first use and turns the path off where it does not.

Here (no GPU) MLX's CPU runs its composed fallback for that call, so these tests check the routing, the
masks, the layouts and the call counts, and that fused = per-head bit for bit through that fallback; the
GPU tests at the end (cuDNN's kernel: `bash bench/h200.sh tests`) check the bits and the error model
where it matters."""

import io
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlxinfer.backend import AttentionSpec
from mlxinfer.backends import mlx as mlx_backend
from mlxinfer.backends.mlx import (PREFILL_ROWS, CheckCase, MLXBackend, check_case_inputs, gpu_kind, sdpa_batch_check_cases,
                                   sdpa_check_cases, verify_mma, verify_sdpa, verify_sdpa_batch)
from mlxinfer.batch import Batch
from mlxinfer.engine import Engine

from . import cuda_host

DTYPES = ["bfloat16", "float16"]
CUDA = gpu_kind() == "cuda"


def _sdpa_backend(dtype: str, attention: str = "fused") -> MLXBackend:
    """An MLX backend on the CPU made to take the CUDA path with MLX's fused attention on 16-bit chunks
    (as on a GPU after the self-check): its other kernels run on the host (`cuda_host.launch_on_host`)."""
    b = cuda_host.cuda_path(dtype, attention)
    b.sdpa = b.sdpa_batch = True
    return b


@pytest.fixture
def calls(monkeypatch):
    """The shapes of q in each `mx.fast.scaled_dot_product_attention` call, in order."""
    seen = []
    real = mx.fast.scaled_dot_product_attention

    def sdpa(q, k, v, **kw):
        seen.append((tuple(q.shape), tuple(k.shape), kw["mask"] if isinstance(kw["mask"], str) else "array"))
        return real(q, k, v, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", sdpa)
    return seen


@pytest.fixture(scope="module")
def host_dir(tmp_path_factory):
    if not cuda_host.available():
        pytest.skip("needs g++ (C++20) to run the CUDA kernels on the host")
    return tmp_path_factory.mktemp("sdpa_host")


# -- 1. the rule ---------------------------------------------------------------------------------------
def test_which_chunks_take_it():
    """PREFILL_ROWS rows or more, head sizes of multiples of 8 up to 128 on CUDA (Metal's list there), no
    soft-cap, and only with `sdpa` on (never on MLX's CPU as constructed)."""
    b = _sdpa_backend("bfloat16")
    std = AttentionSpec.standard
    assert b._sdpa_takes(std(4, 2, 128), PREFILL_ROWS) and b._sdpa_takes(std(4, 2, 80, window=40), 4096)
    assert not b._sdpa_takes(std(4, 2, 128), PREFILL_ROWS - 1)
    for d in (72 + 4, 136, 256):
        assert not b._sdpa_takes(std(4, 2, d), 512), d
    assert not b._sdpa_takes(replace(std(4, 2, 64), softcap=50.0), 512)
    b.gpu_kernels = "metal"  # MLX's Metal kernel: its own list of head sizes
    assert b._sdpa_takes(std(4, 2, 256), 512) and b._sdpa_takes(std(4, 2, 96), 512)
    assert not b._sdpa_takes(std(4, 2, 48), 512) and not b._sdpa_takes(std(4, 2, 136), 512)
    b.gpu_kernels = None  # the kernels' self-check failed: the reference's own steps, MLX's GEMMs
    assert not b._sdpa_takes(std(4, 2, 128), 512)
    for dtype in ("float32", *DTYPES):
        assert MLXBackend(device="cpu", dtype=dtype).sdpa is False


@pytest.mark.parametrize("gpu,dtype,kv_dtype,on", [
    ("cuda", "bfloat16", None, True), ("cuda", "float16", None, True), ("cuda", "float32", None, False),
    ("cuda", "bfloat16", "q8_0", False), ("cuda", "bfloat16", "float16", False), ("metal", "bfloat16", None, True),
    ("metal", "float32", None, False), ("cuda-sm75", "bfloat16", None, False)])
def test_the_construction_rule(monkeypatch, gpu, dtype, kv_dtype, on):
    """On CUDA (compute capability 8.0+; "cuda-sm75": a Turing GPU) and Metal, with q and the cache of one
    16-bit type; a prefill pass of 2,048 tokens there (mlx-lm's step too)."""
    b = MLXBackend(device="gpu", kernel=cuda_host.pretend_gpu(monkeypatch, gpu), dtype=dtype, kv_dtype=kv_dtype)
    assert b.sdpa is on
    b.mma = False  # (the chunk follows either 16-bit path)
    assert b.prefill_chunk == (2048 if on else 512)


# -- 2. the masks ----------------------------------------------------------------------------------------
def _drawn(mask, rows: int, keys: int) -> np.ndarray:
    """A mask as the keys it hides, [rows, keys] bool ("causal": MLX's bottom-right rule)."""
    if isinstance(mask, str):
        assert mask == "causal"
        return np.arange(keys)[None, :] > np.arange(keys - rows, keys)[:, None]
    m = np.array(mask.astype(mx.float32))
    assert set(np.unique(m)) <= {0.0, -np.inf}
    return m == -np.inf


@pytest.mark.parametrize("window", [None, 1, 40])
@pytest.mark.parametrize("start,rows", [(0, 130), (81, 130), (300, 200)])
def test_the_mask_hides_what_mask_scores_hides(window, start, rows):
    """`_sdpa_mask` against the reference's `mask_scores` (which sets hidden scores to -inf): the same keys
    hidden from every row, causal from the cache's start and from mid-cache, with windows of 1 and 40; the
    string "causal" only without a window, and an array where the chunk's last row is not the last key
    (a cache that holds more keys than the pass's sequence: the rows of a windowed store's view)."""
    b = _sdpa_backend("bfloat16")
    spec = AttentionSpec.standard(4, 2, 64, window=window)
    batch = Batch(b, [0], [start], [rows])
    keys = start + rows
    want = np.isinf(np.array(b.mask_scores(mx.zeros((rows, keys)), batch.positions_of(b, 0), True, window)))
    mask = b._sdpa_mask(batch, 0, keys, spec)
    assert isinstance(mask, str) is (window is None)
    assert np.array_equal(_drawn(mask, rows, keys), want)
    more = b._sdpa_mask(batch, 0, keys + 5, spec)  # five keys past the last row's
    assert not isinstance(more, str)
    want = np.isinf(np.array(b.mask_scores(mx.zeros((rows, keys + 5)), batch.positions_of(b, 0), True, window)))
    assert np.array_equal(_drawn(more, rows, keys + 5), want)


# -- 3. fused = per-head ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sdpa_check_cases(head_dims=(16, 48)), ids=str)
def test_fused_is_the_per_head_reference_through_mlxs_fallback(dtype, case, calls, host_dir, monkeypatch):
    """The self-check's own cases at head sizes 16 and 48, with MLX's CPU fallback for the call: the fused
    override bit for bit the per-head reference, each long chunk's heads in one call in the fused
    override and one call each in the reference (two chunks in one pass put in their places), both in
    the activations' dtype, the mask a string where the chunk's last row is the last key and an array
    with a window."""
    cuda_host.launch_on_host(host_dir, monkeypatch)
    b = _sdpa_backend(dtype)
    q, view, batch = check_case_inputs(b, case)
    got, ref = b.fused_attention_override(q, view, batch, case.spec), b.per_head_attention(q, view, batch, case.spec)
    assert got.dtype == ref.dtype == b.dtype  # the activations' dtype: MLX's result handed on as it is
    got, ref = b.to_numpy(got), b.to_numpy(ref)
    assert np.isfinite(ref).all() and np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    spec, d, mask = case.spec, case.spec.head_dim, "array" if case.spec.window else "causal"
    fused = [((1, spec.n_heads, t, d), (1, spec.n_kv_heads, s, d), mask) for s, t in case.seqs]
    per_head = [((1, 1, t, d), (1, 1, s, d), mask) for s, t in case.seqs for _ in range(spec.n_heads)]
    assert calls == fused + per_head


_APART = [CheckCase("two 130-row chunks from the start, a short chunk between", AttentionSpec.standard(4, 2, 16),
                    ((130, 130), (60, 20), (130, 130))),
          CheckCase("two soft-capped 130-row chunks from the start", replace(AttentionSpec.standard(4, 2, 16), softcap=2.0),
                    ((130, 130),) * 2)]


@pytest.mark.parametrize("case", sdpa_batch_check_cases(head_dims=(16,)) + _APART, ids=str)
@pytest.mark.parametrize("limit", [None, 0])
def test_prompts_of_one_length_take_one_call(case, limit, calls, host_dir, monkeypatch):
    """The batched self-check's cases at head size 16, through MLX's CPU fallback: consecutive chunks of
    one length over as many keys take one call of B prompts in the fused override (a call a head and a
    prompt in the reference), bit for bit the reference; with SDPA_BATCH_MAX_BYTES 0 (keys too large to
    stack) or `sdpa_batch` off, a call a prompt again, the same bits. Two such chunks with a short one
    between (our kernels) are a call each; soft-capped ones take no call (MLX's kernel has no cap)."""
    import itertools

    cuda_host.launch_on_host(host_dir, monkeypatch)
    if limit is not None:
        monkeypatch.setattr(mlx_backend, "SDPA_BATCH_MAX_BYTES", limit)
    b = _sdpa_backend("bfloat16")
    q, view, batch = check_case_inputs(b, case)
    ref = b.to_numpy(b.per_head_attention(q, view, batch, case.spec))
    del calls[:]
    got = b.to_numpy(b.fused_attention_override(q, view, batch, case.spec))
    assert np.isfinite(ref).all() and np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    spec, d = case.spec, case.spec.head_dim
    runs = [(len(list(g)), seq) for seq, g in itertools.groupby(case.seqs)] if limit is None else [(1, x) for x in case.seqs]
    runs = [(n, (s, t)) for n, (s, t) in runs if t >= PREFILL_ROWS and not spec.softcap]  # (else: no call)
    if case is _APART[0] and limit is None:
        runs = [(1, x) for x in case.seqs if x[1] >= PREFILL_ROWS]  # (apart: a call each)
    assert calls == [((n, spec.n_heads, t, d), (n, spec.n_kv_heads, s, d), "causal") for n, (s, t) in runs]
    b.sdpa_batch = False
    del calls[:]
    assert np.array_equal(b.to_numpy(b.fused_attention_override(q, view, batch, case.spec)).view(np.uint32), ref.view(np.uint32))
    assert [c[0][0] for c in calls] == [1] * sum(t >= PREFILL_ROWS and not spec.softcap for _, t in case.seqs)


def test_each_batched_check_case_takes_one_call():
    """Every case of the batched self-check (`sdpa_batch_check_cases`, and its passes of real size) makes
    at least one call over several prompts under the default bound: a case that did not would check
    nothing of the batching."""
    b = _sdpa_backend("bfloat16")
    for case in sdpa_batch_check_cases(head_dims=(64, 80, 128)) + mlx_backend.SDPA_BATCH_SIZED:
        assert max(map(len, _groups(b, case))) > 1, str(case)


def _groups(b: MLXBackend, case: CheckCase) -> list[list[int]]:
    """The runs of a case's sequences that one call of MLX's fused attention takes (`_sdpa_groups`)."""
    batch = Batch(b, list(range(len(case.seqs))), [s - t for s, t in case.seqs], [t for _, t in case.seqs])
    return b._sdpa_groups(batch, case.spec, range(len(case.seqs)))


def test_the_stacked_keys_stay_within_their_bound(calls, monkeypatch):
    """SDPA_BATCH_MAX_BYTES bounds the keys that a layer's call stacks in all: at exactly two prompts'
    keys, three equal chunks are a call of two and a call of one (then the chunk over other keys)."""
    b = _sdpa_backend("bfloat16")
    case = sdpa_batch_check_cases(head_dims=(16,))[1]  # three 130-row chunks from the start, then 300 keys
    spec = case.spec
    monkeypatch.setattr(mlx_backend, "SDPA_BATCH_MAX_BYTES", 2 * 130 * spec.n_kv_heads * spec.head_dim * 2)
    q, view, batch = check_case_inputs(b, case)
    ref = b.to_numpy(b.per_head_attention(q, view, batch, spec))
    del calls[:]
    got = b.to_numpy(b.fused_attention_override(q, view, batch, spec))
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    assert [(c[0][0], c[1][2]) for c in calls] == [(2, 130), (1, 130), (1, 300)]


def test_a_pass_of_long_and_short_sequences(calls, host_dir, monkeypatch):
    """Two long chunks (from the cache's start and from mid-cache) beside a short chunk and a decode row, in
    the paged cache: each long chunk one call in the fused override, the others on the kernels; bit for
    bit the reference."""
    cuda_host.launch_on_host(host_dir, monkeypatch)
    b = _sdpa_backend("bfloat16")
    case = CheckCase("two long chunks, a short one, a decode row", AttentionSpec.standard(4, 2, 32),
                     ((130, 130), (400, 150), (60, 20), (90, 1)), "paged")
    q, view, batch = check_case_inputs(b, case)
    got = b.to_numpy(b.fused_attention_override(q, view, batch, case.spec))
    assert [c[0][1] for c in calls] == [4, 4]
    ref = b.to_numpy(b.per_head_attention(q, view, batch, case.spec))
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    assert [c[0][1] for c in calls[2:]] == [1] * 8


def test_the_fused_call_reads_the_heads_in_place(monkeypatch):
    """The fused override hands MLX's fused attention q, K and V as views: the chunk's rows and the KV
    store's rows seen head-major, no contiguous copy in their graphs (MLX's kernels read strided heads; a
    copy of a 32k-token chunk's keys and values is 128 MiB a layer of Qwen3-0.6B in bfloat16, and on a GPU
    every layer's copy lives until the pass is done); its context comes back without a gather."""
    import re
    import tempfile

    seen = []
    real = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", lambda q, k, v, **kw: seen.append((q, k, v)) or real(q, k, v, **kw))
    b = _sdpa_backend("bfloat16")
    case = CheckCase("a long chunk", AttentionSpec.standard(4, 2, 32), ((PREFILL_ROWS + 3, PREFILL_ROWS + 3),))
    q, view, batch = check_case_inputs(b, case)
    out = b.fused_attention_override(q, view, batch, case.spec)  # (read before it is evaluated: a graph)
    assert len(seen) == 1
    for x in seen[0]:
        with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
            mx.export_to_dot(f.name, x)
            names = set(re.findall(r'label ="(\w+)', f.read()))
        assert "Transpose" in names and not names & {"Contiguous", "Copy"}, names
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:  # its context back as rows: no gather (MLX's
        mx.export_to_dot(f.name, out)                             # ctx[0] is one: a copy of it all, a launch)
        assert "Gather" not in set(re.findall(r'label ="(\w+)', f.read()))
    mx.eval(out)


def test_the_tracer_keeps_the_reference_bits(calls, host_dir, monkeypatch):
    """`--trace` on per-head attention: a chunk MLX's fused attention takes runs the inner backend's own
    steps (a call a head, counted as one "sdpa" op), so the traced reference has the untraced one's bits;
    a short chunk still runs the primitive steps on the tracer."""
    from mlxinfer.tracing import TracingBackend

    cuda_host.launch_on_host(host_dir, monkeypatch)
    b = _sdpa_backend("bfloat16", "per-head")
    case = CheckCase("a long chunk beside a short one", AttentionSpec.standard(4, 2, 32), ((200, 130), (60, 20)))
    q, view, batch = check_case_inputs(b, case)
    want = b.to_numpy(b.per_head_attention(q, view, batch, case.spec))
    tracer = TracingBackend(b, stream=io.StringIO())
    del calls[:]
    got = np.array(tracer.fused_attention(q, view, batch, case.spec).astype(mx.float32))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert len(calls) == 4 and tracer.counts["sdpa"] == 1 and tracer.counts["softmax_rows"] == 4


# -- 4. the self-check and the other 16-bit path ----------------------------------------------------------
def test_the_tensor_core_check_runs_its_own_kernels(host_dir, monkeypatch):
    """`verify_mma` turns MLX's fused attention off while it runs, so that its cases reach the
    tensor-core kernels (here those without a soft-cap, which MLX's would take), and back on after."""
    launched = cuda_host.launch_on_host(host_dir, monkeypatch)
    real = mlx_backend.mma_check_cases
    monkeypatch.setattr(mlx_backend, "mma_check_cases", lambda: [c for c in real(head_dims=(16,)) if len(c.seqs) == 1 and not c.spec.softcap])
    b = _sdpa_backend("bfloat16")
    b.mma = True
    assert verify_mma(b) is None
    assert "mma_attention" in launched and b.sdpa is True


def _checked(monkeypatch, capsys, **problems):
    """A bfloat16 CUDA backend (MLX made to report a GPU) after its self-checks, each passing but those
    named (`verify_sdpa="..."`: that check's failure line); (the backend, its stderr lines)."""
    cuda_host.pretend_gpu(monkeypatch, "cuda")
    for name in ("verify_mma", "verify_block_kernels", "verify_fused_forms", "verify_rms_norm", "verify_swiglu"):
        monkeypatch.setattr(mlx_backend, name, lambda b, kernel=None: None)
    for name in ("verify_sdpa", "verify_sdpa_batch", "verify_gpu_kernels"):
        monkeypatch.setattr(mlx_backend, name, lambda b, problem=problems.get(name): problem)
    monkeypatch.setattr(mlx_backend.kernel_checks, "verdict", lambda kind, dt, kv, run, fresh=False: run())
    b = MLXBackend(device="gpu", kernel="cuda", dtype="bfloat16")
    b.check_kernels(verify=mlx_backend.verify_gpu_kernels)
    return b, capsys.readouterr().err.strip().splitlines()


def test_a_failed_self_check_turns_it_off(monkeypatch, capsys):
    """A failing `verify_sdpa` (a device whose kernel gives a head other bits when called on every head)
    turns the path off with a one-line warning, and only it: the tensor-core path stays, and 16-bit
    chunks keep 2,048 tokens a pass; the backend line and the kernel report name it."""
    b, err = _checked(monkeypatch, capsys, verify_sdpa="fused attention kernel differs in 3 of 9 values")
    assert b.sdpa is False and b.sdpa_fallback == "fused attention kernel differs in 3 of 9 values"
    assert b.mma is True and b.fallback is None and b.prefill_chunk == 2048
    assert len(err) == 1 and "MLX's fused attention failed its self-check" in err[0] and "tensor-core" in err[0]
    assert "MLX's fused attention failed its self-check on prefill chunks" in b.describe()
    b.device = "gpu"
    line, ok = b.kernel_report()
    assert not ok and "self-check FAILED (fused attention kernel differs in 3 of 9 values)" in line


def test_a_failed_batched_self_check_turns_only_it_off(monkeypatch, capsys):
    """A failing `verify_sdpa_batch` (a device whose kernel gives a prompt other bits when called with
    others) turns off only the one call over several prompts, with a one-line warning: MLX's fused
    attention stays, a call a prompt; the backend line (the engine's identity) and the kernel report name it."""
    b, err = _checked(monkeypatch, capsys, verify_sdpa_batch="prompt 2 of 3 differs in 5 values")
    assert b.sdpa is True and b.sdpa_batch is False and b.sdpa_batch_fallback == "prompt 2 of 3 differs in 5 values"
    assert len(err) == 1 and "several prompts in one call failed its self-check" in err[0]
    assert "the batched one failed its self-check" in b.describe()
    line, ok = b.kernel_report()  # (`inspect --kernels`)
    assert not ok and "one call over several prompts: self-check FAILED (prompt 2 of 3 differs in 5 values)" in line


def test_the_verdict_is_kept_per_cudnn_release(monkeypatch):
    """The self-check's verdict on CUDA is kept under a key naming the cuDNN wheel's version (another
    release is checked again); Metal's names none."""
    from importlib import metadata

    def installed(**wheels):
        def version(name):
            if name.replace("-", "_") not in wheels:
                raise metadata.PackageNotFoundError(name)
            return wheels[name.replace("-", "_")]
        return version

    monkeypatch.setattr(metadata, "version", installed(nvidia_cudnn_cu13="9.8.0.87"))  # (mlx-cuda-13's requirement)
    assert mlx_backend.cudnn_version("cuda") == " cudnn 9.8.0.87" and mlx_backend.cudnn_version("metal") == ""
    monkeypatch.setattr(metadata, "version", installed(nvidia_cudnn_cu12="9.1.0"))
    assert mlx_backend.cudnn_version("cuda") == " cudnn 9.1.0"
    both = dict(nvidia_cudnn_cu13="9.8.0.87", nvidia_cudnn_cu12="9.1.0")  # the one MLX's build requires
    monkeypatch.setattr(metadata, "version", installed(mlx_cuda_12="0.32.4", **both))
    assert mlx_backend.cudnn_version("cuda") == " cudnn 9.1.0"
    monkeypatch.setattr(metadata, "version", installed(mlx_cuda_13="0.32.4", **both))
    assert mlx_backend.cudnn_version("cuda") == " cudnn 9.8.0.87"
    monkeypatch.setattr(metadata, "version", installed())
    assert mlx_backend.cudnn_version("cuda") == " cudnn ?"
    kinds = []
    monkeypatch.setattr(mlx_backend.kernel_checks, "verdict", lambda kind, dt, kv, run, fresh=False: kinds.append(kind))
    monkeypatch.setattr(mlx_backend, "verify_gpu_kernels", lambda b: None)
    b = MLXBackend(device="gpu", kernel=cuda_host.pretend_gpu(monkeypatch, "cuda"), dtype="bfloat16")
    b.check_kernels(verify=mlx_backend.verify_gpu_kernels)
    assert "cuda sdpa prefill cudnn ?" in kinds and "cuda sdpa batched prefill cudnn ?" in kinds


def test_cudnn_switched_off_in_mlx_is_not_taken(monkeypatch):
    """MLX_CUDA_USE_CUDNN_SDPA=0 (MLX's own switch): cuDNN's kernel would refuse every chunk (`force_fused`),
    so the path is off from construction; the tensor-core path stays."""
    monkeypatch.setenv("MLX_CUDA_USE_CUDNN_SDPA", "0")
    b = MLXBackend(device="gpu", kernel=cuda_host.pretend_gpu(monkeypatch, "cuda"), dtype="bfloat16")
    assert b.sdpa is False and b.mma is True


def test_the_kernels_falling_back_take_it_off_too(monkeypatch):
    """When the attention kernels fail their self-check (`_attention_falls_back`) the 16-bit paths go with
    them: the backend line stops naming them and the prefill chunk is the protocol's again."""
    b = MLXBackend(device="gpu", kernel=cuda_host.pretend_gpu(monkeypatch, "cuda"), dtype="bfloat16")
    b._attention_falls_back("fused attention kernel differs")
    assert b.sdpa is False and b.mma is False and b.prefill_chunk == 512
    assert "MLX's fused attention" not in b.describe()


@pytest.mark.parametrize("gpu,softcap,chunk", [("metal", None, 2048), ("metal", 50.0, 512), ("cuda", 50.0, 2048)])
def test_the_chunk_follows_the_models_attention(monkeypatch, gpu, softcap, chunk):
    """2,048-token passes only where a 16-bit path takes the model's chunks: on Metal not a soft-capped
    model's (MLX's fused attention has no soft-cap, and no tensor-core kernel there: 512-row passes keep
    its per-head products' scores small); on CUDA the tensor-core kernel takes those."""
    b = MLXBackend(device="gpu", kernel=cuda_host.pretend_gpu(monkeypatch, gpu), dtype="bfloat16")
    assert b.prefill_chunk == 2048
    b.check_model([replace(AttentionSpec.standard(4, 2, 128), softcap=softcap)])
    assert b.prefill_chunk == chunk


@pytest.mark.parametrize("gpu,instead", [("cuda", "the tensor-core kernels"), ("metal", "MLX's products a head at a time")])
def test_the_warning_names_what_takes_the_chunks(monkeypatch, capsys, gpu, instead):
    b = MLXBackend(device="gpu", kernel=cuda_host.pretend_gpu(monkeypatch, gpu), dtype="bfloat16")
    b._sdpa_off("differs")
    assert instead in capsys.readouterr().err and b.sdpa is False


@pytest.mark.parametrize("fails_with", ["batched", "sdpa", "anything"])
def test_a_models_shape_failing_on_it_turns_it_off_alone(monkeypatch, capsys, tmp_path, fails_with):
    """`check_model` runs the model's shapes, whose chunks take MLX's fused attention at the model's head
    size (which `verify_sdpa` may not have asked), two of them in one call: a failure there turns the
    one call over several prompts off and checks again, then the path itself; only a failure that
    persists turns the kernels off. Each check's verdict is kept under a key of its own (the paths on
    then), so that the check after a path is turned off is run, not read back."""
    from mlxinfer.backends import kernel_checks

    b = MLXBackend(device="gpu", kernel=cuda_host.pretend_gpu(monkeypatch, "cuda"), dtype="bfloat16")
    b.checked = "cuda"  # (as checked)
    monkeypatch.setattr(kernel_checks, "_VERDICTS", {})
    monkeypatch.setattr(kernel_checks, "_read", lambda: {})
    monkeypatch.setattr(kernel_checks, "_file", lambda: tmp_path / "verdicts.json")
    assert b.sdpa and b.sdpa_batch
    monkeypatch.setattr(mlx_backend, "model_check_cases", lambda spec: [])
    monkeypatch.setattr(mlx_backend, "_prebuild", lambda backend, parts: None)
    fails = {"batched": lambda c: c.sdpa_batch, "sdpa": lambda c: c.sdpa, "anything": lambda c: True}[fails_with]
    monkeypatch.setattr(mlx_backend, "_first_problem", lambda backend, cases: "differs in 3 values" if fails(backend) else None)
    problem = b.check_model([AttentionSpec.standard(4, 2, 96)])
    assert b.sdpa_batch is False and b.sdpa_batch_fallback == "differs in 3 values, in the model's shape"
    assert (b.sdpa, b.sdpa_fallback) == ((True, None) if fails_with == "batched" else
                                         (False, "differs in 3 values, in the model's shape"))
    assert (problem is not None, b.gpu_kernels is None) == (fails_with == "anything",) * 2
    assert len(kernel_checks._VERDICTS) == (2 if fails_with == "batched" else 3)
    err = capsys.readouterr().err
    assert "over several prompts in one call failed its self-check" in err
    assert ("MLX's fused attention failed its self-check" in err) == (fails_with != "batched")


def test_the_models_check_has_two_equal_chunks():
    """`model_check_cases` has two equal chunks long enough for MLX's fused attention, over as many keys:
    on a 16-bit GPU path they take one call over both prompts, the batching checked in the model's shape."""
    b = _sdpa_backend("bfloat16")
    groups = [g for case in mlx_backend.model_check_cases(AttentionSpec.standard(16, 8, 128)) for g in _groups(b, case)]
    assert max(map(len, groups)) == 2


# -- 5. a model -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mlxinfer.synthetic import rewrite_gguf, write_synthetic_model

    from .reference.specs import GEMMA3_EDITS, GEMMA3_SYNTHETIC, QWEN3_SYNTHETIC

    tmp = tmp_path_factory.mktemp("sdpa_models")
    g3 = write_synthetic_model(tmp / "gemma3_plain.gguf", GEMMA3_SYNTHETIC)
    return {"qwen3": write_synthetic_model(tmp / "qwen3.gguf", QWEN3_SYNTHETIC),
            "gemma3": rewrite_gguf(g3, tmp / "gemma3.gguf", edits=GEMMA3_EDITS)}


PROMPT = [(7 * i + 3) % 380 for i in range(300)]


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_a_model_fused_is_per_head_on_the_host(name, models, calls, host_dir, monkeypatch):
    """Qwen3 and Gemma 3 (windows of 8 on five layers of six) in bfloat16 through the CUDA path with MLX's
    fused attention on: a 300-token prompt in chunks of 128 (two chunks take it, from the cache's start
    and from mid-cache; the last 44 rows take the kernels), logits of every row bit for bit the per-head
    engine's, and the same 8 greedy tokens."""
    cuda_host.launch_on_host(host_dir, monkeypatch)
    out = {}
    for attention in ("fused", "per-head"):
        engine = Engine(models[name], _sdpa_backend("bfloat16", attention), prefill_chunk=128)
        engine.compile_decode = False
        del calls[:]
        out[attention] = engine.logits(PROMPT), engine.generate(PROMPT[:200], max_tokens=8).token_ids
        n_layers, heads = engine.args.n_layers, engine.args.n_heads
        assert len(calls) == 2 * n_layers * (1 if attention == "fused" else heads) + n_layers * (1 if attention == "fused" else heads)
    assert np.array_equal(out["fused"][0], out["per-head"][0])
    assert out["fused"][1] == out["per-head"][1]


# -- 6. on a CUDA GPU: cuDNN's kernel ------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs MLX's CUDA device (cuDNN's attention kernel)")


def _gpu(dtype: str) -> MLXBackend:
    """The GPU backend in that dtype with every kernel on, unchecked (the test checks)."""
    return MLXBackend(device="gpu", dtype=dtype, verify=None)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_on_cuda_the_self_check_passes(dtype):
    """`verify_sdpa` on the device: every case's one call over every head has the bits of a call a head;
    `verify_sdpa_batch`: one call over several prompts has each prompt's bits."""
    b = _gpu(dtype)
    assert b.sdpa is True
    assert verify_sdpa(b) is None
    assert verify_sdpa_batch(b) is None


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,keys,window", [(512, 2048, None), (130, 600, 256), (2048, 2048, None)])
def test_on_cuda_a_chunk_of_qwen3_shape_and_its_error_model(dtype, rows, keys, window, calls):
    """A chunk of Qwen3-0.6B's shape (16 heads over 8, head size 128; q and K ~3, V ~3) from mid-cache,
    also with a window of 256: fused bit for bit the per-head reference, and within the error model of
    float64 attention of the same 16-bit values. The model (`test_tensor_core_order._attention_bound`,
    the tensor-core order's, whose instruction cuDNN's kernel uses too: k-steps of 16, float32
    accumulators) with the 16-bit rounding counted twice, for the weights (unnormalized here, then
    divided by their float32 total: the same first-order bound) and for the output, which the kernel
    rounds to the 16-bit type; plus the online softmax's float32 roundings (exp2 of a fused multiply-add,
    at most S/64 rescalings of the running sums): (S/32 + 8 + max|s|) u max|v|. The u16 terms dominate:
    the error must exceed the bound of float32 weights."""
    from .test_tensor_core_order import ETA16, U16, U32, _attention_bound

    b = _gpu(dtype)
    spec = AttentionSpec.standard(16, 8, 128, window=window)
    q, view, batch = check_case_inputs(b, CheckCase("a chunk", spec, ((keys, rows),)))
    got = b.to_numpy(b.fused_attention_override(q, view, batch, spec))
    assert len(calls) == 1 and calls[0][0] == (1, 16, rows, 128)
    ref = b.to_numpy(b.per_head_attention(q, view, batch, spec))
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    k, v = view.sequence(b, 0)
    qf, kf, vf = (np.array(x.astype(mx.float32)).astype(np.float64) for x in (q, k, v))
    positions = np.arange(keys - rows, keys)
    exact, bound = _attention_bound(qf, kf, vf, positions, spec, 2 * U16[dtype], ETA16[dtype])
    scores = max(np.max(np.abs(qf[:, h * 128:(h + 1) * 128] @ kf[:, (h // 2) * 128:(h // 2 + 1) * 128].T))
                 for h in range(16)) * spec.scale
    bound = bound + (keys / 32 + 8 + scores) * U32 * np.max(np.abs(vf))
    err = np.abs(got - exact)
    assert np.all(err <= bound), f"worst {np.max(err / bound):.3g} of the bound"
    _, float32_bound = _attention_bound(qf, kf, vf, positions, spec, 0.0, 0.0)
    assert np.any(err > float32_bound)


@needs_cuda
def test_on_cuda_a_model_in_bfloat16(models):
    """The synthetic Qwen3 in bfloat16 on the GPU, a 300-token prompt (one chunk on cuDNN's kernel): logits
    of every row bit for bit the per-head engine's, within test_mlx_backend's bfloat16 bound of float32's
    (5% of the largest logit), and 8 greedy tokens float32's (on an H200, 2026-12-05: 15 of 16 agreed; the
    16th is a near-tie, which bfloat16's rounding of the activations may flip)."""
    import mlxinfer

    from .test_mlx_backend import LOW_PRECISION

    f32 = mlxinfer.load(models["qwen3"], backend="mlx", dtype="float32")
    fused, per_head = (mlxinfer.load(models["qwen3"], backend="mlx", dtype="bfloat16", attention=a)
                       for a in ("fused", "per-head"))
    assert fused.backend.sdpa
    want, got = f32.logits(PROMPT), fused.logits(PROMPT)
    assert np.array_equal(got, per_head.logits(PROMPT))
    assert np.max(np.abs(got - want)) <= LOW_PRECISION[("bfloat16", None)] * np.max(np.abs(want))
    assert fused.generate(PROMPT, max_tokens=8).token_ids == f32.generate(PROMPT, max_tokens=8).token_ids


@needs_cuda
def test_on_cuda_prompts_of_one_length_share_a_call(models, calls):
    """Four 300-token prompts in one batch, bfloat16 on the GPU: after its self-check the batched path is on,
    a layer's four equal chunks take one call of cuDNN's kernel (q of 4 prompts), and each prompt's 8 greedy
    tokens are those of the per-head engine, whose calls are a head and a prompt each."""
    import mlxinfer

    prompts = [[(7 * i + 3 + 11 * j) % 380 for i in range(300)] for j in range(4)]
    fused, per_head = (mlxinfer.load(models["qwen3"], backend="mlx", dtype="bfloat16", attention=a)
                       for a in ("fused", "per-head"))
    got = [g.token_ids for g in fused.generate_batch(prompts, max_tokens=8)]
    assert fused.backend.sdpa_batch is True
    assert any(q[0] == 4 and q[2] == 300 for q, _, _ in calls)
    del calls[:]
    assert got == [g.token_ids for g in per_head.generate_batch(prompts, max_tokens=8)]
    assert calls and all(q[:2] == (1, 1) for q, _, _ in calls)
