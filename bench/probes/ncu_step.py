"""Every kernel of a few decode steps, for Nsight Compute: loads a model on MLX's CUDA backend, warms it
(a prompt and a few tokens: every kernel form compiled), then generates again between
`cuProfilerStart` and `cuProfilerStop`, so that `ncu --profile-from-start off` profiles only that
generation: the prompt's pass and `--tokens` - 1 decode passes, in launch order. Device time a kernel
(ncu replays each alone: no launch gaps, no overlap), to read what a decode token's device time is made
of, e.g. (H100, 2026-12-06, bench/results/h100-20261206-*-ncu-step-8b.csv):

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv --print-units base \\
        python3 bench/probes/ncu_step.py -m qwen3-8b-q4km-synthetic -p 17 --tokens 4 > step.csv

`--batch B` profiles B prompts of `-p` tokens generated together (`Engine.generate_batch`: the prompts'
passes, then decode passes of B rows). `--engine mlx-lm` profiles mlx-lm's model of the same shapes instead (random weights quantized by
`--peer-quant`, stepped by its `generate_step`).
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import mlx.core as mx

import mlxinfer
from mlxinfer.benchmark import model_path
from mlxinfer.peers import prompt_ids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen3-0.6b-synthetic")
    ap.add_argument("-p", "--prompt", type=int, default=17)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1, help="ours: B prompts of -p tokens in one generate_batch call")
    ap.add_argument("--engine", default="ours", choices=["ours", "mlx-lm"])
    ap.add_argument("--peer-quant", default="4:64", help="mlx-lm: BITS:GROUP of random weights of the shapes")
    a = ap.parse_args(argv)
    generate = _mlx_lm(a) if a.engine == "mlx-lm" else _ours(a)
    generate(a.tokens + 2)  # warm
    mx.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    print(f"ncu_step: cuProfilerStart -> {cuda.cuProfilerStart()}", file=sys.stderr)
    n = generate(a.tokens)
    mx.synchronize()
    print(f"ncu_step: cuProfilerStop -> {cuda.cuProfilerStop()}; {n} tokens", file=sys.stderr)
    return 0


def _ours(a):
    engine = mlxinfer.load(model_path(a.model), backend="mlx", device="gpu", dtype=a.dtype)
    ids = prompt_ids(a.prompt, engine.args.vocab_size)
    if a.batch > 1:  # as `mlxinfer bench --batch B`: row b's prompt seeded b
        prompts = [prompt_ids(a.prompt, engine.args.vocab_size, seed=b) for b in range(a.batch)]
        return lambda n: sum(len(g.token_ids) for g in engine.generate_batch(prompts, max_tokens=n))
    return lambda n: len(engine.generate(ids, max_tokens=n).token_ids)


def _mlx_lm(a):
    """mlx-lm's model of the same shapes (random weights, `--peer-quant`), stepped by its generate_step."""
    import pathlib
    import tempfile

    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    from mlxinfer.peers import write_mlx_lm_model

    quant = tuple(int(x) for x in a.peer_quant.split(":"))
    with tempfile.TemporaryDirectory(prefix="ncu-step-") as folder:  # (loaded into memory: the files can go)
        model, _ = load_model(pathlib.Path(write_mlx_lm_model(model_path(a.model), folder, a.dtype, quant)))
        mx.eval(model.parameters())
    ids = mx.array(prompt_ids(a.prompt, model.args.vocab_size))
    return lambda n: sum(1 for _ in generate_step(ids, model, max_tokens=n))


if __name__ == "__main__":
    sys.exit(main())
