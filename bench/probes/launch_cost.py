"""Host cost of one kernel launch in MLX's CUDA backend, built-in ops against `mx.fast.cuda_kernel`s
(issue 10: decode is host-bound, and our attention's custom launches looked ~4x dearer than MLX's own).

Each variant is a chain of N launches (each one's input the previous one's output) inside an
mx.compile'd function, so Python builds nothing per launch; per launch it reports the median over
--reps of the host time of `mx.async_eval` (MLX's encoding: every primitive's eval_gpu and its CUDA
graph nodes) and of the whole evaluation (encoding + waiting for the GPU), in microseconds:
- `rms_norm`: `mx.fast.rms_norm` (a built-in kernel mx.compile does not fuse with its neighbours; an
  elementwise chain such as `x + 1` would be fused into one kernel, which is what the 17:31 UTC run's
  `add` row measured: 0.41 us per op);
- `custom_tiny`: a cuda_kernel computing the same, its source a few lines;
- `custom_padded`: the same kernel with 6 KB of comments in its header (MLX hashes the whole source
  at every launch: does its size show?);
- `custom_template`: the tiny kernel with six template constants, as our split attention kernels have;
- `attn_decode`: our decode attention for one row (`kernels.fused_attention`, two launches) on a
  [1, 2048, 8*128] cache, chained through its output as the next query; per launch (two per call;
  the runs of 17:31 and 17:35 UTC wrote this row per call, as `attn_decode (2 launches)`).

    python3 bench/probes/launch_cost.py --n 200 --reps 15 --out results.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx

from jsonl import emit

BODY = """
const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
if (i < x_shape[0]) out[i] = x[i] + 1.0f;
"""
TEMPLATE = [("A", 1), ("B", 2), ("C", 3), ("E", 4), ("F", 5), ("G", 6)]


def custom(name: str, header: str = ""):
    k = mx.fast.cuda_kernel(name=name, input_names=["x"], output_names=["out"], source=BODY, header=header,
                            ensure_row_contiguous=True)

    def f(x, template=None):
        kw = {"template": template} if template else {}
        (y,) = k(inputs=[x], grid=(x.size, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape],
                 output_dtypes=[x.dtype], **kw)
        return y
    return f


def measure(step, x, n: int, reps: int, launches: int = 1) -> dict:
    """Median µs per launch over `reps` evaluations of a compiled chain of n steps of `launches` each."""
    chain = mx.compile(lambda v: _chain(step, v, n))
    for _ in range(3):
        mx.eval(chain(x))
    enc, tot = [], []
    for _ in range(reps):
        y = chain(x)
        t0 = time.perf_counter()
        mx.async_eval(y)
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        enc.append((t1 - t0) * 1e6 / (n * launches))
        tot.append((t2 - t0) * 1e6 / (n * launches))
    return dict(encode_us_per_launch=round(statistics.median(enc), 2), total_us_per_launch=round(statistics.median(tot), 2))


def _chain(step, v, n):
    for _ in range(n):
        v = step(v)
    return v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200, help="launches per chain")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not mx.cuda.is_available():
        print("launch_cost.py needs MLX's CUDA backend", file=sys.stderr)
        return 1
    x = mx.zeros((4096,), dtype=mx.float32)
    w = mx.ones((4096,), dtype=mx.float32)
    mx.eval(x, w)
    tiny = custom("lc_tiny")
    padded = custom("lc_padded", header="// " + "x" * 97 + "\n" * 1 + ("// " + "y" * 97 + "\n") * 60)
    variants = {
        "rms_norm": lambda v: mx.fast.rms_norm(v, w, 1e-5),
        "custom_tiny": tiny,
        "custom_padded": padded,
        "custom_template": lambda v: tiny(v, TEMPLATE),
    }
    rows = []
    for name, step in variants.items():
        rows.append(dict(variant=name, n=a.n, **measure(step, x, a.n, a.reps)))
        emit(rows[-1], a.out)
    from mlxinfer import kernels
    from mlxinfer.backend import AttentionSpec

    spec = AttentionSpec.standard(16, 8, 128)
    cap = 2048
    keys = mx.random.normal((1, cap, 8 * 128))
    values = mx.random.normal((1, cap, 8 * 128))
    slot, pos, length = (mx.array([v], dtype=mx.int32) for v in (0, cap - 1, cap))
    q = mx.random.normal((1, 16 * 128))
    mx.eval(keys, values, q)

    def attn(v):
        return kernels.fused_attention("cuda", v, keys, values, slot, pos, length, spec)
    n = max(1, a.n // 4)
    rows.append(dict(variant="attn_decode", launches_per_call=2, n=n, **measure(attn, q, n, a.reps, launches=2)))
    emit(rows[-1], a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
