"""Prompt passes started a few layers at a time (`loop.PACE_LAYERS`) against whole: first token and peak
memory, and float32 prompt chunks on the fused kernel against MLX's products (`PREFILL_ROWS`); issue 30.

    python3 bench/probes/prefill_pacing.py [--model qwen3-0.6b-synthetic] [--dtypes bfloat16,float32]
        [--cases 8x128,32x128,1x511,1x2047] [--chunks 0,4096] [--variants paced,whole,kernel-paced,kernel-whole]
        [--runs 2] [--rounds 2] [--out F]

On a GPU MLX keeps every buffer of an evaluation until the device has run all of it, so a prompt pass
started whole holds all its layers' activations where the host encodes it faster than the device runs
it. One process, one engine a dtype and prefill chunk (0: the backend's default); for each round the
variants in turn (reversed every other round): "paced" (PACE_LAYERS as committed), "whole" (None);
"kernel-" variants also send float32 chunks of any length to the published-order kernel
(`mlxinfer.backends.mlx.PREFILL_ROWS` past every chunk; 16-bit dtypes skip them). Each case (B prompts of
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

PACED, ROWS = loop.PACE_LAYERS, mlx_backend.PREFILL_ROWS


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b-synthetic")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--cases", default="8x128,32x128,1x511,1x2047", help="BxT,...: B prompts of T tokens")
    p.add_argument("--chunks", default="0", help="prefill chunks, 0: the backend's default")
    p.add_argument("--variants", default="paced,whole,kernel-paced,kernel-whole")
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
            for rnd in range(args.rounds):
                for variant in (variants if rnd % 2 == 0 else variants[::-1]):
                    if variant.startswith("kernel") and dtype != "float32":
                        continue
                    loop.PACE_LAYERS = PACED if variant.endswith("paced") else None
                    mlx_backend.PREFILL_ROWS = 1 << 30 if variant.startswith("kernel") else ROWS
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
    loop.PACE_LAYERS, mlx_backend.PREFILL_ROWS = PACED, ROWS


if __name__ == "__main__":
    main()
