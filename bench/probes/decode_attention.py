"""Decode attention microbenchmark (issue 10, target 4): one query row per sequence against its cached
keys and values, GQA 16/8, head_dim 128, float32, at several contexts, for

- `fused`: mlxinfer's fused attention kernel (`mlxinfer.kernels.fused_attention`, CUDA or Metal) reading
  the [slots, capacity, KV*D] cache in place, each row's length from an array;
  with the launch plan it picks for such passes (CUDA: the split kernels) and, as `one_launch`, the
  one-launch kernel (one block per row and head) forced;
- `sdpa`: `mx.fast.scaled_dot_product_attention` on [B, 16, 1, 128] queries and [B, 8, S, 128] keys
  and values (MLX's own fused kernel; no mask needed for one query row that sees every key).

Each case evaluates the op `--reps` times in a row (one graph per call, evaluated) and reports the
median microseconds per call (`*_us`: launch and synchronisation included, as a decode step without
compilation pays them), and the median over `--reps` graphs of 20 independent calls each, per call
(`*_us_in20`: closer to the kernels' own time, as inside a compiled step); for the split plan also its
first step alone (`split_scores_us_in20`); and
`*_us_compiled20`: the op as an mx.compile'd function, 20 calls per graph (no Python graph building). Before timing it checks that
both plans give the same bits and that they agree with sdpa to 1e-4. Needs an MLX GPU.

`--gpu-clock` (CUDA) measures instead the device time alone: 20 calls chained (each call's output is
the next call's query), between two GPU clock stamps (bench/probes/gpu_clock.py), all in one CUDA graph
(MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER set high), per call (`*_gpu_us`; the split plan's two- and three-launch forms forced as
`split_two_launches_gpu_us` and `split_three_launches_gpu_us`, and where the cache is short enough the
two-launch form in one launch (`kernels.uses_short`: attn_short) as `split_short_launches_gpu_us`; with `--one-row-forms SU:KU:PF:WS,...`, one
row also with each of those `kernels.ONE_ROW_FORM`s as `fused_SU8_KU64_PF1_WS1_gpu_us` etc., then the default
again as `fused_gpu_us_again`; the row arrays (slot, position, length) are slices of arrays of at least 4
entries, as the engine passes them, and for one or two rows `fused_rows_small_gpu_us` times arrays of
their own size, which MLX's CUDA allocator keeps in host memory when they hold at most 8 bytes); for the split plan
also its first step (the scores), chained through a glue op whose own time is `glue_gpu_us`. The first
stamp depends only on the (evaluated) query, so in MLX's CUDA graph it may run beside the first call's
first kernel (an error of at most that kernel's time over the 20 calls). Two graphs of warm-up, then the
median of `--reps`/5 graphs; the plans run in a fixed order, and single calls of one kernel moved by up
to 1.4x between measurements of one run on the H200.

    python3 bench/probes/decode_attention.py --contexts 512,2048,8192,32768 --batch 1,8 --out results.jsonl

`--dtype bfloat16` (or float16) gives q, the cached keys and values and sdpa's operands that type (a
16-bit `--kv-dtype`'s cache: the kernels read two bytes a value); the agreement with sdpa is then checked
to 2e-2 (the output's rounding to the type, up to 2^-8 of values up to ~3, and sdpa's own roundings).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--gpu-clock" in sys.argv:  # read by MLX when its GPU stream starts: before the import
    os.environ["MLX_MAX_OPS_PER_BUFFER"] = os.environ["MLX_MAX_MB_PER_BUFFER"] = "1000000"

import mlx.core as mx
import numpy as np

from mlxinfer import kernels
from mlxinfer.backend import AttentionSpec
from mlxinfer.batch import MIN_INDEX_ENTRIES

from gpu_clock import elapsed_us, stamp
from jsonl import emit


def timed(fn, reps, chain=1):
    """Median microseconds per call, `chain` calls per evaluated graph."""
    for _ in range(3):
        mx.eval([fn() for _ in range(chain)])
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval([fn() for _ in range(chain)])
        times.append((time.perf_counter() - t) * 1e6 / chain)
    return statistics.median(times)


def gpu_time(fn, x0, reps, chain=20):
    """Median device microseconds per call of fn over a chain of `chain` calls, x -> fn(x)."""
    times = []
    for r in range(reps + 2):
        x = x0
        s0 = stamp(x)
        for _ in range(chain):
            x = fn(x)
        s1 = stamp(x)
        mx.eval(s0, s1, x)
        if r >= 2:
            times.append(elapsed_us(s0, s1) / chain)
    return statistics.median(times)


def bits(a) -> np.ndarray:
    """An output's bits (numpy has no bfloat16)."""
    return np.array(mx.view(a, mx.uint32 if a.dtype == mx.float32 else mx.uint16))


def glue(x, out):
    """The next query of a chain that times a step alone: x + 0 * one value of the step's output (two
    small kernels, timed on their own as `glue_gpu_us`)."""
    return x + 0.0 * out.reshape(-1)[:1]


def form_name(form) -> str:
    return "_".join(f"{k}{v}" for k, v in form)


