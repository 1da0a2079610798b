"""What one decode product costs on a GPU, by the block kernels (`block_kernels.product`, each warp taking
1, 2 or 4 output rows) against MLX's `mx.quantized_matmul` with its scales formed once (the path the
kernels replaced at decode): the weight products of the Qwen3-0.6B and Qwen3-8B shapes, random blocks
(`quants.random_blocks`), 1 and 8 rows of x, float32 and bfloat16 x. Each figure is the wall time of a
graph of CHAIN independent products of one weight divided by CHAIN (launches included: decode pays
them too), median of REPS graphs; GB/s is the weight's file bytes over that time. Also checks that each
row count a warp takes gives the same bits. `--baseline FILE`: another blocks.cu (one row a warp, dims
[N, K]; e.g. `git show REV:metal_kernels/blocks.cu`) timed beside them, and its bits compared.

    python3 bench/probes/block_products.py [--types Q8_0,Q4_K,Q6_K] [--shapes 0.6b,8b] [--rows 1,8] [--outputs N,...]
        [--dtypes float32,bfloat16] [--chain 20] [--reps 7] [--baseline FILE] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import datetime

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from mlxinfer import block_kernels, cuda_jit, quants
from mlxinfer.backends.mlx import gpu_kind
from mlxinfer.backends.mlx_weights import to_device
from mlxinfer.kernels import split_parts, strip_comments

from decode_attention import timed  # median us per call, `chain` calls a graph, after a warm-up
from jsonl import emit

# (in, out) of each product a decode token runs: the merged QKV, o, merged gate|up, down, the head
SHAPES = {"0.6b": [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (1024, 151936)],
          "8b": [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (4096, 151936)]}


def baseline_kernels(path: str) -> dict:
    """{kernel name: cuda_jit.Kernel} of another blocks.cu, named apart from ours."""
    header, bodies = split_parts(open(path, encoding="utf-8").read())
    return {name: cuda_jit.Kernel(f"mlxinfer_{name}_baseline", block_kernels.INPUTS[name], ["out"], strip_comments(body),
                                  strip_comments(header)) for name, body in bodies.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="Q8_0,Q4_K,Q6_K")
    p.add_argument("--shapes", default="0.6b,8b")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--outputs", default=None, help="only the products of these output sizes (e.g. 151936: the head)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--chain", type=int, default=20)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--baseline", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    baseline = baseline_kernels(a.baseline) if a.baseline else None
    kind = gpu_kind()
    if kind is None:
        raise SystemExit("block_products.py: needs an MLX GPU")
    mx.set_default_device(mx.gpu)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rng = np.random.default_rng(0)
    for shape in a.shapes.split(","):
        for k, n in SHAPES[shape]:
            if a.outputs and str(n) not in a.outputs.split(","):
                continue
            for name in a.types.split(","):
                qtype = Q[name]
                raw = quants.random_blocks(rng, qtype, n, k, std=k ** -0.5)
                parts = quants.split(raw, qtype, n, k)
                block, size = GGML_QUANT_SIZES[qtype]
                file_bytes = n * k // block * size
                for dname in a.dtypes.split(","):
                    dtype = getattr(mx, dname)
                    w = to_device(qtype, parts, (n, k), dtype=dtype)
                    formed = to_device(qtype, parts, (n, k), float_scales=True, dtype=dtype) if qtype in quants.AFFINE_BITS else None
                    for m in map(int, a.rows.split(",")):
                        x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
                        row = dict(probe="block_products", when=stamp, shape=shape, type=name, k=k, n=n, rows=m, dtype=dname,
                                   default_per_warp=block_kernels.default_per_warp(kind, n))
                        outs = {}
                        for r in ((1, 2, 4) if kind == "cuda" else (1,)):
                            us = timed(lambda r=r: block_kernels.product(kind, x, w, r), a.reps, a.chain)
                            outs[r] = np.array(block_kernels.product(kind, x, w, r).astype(mx.float32))
                            row[f"kernel_{r}_us"] = round(us, 2)
                            row[f"kernel_{r}_gbs"] = round(file_bytes / us / 1e3, 1)
                        if baseline is not None:
                            ours = block_kernels._kernel
                            block_kernels._kernel = lambda kind, name, blocks=1: baseline[name]
                            try:
                                us = timed(lambda: block_kernels.product(kind, x, w, 1), a.reps, a.chain)
                                outs["baseline"] = np.array(block_kernels.product(kind, x, w, 1).astype(mx.float32))
                            finally:
                                block_kernels._kernel = ours
                            row["baseline_us"] = round(us, 2)
                            row["baseline_gbs"] = round(file_bytes / us / 1e3, 1)
                        row["same_bits"] = all(np.array_equal(o.view(np.uint32), outs[1].view(np.uint32)) for o in outs.values())
                        if formed is not None:
                            us = timed(lambda: formed.product(x), a.reps, a.chain)
                            row["quantized_matmul_us"] = round(us, 2)
                            row["quantized_matmul_gbs"] = round(file_bytes / us / 1e3, 1)
                            ref = np.array(formed.product(x).astype(mx.float32))
                            row["max_rel_diff"] = float(np.max(np.abs(ref - outs[1])) / (np.max(np.abs(ref)) + 1e-30))
                        emit(row, a.out)
                    del w, formed
                mx.clear_cache()


if __name__ == "__main__":
    main()
