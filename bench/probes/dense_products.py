"""Many rows of x by an affine-quantized weight on a GPU (issue 30: a batch's decode rows, prefill
chunks): MLX's `mx.quantized_matmul` (the weight's scales formed by its compiled kernel, as the backend
does) against `mlx_weights.dense_product` (the weight dequantized to the dtype, then `mx.matmul`: `dense_us` by the
graph's ops, `kernel_us` by blocks.cu's affine_values kernel, one launch, as the backend does from 9 rows
for weights of DENSE_VALUES_MIN values), for
the weight products of the Qwen3-0.6B and Qwen3-8B shapes, random blocks (`quants.random_blocks`). Each
figure is the wall time of a graph of CHAIN independent products divided by CHAIN, median of REPS
graphs (launches included). `speedup`: quantized_matmul's time over dense's; `max_rel_diff`: the two
products' largest difference over the largest value (they round in different orders).

    python3 bench/probes/dense_products.py [--types Q8_0,Q4_K] [--shapes 0.6b,8b]
        [--rows 9,16,32,64,128,512,2048] [--dtypes bfloat16] [--chain 10] [--reps 5] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import datetime

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q

from dataclasses import replace

from mlxinfer import block_kernels, quants
from mlxinfer.backends.mlx_weights import dense_product, to_device

from block_products import SHAPES
from decode_attention import timed
from jsonl import emit


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="Q8_0,Q4_K")
    p.add_argument("--shapes", default="0.6b,8b")
    p.add_argument("--rows", default="9,16,32,64,128,512,2048")
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--chain", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not mx.cuda.is_available() and not mx.metal.is_available():
        raise SystemExit("dense_products.py: needs an MLX GPU")
    mx.set_default_device(mx.gpu)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rng = np.random.default_rng(0)
    for shape in a.shapes.split(","):
        for k, n in SHAPES[shape]:
            for name in a.types.split(","):
                qtype = Q[name]
                parts = quants.split(quants.random_blocks(rng, qtype, n, k, std=k ** -0.5), qtype, n, k)
                for dname in a.dtypes.split(","):
                    dtype = getattr(mx, dname)
                    w = to_device(qtype, parts, (n, k), dtype=dtype, compiled=True)
                    former = "cuda" if mx.cuda.is_available() else "metal"
                    wk = replace(w, former=former, kernel_fields=block_kernels.kernel_fields(w))
                    for m in map(int, a.rows.split(",")):
                        x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
                        mx.eval(x)
                        qmm = timed(lambda: w.product(x), a.reps, a.chain)
                        dense = timed(lambda: dense_product(w, x), a.reps, a.chain)
                        kernel = timed(lambda: dense_product(wk, x), a.reps, a.chain)
                        ref = np.array(w.product(x).astype(mx.float32))
                        got = np.array(dense_product(w, x).astype(mx.float32))
                        emit(dict(probe="dense_products", when=stamp, shape=shape, type=name, k=k, n=n, rows=m, dtype=dname,
                                  quantized_matmul_us=round(qmm, 1), dense_us=round(dense, 1), kernel_us=round(kernel, 1),
                                  speedup=round(qmm / dense, 2), kernel_speedup=round(qmm / kernel, 2),
                                  kernel_same_bits=bool(np.array_equal(np.array(dense_product(wk, x).astype(mx.float32)), got)),
                                  max_rel_diff=float(np.max(np.abs(ref - got)) / (np.max(np.abs(ref)) + 1e-30))), a.out)
                    del w, wk
                mx.clear_cache()


if __name__ == "__main__":
    main()
