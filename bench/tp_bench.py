"""Tensor parallelism benchmark: decode tokens/s, time to first token and memory per rank at TP=N,
and the time per token the all-sums take.

    python3 bench/tp_bench.py MODEL.gguf --tp 1 --out results.jsonl           # one process
    mlx.launch -n 2 -- python3 bench/tp_bench.py MODEL.gguf --tp 2 --out results.jsonl
    (on CUDA GPUs mlx.launch picks NCCL and gives each rank its own GPU; keep NCCL_NVLS_ENABLE=0)

Per prompt length (--cases) it loads the model once, warms up, then runs --runs generations of --gen
greedy tokens and reports the medians (rank 0 writes one JSON line per case). Peak memory is MLX's peak
allocation of every rank (all-gathered). The all-sum cost is measured two ways at TP > 1:
- isolated: 2 x layers all-sums of one [1, hidden] float32 row (what one decode token does), timed as
  one evaluated graph, median of 50;
- in place: the same generation with every all-sum replaced by the identity (the text is then wrong,
  the work otherwise the same), decode ms/token with minus without.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import mlxinfer  # noqa: E402
import numpy as np  # noqa: E402
from ablations import NoAllSum  # noqa: E402
from peers import emit, prompt_ids  # noqa: E402


def generate_runs(engine, prompt, n_gen, runs):
    out = []
    for _ in range(runs):
        g = engine.generate(prompt, max_tokens=n_gen, temperature=0.0)
        m = g.metrics
        out.append((m.time_to_first_token_ms, m.decode_tokens_per_second, len(g.token_ids)))
    return out


def all_sum_ms(engine, reps=50):
    """ms for one decode token's all-sums (2 per layer of one [1, hidden] row), evaluated as one graph."""
    import mlx.core as mx

    a, group = engine.args, engine.shard.group
    x = mx.random.normal((1, a.hidden))
    mx.eval(x)
    times = []
    for _ in range(reps + 5):
        t = time.perf_counter()
        y = x
        for _ in range(2 * a.n_layers):
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
    p.add_argument("--no-compile", action="store_true", help="decode eagerly (no compiled decode step)")
    a = p.parse_args(argv)

    t0 = time.perf_counter()
    engine = mlxinfer.load(a.model, backend=a.backend, tp=a.tp)
    load_s = time.perf_counter() - t0
    engine.compile_decode = not a.no_compile
    rank = engine.shard.rank
    import mlx.core as mx

    def gathered(value):  # one float from every rank, in rank order
        if a.tp == 1:
            return [value]
        v = mx.distributed.all_gather(mx.array([value], dtype=mx.float32), group=engine.shard.group)
        return [float(x) for x in np.array(v)]

    weights_mb = gathered(mx.get_active_memory() / 2**20)
    rows, ablated = [], None
    for n in (int(c) for c in a.cases.split(",")):
        prompt = prompt_ids(n, engine.args.vocab_size)
        generate_runs(engine, prompt, 8, 1)  # warm-up (kernels compiled, cache sized)
        mx.reset_peak_memory()
        res = generate_runs(engine, prompt, a.gen, a.runs)
        row = dict(
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            model=os.path.basename(a.model), arch=engine.args.arch, layers=engine.args.n_layers,
            hidden=engine.args.hidden, tp=a.tp, compiled_decode=engine.compile_decode and engine.backend.compiles_decode,
            backend=engine.backend.describe(), prompt_tokens=n,
            generated=res[0][2], runs=a.runs, load_s=round(load_s, 2),
            time_to_first_token_ms=statistics.median(r[0] for r in res),
            time_to_first_token_ms_min=min(r[0] for r in res), time_to_first_token_ms_max=max(r[0] for r in res),
            decode_tokens_per_second=statistics.median(r[1] for r in res),
            decode_tokens_per_second_min=min(r[1] for r in res), decode_tokens_per_second_max=max(r[1] for r in res),
            weights_mb_per_rank=weights_mb, peak_memory_mb_per_rank=gathered(mx.get_peak_memory() / 2**20),
            nccl_env={k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_") and k != "NCCL_EXTRA"},
        )
        if a.tp > 1 and a.backend == "mlx":  # (the ablation is an MLX backend)
            row["all_sum_ms_per_token_isolated"] = all_sum_ms(engine)
            if ablated is None:  # no all-sum (wrong text, same work otherwise): an engine of its own
                ablated = mlxinfer.Engine(a.model, NoAllSum(), tp=a.tp)
                ablated.compile_decode = engine.compile_decode
            generate_runs(ablated, prompt, 8, 1)
            without = statistics.median(r[1] for r in generate_runs(ablated, prompt, a.gen, a.runs))
            row["decode_tokens_per_second_without_all_sum"] = without
            row["all_sum_ms_per_token_in_place"] = 1000 / row["decode_tokens_per_second"] - 1000 / without
        rows.append(row)
        if rank == 0:
            emit(row, a.out)


if __name__ == "__main__":
    main()
