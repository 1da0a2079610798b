"""What one mixture-of-experts layer costs on MLX per expert type (issue 29): median time of
`MLXBackend.moe_mlp` (router softmax, top-k, the gate/up/down expert products) on `--rows` rows, and the
peak MLX memory above the loaded stacks during one call (`mx.get_peak_memory()` after
`mx.reset_peak_memory()`), for expert stacks of each `--types` (random blocks, `quants.random_blocks`)
kept as `MLXBackend.load_experts` keeps them (`ExpertStack`). Default shapes: one layer of
Qwen3-30B-A3B (128 experts, 8 used, hidden 2048, an expert 768 wide); one thread, the default device.

    python3 bench/probes/expert_products.py [--types Q6_K,F16] [--rows 1] [--experts 128 --used 8]
        [--hidden 2048 --width 768] [--reps 10] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q

from mlxinfer import quants
from mlxinfer.backends.mlx import MLXBackend
from mlxinfer.backends.mlx_weights import ExpertStack, to_device

from jsonl import emit


def stack(rng, qtype, e, out, n_in) -> ExpertStack:
    raw = quants.random_blocks(rng, qtype, e * out, n_in, std=n_in ** -0.5)
    weight = to_device(qtype, quants.split(raw, qtype, e * out, n_in), (e * out, n_in))
    return ExpertStack((e, out, n_in), weight=weight)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="Q6_K,F16")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--used", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cpu = mx.default_device() == mx.cpu
    ops = MLXBackend(device="cpu" if cpu else "gpu", threads=1 if cpu else None)
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((a.rows, a.hidden)).astype(np.float32))
    logits = mx.array(rng.standard_normal((a.rows, a.experts)).astype(np.float32))
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for name in a.types.split(","):
        qtype = Q[name]
        experts = (stack(rng, qtype, a.experts, a.width, a.hidden), stack(rng, qtype, a.experts, a.width, a.hidden),
                   stack(rng, qtype, a.experts, a.hidden, a.width))
        layer = lambda: ops.moe_mlp(x, logits, experts, a.used)  # noqa: E731
        mx.eval(layer())
        resident = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(layer())
        peak = mx.get_peak_memory() - resident
        times = []
        for _ in range(a.reps):
            t = time.perf_counter()
            mx.eval(layer())
            times.append((time.perf_counter() - t) * 1e3)
        emit(dict(probe="expert_products", when=stamp, device=str(mx.default_device()), type=name, rows=a.rows,
                  experts=a.experts, used=a.used, hidden=a.hidden, width=a.width,
                  ms=round(statistics.median(times), 2), peak_mib_over_stacks=round(peak / 2 ** 20, 1),
                  stacks_mib=round(resident / 2 ** 20, 1)), a.out)
        del experts, layer
        mx.clear_cache()


if __name__ == "__main__":
    main()
