"""Weight products on MLX's CPU device: is there a faster way than `mx.quantized_matmul` (issue 10's
CPU target)? For decode-shaped products (one row) of SmolLM2's and Qwen3-0.6B's shapes, median time of:
- qmm: `mx.quantized_matmul` on the 4- or 8-bit weights (what mlxinfer and mlx-lm both run);
- f32: the same weights dequantized to float32, `x @ W.T` (4-8x the memory);
- qmm on 2 streams: the output rows split in two halves, each half's product on its own CPU stream
  (MLX runs each stream on its own thread), then concatenated; bitwise equal to qmm (checked).

    python3 bench/probes/cpu_weight_products.py [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import mlx.core as mx
import numpy as np

from jsonl import emit

SHAPES = [(576, 1536), (1536, 576), (1024, 3072), (3072, 1024)]  # (in, out): SmolLM2 FFN, Qwen3-0.6B FFN


def median_us(fn, reps):
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    mx.set_default_device(mx.cpu)
    streams = [mx.new_stream(mx.cpu) for _ in range(2)]
    for k, n in SHAPES:
        w = mx.random.normal((n, k), key=mx.random.key(n))
        x = mx.random.normal((1, k), key=mx.random.key(k))
        for bits in (4, 8):
            wq, s, b = mx.quantize(w, group_size=32, bits=bits)
            wd = mx.dequantize(wq, s, b, group_size=32, bits=bits)
            halves = [tuple(mx.array(t[i * n // 2:(i + 1) * n // 2]) for t in (wq, s, b)) for i in range(2)]
            mx.eval(wq, s, b, wd, halves)

            def qmm():
                return mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=32, bits=bits)

            def two_streams():
                parts = []
                for st, h in zip(streams, halves):
                    with mx.stream(st):
                        parts.append(mx.quantized_matmul(x, *h, transpose=True, group_size=32, bits=bits))
                return mx.concatenate(parts, axis=1)

            row = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       shape=[k, n], bits=bits, load=os.getloadavg()[0],
                       qmm_us=round(median_us(qmm, a.reps), 1), f32_us=round(median_us(lambda: x @ wd.T, a.reps), 1),
                       qmm_two_streams_us=round(median_us(two_streams, a.reps), 1),
                       two_streams_bitwise=bool(np.array_equal(np.array(qmm()), np.array(two_streams()))))
            emit(row, a.out)


if __name__ == "__main__":
    main()
