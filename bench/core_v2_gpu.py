"""Core v2 on a GPU, in one run: batch invariance of MLX's products, the cost of the published-order
attention kernels, decode and batched throughput, and long-prompt prefill memory.

    python3 bench/core_v2_gpu.py --out results.jsonl [--quick]

Each measurement is one JSON line (what, the configuration, the figures). The model is the synthetic
Qwen3-0.6B shape (28 layers, hidden 1024, 16/8 heads, head_dim 128, vocab 151936), Q8_0, written once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402

import mlxinfer  # noqa: E402
from mlxinfer.backends.mlx import MLXBackend  # noqa: E402

from ablations import OwnProducts  # noqa: E402
from mlxinfer.synthetic import SyntheticSpec, write_synthetic_model  # noqa: E402

QWEN3_06B = SyntheticSpec(arch="qwen3", n_layers=28, hidden=1024, ffn=3072, n_heads=16, n_kv_heads=8, head_dim=128,
                          vocab_size=151936, context_length=40960, tied_output=True, qtype="Q8_0", seed=0)


def emit(out, **row):
    line = json.dumps(row)
    print(line, flush=True)
    out.write(line + "\n")
    out.flush()


def prompt(n, seed=0):
    return np.random.default_rng(seed + n).integers(0, 150000, size=n).tolist()


def row_invariance(out):
    """Row i of an M-row product vs the same row alone (M = 1), for MLX's products on this device."""
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((64, 1024)).astype(np.float32))
    w = mx.array(rng.standard_normal((3072, 1024)).astype(np.float32) * 0.03)
    wq, s, b = mx.quantize(w, group_size=32, bits=8)
    s, b = s.astype(mx.float32), b.astype(mx.float32)
    cases = {"quantized_matmul q8 g32": lambda a: mx.quantized_matmul(a, wq, s, b, transpose=True, group_size=32, bits=8),
             "float matmul x @ W.T": lambda a: a @ w.T}
    for name, f in cases.items():
        alone = [np.array(f(x[i:i + 1]))[0] for i in range(64)]
        bad = []
        for m in (2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 32, 33, 64):
            got = np.array(f(x[:m]))
            if not all(np.array_equal(got[i], alone[i]) for i in range(m)):
                bad.append(m)
        emit(out, what="row invariance", op=name, rows_that_differ_from_alone=bad)


def timed_generate(engine, ids, n_gen, runs):
    rows = []
    for r in range(runs + 1):
        mx.reset_peak_memory()
        g = engine.generate(ids, max_tokens=n_gen)
        if r:
            rows.append(g.metrics)
    med = lambda f: statistics.median(f(m) for m in rows)  # noqa: E731
    return dict(decode_tok_s=med(lambda m: m.decode_tokens_per_second),
                decode_min=min(m.decode_tokens_per_second for m in rows),
                decode_max=max(m.decode_tokens_per_second for m in rows),
                ttft_ms=med(lambda m: m.time_to_first_token_ms), peak_mb=max(m.peak_memory_mb for m in rows),
                generated=rows[0].generated_tokens)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="core_v2_gpu.jsonl")
    p.add_argument("--model", default="/tmp/qwen3-0.6b-q8.gguf")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--long", type=int, default=8192, help="prompt length of the long-prefill case")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--parts", default="invariance,single,batch,long", help="which measurements to run")
    a = p.parse_args()
    out = open(a.out, "a")
    emit(out, what="header", machine=platform.node(), mlx=mx.__version__, device=str(mx.default_device()),
         gpu=mx.cuda.is_available() if hasattr(mx, "cuda") else None, date=time.strftime("%Y-%m-%d %H:%M"))
    parts = a.parts.split(",")
    if "invariance" in parts:
        row_invariance(out)
    if not os.path.exists(a.model):
        t0 = time.perf_counter()
        write_synthetic_model(a.model, QWEN3_06B)
        emit(out, what="wrote model", seconds=time.perf_counter() - t0)
    path = a.model

    # 1. decode and TTFT: fused kernel, graph override, per-head; per-head with MLX's own products.
    configs = [("cuda kernel", dict(kernel="cuda")), ("graph", dict(kernel="graph")),
               ("per-head", dict(attention="per-head"))] if "single" in parts else []
    for name, kw in configs:
        engine = mlxinfer.Engine(path, MLXBackend(**kw))
        for n in (17, 511):
            emit(out, what="single sequence", path=name, prompt=n, **timed_generate(engine, prompt(n), a.gen, a.runs))
    engine = mlxinfer.Engine(path, OwnProducts(attention="per-head"))  # the cost of routing through our kernels
    for n in ((17, 511) if "single" in parts else ()):
        emit(out, what="single sequence", path="per-head, MLX's own products", prompt=n,
             **timed_generate(engine, prompt(n), a.gen, a.runs))

    # 2. batch invariance and throughput with the fused kernel.
    if "batch" in parts:
        batched(out, path, a)
    if "long" in parts:
        long_prompt(out, path, a)


