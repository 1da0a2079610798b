"""Prefill chunks on a GPU (mlxinfer/backends/mlx.py, PREFILL_ROWS): a sequence's attention products with
at least PREFILL_ROWS query rows and PREFILL_GEMM_MIN multiply-adds are MLX's own GEMMs a head at a time,
in the per-head reference and in the fused override alike; the other sequences of the pass keep the
published-order kernels. (Most tests here set PREFILL_GEMM_MIN to 1, so that rows alone decide; the
size rule has tests of its own.)

Here (no GPU) the MLX backend runs on its CPU device with stand-ins for the GPU kernels (MLX's CPU
products, which compute each row on its own, as the published order does): the override must give the
reference's bits on batches that mix long chunks, short chunks and decode rows, on every cache kind,
and must never hand a long chunk to a kernel. On a GPU the self-check's cases with long chunks and
tests/test_mlx_backend.py run the real kernels."""

import mlx.core as mx
import numpy as np
import pytest

from mlxinfer import kernels
from mlxinfer.backend import AttentionSpec
from mlxinfer.backends import mlx as mlx_backend
from mlxinfer.backends.mlx import PREFILL_ROWS, CheckCase, MLXBackend, check_case_inputs
from mlxinfer.kv_cache import KV_CACHES


@pytest.fixture
def gpu_like(monkeypatch):
    """An MLX backend on the CPU whose 'GPU kernels' are stand-ins; returns (backend, log of the rows
    each stand-in was given)."""
    log = {"matmul_rows": [], "fused_rows": []}

    def matmul(kind, a, bt, group=1):
        log["matmul_rows"].append(a.shape[1])
        return mx.matmul(a, mx.swapaxes(mx.repeat(bt, group, axis=0), -1, -2))

    def softmax(kind, x):
        return mx.softmax(x, axis=-1, precise=True)

    def fused(kind, q, keys, values, row_slots, positions, row_lens, spec, seq_rows=None, **kw):
        """Each row alone, with the reference's steps on the stand-ins."""
        log["fused_rows"].append(q.shape[0])
        d, out = spec.head_dim, []
        slots, pos, lens = (np.array(a).tolist() for a in (row_slots, positions, row_lens))
        for r in range(q.shape[0]):
            heads = []
            for h in range(spec.n_heads):
                c = (h // spec.group) * d
                k = keys[slots[r], :lens[r], c:c + d]
                v = values[slots[r], :lens[r], c:c + d]
                s = be._softcap(be.scale(be.matmul(q[r:r + 1, h * d:(h + 1) * d], mx.transpose(k)), spec.scale),
                                spec.softcap)
                s = be.mask_scores(s, mx.array([pos[r]], dtype=mx.int32), spec.causal, spec.window)
                heads.append(be.matmul(be.softmax_rows(s), v))
            out.append(mx.concatenate(heads, axis=1))
        return mx.concatenate(out)

    be = MLXBackend(device="cpu")
    be.gpu_kernels, be.kernel = "cuda", "cuda"  # the kernel paths, on the stand-ins
    monkeypatch.setattr(mlx_backend, "PREFILL_GEMM_MIN", 1)  # (rows alone decide; see the size rule's tests)
    monkeypatch.setattr(kernels, "matmul", matmul)
    monkeypatch.setattr(kernels, "softmax", softmax)
    monkeypatch.setattr(kernels, "tanh", lambda kind, x: mx.tanh(x))
    monkeypatch.setattr(kernels, "fused_attention", fused)
    monkeypatch.setattr(kernels, "uses_split", lambda *a: False)
    monkeypatch.setattr(MLXBackend, "_few_long_rows", staticmethod(lambda *a: False))
    return be, log


BATCHES = {
    "one-long-chunk": ((300, PREFILL_ROWS + 2),),
    "long-chunk-short-chunk-decode-rows": ((70, 1), (300, PREFILL_ROWS + 40), (40, 9), (129, 1)),
    "two-long-chunks": ((PREFILL_ROWS, PREFILL_ROWS), (260, PREFILL_ROWS + 3)),
    "just-below": ((200, PREFILL_ROWS - 1), (7, 1)),
}


# Gemma 2's steps besides: soft-capping and a sliding window (shorter than the chunks), 4 heads a KV head
CAPPED = AttentionSpec(8, 2, 32, 0.17, True, window=100, softcap=50.0)


@pytest.mark.parametrize("kv", list(KV_CACHES))
@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("spec", [AttentionSpec.standard(4, 2, 32), CAPPED], ids=["standard", "capped-window"])
def test_long_chunks_take_the_reference_steps_and_keep_its_bits(gpu_like, monkeypatch, name, kv, spec):
    """The override's long chunks (`_heads_together`) give the reference's bits; a long chunk's products
    are MLX's, 2 a head (its other steps once over the heads), none at the kernel's product."""
    be, log = gpu_like
    q, view, batch = check_case_inputs(be, CheckCase(name, spec, BATCHES[name], kv))
    ref = be.to_numpy(be.per_head_attention(q, view, batch, spec))
    log["matmul_rows"].clear()
    products = _count_mlx_products(monkeypatch)
    got = be.to_numpy(be.fused_attention_override(q, view, batch, spec))
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    assert sum(log["fused_rows"]) == sum(t for _, t in BATCHES[name] if t < PREFILL_ROWS)  # only the short ones
    assert max(log["matmul_rows"], default=0) < PREFILL_ROWS  # long chunks never reach the kernel's product
    # (the stand-in kernels' products, of fewer rows, call mx.matmul too)
    assert [r for r in products if r >= PREFILL_ROWS] == [t for _, t in BATCHES[name] if t >= PREFILL_ROWS
                                                         for _ in range(2 * spec.n_heads)]


def _count_mlx_products(monkeypatch) -> list[int]:
    """From now on, the rows of each `mx.matmul` call, in a list (returned)."""
    rows, real = [], mx.matmul

    def counted(a, b, **kw):
        rows.append(a.shape[-2])
        return real(a, b, **kw)

    monkeypatch.setattr(mlx_backend.mx, "matmul", counted)
    return rows


@pytest.mark.parametrize("spare", [0, -1])
def test_heads_together_only_where_the_scores_fit_the_bound(gpu_like, monkeypatch, spare):
    """A long chunk goes over all heads at once where its heads' float32 scores take at most
    HEADS_TOGETHER_MAX_BYTES (here exactly so), else a head at a time (one byte short): the same bits."""
    be, _ = gpu_like
    t, s = PREFILL_ROWS + 2, 300
    q, view, batch = check_case_inputs(be, CheckCase("one-long-chunk", CAPPED, ((s, t),), "prealloc"))
    ref = be.to_numpy(be.per_head_attention(q, view, batch, CAPPED))
    monkeypatch.setattr(mlx_backend, "HEADS_TOGETHER_MAX_BYTES", CAPPED.n_heads * t * s * 4 + spare)
    stacks, real = [], mx.stack

    def stack(arrays, *a, **kw):
        stacks.append(len(arrays))
        return real(arrays, *a, **kw)

    monkeypatch.setattr(mlx_backend.mx, "stack", stack)
    got = be.to_numpy(be.fused_attention_override(q, view, batch, CAPPED))
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    assert stacks == ([CAPPED.n_heads] if spare == 0 else [])


def test_the_reference_uses_mlx_products_from_prefill_rows(gpu_like, monkeypatch):
    """`matmul` of PREFILL_ROWS rows or more and PREFILL_GEMM_MIN multiply-adds or more is MLX's
    product; fewer rows, or fewer multiply-adds (either product of a head: scores and context), the
    kernel's."""
    be, log = gpu_like
    a = mx.ones((PREFILL_ROWS, 8))
    be.matmul(a, mx.ones((8, 3)))
    be.matmul(a[:PREFILL_ROWS - 1], mx.ones((8, 3)))
    assert log["matmul_rows"] == [PREFILL_ROWS - 1]
    log["matmul_rows"].clear()
    monkeypatch.setattr(mlx_backend, "PREFILL_GEMM_MIN", PREFILL_ROWS * 8 * 3)
    be.matmul(a, mx.ones((8, 3)))  # scores: rows x head size x keys
    be.matmul(mx.ones((PREFILL_ROWS, 3)), mx.ones((3, 8)))  # context: rows x keys x head size
    assert log["matmul_rows"] == []
    monkeypatch.setattr(mlx_backend, "PREFILL_GEMM_MIN", PREFILL_ROWS * 8 * 3 + 1)
    be.matmul(a, mx.ones((8, 3)))
    be.matmul(mx.ones((PREFILL_ROWS, 3)), mx.ones((3, 8)))
    assert log["matmul_rows"] == [PREFILL_ROWS, PREFILL_ROWS]


@pytest.mark.parametrize("kv", list(KV_CACHES))
@pytest.mark.parametrize("spare", [0, 1])
@pytest.mark.parametrize("spec", [AttentionSpec.standard(4, 2, 32), CAPPED], ids=["standard", "capped-window"])
def test_float32_chunks_under_the_gemm_size_take_the_kernels(gpu_like, monkeypatch, spec, spare, kv):
    """A chunk of PREFILL_ROWS rows or more whose head products are PREFILL_GEMM_MIN multiply-adds (rows
    x keys x head size) takes MLX's GEMMs in the reference and the override alike; one multiply-add
    short, the kernels in both (the override's fused launch over its rows, the reference's kernel
    products): the reference's bits either way, beside a short chunk and a decode row."""
    be, log = gpu_like
    t, s = PREFILL_ROWS + 2, 300
    seqs = ((70, 1), (s, t), (40, 9))
    monkeypatch.setattr(mlx_backend, "PREFILL_GEMM_MIN", t * s * spec.head_dim + spare)
    q, view, batch = check_case_inputs(be, CheckCase("sized", spec, seqs, kv))
    ref = be.to_numpy(be.per_head_attention(q, view, batch, spec))
    long_reference = max(log["matmul_rows"]) < PREFILL_ROWS
    log["matmul_rows"].clear(), log["fused_rows"].clear()
    got = be.to_numpy(be.fused_attention_override(q, view, batch, spec))
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    assert long_reference == (spare == 0)  # the reference: GEMMs at the size, kernel products under it
    assert sum(log["fused_rows"]) == 1 + 9 + (t if spare else 0)  # the override: the same choice


def test_prefill_rows_is_between_short_prompts_and_chunks():
    """Short prompts (< 128 tokens) keep the one-launch kernels; the default prefill chunk (512) is long."""
    from mlxinfer.engine import DEFAULT_PREFILL_CHUNK

    assert 16 < mlx_backend.PREFILL_ROWS <= DEFAULT_PREFILL_CHUNK
