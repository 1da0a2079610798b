"""Per-pass op histogram of one decode step, per-head vs fused, on each backend (README's table).

    python3 bench/trace_decode.py [--model qwen3-0.6b-synthetic] [--backends cpu,mlx] [--prompt 16]

For each backend and attention path: prefill a prompt, then trace exactly one decode step and print its
histogram, then time untraced decode steps (median of --steps) for the wall time.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import mlxinfer  # noqa: E402
from bench import resolve  # noqa: E402
from mlxinfer.kv_cache import BasicKVCache  # noqa: E402
from mlxinfer.tracing import TracingBackend  # noqa: E402
from peers import prompt_ids  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b-synthetic")
    p.add_argument("--backends", default="cpu,mlx")
    p.add_argument("--device", default=None)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cache", default=os.path.join(HERE, "models"))
    a = p.parse_args(argv)
    path = resolve(a.model, a.cache)
    for backend in a.backends.split(","):
        for attention in ("per-head", "fused"):
            engine = mlxinfer.load(path, backend=backend, attention=attention, device=a.device)
            ids = prompt_ids(a.prompt, engine.args.vocab_size)
            # untraced decode-step wall time
            cache = engine.new_cache()
            ops = engine.backend
            tok = ops.argmax_with_prob(engine.model.forward(ops, ids, cache))[0]
            times = []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                tok = ops.argmax_with_prob(engine.model.forward(ops, [tok], cache))[0]
                times.append((time.perf_counter() - t0) * 1000)
            # one traced decode step after a fresh prefill
            out = io.StringIO()
            tracer = TracingBackend(engine.backend, out)
            cache = BasicKVCache(tracer, engine.args.n_layers)
            tok = tracer.argmax_with_prob(engine.model.forward(tracer, ids, cache))[0]
            tracer.start_pass()  # drop the prefill: trace exactly one decode step
            tracer.argmax_with_prob(engine.model.forward(tracer, [tok], cache))
            tracer.end_pass(f"decode step ({attention}, {a.prompt} cached tokens)")
            print(out.getvalue().rstrip())
            print(f"  untraced decode step wall time: median {statistics.median(times):.2f} ms "
                  f"(min {min(times):.2f}, {a.steps} steps)\n", flush=True)
            del engine


if __name__ == "__main__":
    main()
