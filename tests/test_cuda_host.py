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

# Each thread t of a block of 64: writes t + 64 b to shared memory, reads its neighbour's after the
# block's barrier, sums that over its warp by the xor butterfly, adds lane 3's value (a broadcast), and
# whether every lane of its warp saw an even block index (__all_sync); one output a thread.
TOY = r"""
#include "%s"
void body(float* out) {
  __shared__ float s[64];
  const unsigned int t = threadIdx.x, b = blockIdx.x;
  s[t] = (float)(t + 64 * b);
  __syncthreads();
  float v = s[(t + 1) %% 64];
  const float own = v;
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  v += __shfl_sync(0xffffffffu, own, 3);
  v += __all_sync(0xffffffffu, b %% 2 == 0) ? 1000.0f : 0.0f;
  __syncthreads();
  out[b * 64 + t] = v;
}
void divergent(float* out) {
  if (threadIdx.x < 32) __syncthreads();  // half the block waits at a barrier the other half never reaches
  out[threadIdx.x] = 1.0f;
}
extern "C" void run(float* out, unsigned int blocks) { mlxh_launch(blocks, 1, 64, [&] { body(out); }); }
extern "C" void run_divergent(float* out) { mlxh_launch(1, 1, 64, [&] { divergent(out); }); }
""" % cuda_host.HEADER


def expected(blocks: int) -> np.ndarray:
    out = np.zeros((blocks, 64), np.float32)
    for b in range(blocks):
        s = np.arange(64, dtype=np.float32) + 64 * b
        own = s[(np.arange(64) + 1) % 64]
        for w in (0, 32):  # the butterfly's sum is every lane's the same: the warp's total, in float32 (exact here)
            out[b, w:w + 32] = own[w:w + 32].sum() + own[w + 3] + (1000.0 if b % 2 == 0 else 0.0)
    return out.reshape(-1)


SWITCHES = {"x86-64 switch": (), "ucontext": ("-DMLXH_UCONTEXT",)}


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_barriers_and_shuffles_of_a_block(switch, tmp_path):
    if switch == "x86-64 switch" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the instruction switch is x86-64's")
    lib = cuda_host._compile(tmp_path, TOY, "toy", SWITCHES[switch])
    blocks = 3
    out = np.zeros(blocks * 64, np.float32)
    lib.run(out.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint(blocks))
    assert np.array_equal(out, expected(blocks))


def test_a_barrier_never_reached_stops_with_a_message(tmp_path):
    lib = cuda_host._compile(tmp_path, TOY, "toy")
    code = ("import ctypes, numpy as np; lib = ctypes.CDLL(%r); out = np.zeros(64, np.float32); "
            "lib.run_divergent(out.ctypes.data_as(ctypes.c_void_p))" % lib._name)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "cuda_host: block (0, 0): a barrier 32 of its threads wait at never opens" in r.stderr
