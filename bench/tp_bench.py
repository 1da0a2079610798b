"""Tensor parallelism benchmark: decode tokens/s, time to first token and memory per rank at TP=N,
and what one decode token's all-sums cost on their own.

    python3 bench/tp_bench.py MODEL.gguf --tp 1 --out results.jsonl           # one process
    mlx.launch -n 2 -- python3 bench/tp_bench.py MODEL.gguf --tp 2 --out results.jsonl
    (on CUDA GPUs mlx.launch picks NCCL and gives each rank its own GPU; keep NCCL_NVLS_ENABLE=0)

`mlxinfer bench` runs each row in a fresh process of its own, which a rank of an mlx.launch group
cannot: this script loads the model once per rank (`mlxinfer.load(tp=N)`) and, per prompt length
(--cases), warms up, then runs --runs generations of --gen greedy tokens; rank 0 writes one JSON line
per case with the medians and their min and max. Peak memory is MLX's peak allocation of every rank
(all-gathered). At TP > 1 it also times 2 x layers all-sums of one [1, hidden] float32 row, what one
decode token does, evaluated as one graph (median of 50).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import mlx.core as mx
import numpy as np

import mlxinfer
from mlxinfer.gguf_file import GGUFFile
from mlxinfer.models import model_args
from mlxinfer.peers import prompt_ids, summarize


def all_sum_ms(hidden: int, layers: int, group, reps: int = 50) -> float:
    """ms for one decode token's all-sums (2 per layer of one [1, hidden] row), evaluated as one graph."""
    x = mx.random.normal((1, hidden))
    mx.eval(x)
    times = []
    for _ in range(reps + 5):
        t = time.perf_counter()
        y = x
        for _ in range(2 * layers):
            y = mx.distributed.all_sum(y, group=group) * 0.5
        mx.eval(y)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times[5:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--backend", default="mlx")
    p.add_argument("--cases", default="17,511")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=None, help="append JSON lines here (rank 0)")
    a = p.parse_args(argv)

    t0 = time.perf_counter()
    engine = mlxinfer.load(a.model, backend=a.backend, tp=a.tp)
    load_s = time.perf_counter() - t0
    group = mx.distributed.init() if a.tp > 1 else None
    rank = group.rank() if group else 0
    with GGUFFile(a.model) as g:
        args = model_args(g)

    def gathered(value):  # one float from every rank, in rank order
        if group is None:
            return [value]
        return [float(x) for x in np.array(mx.distributed.all_gather(mx.array([value], dtype=mx.float32), group=group))]

    weights_mb = gathered(mx.get_active_memory() / 2**20)
    for n in (int(c) for c in a.cases.split(",")):
        prompt = prompt_ids(n, args.vocab_size)
        engine.generate(prompt, max_tokens=8)  # warm-up (kernels compiled, cache sized)
        mx.reset_peak_memory()
        runs = []
        for _ in range(a.runs):
            m = engine.generate(prompt, max_tokens=a.gen).metrics
            runs.append(dict(backend=m.backend, generated=m.generated_tokens,
                             time_to_first_token_ms=m.time_to_first_token_ms,
                             decode_tokens_per_second=m.decode_tokens_per_second, intervals=m.token_intervals_ms))
        row = dict(summarize(runs), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   model=os.path.basename(a.model), arch=args.arch, layers=args.n_layers, hidden=args.hidden, tp=a.tp,
                   prompt_tokens=n, load_s=round(load_s, 2), weights_mb_per_rank=weights_mb,
                   peak_memory_mb_per_rank=gathered(mx.get_peak_memory() / 2**20),
                   nccl_env={k: v for k, v in sorted(os.environ.items())
                             if k.startswith("NCCL_") and k != "NCCL_EXTRA"})
        if group is not None:
            row["all_sum_ms_per_token_isolated"] = all_sum_ms(args.hidden, args.n_layers, group)
        if rank == 0:
            print(json.dumps(row), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
