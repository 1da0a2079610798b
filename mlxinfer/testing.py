"""A harness for kernel authors: Hypothesis strategies for attention inputs and one assertion that a
`fused_attention` override is byte-identical to the protocol's per-head default.

    from hypothesis import given
    from mlxinfer.testing import attention_inputs, assert_matches_default

    @given(attention_inputs())
    def test_my_kernel(case):
        assert_matches_default(MyBackend(), case)

Needs `hypothesis` (the `test` extra).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from .backend import Backend


@dataclass
class AttentionCase:
    q: np.ndarray  # [T, H*D] float32
    k: np.ndarray  # [S, KV*D]
    v: np.ndarray  # [S, KV*D]
    n_heads: int
    n_kv_heads: int
    head_dim: int

    def __repr__(self):
        return (f"AttentionCase(T={self.q.shape[0]}, S={self.k.shape[0]}, heads={self.n_heads}, "
                f"kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, max|x|={float(np.abs(self.k).max()):.3g})")


@st.composite
def attention_inputs(draw, max_seq: int = 600, head_dims=(64, 128, 32, 80, 96, 16), max_kv_heads: int = 4,
                     max_group: int = 8, max_magnitude: float = 1e3, max_query_rows: int = 16):
    """Random attention problems: GQA groups 1..max_group, head_dim from `head_dims`, S cached rows in
    1..max_seq, T query rows (1 = a decode step; T > 1 is a causal prefill chunk ending at row S),
    values drawn N(0, 1) times a magnitude up to `max_magnitude`."""
    kv = draw(st.integers(1, max_kv_heads))
    group = draw(st.integers(1, max_group))
    d = draw(st.sampled_from(head_dims))
    s = draw(st.integers(1, max_seq))
    t = draw(st.one_of(st.just(1), st.integers(1, min(s, max_query_rows))))
    mag = draw(st.floats(1e-2, max_magnitude))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    h = kv * group

    def arr(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(mag)).astype(np.float32)

    return AttentionCase(arr(t, h * d), arr(s, kv * d), arr(s, kv * d), h, kv, d)


def run_both(backend: Backend, case: AttentionCase) -> tuple[np.ndarray, np.ndarray]:
    """(override, default) outputs as numpy, computed on `backend` from the same inputs."""
    q, k, v = (backend.from_numpy(x) for x in (case.q, case.k, case.v))
    args = (case.n_heads, case.n_kv_heads, case.head_dim)
    fused = backend.to_numpy(backend.fused_attention(q, k, v, *args))
    default = backend.to_numpy(Backend.fused_attention(backend, q, k, v, *args))
    return fused, default


def assert_matches_default(backend: Backend, case: AttentionCase) -> None:
    """Assert the backend's `fused_attention` equals the per-head default bit for bit."""
    fused, default = run_both(backend, case)
    assert fused.shape == default.shape == (case.q.shape[0], case.n_heads * case.head_dim)
    same = fused.view(np.uint32) == default.view(np.uint32)
    if not same.all():
        i = np.argwhere(~same)[0]
        raise AssertionError(
            f"{type(backend).__name__}.fused_attention differs from the per-head default in "
            f"{int((~same).sum())} of {same.size} values, first at {tuple(int(x) for x in i)}: "
            f"{fused[tuple(i)]!r} vs {default[tuple(i)]!r} ({case!r})"
        )
