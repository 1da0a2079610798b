"""Decode attention microbenchmark (issue 10, target 4): one query row per sequence against its cached
keys and values, GQA 16/8, head_dim 128, float32, at several contexts, for

- `fused`: mlxinfer's fused attention kernel (`mlxinfer.kernels.fused_attention`, CUDA or Metal) reading
  the [slots, capacity, KV*D] cache in place, each row's length from an array;
- `sdpa`: `mx.fast.scaled_dot_product_attention` on [B, 16, 1, 128] queries and [B, 8, S, 128] keys
  and values (MLX's own fused kernel; no mask needed for one query row that sees every key).

Each case evaluates the op `--reps` times in a row (one graph per call, evaluated) and reports the
median microseconds per call. Needs an MLX GPU.

    python3 bench/decode_attention.py --contexts 512,2048,8192,32768 --batch 1,8 --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlxinfer import kernels  # noqa: E402
from mlxinfer.backend import AttentionSpec  # noqa: E402


def timed(fn, reps):
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="512,2048,8192,32768")
    p.add_argument("--batch", default="1")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    kind = "cuda" if mx.cuda.is_available() else "metal" if mx.metal.is_available() else None
    if kind is None:
        sys.exit("decode_attention: needs an MLX GPU (CUDA or Metal)")
    spec = AttentionSpec.standard(16, 8, 128)
    rng = np.random.default_rng(0)
    for b in (int(x) for x in a.batch.split(",")):
        for s in (int(x) for x in a.contexts.split(",")):
            q = mx.array(rng.standard_normal((b, 16 * 128), dtype=np.float32))
            keys = mx.array(rng.standard_normal((b, s, 8 * 128), dtype=np.float32))
            values = mx.array(rng.standard_normal((b, s, 8 * 128), dtype=np.float32))
            slots = mx.arange(b, dtype=mx.int32)
            pos = mx.full((b,), s - 1, dtype=mx.int32)
            lens = mx.full((b,), s, dtype=mx.int32)
            qh = mx.reshape(q, (b, 16, 1, 128))
            kh = mx.contiguous(mx.transpose(mx.reshape(keys, (b, s, 8, 128)), (0, 2, 1, 3)))
            vh = mx.contiguous(mx.transpose(mx.reshape(values, (b, s, 8, 128)), (0, 2, 1, 3)))
            mx.eval(q, keys, values, kh, vh)
            fused = timed(lambda: kernels.fused_attention(kind, q, keys, values, slots, pos, lens, spec), a.reps)
            sdpa = timed(lambda: mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=spec.scale), a.reps)
            row = dict(batch=b, context=s, fused_us=round(fused, 1), sdpa_us=round(sdpa, 1),
                       fused_over_sdpa=round(fused / sdpa, 2), kernel=kind)
            print(json.dumps(row), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
