"""Latency of mx.distributed.all_sum for decode-sized rows, and what NCCL picked to carry it.

    mlx.launch -n 2 --backend nccl --env NCCL_NVLS_ENABLE=0 -- python3 bench/probes/all_sum_latency.py --out r.jsonl

A TP decode token does 2 all-sums per layer of one [1, hidden] row, each waiting on the last. Per row size
(--hidden) and dtype, rank 0 writes one JSON line: the median time of one all-sum
- chained: --chain all-sums (each output halved and fed to the next) in one evaluated graph, divided by --chain
  (the decode token's pattern: the GPU runs them back to back, the host encodes them once);
- alone: one all-sum evaluated by itself (host encode + launch + wait, the round trip).
NCCL_* variables in the environment (NCCL_PROTO, NCCL_ALGO, ...) are recorded with the row, so one call can
compare NCCL's settings by launching this script once per setting.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import mlx.core as mx

from jsonl import emit


def median_ms(fn, reps):
    times = []
    for _ in range(reps + 5):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times[5:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", default="1024,5120", help="row sizes (floats), comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--chain", type=int, default=80, help="all-sums per evaluated graph (2 x layers)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None, help="append JSON lines here (rank 0)")
    a = p.parse_args(argv)
    group = mx.distributed.init(strict=True)
    for hidden in (int(h) for h in a.hidden.split(",")):
        for dtype in a.dtypes.split(","):
            x = mx.random.normal((1, hidden)).astype(getattr(mx, dtype))
            mx.eval(x)

            def chained():
                y = x
                for _ in range(a.chain):
                    y = mx.distributed.all_sum(y, group=group) * 0.5
                mx.eval(y)

            def alone():
                mx.eval(mx.distributed.all_sum(x, group=group))

            row = dict(
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                ranks=group.size(), hidden=hidden, dtype=dtype, chain=a.chain,
                chained_us_per_all_sum=1000 * median_ms(chained, a.reps) / a.chain,
                alone_us=1000 * median_ms(alone, a.reps * 10),
                nccl_env={k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_") and k != "NCCL_DEBUG"},
            )
            if group.rank() == 0:
                emit(row, a.out)


if __name__ == "__main__":
    main()
