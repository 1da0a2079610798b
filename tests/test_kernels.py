"""mlxinfer's published GPU summation order: its numpy emulation is checked here on any machine; on a
CUDA (or Metal) GPU the kernels are checked against the emulation bit for bit."""

import numpy as np
import pytest

from mlxinfer import kernels

GPU = None
try:
    from mlxinfer.backends.mlx import gpu_kind

    GPU = gpu_kind()
except ImportError:
    pass
needs_gpu = pytest.mark.skipif(GPU is None, reason="needs an MLX GPU (Metal or CUDA); this machine has none")


def test_kernel_sources_hold_every_kernel():
    for kind in ("cuda", "metal"):
        header, bodies = kernels.kernel_source(kind)
        assert set(bodies) == {"matmul", "softmax", "fused_attention"}
        assert "mlxi_dot" in header and "mlxi_softmax" in header


def test_published_dot_is_a_dot_product_in_its_own_order():
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((5, 200)) * 10).astype(np.float32)
    b = (rng.standard_normal((7, 200)) * 10).astype(np.float32)
    got = kernels.published_dot(a, b)
    np.testing.assert_allclose(got, a.astype(np.float64) @ b.T.astype(np.float64), rtol=1e-5, atol=1e-3)
    # a sequential float32 sum rounds differently on some of these outputs: the order is visible
    seq = np.zeros((5, 7), np.float32)
    for k in range(200):
        seq = (seq + a[:, None, k] * b[None, :, k]).astype(np.float32)
    assert not np.array_equal(got, seq)
    # the lane-strided order: a change in lane 3's terms only moves lane 3's partial
    assert kernels.published_dot(np.ones((1, 33), np.float32), np.ones((1, 33), np.float32))[0, 0] == 33


def test_published_softmax_total_order():
    e = np.random.default_rng(1).random(5000).astype(np.float32)
    total = kernels.published_softmax_total(e)
    assert abs(float(total) - float(e.astype(np.float64).sum())) < 1e-3
    assert total != np.float32(np.cumsum(e, dtype=np.float32)[-1])  # not a sequential sum


@needs_gpu
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 37, 128), (5, 300, 64), (17, 33, 48), (3, 4100, 128), (64, 64, 4097),
                                   (2, 300000, 32)])  # the last one needs the kernel's 2-D grid
def test_gpu_matmul_kernel_follows_the_published_order(m, n, k):
    import mlx.core as mx

    rng = np.random.default_rng(m * n + k)
    a = (rng.standard_normal((m, k)) * 7).astype(np.float32)
    bt = (rng.standard_normal((n, k)) * 7).astype(np.float32)
    got = np.array(kernels.matmul(GPU, mx.array(a)[None], mx.array(bt)[None])[0])
    assert np.array_equal(got.view(np.uint32), kernels.published_dot(a, bt).view(np.uint32))


@needs_gpu
@pytest.mark.parametrize("n", [1, 7, 255, 256, 257, 1000, 4097, 9000])
def test_gpu_softmax_kernel(n):
    import mlx.core as mx

    x = (np.random.default_rng(n).standard_normal((3, n)) * 5).astype(np.float32)
    got = np.array(kernels.softmax(GPU, mx.array(x)))
    e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(1, keepdims=True), rtol=2e-6, atol=1e-9)
    assert np.all(np.isfinite(got))
