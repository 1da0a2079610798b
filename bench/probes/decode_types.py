"""Decode speed of a whole model per GGUF weight type on the MLX backend (issue 28): a synthetic model of
random blocks of each type (`mlxinfer.synthetic --random-blocks`, default the Qwen3-0.6B shape), 64
greedy tokens after a 17-token prompt, median of RUNS runs; for the affine types also with the scales
precomputed in float32 (`MLXBackend(float_scales=True)`: same bits, more memory), to see what forming
them in the graph at each use costs. Rounds alternate the two.

    python3 bench/probes/decode_types.py [--types Q8_0,Q4_K,Q6_K] [--runs 3] [--dir /tmp] [--out rows.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
from gguf import GGMLQuantizationType as Q

import mlxinfer
from mlxinfer import quants
from mlxinfer.backends.mlx import MLXBackend

from jsonl import emit

SHAPE = ["--arch", "qwen3", "--layers", "28", "--hidden", "1024", "--ffn", "3072", "--heads", "16",
         "--kv-heads", "8", "--head-dim", "128", "--vocab", "151936"]


def run(path, float_scales: bool, runs: int, n: int) -> dict:
    init = MLXBackend.__init__
    MLXBackend.__init__ = functools.partialmethod(init, float_scales=float_scales)
    try:
        engine = mlxinfer.load(path, backend="mlx")
    finally:
        MLXBackend.__init__ = init
    prompt = list(range(100, 117))
    engine.generate(prompt, max_tokens=8)  # warm-up: kernels built, step compiled
    gens = [engine.generate(prompt, max_tokens=n) for _ in range(runs)]
    return dict(decode_tok_s=round(statistics.median(g.metrics.decode_tokens_per_second for g in gens), 1),
                ttft_ms=round(statistics.median(g.metrics.time_to_first_token_ms for g in gens), 2),
                active_mb=round(mx.get_active_memory() / 2**20, 1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="Q8_0,Q4_0,Q4_K,Q5_K,Q6_K,Q3_K,IQ4_XS,F16")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for name in a.types.split(","):
        path = Path(a.dir) / f"qwen3-0.6b-{name}.gguf"
        if not path.exists():
            subprocess.run([sys.executable, "-m", "mlxinfer.synthetic", str(path), *SHAPE, "--type", name,
                            "--random-blocks"], check=True, stdout=subprocess.DEVNULL)
        variants = [False, True] if Q[name] in quants.AFFINE_BITS else [False]
        for rnd in range(2 if len(variants) == 2 else 1):
            for fs in (variants if rnd % 2 == 0 else variants[::-1]):
                row = run(str(path), fs, a.runs, a.tokens)
                emit(dict(probe="decode_types", when=stamp, device=str(mx.default_device()), type=name,
                          scales="float32 precomputed" if fs else "compact (block kernels at decode on a GPU)", round=rnd,
                          file_mb=round(path.stat().st_size / 2**20, 1), **row), a.out)
                mx.clear_cache()


if __name__ == "__main__":
    main()
