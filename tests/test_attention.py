"""The attention contract on the cpu backend: the numpy override is byte-identical to the per-head
reference for batches of decode rows and prefill chunks, and both compute causal GQA attention."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings

from mlxinfer.backend import AttentionSpec, Backend
from mlxinfer.backends.cpu import CPUBackend
from mlxinfer.testing import AttentionCase, assert_matches_default, attention_inputs, run_both


@settings(max_examples=120, deadline=None)
@given(attention_inputs())
def test_cpu_fused_attention_is_byte_identical_to_per_head_reference(case):
    assert_matches_default(CPUBackend(), case)


@settings(max_examples=25, deadline=None)
@given(attention_inputs(max_seq=300))
def test_cpu_fused_attention_on_the_basic_cache(case):
    assert_matches_default(CPUBackend(), case, kv="basic")


@settings(max_examples=25, deadline=None)
@given(attention_inputs(max_seq=300))
def test_cpu_fused_attention_on_the_paged_cache(case):
    """Over pages: the override and the reference read the same rows gathered from the blocks."""
    assert_matches_default(CPUBackend(), case, kv="paged")


@settings(max_examples=40, deadline=None)
@given(attention_inputs(max_seq=600).filter(lambda case: case.spec.window))
def test_cpu_fused_attention_on_the_windowed_cache(case):
    """A windowed layer's store (`PreallocKVCache(windows=)`), its rows starting at an origin moved on
    before the pass: both paths read the same rows at the same shifted positions."""
    assert_matches_default(CPUBackend(), case, kv="windowed")


@pytest.mark.parametrize("rows,window,softcap", [([(6, 400), (1, 300), (3, 150)], 7, None),
                                                 ([(6, 400), (1, 300)], 40, 2.0), ([(1, 301), (2, 9)], 100, None),
                                                 ([(9, 64)], 57, None)])
def test_the_windowed_cache_is_attention(rows, window, softcap):
    """With the windowed store's rows dropped before their origin, both paths are still causal
    windowed attention (float64 textbook, the tolerance of the full cache's test); the origins did move
    (but not for 64 keys behind a window of 57: origin 0)."""
    from mlxinfer.testing import WINDOWED_STEP, case_batch

    case = make_case(rows, 2, 2, 32, window, seed=window, softcap=softcap)
    _, view, batch = case_batch(CPUBackend(), case, kv="windowed")
    moved = [s - t - window + 1 >= WINDOWED_STEP for t, s in rows]
    assert [k > 0 for k in (s - n for (_, s), n in zip(rows, batch.kv_lens))] == moved
    fused, default = run_both(CPUBackend(), case, kv="windowed")
    want = naive_attention(case)
    np.testing.assert_allclose(default, want, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(fused, want, atol=2e-5, rtol=1e-4)


def naive_attention(case):
    """float64 textbook attention, causal with an optional window, sequence by sequence."""
    sp = case.spec
    d, g = sp.head_dim, sp.group
    out, r0 = [], 0
    for k, v, t in zip(case.keys, case.values, case.rows):
        s = k.shape[0]
        pos = np.arange(s - t, s)[:, None]
        hidden = np.arange(s)[None, :] > pos
        if sp.window:
            hidden |= np.arange(s)[None, :] <= pos - sp.window
        o = np.zeros((t, sp.n_heads * d))
        for h in range(sp.n_heads):
            kh = k[:, (h // g) * d:(h // g + 1) * d].astype(np.float64)
            vh = v[:, (h // g) * d:(h // g + 1) * d].astype(np.float64)
            sc = case.q[r0:r0 + t, h * d:(h + 1) * d].astype(np.float64) @ kh.T / np.sqrt(d)
            if sp.softcap:
                sc = sp.softcap * np.tanh(sc / sp.softcap)
            sc[hidden] = -np.inf
            p = np.exp(sc - sc.max(1, keepdims=True))
            o[:, h * d:(h + 1) * d] = (p / p.sum(1, keepdims=True)) @ vh
        out.append(o)
        r0 += t
    return np.concatenate(out)


def make_case(rows_and_lengths, kv, group, d, window=None, seed=0, softcap=None):
    rng = np.random.default_rng(seed)
    spec = replace(AttentionSpec.standard(kv * group, kv, d, window=window), softcap=softcap)
    keys = [rng.standard_normal((s, kv * d), dtype=np.float32) for _, s in rows_and_lengths]
    values = [rng.standard_normal((s, kv * d), dtype=np.float32) for _, s in rows_and_lengths]
    q = rng.standard_normal((sum(t for t, _ in rows_and_lengths), spec.n_heads * d), dtype=np.float32)
    return AttentionCase(q, keys, values, [t for t, _ in rows_and_lengths], spec)


@pytest.mark.parametrize("rows,kv,group,d,window,softcap", [
    ([(1, 1)], 1, 1, 64, None, None), ([(1, 37)], 2, 4, 128, None, None), ([(5, 5)], 1, 2, 32, None, None),
    ([(3, 20), (1, 9), (4, 4)], 3, 3, 64, None, None), ([(6, 40), (1, 30)], 2, 2, 32, 7, None),
    ([(6, 40), (1, 30)], 2, 2, 32, 7, 2.0), ([(1, 37)], 2, 4, 128, None, 0.75)])
def test_attention_paths_compute_causal_gqa_attention(rows, kv, group, d, window, softcap):
    """Both paths against float64 textbook attention (soft-capped where asked: cap * tanh(score / cap),
    caps small enough here that every score is bent)."""
    case = make_case(rows, kv, group, d, window, seed=len(rows) * 100 + d, softcap=softcap)
    fused, default = run_both(CPUBackend(), case)
    want = naive_attention(case)
    np.testing.assert_allclose(default, want, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(fused, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
def test_large_score_blocks_in_tiles_and_threads_are_byte_identical(threads):
    """Scores of a long prefill chunk are scaled, masked and softmaxed in row tiles: with 1 thread all
    heads' rows form one block whose tiles start inside a head's rows, with 2 (whatever the machine's
    load would choose) each head is a task of its own on the backend's threads; every row is still
    the reference's, and attention."""
    from mlxinfer.backends.cpu import PARALLEL_PRODUCT_MACS, TILE_ELEMENTS

    t, group, s, d = 50, 3, 4096, 16
    case = make_case([(t, s)], 1, group, d, window=1000, seed=9)
    assert t * d * s >= PARALLEL_PRODUCT_MACS and (TILE_ELEMENTS // s) % t
    assert_matches_default(CPUBackend(threads=threads), case)
    fused, _ = run_both(CPUBackend(threads=threads), case)
    np.testing.assert_allclose(fused, naive_attention(case), atol=2e-5, rtol=1e-4)


def test_gqa_mapping_uses_consecutive_query_heads_per_kv_head():
    # KV head 0 has V = 1, KV head 1 has V = 2: query heads 0,1 must read 1 and heads 2,3 read 2.
    d, s = 4, 3
    v = np.concatenate([np.full((s, d), 1, np.float32), np.full((s, d), 2, np.float32)], axis=1)
    case = AttentionCase(np.ones((1, 4 * d), np.float32), [np.zeros((s, 2 * d), np.float32)], [v], [1],
                         AttentionSpec.standard(4, 2, d))
    for out in run_both(CPUBackend(), case):
        assert out.reshape(4, d)[:, 0].tolist() == [1, 1, 2, 2]


def test_each_sequence_reads_only_its_own_cache():
    """Two sequences in one pass: each output equals the same sequence attended alone."""
    case = make_case([(3, 10), (1, 25)], 2, 2, 32, seed=4)
    both, _ = run_both(CPUBackend(), case)
    alone0, _ = run_both(CPUBackend(), AttentionCase(case.q[:3], case.keys[:1], case.values[:1], [3], case.spec))
    alone1, _ = run_both(CPUBackend(), AttentionCase(case.q[3:], case.keys[1:], case.values[1:], [1], case.spec))
    assert np.array_equal(both, np.concatenate([alone0, alone1]))


def mutated_override(mutation):
    """The cpu override with one deliberate change of float order (the same math, other rounding)."""
    import mlxinfer.backends.cpu as cpu

    class Mutant(CPUBackend):
        def fused_attention_override(self, q, kv, batch, spec):
            out = np.empty((q.shape[0], spec.n_heads * spec.head_dim), np.float32)
            kvh, d, g = spec.n_kv_heads, spec.head_dim, spec.group
            for i, (r0, r1) in enumerate(batch.rows):
                k, v = kv.sequence(self, i)
                t, s = r1 - r0, k.shape[0]
                qh = np.ascontiguousarray(q[r0:r1].reshape(t, kvh, g, d).transpose(1, 2, 0, 3))
                kh = np.ascontiguousarray(k.reshape(s, kvh, d).transpose(1, 0, 2))[:, None]
                vh = np.ascontiguousarray(v.reshape(s, kvh, d).transpose(1, 0, 2))[:, None]
                if mutation == "scale q first":
                    sc = np.matmul(qh * np.float32(spec.scale), kh.transpose(0, 1, 3, 2))
                elif mutation == "divide by sqrt(d)":
                    sc = np.matmul(qh, kh.transpose(0, 1, 3, 2)) / np.float32(np.sqrt(d))
                else:
                    sc = np.matmul(qh, kh.transpose(0, 1, 3, 2)) * np.float32(spec.scale)
                if t > 1 or spec.window:
                    sc = self.mask_scores(sc, batch.positions_of(self, i), spec.causal, spec.window)
                if mutation == "float64 softmax":
                    e = np.exp(sc.astype(np.float64) - sc.max(-1, keepdims=True))
                    attn = (e / e.sum(-1, keepdims=True)).astype(np.float32)
                else:
                    attn = cpu._softmax_last_axis(sc)
                out[r0:r1] = np.matmul(attn, vh).transpose(2, 0, 1, 3).reshape(t, -1)
            return out

    return Mutant()


@pytest.mark.parametrize("mutation", ["scale q first", "divide by sqrt(d)", "float64 softmax"])
def test_harness_catches_a_different_rounding_order(mutation):
    case = make_case([(1, 300), (8, 200)], 2, 2, 128, seed=3)
    fused, default = run_both(mutated_override(mutation), case)
    np.testing.assert_allclose(fused, default, rtol=1e-4, atol=1e-5)  # the same math...
    with pytest.raises(AssertionError, match="differs from the per-head reference"):
        assert_matches_default(mutated_override(mutation), case)  # ...other bits


def test_the_unmutated_copy_passes():
    assert_matches_default(mutated_override(None), make_case([(1, 300), (8, 200)], 2, 2, 128, seed=3))


def test_harness_refuses_an_override_that_calls_the_reference():
    class Cheat(CPUBackend):
        def fused_attention_override(self, q, kv, batch, spec):
            return self.per_head_attention(q, kv, batch, spec)

    with pytest.raises(AssertionError, match="called the per-head reference"):
        assert_matches_default(Cheat(), make_case([(2, 8)], 1, 1, 16))


def test_heads_of_long_chunks_on_several_threads_stay_byte_identical():
    """Long prefill chunks run one task per head on two threads (each with its own score buffer),
    a decode row between them all heads as one task: same bits."""
    from mlxinfer.backends.cpu import PARALLEL_PRODUCT_MACS

    case = make_case([(64, 4096), (1, 3000), (40, 700)], 2, 4, 64, seed=9)
    case.q *= 4  # spread softmax rows
    backend = CPUBackend(threads=2)
    assert 40 * 64 * 700 >= PARALLEL_PRODUCT_MACS > 1 * 64 * 3000
    assert_matches_default(backend, case)
    assert backend._pool is not None  # the threaded path ran


def test_a_head_task_over_several_tiles_stays_byte_identical():
    """One head's task whose rows span several softmax tiles (T > TILE_ELEMENTS // S), with a window,
    on two threads: same bits."""
    from mlxinfer.backends.cpu import PARALLEL_PRODUCT_MACS, TILE_ELEMENTS

    t, s, d = 200, 4096, 16
    case = make_case([(t, s)], 2, 2, d, window=1500, seed=3)
    assert t > TILE_ELEMENTS // s and t * d * s >= PARALLEL_PRODUCT_MACS
    backend = CPUBackend(threads=2)
    assert_matches_default(backend, case)
    assert backend._pool is not None


@pytest.mark.parametrize("rows", [[(512, 909)], [(200, 1306), (1, 4085)]])
def test_bits_do_not_depend_on_the_blas_thread_count(rows):
    """OpenBLAS's threaded gemm sums a chunk's weights x values product ([T x S] x [S x 64]) in another
    order than its one-thread gemm for these S (measured); the cpu backend's activation products run on
    one BLAS thread each, so the override and the reference give the same bits on 1 and 2 threads."""
    case = make_case(rows, 3, 3, 64, None, seed=5)
    got = {}
    for threads in (1, 2):
        backend = CPUBackend(threads=threads)  # sets the process's BLAS threads
        got[threads] = run_both(backend, case)
    for one, two in zip(got[1], got[2]):
        assert np.array_equal(one.view(np.uint32), two.view(np.uint32))
