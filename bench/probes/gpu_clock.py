"""GPU-side timestamps for MLX's CUDA backend: how long kernels take on the device itself, whatever the
host does meanwhile.

`stamp(x)` is a one-thread `mx.fast.cuda_kernel` that reads the GPU's nanosecond clock (`%globaltimer`)
once `x` is computed (it takes `x` as an input, so MLX orders it after x's kernels). Two stamps around
a chain of ops, each op depending on the one before, give the device time of the chain: kernel time
plus the gaps between launches inside MLX's CUDA graphs, but none of the host's graph building or
encoding. CUDA only (Metal has no such register through metal_kernel).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_SOURCE = """
if (threadIdx.x == 0 && blockIdx.x == 0) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  out[0] = (uint32_t)(t & 0xffffffffull);
  out[1] = (uint32_t)(t >> 32);
}
"""
_kernel = None


def stamp(x) -> mx.array:
    """A [2] uint32 array: the GPU clock (ns, low and high words) read after `x` is computed."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="mlxinfer_gpu_clock", input_names=["dep"], output_names=["out"],
                                      source=_SOURCE, ensure_row_contiguous=False)
    (out,) = _kernel(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(2,)],
                     output_dtypes=[mx.uint32])
    return out


def ns(s) -> int:
    """The nanoseconds of an evaluated stamp."""
    lo, hi = np.array(s, dtype=np.uint64)
    return int(lo | (hi << np.uint64(32)))


def elapsed_us(first, last) -> float:
    return (ns(last) - ns(first)) / 1000.0


def available() -> bool:
    return hasattr(mx, "cuda") and mx.cuda.is_available()
