"""Host time per decode step of the paged cache's index arrays (`PagedKVCache.step_inputs`: what the
compiled decode step takes besides the tokens), on MLX's CPU device: the host lists, the arrays made
from them and their evaluation, median over `--steps` steps after a prompt of `--context` tokens per
sequence. `--before FILE` also times another version of mlxinfer/kv_cache.py (e.g. `git show
2b68601:mlxinfer/kv_cache.py > /tmp/kv_old.py`), loaded as a module of this package.

    python3 bench/probes/decode_index.py --cases 1x2000,8x2000,1x8000 --before /tmp/kv_old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import mlx.core as mx

from mlxinfer import kv_cache
from mlxinfer.backends.mlx import MLXBackend
from mlxinfer.batch import Batch


def host_ms(module, ops, b: int, s: int, steps: int) -> float:
    cache = module.PagedKVCache(ops, n_layers=1, width=8)
    slots = [cache.alloc() for _ in range(b)]
    cache.reserve(Batch(ops, slots, [0] * b, [s] * b))
    times = []
    for t in range(steps):
        batch = Batch(ops, slots, [s + t] * b, [1] * b)
        cache.reserve(batch)
        t0 = time.perf_counter()
        mx.eval(*cache.step_inputs(ops, batch))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="1x2000,8x2000,1x8000", help="BATCHxCONTEXT,...")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--before", default=None, help="another kv_cache.py to time beside this one")
    a = p.parse_args(argv)
    versions = {"this": kv_cache}
    if a.before:
        spec = importlib.util.spec_from_file_location("mlxinfer._kv_cache_before", a.before)
        before = importlib.util.module_from_spec(spec)
        before.__package__ = "mlxinfer"
        spec.loader.exec_module(before)
        versions = {"before": before, "this": kv_cache}
    ops = MLXBackend(device="cpu")
    for case in a.cases.split(","):
        b, s = (int(x) for x in case.split("x"))
        times = ", ".join(f"{name} {host_ms(m, ops, b, s, a.steps):.3f}" for name, m in versions.items())
        print(f"batch {b}, {s} cached tokens a sequence: step_inputs host ms per step (median of {a.steps}): {times}")


if __name__ == "__main__":
    main()
