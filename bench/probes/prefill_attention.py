"""Prefill attention microbenchmark (issue 10, target 2): one sequence's causal chunk of T query rows at
positions 0..T-1 against its own T keys and values in a cache of capacity T rounded up to 256 (what a
prompt's first chunk sees), GQA 16/8, head_dim 128, float32. Device time per call (CUDA, GPU clock
stamps, bench/probes/gpu_clock.py, 20 calls chained, median of `--reps` graphs) of

- `auto`: mlxinfer's fused attention with the launch plan it picks (`kernels.uses_split`);
- `scores`, `scores_softmax` (and `_rows`, the kernels by rows): the split plan's first step, and its
  first two (three-launch form), each
  chained through a glue op (next query = x + 0 * one output value) whose own time is `glue`: a step's
  time is its row less the one before (less the glue for `scores`);
- `split_three_rows`, `split_three`, `one_launch`: the split plan's three-launch form with the context
  kernel by rows (`attn_context_rows`, what a prefill chunk takes) and with `attn_context` (a thread per
  chain), and the one-launch kernel, forced;
- `sdpa`: `mx.fast.scaled_dot_product_attention(..., mask="causal")` on [1, 16, T, 128] (MLX's own kernel;
  not byte-identical to ours, shown for scale).

Before timing it checks that the plans give the same bits and agree with sdpa to 1e-2 (MLX's CUDA sdpa
for many query rows is 1e-3 from the float32 result on the H200; the largest difference is `sdpa_err`).

    python3 bench/probes/prefill_attention.py --rows 511,2047 --out results.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["MLX_MAX_OPS_PER_BUFFER"] = os.environ["MLX_MAX_MB_PER_BUFFER"] = "1000000"  # one CUDA graph


import mlx.core as mx
import numpy as np

from mlxinfer import kernels
from mlxinfer.backend import AttentionSpec

from decode_attention import glue, gpu_time
from jsonl import emit


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="511,2047")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--context-forms", default="", help="attn_context_rows' forms to time, NHBxUR, e.g. 2x2,1x4")
    a = p.parse_args(argv)
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        sys.exit("prefill_attention: needs MLX's CUDA backend (GPU clock stamps)")
    kind = "cuda"
    spec = AttentionSpec.standard(16, 8, 128)
    rng = np.random.default_rng(0)
    for t in (int(x) for x in a.rows.split(",")):
        cap = -(-t // 256) * 256
        q = mx.array(rng.standard_normal((t, 16 * 128), dtype=np.float32))
        keys = mx.array(rng.standard_normal((1, cap, 8 * 128), dtype=np.float32))
        values = mx.array(rng.standard_normal((1, cap, 8 * 128), dtype=np.float32))
        slots = mx.zeros((t,), dtype=mx.int32)
        pos = mx.arange(t, dtype=mx.int32)
        lens = mx.full((t,), t, dtype=mx.int32)
        qh = mx.transpose(mx.reshape(q, (1, t, 16, 128)), (0, 2, 1, 3))
        kh = mx.contiguous(mx.transpose(mx.reshape(keys[:, :t], (1, t, 8, 128)), (0, 2, 1, 3)))
        vh = mx.contiguous(mx.transpose(mx.reshape(values[:, :t], (1, t, 8, 128)), (0, 2, 1, 3)))
        mx.eval(q, keys, values, kh, vh)
        args = (keys, values, slots, pos, lens, spec)
        plans = {
            "auto": lambda x: kernels.fused_attention(kind, x, *args, seq_rows=[(0, t)]),
            "split_three_rows": lambda x: kernels.split_attention(kind, x, *args, two_launches=False, seq_rows=[(0, t)]),
            "split_three": lambda x: kernels.split_attention(kind, x, *args, two_launches=False),
            "one_launch": lambda x: kernels.fused_attention(kind, x, *args, split=False),
        }
        outs = {name: np.array(fn(q)) for name, fn in plans.items()}
        ref = np.array(mx.transpose(mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=spec.scale, mask="causal"),
                                    (0, 2, 1, 3))).reshape(t, -1)
        for name, o in outs.items():
            if not np.array_equal(o.view(np.uint32), outs["auto"].view(np.uint32)):
                sys.exit(f"prefill_attention: plan {name} differs from auto at {t} rows")
        err = float(np.max(np.abs(outs["auto"] - ref)))
        if err > 1e-2:
            sys.exit(f"prefill_attention: {err:.3g} from sdpa at {t} rows")
        row = dict(rows=t, capacity=cap, split=kernels.uses_split(kind, t, spec, cap), kernel=kind, clock="gpu", sdpa_err=err)
        for name, fn in plans.items():
            row[f"{name}_gpu_us"] = round(gpu_time(fn, q, a.reps), 1)

        default_form = list(kernels.CONTEXT_ROWS_FORM)
        for form in (a.context_forms.split(",") if a.context_forms else []):  # attn_context_rows' forms
            nhb, ur = (int(x) for x in form.split("x"))
            kernels.CONTEXT_ROWS_FORM = [("NHB", nhb), ("UR", ur)]
            fn = plans["split_three_rows"]
            if not np.array_equal(np.array(fn(q)).view(np.uint32), outs["auto"].view(np.uint32)):
                sys.exit(f"prefill_attention: context form {form} differs at {t} rows")
            row[f"split_three_rows_{form}_gpu_us"] = round(gpu_time(fn, q, a.reps), 1)
        kernels.CONTEXT_ROWS_FORM = default_form
        row["glue_gpu_us"] = round(gpu_time(lambda x: glue(x, x), q, a.reps), 1)
        for steps, name in ((1, "scores"), (2, "scores_softmax")):
            for rows, suffix in ((False, ""), (True, "_rows")):
                fn = lambda x, s=steps, b=rows: glue(x, kernels.split_attention(  # noqa: E731
                    kind, x, *args, steps=s, two_launches=False, seq_rows=[(0, t)], by_rows=b))
                row[f"{name}{suffix}_glued_gpu_us"] = round(gpu_time(fn, q, a.reps), 1)
        sdpa = lambda x: mx.fast.scaled_dot_product_attention(x, kh, vh, scale=spec.scale, mask="causal")  # noqa: E731
        row["sdpa_gpu_us"] = round(gpu_time(sdpa, qh, a.reps), 1)
        emit(row, a.out)


if __name__ == "__main__":
    main()