def parse_forms(text: str) -> list[tuple]:
    """--one-row-forms "SU:KU:PF:WS,..." -> [(("SU", su), ("KU", ku), ("PF", pf), ("WS", ws)), ...]"""
    forms = []
    for item in filter(None, text.split(",")):
        su, ku, pf, ws = (int(x) for x in item.split(":"))
        if su < 1 or ku < 8 or ku % 8 or pf not in (0, 1) or ws not in (0, 1):
            raise SystemExit(f"decode_attention: bad form {item!r} (SU >= 1, KU a multiple of 8, PF and WS 0 or 1)")
        forms.append((("SU", su), ("KU", ku), ("PF", pf), ("WS", ws)))
    return forms


def gpu_rows(kind, spec, b, s, q, keys, values, slots, pos, lens, qh, kh, vh, reps, forms=()):
    """The --gpu-clock row of one case."""
    row = dict(batch=b, context=s, capacity=keys.shape[1], heads=f"{spec.n_heads}/{spec.n_kv_heads}",
               split=kernels.uses_split(kind, b, spec), kernel=kind, clock="gpu",
               two_launches=kernels.uses_two_launches(b, keys.shape[1]), short=kernels.uses_short(b, spec, keys.shape[1]))
    fused = lambda x: kernels.fused_attention(kind, x, keys, values, slots, pos, lens, spec)  # noqa: E731
    row["fused_gpu_us"] = round(gpu_time(fused, q, reps), 1)
    one = lambda x: kernels.fused_attention(kind, x, keys, values, slots, pos, lens, spec, split=False)  # noqa: E731
    row["one_launch_gpu_us"] = round(gpu_time(one, q, reps), 1)
    plans = [(True, False, "two"), (False, False, "three")]  # the split plan's forms, forced
    if kernels.short_fits(spec, keys.shape[1]):  # ... and the two-launch form in one (attn_short)
        plans.append((True, True, "short"))
    for two, short, name in plans:
        fn = lambda x, t=two, sh=short: kernels.split_attention(kind, x, keys, values, slots, pos, lens, spec,  # noqa: E731
                                                                two_launches=t, short=sh)
        row[f"split_{name}_launches_gpu_us"] = round(gpu_time(fn, q, reps), 1)
    sdpa = lambda x: mx.fast.scaled_dot_product_attention(x, kh, vh, scale=spec.scale)  # noqa: E731
    row["sdpa_gpu_us"] = round(gpu_time(sdpa, qh, reps), 1)
    # the split plan's first step chained through the glue op, and the glue alone: a step's time is
    # (its chain - glue)
    row["glue_gpu_us"] = round(gpu_time(lambda x: glue(x, x), q, reps), 1)
    fn = lambda x: glue(x, kernels.split_attention(kind, x, keys, values, slots, pos, lens, spec, steps=1))  # noqa: E731
    row["split_scores_glued_gpu_us"] = round(gpu_time(fn, q, reps), 1)
    row["fused_over_sdpa_gpu"] = round(row["fused_gpu_us"] / row["sdpa_gpu_us"], 2)
    if b * 4 <= 8:  # MLX's CUDA allocator puts arrays of <= 8 bytes in its small pool of host (managed)
        # memory, which the GPU reads across the bus (mlxinfer.batch.MIN_INDEX_ENTRIES): the same rows,
        # each array of b entries alone, as the engine passed them before 6079cb6
        small = [x[:b] + 0 for x in (slots, pos, lens)]
        mx.eval(*small)
        fs = lambda x: kernels.fused_attention(kind, x, keys, values, *small, spec)  # noqa: E731
        if not np.array_equal(bits(fs(q)), bits(fused(q))):
            sys.exit("decode_attention: row arrays of b entries give other bits")
        row["fused_rows_small_gpu_us"] = round(gpu_time(fs, q, reps), 1)
    if forms and b == 1:  # one row's other attn_softmax_context forms, each bit for bit first
        want = bits(fused(q))
        default = kernels.ONE_ROW_FORM, kernels.ONE_ROW_LONG_FORM
        for form in forms:
            kernels.ONE_ROW_FORM = kernels.ONE_ROW_LONG_FORM = form
            try:
                if not np.array_equal(bits(fused(q)), want):
                    sys.exit(f"decode_attention: form {form_name(form)} differs from the default")
                row[f"fused_{form_name(form)}_gpu_us"] = round(gpu_time(fused, q, reps), 1)
            finally:
                kernels.ONE_ROW_FORM, kernels.ONE_ROW_LONG_FORM = default
        row["fused_gpu_us_again"] = round(gpu_time(fused, q, reps), 1)  # the default again, after them
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="512,2048,8192,32768")
    p.add_argument("--batch", default="1")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default=None)
    p.add_argument("--gpu-clock", action="store_true", help="device time per call only (CUDA)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="q's, the keys' and the values' type")
    p.add_argument("--heads", default="16/8", help="query heads / KV heads (head_dim 128): 16/8 the 0.6B shape, 32/8 the 8B")
    p.add_argument("--capacity", type=int, default=0,
                   help="rows of each slot's store (default: the context); a decode step's store is longer than "
                        "its keys (PreallocKVCache rounds it up to 256)")
    p.add_argument("--one-row-forms", default="",
                   help="with --gpu-clock: also time one row with these attn_softmax_context forms, "
                        "SU:KU:PF:WS,... (kernels.ONE_ROW_FORM and ONE_ROW_LONG_FORM; fused_SU8_KU32_PF1_WS1_gpu_us, ...)")
    a = p.parse_args(argv)
    forms = parse_forms(a.one_row_forms)  # a bad one fails before any case runs
    kind = "cuda" if mx.cuda.is_available() else "metal" if mx.metal.is_available() else None
    if kind is None:
        sys.exit("decode_attention: needs an MLX GPU (CUDA or Metal)")
    nh, nkv = (int(x) for x in a.heads.split("/"))
    spec = AttentionSpec.standard(nh, nkv, 128)
    dtype, tol = getattr(mx, a.dtype), (1e-4 if a.dtype == "float32" else 2e-2)
    rng = np.random.default_rng(0)
    for b in (int(x) for x in a.batch.split(",")):
        for s in (int(x) for x in a.contexts.split(",")):
            cap = max(s, a.capacity)
            q = mx.array(rng.standard_normal((b, nh * 128), dtype=np.float32)).astype(dtype)
            keys = mx.array(rng.standard_normal((b, cap, nkv * 128), dtype=np.float32)).astype(dtype)
            values = mx.array(rng.standard_normal((b, cap, nkv * 128), dtype=np.float32)).astype(dtype)
            width = max(b, MIN_INDEX_ENTRIES)  # as the engine passes them (Batch.packed): never <= 8 bytes
            slots = mx.arange(width, dtype=mx.int32)[:b]
            pos = mx.full((width,), s - 1, dtype=mx.int32)[:b]
            lens = mx.full((width,), s, dtype=mx.int32)[:b]
            qh = mx.reshape(q, (b, nh, 1, 128))
            kh = mx.contiguous(mx.transpose(mx.reshape(keys[:, :s], (b, s, nkv, 128)), (0, 2, 1, 3)))
            vh = mx.contiguous(mx.transpose(mx.reshape(values[:, :s], (b, s, nkv, 128)), (0, 2, 1, 3)))
            mx.eval(q, keys, values, kh, vh, slots, pos, lens)
            ops = {"fused": lambda: kernels.fused_attention(kind, q, keys, values, slots, pos, lens, spec),
                   "one_launch": lambda: kernels.fused_attention(kind, q, keys, values, slots, pos, lens, spec,
                                                                 split=False),
                   "sdpa": lambda: mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=spec.scale)}
            out = {name: np.array(op().astype(mx.float32)).reshape(b, -1) for name, op in ops.items()}
            same = np.array_equal(out["fused"].view(np.uint32), out["one_launch"].view(np.uint32))
            err = float(np.max(np.abs(out["fused"] - out["sdpa"])))
            if not same or err > tol:
                sys.exit(f"decode_attention: plans differ (bitwise equal: {same}) or far from sdpa ({err:.3g})")
            if a.gpu_clock:
                emit(dict(gpu_rows(kind, spec, b, s, q, keys, values, slots, pos, lens, qh, kh, vh, max(5, a.reps // 5),
                                   forms=forms), dtype=a.dtype), a.out)
                continue
            row = dict(batch=b, context=s, split=kernels.uses_split(kind, b, spec), kernel=kind, dtype=a.dtype)
            for name, op in ops.items():
                row[f"{name}_us"] = round(timed(op, a.reps), 1)
                row[f"{name}_us_in20"] = round(timed(op, max(5, a.reps // 5), chain=20), 1)
            if row["split"]:  # the split plan's first step alone, the scores (in graphs of 20)
                row["split_scores_us_in20"] = round(timed(lambda: kernels.split_attention(
                    kind, q, keys, values, slots, pos, lens, spec, steps=1), max(5, a.reps // 5), chain=20), 1)
            compiled = {  # under mx.compile: no Python graph building per call
                "fused": (mx.compile(lambda q_, k_, v_: kernels.fused_attention(kind, q_, k_, v_, slots, pos, lens, spec)),
                          (q, keys, values)),
                "sdpa": (mx.compile(lambda q_, k_, v_: mx.fast.scaled_dot_product_attention(q_, k_, v_, scale=spec.scale)),
                         (qh, kh, vh))}
            for name, (fn, args) in compiled.items():
                row[f"{name}_us_compiled20"] = round(timed(lambda fn=fn, args=args: fn(*args), max(5, a.reps // 5),
                                                           chain=20), 1)
            row["fused_over_sdpa"] = round(row["fused_us"] / row["sdpa_us"], 2)
            row["fused_over_sdpa_in20"] = round(row["fused_us_in20"] / row["sdpa_us_in20"], 2)
            row["fused_over_sdpa_compiled20"] = round(row["fused_us_compiled20"] / row["sdpa_us_compiled20"], 2)
            emit(row, a.out)


if __name__ == "__main__":
    main()
