"""The attention kernels' launches for Nsight Compute (CUDA): a 511-row causal prefill chunk (the plan
fused_attention picks for it, and the split plan's three-launch form with the kernels one row a
sequence), one decode row over 32,768 and over 2,048 keys, and mx.fast.scaled_dot_product_attention on
the same shapes, each launched once after MLX compiles it. Run it under ncu, e.g. (H200, 2026-11-30,
bench/results/h200-ncu-attention-1900.txt, -1910.txt and h200-ncu-prefill-rows-1922.txt):

    ncu --kernel-name regex:"attn_(scores|context)" --section SpeedOfLight --section LaunchStats \
        --section Occupancy --section WarpStateStats python3 bench/probes/ncu_attention.py

`--decode-only`: the one-row cases alone, at 512, 2,048, 8,192 and 32,768 keys; `--repeat N`: each op N
times (under `ncu --cache-control none` the later launches find the cache as a chain of calls leaves it).
"""

import argparse
import sys

import mlx.core as mx
import numpy as np

from mlxinfer import kernels
from mlxinfer.backend import AttentionSpec

if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
    sys.exit("ncu_attention: needs MLX's CUDA backend")
p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--decode-only", action="store_true")
p.add_argument("--repeat", type=int, default=1)
a = p.parse_args()
spec = AttentionSpec.standard(16, 8, 128)
rng = np.random.default_rng(0)
cases = [(1, s, s) for s in (512, 2048, 8192, 32768)] if a.decode_only else [(511, 512, None), (1, 32768, 32768),
                                                                               (1, 2048, 2048)]
for t, cap, s in cases:
    q = mx.array(rng.standard_normal((t, 2048), dtype=np.float32))
    k = mx.array(rng.standard_normal((1, cap, 1024), dtype=np.float32))
    v = mx.array(rng.standard_normal((1, cap, 1024), dtype=np.float32))
    n = s or t
    pos = mx.arange(t, dtype=mx.int32) if s is None else mx.full((1,), s - 1, dtype=mx.int32)
    lens = mx.full((t,), n, dtype=mx.int32)
    args = (q, k, v, mx.zeros((t,), dtype=mx.int32), pos, lens, spec)
    for _ in range(a.repeat):
        mx.eval(kernels.fused_attention("cuda", *args, seq_rows=[(0, t)]))
        if t > 1:
            mx.eval(kernels.split_attention("cuda", *args, two_launches=False))
        heads = (lambda x, h: mx.reshape(x, (1, -1, h, 128)).transpose(0, 2, 1, 3))
        mx.eval(mx.fast.scaled_dot_product_attention(heads(q, 16), heads(k[:, :n], 8), heads(v[:, :n], 8),
                                                     scale=spec.scale, mask="causal" if t > 1 else None))
