"""The host's stand-in for CUDA (tests/cuda_host.h) that the kernel tests rest on: a block's threads as
fibers, `__syncthreads` and the warp shuffles as barriers among them, with both of its fiber switches
(x86-64's few instructions and the portable ucontext one); and a barrier some thread never reaches
stops the launch with a message instead of hanging."""

import ctypes
import platform
import subprocess
import sys

import numpy as np
import pytest

from . import cuda_host

pytestmark = pytest.mark.skipif(not cuda_host.available(), reason="needs g++ (C++20)")

# Each thread t of a block of 64 (lane l of its warp): writes t + 64 b to shared memory, reads its
# neighbour's after the block's barrier (`own`); then per thread three outputs: lane l ^ 5's `own` (an
# xor, not a rotation), the warp's total by the xor butterfly plus lane 3's `own` (a broadcast), and
# __all_sync of a predicate false in lane 7 alone of the odd blocks' warps.
TOY = r"""
#include "%s"
void body(float* out) {
  __shared__ float s[64];
  const unsigned int t = threadIdx.x, b = blockIdx.x, l = t & 31;
  s[t] = (float)(t + 64 * b);
  __syncthreads();
  const float own = s[(t + 1) %% 64];
  const float x = __shfl_xor_sync(0xffffffffu, own, 5);
  float v = own;
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  v += __shfl_sync(0xffffffffu, own, 3);
  const bool all = __all_sync(0xffffffffu, l != 7 || b %% 2 == 0);
  __syncthreads();
  out[3 * (b * 64 + t)] = x;
  out[3 * (b * 64 + t) + 1] = v;
  out[3 * (b * 64 + t) + 2] = all ? 1.0f : 0.0f;
}
void divergent(float* out) {
  if (threadIdx.x < 32) __syncthreads();  // half the block waits at a barrier the other half never reaches
  out[threadIdx.x] = 1.0f;
}
void racy(float* out) {  // reads a neighbour's write with no barrier between
  __shared__ float s[64];
  s[threadIdx.x] = (float)(threadIdx.x + 64 * blockIdx.x);
  out[blockIdx.x * 64 + threadIdx.x] = s[(threadIdx.x + 1) %% 64];
}
extern "C" void run(float* out, unsigned int blocks) { mlxh_launch(blocks, 1, 64, [&] { body(out); }); }
extern "C" void run_divergent(float* out) { mlxh_launch(1, 1, 64, [&] { divergent(out); }); }
extern "C" void run_racy(float* out) { mlxh_launch(2, 1, 64, [&] { racy(out); }); }
""" % cuda_host.HEADER


def expected(blocks: int) -> np.ndarray:
    out = np.zeros((blocks, 64, 3), np.float32)
    lanes = np.arange(32)
    for b in range(blocks):
        s = np.arange(64, dtype=np.float32) + 64 * b
        own = s[(np.arange(64) + 1) % 64]
        for w in (0, 32):  # the butterfly's sum is every lane's the same: the warp's total (exact here)
            out[b, w:w + 32, 0] = own[w + (lanes ^ 5)]
            out[b, w:w + 32, 1] = own[w:w + 32].sum() + own[w + 3]
            out[b, w:w + 32, 2] = 1.0 if b % 2 == 0 else 0.0
    return out.reshape(-1)


SWITCHES = {"x86-64 switch": (), "ucontext": ("-DMLXH_UCONTEXT",)}


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_barriers_and_shuffles_of_a_block(switch, tmp_path):
    if switch == "x86-64 switch" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the instruction switch is x86-64's")
    lib = cuda_host._compile(tmp_path, TOY, "toy", SWITCHES[switch])
    blocks = 3
    out = np.zeros(blocks * 64 * 3, np.float32)
    lib.run(out.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint(blocks))
    assert np.array_equal(out, expected(blocks))


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_a_barrier_never_reached_stops_with_a_message(switch, tmp_path):
    if switch == "x86-64 switch" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the instruction switch is x86-64's")
    lib = cuda_host._compile(tmp_path, TOY, "toy", SWITCHES[switch])
    code = ("import ctypes, numpy as np; lib = ctypes.CDLL(%r); out = np.zeros(64, np.float32); "
            "lib.run_divergent(out.ctypes.data_as(ctypes.c_void_p))" % lib._name)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "cuda_host: block (0, 0): a barrier 32 of its threads wait at never opens" in r.stderr


def test_a_read_with_no_barrier_shows_in_one_of_two_blocks(tmp_path):
    """Blocks alternate their fibers' order: thread t's read of thread t + 1's shared write with no
    barrier between them gets the written value in the block run from n-1 down (block 1) and not in the
    one run from 0 up (block 0); thread 63 reads thread 0's, the other way round."""
    lib = cuda_host._compile(tmp_path, TOY, "toy")
    out = np.full(128, -1.0, np.float32)
    lib.run_racy(out.ctypes.data_as(ctypes.c_void_p))
    written = (np.arange(128) % 64 + 1) % 64 + 64 * (np.arange(128) // 64)
    right = out == written
    assert not right[:63].any() and right[64:127].all()
