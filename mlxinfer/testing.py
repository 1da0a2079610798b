"""A harness for kernel authors: Hypothesis strategies for batched attention problems and one assertion
that a `fused_attention` override is byte-identical to the per-head reference.

    from hypothesis import given
    from mlxinfer.testing import attention_inputs, assert_matches_default

    @given(attention_inputs())
    def test_my_kernel(case):
        assert_matches_default(MyBackend(), case)

A case is a batch of sequences, each with its own cached length S and its own number of query rows T
(T = 1: a decode step; T > 1: a causal prefill chunk ending at its last cached row). Inputs are drawn
so that a change of summation order shows: magnitudes log-uniform (mostly 0.1 to 30, where softmax rows
are far from one-hot), lengths up to ~4k including multiples of 64 and 128 and lengths past every
kernel block size, up to 64 query rows. Outputs must be finite.

Needs `hypothesis` (the `test` extra).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import numpy as np
from hypothesis import strategies as st

from .backend import AttentionSpec, Backend
from .batch import Batch
from .kv_cache import KV_CACHES


@dataclass
class AttentionCase:
    q: np.ndarray  # [N, H*D] float32: every sequence's query rows, packed
    keys: list  # per sequence [S, KV*D] float32 (the last T rows are this pass's)
    values: list
    rows: list  # per sequence T (query rows)
    spec: AttentionSpec

    def __repr__(self):
        sp = self.spec
        shapes = ", ".join(f"T={t}/S={k.shape[0]}" for t, k in zip(self.rows, self.keys))
        return (f"AttentionCase([{shapes}], heads={sp.n_heads}, kv_heads={sp.n_kv_heads}, head_dim={sp.head_dim}, "
                f"window={sp.window}, softcap={sp.softcap}, max|k|={max(float(np.abs(k).max()) for k in self.keys):.3g})")


SPECIAL_LENGTHS = (63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 1024, 1025, 2048, 4096)


@st.composite
def attention_inputs(draw, max_seq: int = 4096, max_query_rows: int = 64, max_seqs: int = 3,
                     head_dims=(64, 128, 32, 48, 80, 96, 16), max_kv_heads: int = 4, max_group: int = 4,
                     windows: bool = True, softcaps: bool = True):
    kv = draw(st.integers(1, max_kv_heads))
    group = draw(st.integers(1, max_group))
    d = draw(st.sampled_from(head_dims))
    window = draw(st.one_of(st.none(), st.integers(1, 96))) if windows else None
    cap = draw(st.one_of(st.none(), st.floats(0.5, 60.0, width=32))) if softcaps else None
    spec = replace(AttentionSpec.standard(kv * group, kv, d, window=window), softcap=cap)
    # Magnitude: log-uniform, mostly 0.1..30 (spread softmax rows), sometimes up to 1e3.
    mag = math.exp(draw(st.one_of(st.floats(math.log(0.1), math.log(30.0)),
                                  st.floats(math.log(0.01), math.log(1e3)))))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    budget = 6000  # total cached rows of the case, to keep examples fast
    keys, values, rows, queries = [], [], [], []
    for _ in range(draw(st.integers(1, max_seqs))):
        short = st.integers(1, 200)
        s = draw(st.one_of(short, st.integers(1, max_seq), st.sampled_from([x for x in SPECIAL_LENGTHS if x <= max_seq])))
        s = max(1, min(s, budget))
        budget -= s
        t = draw(st.one_of(st.just(1), st.integers(1, min(s, max_query_rows))))

        def arr(n, cols):
            return (rng.standard_normal((n, cols), dtype=np.float32) * np.float32(mag)).astype(np.float32)

        keys.append(arr(s, kv * d))
        values.append(arr(s, kv * d))
        queries.append(arr(t, spec.n_heads * d))
        rows.append(t)
        if budget <= 0:
            break
    return AttentionCase(np.concatenate(queries), keys, values, rows, spec)


WINDOWED_STEP = 8  # kv="windowed": the preallocated cache keeping the case's window, origins in steps of 8


def case_batch(backend: Backend, case: AttentionCase, kv: str = "prealloc"):
    """(q, cache layer view, batch) of a case on `backend`: each sequence's earlier rows written by a
    first pass, this pass's rows by the pass itself, as the engine does. kv: a KV_CACHES name, or
    "windowed": the preallocated cache given the case's window (`PreallocKVCache(windows=)`), whose
    rows then start at an origin before this pass; the batch is the pass as the view addresses it."""
    width = case.spec.n_kv_heads * case.spec.head_dim
    if kv == "windowed":
        cache = KV_CACHES["prealloc"](backend, 1, width, step=WINDOWED_STEP, windows=[case.spec.window])
    else:
        cache = KV_CACHES[kv](backend, 1, width)
    slots = [cache.alloc() for _ in case.rows]
    starts = [k.shape[0] - t for k, t in zip(case.keys, case.rows)]
    early = [(slot, st_) for slot, st_ in zip(slots, starts) if st_ > 0]
    if early:  # the cached prefix, written as one pass of its own
        pre = Batch(backend, [s for s, _ in early], [0] * len(early), [n for _, n in early])
        cache.reserve(pre)
        cache.update(backend, 0, backend.from_numpy(np.concatenate([case.keys[slots.index(s)][:n] for s, n in early])),
                     backend.from_numpy(np.concatenate([case.values[slots.index(s)][:n] for s, n in early])), pre)
    batch = Batch(backend, slots, starts, case.rows)
    cache.reserve(batch)
    k_new = np.concatenate([k[st_:] for k, st_ in zip(case.keys, starts)])
    v_new = np.concatenate([v[st_:] for v, st_ in zip(case.values, starts)])
    view = cache.update(backend, 0, backend.from_numpy(k_new), backend.from_numpy(v_new), batch)
    return backend.activation(backend.from_numpy(case.q)), view, view.batch


@contextlib.contextmanager
def forbid_reference():
    """Inside this block, calling the per-head reference raises: an override that secretly routes
    through the default would pass every byte-identity test, so the harness rules it out."""
    original = Backend.per_head_attention

    def refuse(*args, **kwargs):
        raise AssertionError("the override called the per-head reference (Backend.per_head_attention)")

    Backend.per_head_attention = refuse
    try:
        yield
    finally:
        Backend.per_head_attention = original


def run_both(backend: Backend, case: AttentionCase, kv: str = "prealloc") -> tuple[np.ndarray, np.ndarray]:
    """(override, reference) outputs as numpy, computed on `backend` from the same inputs (both in one
    dtype, the activations')."""
    q, view, batch = case_batch(backend, case, kv)
    with forbid_reference():
        fused = backend.fused_attention_override(q, view, batch, case.spec)
    reference = Backend.per_head_attention(backend, q, view, batch, case.spec)
    assert fused.dtype == reference.dtype, f"the override's result is {fused.dtype}, the reference's {reference.dtype}"
    return backend.to_numpy(fused), backend.to_numpy(reference)


def assert_matches_default(backend: Backend, case: AttentionCase, kv: str = "prealloc") -> None:
    """Assert the backend's fused override equals the per-head reference bit for bit (and is finite)."""
    fused, default = run_both(backend, case, kv)
    want_shape = (case.q.shape[0], case.spec.n_heads * case.spec.head_dim)
    assert fused.shape == default.shape == want_shape, (fused.shape, default.shape, want_shape)
    assert np.isfinite(default).all(), f"the reference produced non-finite values ({case!r})"
    same = fused.view(np.uint32) == default.view(np.uint32)
    if not same.all():
        i = np.argwhere(~same)[0]
        raise AssertionError(
            f"{type(backend).__name__}.fused_attention differs from the per-head reference in "
            f"{int((~same).sum())} of {same.size} values, first at {tuple(int(x) for x in i)}: "
            f"{fused[tuple(i)]!r} vs {default[tuple(i)]!r} ({case!r})"
        )
