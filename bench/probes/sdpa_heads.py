"""Does `mx.fast.scaled_dot_product_attention` give a head the same bits whether it is called on that head
alone or on all of a sequence's heads at once, and what does each way cost (issue 30: a 16-bit prefill
chunk's attention on MLX's own fused kernel, cuDNN's on CUDA, in the per-head reference and the fused
override alike)?

    python3 bench/probes/sdpa_heads.py [--dtypes bfloat16,float16] [--out F]

For each dtype, head size D and (rows T, keys S): random q [T, H*D] (16 query heads, 8 KV heads), K and V
[S, 8*D] laid out as the engine's pass and cache hold them; the chunk's rows at positions S - T .. S - 1
(`mask="causal"`, bottom-right), and again with a sliding window of 256 as an additive mask. Compared bit
for bit: one call over all heads, one call per query head (its KV head), one call per KV head (its group
of query heads), and the all-heads call repeated. Timed: the same ways, median of 10 after a warm-up.
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx
import numpy as np

from jsonl import emit
from mma_check import timed

H, KV = 16, 8


def heads(x, n, d):
    """[R, n*d] -> [1, n, R, d] (a view: the engine's rows are tokens, its columns heads)."""
    return mx.transpose(mx.reshape(x, (x.shape[0], n, d)), (1, 0, 2))[None]


def rows(o, d):
    """[1, n, R, d] -> [R, n*d]."""
    return mx.reshape(mx.transpose(o[0], (1, 0, 2)), (o.shape[2], -1))


def window_mask(t, s, window, dtype):
    """Additive mask [T, S]: row i (position s - t + i) sees keys j with pos - window < j <= pos."""
    pos = np.arange(s - t, s)[:, None]
    j = np.arange(s)[None, :]
    keep = (j <= pos) & (j > pos - window)
    return mx.array(np.where(keep, 0.0, -np.inf).astype(np.float32)).astype(dtype)


def ways(q, k, v, d, scale, mask):
    """name -> fn() giving [T, H*D]."""
    g = H // KV

    def all_heads():
        return rows(mx.fast.scaled_dot_product_attention(heads(q, H, d), heads(k, KV, d), heads(v, KV, d),
                                                         scale=scale, mask=mask), d)

    def per_head():
        outs = []
        for h in range(H):
            kh = h // g
            qh = q[:, h * d:(h + 1) * d][None, None]
            kk = k[:, kh * d:(kh + 1) * d][None, None]
            vv = v[:, kh * d:(kh + 1) * d][None, None]
            outs.append(mx.fast.scaled_dot_product_attention(qh, kk, vv, scale=scale, mask=mask)[0, 0])
        return mx.concatenate(outs, axis=1)

    def per_group():
        outs = []
        for kh in range(KV):
            qg = heads(q[:, kh * g * d:(kh + 1) * g * d], g, d)
            kk = k[:, kh * d:(kh + 1) * d][None, None]
            vv = v[:, kh * d:(kh + 1) * d][None, None]
            outs.append(rows(mx.fast.scaled_dot_product_attention(qg, kk, vv, scale=scale, mask=mask), d))
        return mx.concatenate(outs, axis=1)

    return {"all_heads": all_heads, "per_head": per_head, "per_group": per_group}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--dims", default="64,80,128,256")
    ap.add_argument("--shapes", default="128x128,130x430,511x511,512x8192,2048x2048,2048x8192")
    ap.add_argument("--time", default="511x511,512x8192,2048x8192")
    ap.add_argument("--out")
    args = ap.parse_args()
    emit({"mlx": mx.__version__, "device": str(mx.default_device())}, args.out)
    rng = np.random.default_rng(0)
    timed_shapes = set(args.time.split(","))
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(mx, dtype_name)
        for d in (int(x) for x in args.dims.split(",")):
            scale = float(np.float32(1 / np.sqrt(d)))
            for shape in args.shapes.split(","):
                t, s = (int(x) for x in shape.split("x"))
                q = mx.array(rng.normal(0, 3, (t, H * d)).astype(np.float32)).astype(dtype)
                k = mx.array(rng.normal(0, 3, (s, KV * d)).astype(np.float32)).astype(dtype)
                v = mx.array(rng.normal(0, 1, (s, KV * d)).astype(np.float32)).astype(dtype)
                for mask_name, mask in (("causal", "causal"), ("window256", window_mask(t, s, 256, dtype))):
                    fns = ways(q, k, v, d, scale, mask)
                    got = {name: np.array(fn().astype(mx.float32)) for name, fn in fns.items()}
                    again = np.array(fns["all_heads"]().astype(mx.float32))
                    ref = got["per_head"]
                    row = {"dtype": dtype_name, "head_dim": d, "rows": t, "keys": s, "mask": mask_name,
                           "all_heads_same_bits": float(np.mean(got["all_heads"].view(np.uint32) == ref.view(np.uint32))),
                           "per_group_same_bits": float(np.mean(got["per_group"].view(np.uint32) == ref.view(np.uint32))),
                           "repeat_same_bits": bool(np.array_equal(again.view(np.uint32), got["all_heads"].view(np.uint32))),
                           "max_abs_all_vs_head": float(np.max(np.abs(got["all_heads"] - ref)))}
                    if shape in timed_shapes and d == 128:
                        row.update({f"{name}_ms": timed(fn) for name, fn in fns.items()})
                    emit(row, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
