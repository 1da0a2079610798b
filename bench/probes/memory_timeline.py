"""Where the peak memory of a long prompt comes from (issue 30: peak at 32,767 tokens above mlx-lm's):
MLX's active and peak memory pass by pass, each pass waited for before the next (no pipelining), with
the KV store's capacity; then the whole run pipelined as `mlxinfer bench` runs it (its peak only).

    python3 bench/probes/memory_timeline.py --cases 8191,32767 --dtypes bfloat16 [-n 8] [--out F]
    python3 bench/probes/memory_timeline.py --cases 32767 -n 64 --wait inf,default --fractions none,0.5,0.7

`pipelined` holds each `wait/fraction` setting's runs (`--wait` MiB, `--fractions`: loop.WAIT_FRACTION).

A row per pass: its name, wall ms (launch to done), active MiB after it, peak MiB during it (the counter
reset before each pass), MLX's buffer cache after it, and the cache's capacity in positions.
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx

import mlxinfer
from mlxinfer.benchmark import model_path
from mlxinfer.peers import prompt_ids

from jsonl import emit

MIB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen3-0.6b-synthetic")
    ap.add_argument("--cases", default="8191,32767")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("-n", "--gen-tokens", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--device", default="gpu")
    ap.add_argument("--wait", default="default", help="MiB of KV cache from which a pass of one sequence waits "
                                                     "for the one before it (Loop.wait_store_bytes; inf: never), "
                                                     "one pipelined run set each; default: the engine's")
    ap.add_argument("--fractions", default="default",
                    help="with each --wait: loop.WAIT_FRACTION (a waiting pass waits for that fraction of the layers "
                         "of the one before; none: the whole pass), one pipelined run set each; default: the engine's")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    args.wait = [None if w == "default" else float(w) for w in args.wait.split(",")]
    args.fractions = [f if f in ("default", "none") else float(f) for f in args.fractions.split(",")]
    path = model_path(args.model)
    for dtype in args.dtypes.split(","):
        engine = mlxinfer.load(path, backend="mlx", device=args.device, dtype=dtype, prefill_chunk=args.chunk)
        vocab = engine.args.vocab_size
        caches = []
        new_cache = engine.new_cache
        engine.new_cache = lambda: caches.append(new_cache()) or caches[-1]  # the run's cache, for its capacity
        engine.generate(prompt_ids(17, vocab), max_tokens=2)  # warm: the self-check, the decode step
        for n in (int(c) for c in args.cases.split(",")):
            ids = prompt_ids(n, vocab)
            mx.synchronize()
            mx.clear_cache()
            loaded = mx.get_active_memory() / MIB
            rows, t = [], [time.perf_counter()]
            mx.reset_peak_memory()

            def on_forward(name):
                mx.synchronize()
                now = time.perf_counter()
                cache = caches[-1] if caches else None
                rows.append({"pass": name, "ms": round((now - t[0]) * 1000, 2),
                             "active_mib": round(mx.get_active_memory() / MIB, 1),
                             "peak_mib": round(mx.get_peak_memory() / MIB, 1),
                             "cache_mib": round(mx.get_cache_memory() / MIB, 1),
                             "capacity": getattr(cache, "capacity", None)})
                mx.reset_peak_memory()
                t[0] = time.perf_counter()

            engine.generate(ids, max_tokens=args.gen_tokens, on_forward=on_forward)
            runs = {}
            for wait, fraction in ((w, f) for w in args.wait for f in args.fractions):
                # pipelined as the engine runs, one-sequence passes waiting from `wait` MiB (for `fraction`)
                new_loop = engine.new_loop

                def waiting_loop(*a, **k):
                    loop = new_loop(*a, **k)
                    if wait is not None:
                        loop.wait_store_bytes = wait * MIB
                    if fraction != "default":
                        loop.wait_fraction = None if fraction == "none" else fraction
                    return loop

                engine.new_loop = waiting_loop
                for _ in range(args.runs):
                    mx.synchronize()
                    mx.clear_cache()
                    mx.reset_peak_memory()
                    t0 = time.perf_counter()
                    g = engine.generate(ids, max_tokens=args.gen_tokens)
                    iv = sorted(g.metrics.token_intervals_ms)
                    runs.setdefault(f"{wait}/{fraction}", []).append(
                        {"peak_mib": round(mx.get_peak_memory() / MIB, 1),
                         "ms": round((time.perf_counter() - t0) * 1000, 1),
                         "ttft_ms": round(g.metrics.time_to_first_token_ms, 1),
                         "decode_tok_s": round(1000 * len(iv) / sum(iv), 1) if iv else None})
                engine.new_loop = new_loop
                print(f"#   wait from {wait} MiB, for {fraction} of the pass: " + "; ".join(
                    f"peak {r['peak_mib']:.0f} MiB, TTFT {r['ttft_ms']:.1f} ms, decode {r['decode_tok_s']} tok/s"
                    for r in runs[f"{wait}/{fraction}"]), file=sys.stderr)
            emit({"model": args.model, "dtype": dtype, "prompt": n, "chunk": engine.prefill_chunk,
                  "backend": engine.backend.describe(), "loaded_mib": round(loaded, 1),
                  "pipelined": runs, "passes": rows}, args.out)
            print(f"# {dtype} {n}: loaded {loaded:.0f} MiB; max pass peak {max(r['peak_mib'] for r in rows):.0f} MiB",
                  file=sys.stderr)
            for r in rows:
                print(f"  {r['pass']:>14} {r['ms']:8.1f} ms  active {r['active_mib']:8.0f}  peak {r['peak_mib']:8.0f}"
                      f"  cache {r['cache_mib']:7.0f}  capacity {r['capacity']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
