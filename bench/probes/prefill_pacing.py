"""Prompt passes started a few layers at a time (`loop.PACE_LAYERS`) against whole: first token and peak
memory, and float32 prompt chunks on the published-order kernels against MLX's GEMMs (`PREFILL_GEMM_MIN`);
issue 30.

    python3 bench/probes/prefill_pacing.py [--model qwen3-0.6b-synthetic] [--dtypes bfloat16,float32]
        [--cases 8x128,32x128,1x511,1x2047] [--chunks 0,4096] [--variants paced,whole,kernel,gemm]
        [--runs 2] [--rounds 2] [--out F]

On a GPU MLX keeps every buffer of an evaluation until the device has run all of it, so a prompt pass
started whole holds all its layers' activations where the host encodes it faster than the device runs
it. One process, one engine a dtype and prefill chunk (0: the backend's default); for each round the
variants in turn (reversed every other round): "paced" (the committed defaults), "whole" (PACE_LAYERS
None); "kernel" sends float32 chunks of any size to the published-order kernels (PREFILL_GEMM_MIN past
every product), "gemm" every one of PREFILL_ROWS rows or more to MLX's GEMMs (the rule before
PREFILL_GEMM_MIN), both paced ("-whole": not); 16-bit dtypes skip those. Each case (B prompts of
T random tokens) runs --runs times, 4 tokens generated greedily: the first prompt's first token and the
last one's (ms), the wall time, MLX's peak memory (MiB) and a digest of every token generated.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from jsonl import emit
from mlxinfer import loop
from mlxinfer.backends import mlx as mlx_backend
from mlxinfer.benchmark import model_path
from mlxinfer.engine import load
from mlxinfer.peers import prompt_ids
from mlxinfer.tokenizer import load_tokenizer

PACED, GEMM_MIN = loop.PACE_LAYERS, mlx_backend.PREFILL_GEMM_MIN


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b-synthetic")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--cases", default="8x128,32x128,1x511,1x2047", help="BxT,...: B prompts of T tokens")
    p.add_argument("--chunks", default="0", help="prefill chunks, 0: the backend's default")
    p.add_argument("--variants", default="paced,whole,kernel,gemm")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="gpu")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    path = model_path(args.model)
    vocab = load_tokenizer(path).vocab_size
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    variants = args.variants.split(",")
    for dtype in args.dtypes.split(","):
        for chunk in (int(c) for c in args.chunks.split(",")):
            engine = load(path, backend="mlx", device=args.device, dtype=dtype, prefill_chunk=chunk or None)
            if args.device == "gpu":
                print(dtype, "self-check:", engine.backend.kernel_report()[0], flush=True)
            for rnd in range(args.rounds):
                for variant in (variants if rnd % 2 == 0 else variants[::-1]):
                    if variant.startswith(("kernel", "gemm")) and dtype != "float32":
                        continue
                    loop.PACE_LAYERS = None if variant.endswith("whole") else PACED
                    mlx_backend.PREFILL_GEMM_MIN = {"kernel": 1 << 62, "gemm": 1}.get(variant.split("-")[0], GEMM_MIN)
                    for batch, n in cases:
                        prompts = [prompt_ids(n, vocab, seed=b) for b in range(batch)]
                        for run in range(args.runs):
                            mx.synchronize()
                            mx.clear_cache()
                            mx.reset_peak_memory()
                            t0 = time.perf_counter()
                            gens = engine.generate_batch(prompts, max_tokens=4)
                            wall = time.perf_counter() - t0
                            ttfts = [g.metrics.time_to_first_token_ms for g in gens]
                            emit(dict(dtype=dtype, chunk=engine.prefill_chunk, variant=variant, round=rnd,
                                      batch=batch, prompt=n, run=run, ttft_ms=round(ttfts[0], 1),
                                      last_ttft_ms=round(max(ttfts), 1), wall_ms=round(wall * 1000, 1),
                                      peak_mib=round(mx.get_peak_memory() / 2**20),
                                      tokens=hash(tuple(i for g in gens for i in g.token_ids)) % 10**8), args.out)
            del engine
            mx.clear_cache()
    loop.PACE_LAYERS, mlx_backend.PREFILL_GEMM_MIN = PACED, GEMM_MIN


if __name__ == "__main__":
    main()
