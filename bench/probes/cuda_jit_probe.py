"""On a CUDA GPU: does MLX load what `mlxinfer.cuda_jit` prebuilds?

1. For a few launches, the source MLX generates (its `verbose=True` print, captured from fd 1) against
   `cuda_jit.mlx_source`'s: equal, or where they first differ.
2. A form prebuilt by cuda_jit, then launched: the time of its first evaluation (a load, milliseconds)
   beside a form MLX compiles itself (seconds), and both forms' outputs on the same inputs, bit for bit.

    python3 bench/probes/cuda_jit_probe.py
"""

import os
import sys
import tempfile
import time

import mlx.core as mx
import numpy as np

from mlxinfer import block_kernels, cuda_jit, kernels


def mlx_printed_source(k: cuda_jit.Kernel, launch: dict) -> str:
    """The source MLX prints for this launch (verbose=True), captured from fd 1."""
    kern = mx.fast.cuda_kernel(name=k.name, input_names=k.input_names, output_names=k.output_names,
                               source=k.body, header=k.header, ensure_row_contiguous=True)
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        try:
            kern(**launch, verbose=True)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        text = f.read().decode()
    return text.split("```\n", 1)[1].rsplit("\n```", 1)[0]


def main():
    b = cuda_jit.builder()
    print("builder:", None if b is None else (mx.__version__, b.arch, b.lib._name, str(b.include), str(b.cache)))
    q, keys, i32 = mx.zeros((3, 512), mx.bfloat16), mx.zeros((2, 70, 256), mx.bfloat16), mx.zeros((3,), mx.int32)
    template = [("H", 4), ("KV", 2), ("D", 128), ("CAUSAL", True), ("WINDOW", 0), ("SCALE_BITS", 7),
                ("SOFTCAP_BITS", 0), ("SOFTCAP_INV_BITS", 0), ("QT", mx.bfloat16), ("KVT", mx.bfloat16)]
    scores = kernels._kernel("cuda", "attn_scores")
    launches = [(scores, dict(inputs=[q, keys, i32, i32, i32], template=template, grid=(256, 1, 1),
                              threadgroup=(256, 1, 1), output_shapes=[(3, 4, 70)], output_dtypes=[mx.float32]))]
    rng = np.random.default_rng(0)
    from gguf import GGMLQuantizationType as Q

    from mlxinfer import quants
    from mlxinfer.backends.mlx_weights import to_device

    w = to_device(Q.Q8_0, quants.split(quants.random_blocks(rng, Q.Q8_0, 64, 512), Q.Q8_0, 64, 512), (64, 512))
    x = mx.array(rng.standard_normal((2, 512)).astype(np.float32))
    for k, kw in launches:
        got = mlx_printed_source(k, kw)
        mine = k.job(kw["inputs"], kw["template"], kw["output_dtypes"])[2]
        at = next((i for i, (a, c) in enumerate(zip(got, mine)) if a != c), min(len(got), len(mine)))
        print(f"{k.name}: MLX's source {'==' if got == mine else '!='} ours ({len(got)} / {len(mine)} chars"
              + ("" if got == mine else f"; first difference at {at}: MLX {got[at - 40:at + 40]!r} ours {mine[at - 40:at + 40]!r}") + ")")
    # a prebuilt form against the same form compiled by MLX itself (a process without the builder)
    t = time.perf_counter()
    out = block_kernels.product("cuda", x, w)
    built = time.perf_counter() - t
    t = time.perf_counter()
    mx.eval(out)
    first = time.perf_counter() - t
    print(f"Q8_0 matvec, 2 rows: prebuild {built:.2f} s (0 if it was on disk), first evaluation {first * 1e3:.1f} ms")
    import subprocess

    code = ("import mlx.core as mx, numpy as np, time, sys; sys.path.insert(0, '.');"
            "from mlxinfer import block_kernels, quants; from mlxinfer.backends.mlx_weights import to_device;"
            "from gguf import GGMLQuantizationType as Q; rng = np.random.default_rng(0);"
            "w = to_device(Q.Q8_0, quants.split(quants.random_blocks(rng, Q.Q8_0, 64, 512), Q.Q8_0, 64, 512), (64, 512));"
            "x = mx.array(rng.standard_normal((2, 512)).astype(np.float32)); t = time.perf_counter();"
            "o = block_kernels.product('cuda', x, w); mx.eval(o); print(time.perf_counter() - t);"
            "np.save(sys.argv[1], np.array(o))")
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, MLXINFER_CUDA_PREBUILD="0", MLX_PTX_CACHE_DIR=os.path.join(d, "ptx"))
        r = subprocess.run([sys.executable, "-c", code, os.path.join(d, "o.npy")], env=env, capture_output=True, text=True)
        if r.returncode:
            print("MLX-compiled twin failed:", r.stderr.strip().splitlines()[-1:])
            return
        theirs = np.load(os.path.join(d, "o.npy"))
    same = np.array(out).view(np.uint32) == theirs.view(np.uint32)
    print(f"the same form compiled by MLX itself: first evaluation {float(r.stdout.split()[-1]) * 1e3:.1f} ms; "
          f"outputs equal bit for bit: {bool(same.all())} ({int(same.sum())} of {same.size})")


if __name__ == "__main__":
    main()
