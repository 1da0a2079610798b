"""What each kept GGUF weight type costs a product on MLX (issue 28): median time of one
[rows, in] x [in, out] product (default one row of Qwen3-0.6B's FFN shape, 1024 -> 3072) for every
type the MLX backend keeps, random blocks (`quants.random_blocks`), one thread, on the default device;
F32 (`x @ W`, W stored [in, out]) as the baseline. Affine types run `mx.quantized_matmul`; the others
dequantize their blocks in the graph first (`BlockWeight.product`). Also prints each type's bytes in
memory over the file's.

    python3 bench/probes/weight_types.py [--rows 1] [--shape 1024,3072] [--reps 20] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES

from mlxinfer import quants
from mlxinfer.backends.mlx_weights import to_device

from jsonl import emit


def median_ms(fn, reps):
    mx.eval(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--shape", default="1024,3072", help="in,out")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    k, n = map(int, a.shape.split(","))
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((a.rows, k)).astype(np.float32))
    w = mx.array(rng.standard_normal((k, n)).astype(np.float32) * k ** -0.5)
    mx.eval(x, w)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    emit(dict(probe="weight_types", when=stamp, device=str(mx.default_device()), type="F32", rows=a.rows, k=k, n=n,
              ms=round(median_ms(lambda: x @ w, a.reps), 3), memory_over_file=1.0), a.out)
    for qtype in (*quants.AFFINE_BITS, *quants.BLOCK_TYPES, *quants.HALF_TYPES):
        raw = quants.random_blocks(rng, qtype, n, k, std=k ** -0.5)
        weight = to_device(qtype, quants.split(raw, qtype, n, k), (n, k))
        block, size = GGML_QUANT_SIZES[qtype]
        ratio = quants.memory_bytes(qtype, (n, k)) / (n * k // block * size)
        emit(dict(probe="weight_types", when=stamp, device=str(mx.default_device()), type=qtype.name,
                  storage=quants.storage(qtype), rows=a.rows, k=k, n=n,
                  ms=round(median_ms(lambda: weight.product(x), a.reps), 3), memory_over_file=round(ratio, 4)), a.out)


if __name__ == "__main__":
    main()
