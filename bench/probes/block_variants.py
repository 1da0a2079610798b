"""Variants of one block kernel side by side on a GPU: the same blocks.cu compiled with other NVRTC options
(a register cap: more blocks resident on an SM), or another blocks.cu, each under a kernel name of its
own, timed on the decode products of the Qwen3-8B (or 0.6B) shape, random blocks, and their bits
compared with the default's. What decides a block kernel's speed at one row of x is how many warps an
SM keeps in flight while each waits for its weights (docs/performance.md): this asks which change moves it.

    python3 bench/probes/block_variants.py [--variants base=,alt=@path/to/blocks.cu]
        [--types Q4_K,Q6_K] [--shapes 8b] [--rows 1] [--dtype bfloat16] [--chain 20] [--reps 7]
        [--per-warp 1,2,4] [--gpu-clock] [--mlx] [--once] [--out results.jsonl]

A variant is NAME=OPTIONS (extra NVRTC options, space-separated) or NAME=@FILE (another blocks.cu, e.g. an
earlier commit's: `git show REV:metal_kernels/blocks.cu > bench/out-variants/REV.cu`, a folder git does
not track: carry it to a lent machine) or NAME=@FILE OPTIONS. NVRTC ignores `--maxrregcount` for a kernel with `__launch_bounds__`, which blocks.cu's
bounded forms have (`block_kernels.min_blocks`): another register bound is another file. `--once`: each product launched twice and not timed, for Nsight Compute, e.g.
`ncu --kernel-name regex:matvec --section SpeedOfLight --section Occupancy --section WarpStateStats
python3 bench/probes/block_variants.py --once`. Each variant's modules are compiled here, in this
process, into MLX's kernel cache (cuda_jit's builder, its options plus the variant's).

Without `--gpu-clock` a figure is wall time, `--chain` independent products a graph: at the narrow
products that is mostly the host's launch (about 40 us a product on the H200, whatever the kernel).
`--gpu-clock` times the device alone: `--chain` products chained (each product's output, cut or repeated
to K values by `glue`, is the next one's x) between two GPU clock stamps in one CUDA graph, less the
glue's own time, measured the same way alone (`glue_gpu_us`). `--per-warp 1,2,4`: each variant also at
those rows a warp (`{tag}_r{R}_us`; by default only `block_kernels.default_per_warp`'s). `--mlx`: MLX's
own `quantized_matmul` beside them on the same shape, 4 bits, groups of 32 and 64, scales and biases
formed once (what mlx-lm's 4-bit models run; `mlx_g32_us`, `mlx_g64_us`): another order, not compared
bit for bit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

if "--gpu-clock" in sys.argv:  # read by MLX when its GPU stream starts: before the import
    os.environ["MLX_MAX_OPS_PER_BUFFER"] = os.environ["MLX_MAX_MB_PER_BUFFER"] = "1000000"

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from mlxinfer import block_kernels, cuda_jit, quants
from mlxinfer.backends.mlx import gpu_kind
from mlxinfer.backends.mlx_weights import to_device
from mlxinfer.kernels import pruned, split_parts

from block_products import SHAPES
from decode_attention import gpu_time, timed  # median us per call: device time of a chain; wall time, `chain` calls a graph
from jsonl import emit


def glue(y, k: int):
    """A product's output [M, N] as the next product's x [M, K]: its first K columns, or it repeated."""
    n = y.shape[1]
    return y[:, :k] if n >= k else mx.concatenate([y] * -(-k // n), axis=1)[:, :k]


def variant_kernels(tag: str, path: str | None):
    """A function (kernel name, min blocks) -> cuda_jit.Kernel of blocks.cu (or the file at path), named
    for the variant (as `block_kernels._kernel` makes ours)."""
    header, bodies = block_kernels.kernel_source("cuda") if path is None else split_parts(open(path, encoding="utf-8").read())
    made = {}

    def kernel(name: str, blocks: int = 1):
        if (name, blocks) not in made:
            h, b = pruned(header, bodies[name])  # (comments stripped too)
            made[name, blocks] = cuda_jit.Kernel(f"mlxinfer_{name}_{tag}", block_kernels.INPUTS[name], ["out"], b,
                                                 block_kernels.bounded(h, blocks))
        return made[name, blocks]
    return kernel


def build_with(options: list[str], jobs) -> None:
    """Compile each (module, kernel, source) here with cuda_jit's builder's options plus `options`."""
    b = cuda_jit.builder()
    if b is None:
        raise SystemExit("block_variants.py: needs cuda_jit's builder (NVRTC and MLX's CUDA backend)")
    plain = cuda_jit.nvrtc_options
    cuda_jit.nvrtc_options = lambda arch, include: plain(arch, include) + options
    try:
        for module, kernel, source in jobs:
            error = cuda_jit._compile_and_write(b.lib_path, source, kernel, b.arch, str(b.include), str(b.cache),
                                                module, b.stamp, lib=b.lib)
            if error:
                raise SystemExit(f"block_variants.py: {kernel}: {error[1]}")
            b.done.add(module)
    finally:
        cuda_jit.nvrtc_options = plain


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="base=")
    p.add_argument("--types", default="Q4_K,Q6_K")
    p.add_argument("--shapes", default="8b")
    p.add_argument("--rows", default="1")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chain", type=int, default=20)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--once", action="store_true")
    p.add_argument("--per-warp", default=None)
    p.add_argument("--gpu-clock", action="store_true")
    p.add_argument("--mlx", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if gpu_kind() != "cuda":
        raise SystemExit("block_variants.py: needs MLX's CUDA backend")
    mx.set_default_device(mx.gpu)
    variants = {}
    for spec in a.variants.split(","):
        tag, _, rest = spec.partition("=")
        path = None
        if rest.startswith("@"):
            path, _, rest = rest[1:].partition(" ")
        variants[tag] = (variant_kernels(f"cuda_{tag}", path), rest.split())
    stamp_when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rng = np.random.default_rng(0)
    dtype = getattr(mx, a.dtype)
    plain_kernel = block_kernels._kernel
    for shape in a.shapes.split(","):
        for k, n in SHAPES[shape]:
            for name in a.types.split(","):
                qtype = Q[name]
                parts = quants.split(quants.random_blocks(rng, qtype, n, k, std=k ** -0.5), qtype, n, k)
                block, size = GGML_QUANT_SIZES[qtype]
                w = to_device(qtype, parts, (n, k), dtype=dtype)
                mlx_weights = {}
                if a.mlx and name == a.types.split(",")[0]:
                    dense = (mx.random.normal((n, k), key=mx.random.key(0)) * k ** -0.5).astype(dtype)
                    mlx_weights = {g: mx.quantize(dense, group_size=g, bits=4) for g in (32, 64)}
                    mx.eval(mlx_weights)
                    del dense
                for m in map(int, a.rows.split(",")):
                    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
                    row = dict(probe="block_variants", when=stamp_when, shape=shape, type=name, k=k, n=n, rows=m,
                               dtype=a.dtype, gpu_clock=a.gpu_clock)
                    glue_us = 0.0
                    if a.gpu_clock and n < k:
                        glue_us = gpu_time(lambda y: glue(y, k)[:, :n], mx.zeros((m, n), dtype), a.reps, a.chain)
                        row["glue_gpu_us"] = round(glue_us, 2)

                    def measure(fn):
                        if a.gpu_clock:
                            return gpu_time(lambda y: glue(fn(y), k), x, a.reps, a.chain) - glue_us
                        return timed(lambda: fn(x), a.reps, a.chain)
                    outs = {}
                    counts = [None] if a.per_warp is None else [int(r) for r in a.per_warp.split(",")]
                    for tag, (kernels, options) in variants.items():
                        block_kernels._kernel = lambda kind, kname, blocks=1, ks=kernels: ks(kname, blocks)
                        try:
                            for r in counts:
                                label = tag if r is None else f"{tag}_r{r}"
                                with cuda_jit.collecting() as jobs:
                                    block_kernels.product("cuda", x, w, r)
                                build_with(options, jobs)
                                if a.once:
                                    mx.eval(block_kernels.product("cuda", x, w, r))
                                else:
                                    us = measure(lambda y, r=r, w=w: block_kernels.product("cuda", y, w, r))
                                    row[f"{label}_us"] = round(us, 2)
                                    row[f"{label}_gbs"] = round(n * k // block * size / us / 1e3, 1)
                                outs[label] = np.array(block_kernels.product("cuda", x, w, r).astype(mx.float32))
                        finally:
                            block_kernels._kernel = plain_kernel
                    first = next(iter(outs.values()))
                    row["same_bits"] = all(np.array_equal(o.view(np.uint32), first.view(np.uint32)) for o in outs.values())
                    if a.mlx and not a.once:
                        for g, (wq, sc, bi) in mlx_weights.items():
                            us = measure(lambda y, wq=wq, sc=sc, bi=bi, g=g: mx.quantized_matmul(
                                y, wq, sc, bi, transpose=True, group_size=g, bits=4))
                            row[f"mlx_g{g}_us"] = round(us, 2)
                    emit(row, a.out)
                del w
                mx.clear_cache()


if __name__ == "__main__":
    main()
