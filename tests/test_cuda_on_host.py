"""attention.cu's attention kernels run on the host (tests/cuda_host.py: g++, a host thread per CUDA
thread, one block at a time), so that their indexing and order are checked without a GPU: MLX's override
on an MLX backend made to take the CUDA path, against the per-head reference (whose products and softmax
are the published-order kernels, on the host too), bit for bit, in every launch plan (the split plan's
two- and three-launch forms, the latter with the context by rows, and the one-launch kernel), float32 and
bfloat16, over the preallocated, paged and windowed stores, with GQA, a soft-cap and a sliding window,
for a decode row beside a 66-row chunk.

Each case takes ~30 s on a 2-core machine (the host runs every CUDA thread), so the 24 run only when
MLXINFER_HOST_PLANS=1; CI runs one plan's windowed case (`test_window_cache.py`). What the host cannot
show: the GPU's compiler and memory system."""

import os
from dataclasses import replace

import numpy as np
import pytest

from mlxinfer import kernels
from mlxinfer.backend import AttentionSpec
from mlxinfer.backends.mlx import MLXBackend
from mlxinfer.testing import AttentionCase, assert_matches_default

from . import cuda_host

pytestmark = [pytest.mark.skipif(not cuda_host.available(), reason="needs g++ (C++20) to run the kernels on the host"),
              pytest.mark.skipif(os.environ.get("MLXINFER_HOST_PLANS") != "1",
                                 reason="~30 s a case: MLXINFER_HOST_PLANS=1 runs them")]

PLANS = {"split, two launches": dict(split=True, two=True, rows=False),
         "split, three launches": dict(split=True, two=False, rows=False),
         "split, three launches, context by rows": dict(split=True, two=False, rows=True),
         "one-launch": dict(split=False, two=False, rows=False)}
WANT = {"split, two launches": {"attn_scores", "attn_softmax_context"},
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
    made, launched = {}, []

    def kernel(kind, name):
        made.setdefault(name, cuda_host.HostKernel(host_dir, name))
        return lambda **kw: launched.append(name) or made[name](**kw)

    p = PLANS[plan]
    monkeypatch.setattr(kernels, "_kernel", kernel)
    monkeypatch.setattr(kernels, "SPLIT_MAX_ITEMS", 10**9 if p["split"] else 0)
    monkeypatch.setattr(kernels, "SPLIT_MAX_SCRATCH", 10**18 if p["split"] else 0)
    monkeypatch.setattr(kernels, "TWO_LAUNCH_ROWS", 10**9 if p["two"] else 0)
    monkeypatch.setattr(kernels, "TWO_LAUNCH_MAX_KEYS", 10**18 if p["two"] else 0)
    monkeypatch.setattr(kernels, "ROWS_MIN", 1 if p["rows"] else 10**9)
    monkeypatch.setattr(kernels, "ROWS_MAX_KEYS_PER_ROW", 10**9)
    b = MLXBackend(device="cpu", dtype=dtype)
    b.gpu_kernels = b.kernel = "cuda"
    rng = np.random.default_rng(5)
    spec = replace(AttentionSpec.standard(2, 1, 16, window=20), softcap=2.0)
    keys, values = ([rng.standard_normal((s, 16), dtype=np.float32) * 3 for s in (90, 70)] for _ in range(2))
    case = AttentionCase(rng.standard_normal((67, 32), dtype=np.float32), keys, values, [1, 66], spec)
    assert_matches_default(b, case, kv=kv)
    assert WANT[plan] <= set(launched), launched
