"""The tensor-core prefill path on a GPU (issue 30): does its self-check pass, are the fused and per-head
paths byte-identical on a chunk of real shape, how far are its outputs from float32's, and what does one
chunk's attention cost against `mx.fast.scaled_dot_product_attention` and the float32 path.

    python3 bench/probes/mma_check.py [--rows 512] [--keys 2048,8192] [--dtype bfloat16] [--out F]

For each key count S: a chunk of `rows` query rows at positions S - rows .. S - 1 (Qwen3-0.6B's shape:
16 query heads, 8 KV heads, head_dim 128), random q, K, V of magnitude ~3, ~3, ~1.
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx
import numpy as np

from mlxinfer import kernels
from mlxinfer.backend import AttentionSpec
from mlxinfer.backends.mlx import MLXBackend, CheckCase, check_case_inputs

from jsonl import emit


def timed(fn, reps: int = 10) -> float:
    """Median ms of fn() evaluated, after one warm-up."""
    mx.eval(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t0) * 1000)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--keys", default="512,2048,8192")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out")
    args = ap.parse_args()
    b = MLXBackend(device="gpu", dtype=args.dtype)
    f32 = MLXBackend(device="gpu", dtype="float32")
    emit({"dtype": args.dtype, "mma": b.mma, "mma_fallback": b.mma_fallback, "fallback": b.fallback}, args.out)
    spec = AttentionSpec.standard(16, 8, 128)
    for s in (int(k) for k in args.keys.split(",")):
        case = CheckCase(f"{args.rows} rows over {s} keys", spec, ((s, args.rows),))
        q, view, batch = check_case_inputs(b, case)
        fused = lambda: b.fused_attention_override(q, view, batch, spec)  # noqa: E731
        ref = b.to_numpy(b.per_head_attention(q, view, batch, spec))
        got = b.to_numpy(fused())  # (16-bit results widened: exact)
        same = float(np.mean(got.view(np.uint32) == ref.view(np.uint32)))
        q32, view32, batch32 = check_case_inputs(f32, case)  # the same draws, in float32
        q32 = q.astype(mx.float32)  # the 16-bit q, widened: the difference is the path's, not the inputs'
        k, v = view.sequence(b, 0)
        row = {"rows": args.rows, "keys": s, "fused_equals_reference": same,
               "fused_ms": timed(fused), "per_head_ms": timed(lambda: b.per_head_attention(q, view, batch, spec), 3)}
        if s <= 2048:  # float32 attention (MLX's, TF32 off) of the same 16-bit values, widened
            kk, vv = k.astype(mx.float32), v.astype(mx.float32)
            qh = mx.transpose(mx.reshape(q32, (args.rows, 16, 128)), (1, 0, 2))[None]
            kh = mx.transpose(mx.reshape(kk, (s, 8, 128)), (1, 0, 2))[None]
            vh = mx.transpose(mx.reshape(vv, (s, 8, 128)), (1, 0, 2))[None]
            want = mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=spec.scale, mask="causal")
            want = np.array(mx.reshape(mx.transpose(want[0], (1, 0, 2)), (args.rows, -1)))
            row["max_abs_vs_float32_sdpa"] = float(np.max(np.abs(got - want)))
        qh = mx.transpose(mx.reshape(q, (args.rows, 16, 128)), (1, 0, 2))[None]
        kh = mx.transpose(mx.reshape(k, (s, 8, 128)), (1, 0, 2))[None]
        vh = mx.transpose(mx.reshape(v, (s, 8, 128)), (1, 0, 2))[None]
        row["sdpa_ms"] = timed(lambda: mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=spec.scale, mask="causal"))
        row["float32_fused_ms"] = timed(lambda: f32.fused_attention_override(q32, view32, batch32, spec), 3)
        emit(row, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
