"""Variants of one block kernel side by side on a GPU: the same blocks.cu compiled with other NVRTC options
(a register cap: more blocks resident on an SM), or another blocks.cu, each under a kernel name of its
own, timed on the decode products of the Qwen3-8B (or 0.6B) shape, random blocks, and their bits
compared with the default's. What decides a block kernel's speed at one row of x is how many warps an
SM keeps in flight while each waits for its weights (docs/performance.md): this asks which change moves it.

    python3 bench/probes/block_variants.py [--variants base=,alt=@path/to/blocks.cu]
        [--types Q4_K,Q6_K] [--shapes 8b] [--rows 1] [--dtype bfloat16] [--chain 20] [--reps 7]
        [--once] [--out results.jsonl]

A variant is NAME=OPTIONS (extra NVRTC options, space-separated) or NAME=@FILE (another blocks.cu) or
NAME=@FILE OPTIONS. NVRTC ignores `--maxrregcount` for a kernel with `__launch_bounds__`, which blocks.cu's
bounded forms have (`block_kernels.min_blocks`): another register bound is another file. `--once`: each product launched twice and not timed, for Nsight Compute, e.g.
`ncu --kernel-name regex:matvec --section SpeedOfLight --section Occupancy --section WarpStateStats
python3 bench/probes/block_variants.py --once`. Each variant's modules are compiled here, in this
process, into MLX's kernel cache (cuda_jit's builder, its options plus the variant's).
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
from mlxinfer.kernels import pruned, split_parts

from block_products import SHAPES
from decode_attention import timed  # median us per call, `chain` calls a graph, after a warm-up
from jsonl import emit


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
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
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
                for m in map(int, a.rows.split(",")):
                    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
                    row = dict(probe="block_variants", when=stamp, shape=shape, type=name, k=k, n=n, rows=m, dtype=a.dtype)
                    outs = {}
                    for tag, (kernels, options) in variants.items():
                        block_kernels._kernel = lambda kind, kname, blocks=1, ks=kernels: ks(kname, blocks)
                        try:
                            with cuda_jit.collecting() as jobs:
                                block_kernels.product("cuda", x, w)
                            build_with(options, jobs)
                            if a.once:
                                mx.eval(block_kernels.product("cuda", x, w))
                            else:
                                us = timed(lambda: block_kernels.product("cuda", x, w), a.reps, a.chain)
                                row[f"{tag}_us"] = round(us, 2)
                                row[f"{tag}_gbs"] = round(n * k // block * size / us / 1e3, 1)
                            outs[tag] = np.array(block_kernels.product("cuda", x, w).astype(mx.float32))
                        finally:
                            block_kernels._kernel = plain_kernel
                    first = next(iter(outs.values()))
                    row["same_bits"] = all(np.array_equal(o.view(np.uint32), first.view(np.uint32)) for o in outs.values())
                    emit(row, a.out)
                del w
                mx.clear_cache()


if __name__ == "__main__":
    main()
