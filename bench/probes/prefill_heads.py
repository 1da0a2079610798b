"""How much sooner does a float32 prompt pass of several prompts reach its first token with a long chunk's
attention steps over all heads at once (`MLXBackend._heads_together`) than with the per-head reference's
steps a head at a time (the code before it), and at what peak memory? (issue 30: float32 batches on a GPU)

    python3 bench/probes/prefill_heads.py [--model qwen3-0.6b-synthetic] [--cases 8x128,32x128,1x2047]
                                          [--bounds 64] [--runs 2] [--rounds 2] [--out F]

One process, one float32 engine on the GPU (prefill chunk 4,096, so each prompt is one chunk); for each
round the variants in turn (the order reversed every other round): "per-head" (the reference's steps,
`Backend.per_head_sequence`, for every long chunk), and "together-N" (`_heads_together` wherever a chunk's
heads' scores take at most N MiB, `HEADS_TOGETHER_MAX_BYTES`). Each case (B prompts of T random tokens)
runs --runs times, 4 tokens generated greedily: its first token (ms), its wall time, MLX's peak memory
and a digest of every generated token (the variants must agree). The engine's self-check verdict first.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from jsonl import emit
from mlxinfer.backends import mlx as mlx_backend
from mlxinfer.benchmark import model_path
from mlxinfer.engine import load
from mlxinfer.peers import prompt_ids
from mlxinfer.tokenizer import load_tokenizer

TOGETHER = mlx_backend.MLXBackend._heads_together


def per_head(self, q, kv, batch, spec, b):
    """The code before `_heads_together`: the reference's steps a head at a time, into the rows of q."""
    r0, r1 = batch.rows[b]
    full = mx.concatenate([mx.zeros((r0, q.shape[1]), dtype=q.dtype), q]) if r0 else q
    out = self.per_head_sequence(full, kv, batch, spec, b, self.zeros(r1, spec.n_heads * spec.head_dim))
    return out[r0:r1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b-synthetic")
    p.add_argument("--cases", default="8x128,32x128,1x2047", help="BxT,...: B prompts of T tokens")
    p.add_argument("--bounds", default="64", help="MiB,...: HEADS_TOGETHER_MAX_BYTES of the together variants")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="gpu", help="(cpu: a smoke run; no long chunk takes either path there)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    path = model_path(args.model)
    vocab = load_tokenizer(path).vocab_size
    engine = load(path, backend="mlx", device=args.device, dtype="float32", prefill_chunk=4096)
    line, passed = engine.backend.kernel_report() if args.device == "gpu" else ("(no GPU)", None)
    print(line, flush=True)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    variants = ["per-head"] + [f"together-{m}" for m in args.bounds.split(",")]
    for rnd in range(args.rounds):
        for variant in (variants if rnd % 2 == 0 else variants[::-1]):
            if variant == "per-head":
                mlx_backend.MLXBackend._heads_together = per_head
                mlx_backend.HEADS_TOGETHER_MAX_BYTES = 1 << 62  # every long chunk to `per_head`
            else:
                mlx_backend.MLXBackend._heads_together = TOGETHER
                mlx_backend.HEADS_TOGETHER_MAX_BYTES = int(variant.split("-")[1]) << 20
            for batch, n in cases:
                prompts = [prompt_ids(n, vocab, seed=b) for b in range(batch)]
                for run in range(args.runs):
                    mx.reset_peak_memory()
                    t0 = time.perf_counter()
                    gens = engine.generate_batch(prompts, max_tokens=4)
                    wall = time.perf_counter() - t0
                    emit(dict(variant=variant, round=rnd, batch=batch, prompt=n, run=run,
                              ttft_ms=round(gens[0].metrics.time_to_first_token_ms, 1),
                              wall_ms=round(wall * 1000, 1), peak_mib=round(mx.get_peak_memory() / 2**20),
                              tokens=hash(tuple(i for g in gens for i in g.token_ids)) % 10**8,
                              self_check=passed), args.out)


if __name__ == "__main__":
    main()