def batched(out, path, a):
    engine = mlxinfer.Engine(path, MLXBackend(kernel="cuda"))
    prompts = [prompt(128, seed=i) for i in range(32)]
    alone = [engine.generate(x, max_tokens=16) for x in prompts[:4]]
    together = engine.generate_batch(prompts[:4], max_tokens=16)
    emit(out, what="batch invariance", tokens_equal=[x.token_ids == y.token_ids for x, y in zip(alone, together)],
         logprobs_bitwise_equal=[x.logprobs == y.logprobs for x, y in zip(alone, together)],
         max_logprob_diff=max(float(np.max(np.abs(np.array(x.logprobs) - np.array(y.logprobs)))) for x, y in zip(alone, together)))
    invariant = mlxinfer.Engine(path, MLXBackend(kernel="cuda", per_sequence_linear=True))
    together = invariant.generate_batch(prompts[:4], max_tokens=16)
    alone = [invariant.generate(x, max_tokens=16) for x in prompts[:4]]
    emit(out, what="batch invariance, per-sequence linear",
         logprobs_bitwise_equal=[x.logprobs == y.logprobs for x, y in zip(alone, together)])
    for label, eng, sizes in (("fused kernel", engine, (1, 8, 32)), ("fused kernel, per-sequence linear", invariant, (8, 32))):
        for bsz in sizes:
            times = []
            for r in range(2):
                t0 = time.perf_counter()
                gens = eng.generate_batch(prompts[:bsz], max_tokens=a.gen)
                dt = time.perf_counter() - t0
                if r:
                    times.append(dt)
            total = sum(len(g.token_ids) for g in gens)
            emit(out, what="batched generation", path=label, batch=bsz, prompt=128, generated_total=total,
                 seconds=min(times), total_tok_s=total / min(times),
                 mean_ttft_ms=statistics.mean(g.metrics.time_to_first_token_ms for g in gens),
                 decode_tok_s_per_sequence=statistics.median(g.metrics.decode_tokens_per_second for g in gens))



def long_prompt(out, path, a):
    """Chunked prefill of a long prompt, then decode at that context."""
    for label, kw, chunk in (("cuda kernel", dict(kernel="cuda"), 512), ("cuda kernel", dict(kernel="cuda"), 2048),
                             ("graph, MLX's own products", dict(kernel="graph"), 512),
                             ("per-head", dict(attention="per-head"), 512)):
        backend = (OwnProducts if "MLX's own" in label else MLXBackend)(**kw)
        engine = mlxinfer.Engine(path, backend, prefill_chunk=chunk)
        engine.generate(prompt(64), max_tokens=2)  # warm-up (kernel compilation)
        mx.reset_peak_memory()
        g = engine.generate(prompt(a.long), max_tokens=16)
        emit(out, what="long prompt", path=label, prompt=a.long, chunk=chunk, ttft_ms=g.metrics.time_to_first_token_ms,
             decode_tok_s=g.metrics.decode_tokens_per_second, peak_mb=g.metrics.peak_memory_mb)


if __name__ == "__main__":
    main()
