import numpy as np
import pytest
from hypothesis import given, settings

from mlxinfer.backend import Backend, attention_scale
from mlxinfer.backends.cpu import CPUBackend
from mlxinfer.testing import AttentionCase, assert_matches_default, attention_inputs, run_both


@settings(max_examples=150, deadline=None)
@given(attention_inputs())
def test_cpu_fused_attention_is_byte_identical_to_per_head_default(case):
    assert_matches_default(CPUBackend(), case)


def naive_attention(case):
    """float64 textbook attention, causal, to check both paths compute attention at all."""
    t, s, d = case.q.shape[0], case.k.shape[0], case.head_dim
    g = case.n_heads // case.n_kv_heads
    out = np.zeros((t, case.n_heads * d))
    for h in range(case.n_heads):
        kh = case.k[:, (h // g) * d:(h // g + 1) * d].astype(np.float64)
        vh = case.v[:, (h // g) * d:(h // g + 1) * d].astype(np.float64)
        sc = case.q[:, h * d:(h + 1) * d].astype(np.float64) @ kh.T / np.sqrt(d)
        sc[np.triu(np.ones((t, s), bool), k=s - t + 1)] = -np.inf
        p = np.exp(sc - sc.max(1, keepdims=True))
        out[:, h * d:(h + 1) * d] = (p / p.sum(1, keepdims=True)) @ vh
    return out


@pytest.mark.parametrize("t,s,kv,group,d", [(1, 1, 1, 1, 64), (1, 37, 2, 4, 128), (5, 5, 1, 2, 32), (3, 20, 3, 3, 64)])
def test_attention_paths_compute_causal_gqa_attention(t, s, kv, group, d):
    rng = np.random.default_rng(t * 1000 + s)
    h = kv * group
    case = AttentionCase(rng.standard_normal((t, h * d), dtype=np.float32),
                         rng.standard_normal((s, kv * d), dtype=np.float32),
                         rng.standard_normal((s, kv * d), dtype=np.float32), h, kv, d)
    fused, default = run_both(CPUBackend(), case)
    want = naive_attention(case)
    np.testing.assert_allclose(default, want, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(fused, want, atol=2e-5, rtol=1e-4)


def test_gqa_mapping_uses_consecutive_query_heads_per_kv_head():
    # KV head 0 has V = 1, KV head 1 has V = 2: query heads 0,1 must read 1 and heads 2,3 read 2.
    d, s = 4, 3
    q = np.ones((1, 4 * d), np.float32)
    k = np.zeros((s, 2 * d), np.float32)
    v = np.concatenate([np.full((s, d), 1, np.float32), np.full((s, d), 2, np.float32)], axis=1)
    for out in run_both(CPUBackend(), AttentionCase(q, k, v, 4, 2, d)):
        assert out.reshape(4, d)[:, 0].tolist() == [1, 1, 2, 2]


def test_harness_catches_a_different_rounding_order():
    """An override that scales q before the score matmul (the same math as scaling the scores after
    it, different float rounding) must fail the byte-identity check."""

    class ScaleFirst(CPUBackend):
        def fused_attention(self, q, k, v, n_heads, n_kv_heads, head_dim):
            unscaled = CPUBackend()
            unscaled.scale = lambda x, s: x
            q = q * np.float32(attention_scale(head_dim))
            return Backend.fused_attention(unscaled, q, k, v, n_heads, n_kv_heads, head_dim)

    rng = np.random.default_rng(0)
    case = AttentionCase(rng.standard_normal((1, 256), dtype=np.float32),
                         rng.standard_normal((64, 128), dtype=np.float32),
                         rng.standard_normal((64, 128), dtype=np.float32), 2, 1, 128)
    fused, default = run_both(ScaleFirst(), case)
    np.testing.assert_allclose(fused, default, rtol=1e-5, atol=1e-6)  # same math...
    with pytest.raises(AssertionError, match="differs from the per-head default"):
        assert_matches_default(ScaleFirst(), case)  # ...different bits
