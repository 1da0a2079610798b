"""Where a decode token's time goes, ours beside mlx-lm's (issue 10, target 1's profile).

MLX evaluates lazily: a decode token costs host time to build its graph (Python, or one call of our
compiled step), host time to encode that graph for the GPU (`mx.async_eval`: every primitive's
eval_gpu, CUDA graph building and launch), and then waiting for the GPU. With one step in flight
(both engines pipeline) a token's interval is max(host, GPU) plus what does not overlap. This script
times the three host parts of every decode token, per engine, at each prompt length:

- `build_ms`: building the step's graph (ours: `Loop._launch`, which builds the pass; `Loop.step` starts
  it; mlx-lm: the model call inside `generate_step`);
- `encode_ms`: `mx.async_eval` (the C++ eval of every primitive: kernel launches into CUDA graphs);
- `wait_ms`: blocked reading the previous token (ours: `to_numpy`, and `sync` where a pass waits for the
  one before it before it starts: a prompt's passes, a cache of `loop.WAIT_STORE_BYTES`; mlx-lm: the rest
  of the interval);
- `interval_ms`: the median time between decode tokens (`decode_tok_s`: 1000 / their mean); the last run's
  first 12 intervals (`intervals_ms`) and their passes' [build, encode, wait] (`tokens_ms`), where a
  median would hide a rhythm (the bench's intervals on an H100 ran 0.5 to 4.3 ms, mean 2.2, 2026-12-06);
- `first_token`: the first token's time (`ttft_ms`, median of the runs) and its host parts. Ours:
  `prompt_build_ms` / `prompt_encode_ms` (the prompt's pass), `next_build_ms` / `next_encode_ms` (the
  first decode pass's build, before the first token is read, and its encoding where that came before
  the read too: 0 since d495d61, which starts it at the next step, counted in the next row), `wait_ms`
  (reading it). mlx-lm:
  `build_ms` (its model calls: the prompt less one token, the last token, the next token), `encode_ms`
  (its `mx.async_eval`s) and `rest_ms` (the rest: waiting, its `mx.eval` of the prompt's cache).

Ours' build is all of `Loop._launch`: the batch's arrays, the compiled step's call and the sampling
graph; mlx-lm's is its model call only (its sampling graph lands in `wait`).

`--gpu-clock` (CUDA) adds `gpu_ms`: the device time of the forward pass alone (ours: the compiled
step; mlx-lm: its model call), between two GPU clock stamps (bench/probes/gpu_clock.py) evaluated with the
step; it sets MLX_MAX_OPS_PER_BUFFER and MLX_MAX_MB_PER_BUFFER so high that each evaluation is one
CUDA graph, launched once encoded, so no host gap falls between the stamps. When `gpu_ms` is well
below the interval the step is host-bound: fewer primitives, not faster kernels, make a faster token. `--variants` adds our engine with the attention kernel's launch plan forced
(`one-launch`), with every down product's SwiGLU in its launch whatever its shape
(`swiglu-fused`: `block_kernels.fuses_swiglu`'s size bound off), with each norm as the rms_norm kernel
apart from its products (`norm-apart`: the same bits), with Q, K, V and gate, up as separate products (`separate`), with each layer's norms
and residual adds apart from the block kernels' products (`unfused`: the launches before their NORM,
ADD and SWIGLU forms), with SwiGLU alone apart (`swiglu-apart`: before the SWIGLU form), with MLX's own
norms and SwiGLU in a prompt's pass (`prefill-mlx-ops`: our kernels for decode rows only), with every CUDA kernel's header inline in the source MLX hashes at each launch (`inline-headers`: before
`cuda_jit.INCLUDE_FROM`), with a weight group's columns a slice each (`sliced-columns`: before one Split took them), with a
group's two runs of two types (a Q4_K_M file's Q/K and Q6_K V) a launch each (`pair-apart`: before
`block_kernels.pair_product`), with a prompt's products' scales and values formed by the graph's compiled
kernels (`formed-graph`: before blocks.cu's formed kernels) or by those kernels launched bare, not
replayed from mx.compile (`formed-launched`), and with attention replaced by a copy of the queries (`no-attention`: wrong text, the
rest of the step's cost). Run each MLX_MAX_OPS_PER_BUFFER setting in its own process (MLX reads it
once). Writes JSON lines. Made for an MLX GPU (`--device cpu` only tries the script).

    python3 bench/probes/step_profile.py --cases 17,511 --gen 64 --out profile.jsonl
    python3 bench/probes/step_profile.py --cases 511,2047 --dtypes float32,bfloat16 --out profile.jsonl

`--dtypes`: ours' --dtype and mlx-lm's weights and activations, each dtype a row of each engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

if "--gpu-clock" in sys.argv:  # read by MLX when its GPU stream starts: before the import
    os.environ["MLX_MAX_OPS_PER_BUFFER"] = os.environ["MLX_MAX_MB_PER_BUFFER"] = "1000000"

import mlx.core as mx

import mlxinfer
from mlxinfer import block_kernels, cuda_jit, kernels
from mlxinfer.loop import Loop
from mlxinfer.benchmark import model_path
from mlxinfer.peers import prompt_ids, write_mlx_lm_model

from gpu_clock import elapsed_us, stamp
from jsonl import emit


class Clock:
    """Accumulates host time per label, per token; and, with `gpu`, GPU clock stamps around each pass."""

    def __init__(self, gpu: bool = False):
        self.per_token: list[dict] = []
        self.now: dict = {}
        self.gpu = gpu
        self.stamps: list[tuple] = []  # (first, last) of each timed pass
        self.pending: list = []  # stamps to evaluate with the pass's outputs

    def around(self, first_input, fn):
        """fn() with GPU stamps after `first_input` and after its first output (self.gpu only)."""
        if not self.gpu:
            return fn()
        s0 = stamp(first_input)
        out = fn()
        s1 = stamp(out[0] if isinstance(out, tuple) else out)
        self.stamps.append((s0, s1))
        self.pending += [s0, s1]
        return out

    def take_pending(self) -> list:
        out, self.pending = self.pending, []
        return out

    def gpu_ms(self):
        if not self.stamps:
            return None
        return round(statistics.median(elapsed_us(a, b) for a, b in self.stamps) / 1000, 3)

    def add(self, label, dt):
        self.now[label] = self.now.get(label, 0.0) + dt

    def token(self):
        self.per_token.append(self.now)
        self.now = {}


def _median(rows, key):
    return round(statistics.median(r.get(key, 0.0) for r in rows) * 1000, 3)


def profile_ours(path, cases, gen, variant, device, gpu_clock=False, dtype="float32", batch=1):
    include_from = cuda_jit.INCLUDE_FROM
    if variant == "inline-headers":  # every CUDA kernel's header inline in its source, as before 2026-12-06
        cuda_jit.INCLUDE_FROM = None
    kernels._kernel.cache_clear()  # (kernels made afresh: a Kernel decides its header at its first launch)
    block_kernels._kernel.cache_clear()
    try:
        return _profile_ours(path, cases, gen, variant, device, gpu_clock, dtype, batch)
    finally:
        cuda_jit.INCLUDE_FROM = include_from


def _profile_ours(path, cases, gen, variant, device, gpu_clock, dtype, batch):
    from mlxinfer.backends.mlx import MLXBackend

    from ablations import FormedGraph, NoAttention, NormApart, PrefillMLXOps, SeparateWeights, SlicedColumns, SwigluApart, Unfused

    backend = {"separate": SeparateWeights, "no-attention": NoAttention, "unfused": Unfused,
               "swiglu-apart": SwigluApart, "norm-apart": NormApart, "prefill-mlx-ops": PrefillMLXOps,
               "sliced-columns": SlicedColumns, "formed-graph": FormedGraph}.get(variant, MLXBackend)
    engine = mlxinfer.Engine(path, backend(device=device, dtype=dtype))
    engine.tokenizer = dataclasses.replace(engine.tokenizer, eog_ids=frozenset())  # always `gen` tokens
    ops = engine.backend
    limits = kernels.SPLIT_MAX_ITEMS, kernels.SPLIT_MAX_SCRATCH, block_kernels.SWIGLU_FUSED_MAX_VALUES
    formed_compiled = block_kernels.FORMED_COMPILED
    short_rows = kernels.SHORT_MAX_ROWS
    if variant == "one-launch":
        kernels.SPLIT_MAX_ITEMS, kernels.SPLIT_MAX_SCRATCH = 0, 0
    if variant == "no-short":  # the split plan's two-launch form in two launches, as before attn_short
        kernels.SHORT_MAX_ROWS = 0
    if variant == "swiglu-fused":  # every down product in its SWIGLU form, whatever its shape
        block_kernels.SWIGLU_FUSED_MAX_VALUES = float("inf")
    if variant == "formed-launched":  # each formed kernel launched bare, not in mx.compile (block_kernels.FORMED_COMPILED)
        block_kernels.FORMED_COMPILED = False
    if variant == "pair-apart":  # a group's two runs of two types a launch each, as before the pair launch
        ops.pair_launch = False
    clock = Clock(gpu_clock)
    start, to_numpy, sync, launch, step = ops.start, ops.to_numpy, ops.sync, Loop._launch, Loop.step
    decode_step = engine.decode_step._step

    def timed_start(*xs):
        t = time.perf_counter()
        start(*xs, *clock.take_pending())
        clock.add("encode", time.perf_counter() - t)

    def stamped_decode_step(ops_, kind, batch_size, *config):  # (DecodeStep._step's arguments)
        step = decode_step(ops_, kind, batch_size, *config)
        return lambda ids, *rest: clock.around(ids, lambda: step(ids, *rest))

    def timed_to_numpy(x):
        t = time.perf_counter()
        out = to_numpy(x)
        clock.add("wait", time.perf_counter() - t)
        return out

    def timed_sync(*xs):
        t = time.perf_counter()
        sync(*xs)
        clock.add("wait", time.perf_counter() - t)

    def timed_launch(loop, plan):
        t = time.perf_counter()
        out = launch(loop, plan)
        clock.add("build", time.perf_counter() - t)
        return out

    def timed_step(loop):  # a row: this pass's build and encode, and the wait for the pass before
        out = step(loop)
        if out or "build" in clock.now:  # (a step that only started the pass built before the first
            clock.token()                # token was read: its encoding joins the next row)
        return out

    ops.start, ops.to_numpy, ops.sync = timed_start, timed_to_numpy, timed_sync
    Loop._launch, Loop.step = timed_launch, timed_step
    engine.decode_step._step = stamped_decode_step
    out = []
    try:
        for n in cases:
            ids = prompt_ids(n, engine.args.vocab_size)
            prompts = [prompt_ids(n, engine.args.vocab_size, seed=b) for b in range(batch)]
            # batch B: one generate_batch call, as `mlxinfer bench --batch B`; its first passes are
            # the prompts' (B * n rows, at most prefill_chunk a pass)
            prompt_passes = 1 if batch == 1 else -(-batch * n // engine.prefill_chunk)

            def run(max_tokens):
                if batch == 1:
                    return [engine.generate(ids, max_tokens=max_tokens)]
                return engine.generate_batch(prompts, max_tokens=max_tokens)

            run(8)  # warm-up: kernels compiled, the step traced
            times, rows, firsts, last_ttft, passes = [], [], [], [], []
            clock.stamps.clear()  # ours: decode passes only (the prompt's pass is not the compiled step)
            for _ in range(2):
                clock.per_token.clear()
                gens = run(gen)
                g = gens[0]
                last_ttft.append(gens[-1].metrics.time_to_first_token_ms)
                passes.append([{k: round(v * 1000, 3) for k, v in r.items()} for r in clock.per_token[:prompt_passes + 1]])
                times.append(g.metrics.token_intervals_ms)
                rows += clock.per_token[prompt_passes:]  # decode passes (the first are the prompts')
                # (a pass's read is timed into the next pass's row: the prompt's into the second)
                prompt, nxt = (clock.per_token + [{}, {}])[:2]
                firsts.append(dict(ttft=g.metrics.time_to_first_token_ms / 1000, prompt_encode=prompt.get("encode", 0.0),
                                   prompt_build=prompt.get("build", 0.0), next_encode=nxt.get("encode", 0.0),
                                   next_build=nxt.get("build", 0.0), wait=nxt.get("wait", 0.0)))
            intervals = [x for t in times for x in t]
            first = {f"{k}_ms": _median(firsts, k) for k in firsts[0]}
            out.append(dict(engine=f"mlxinfer ({variant})", dtype=dtype, prompt=n, batch=batch, gen=gen, tokens=len(rows), first_token=first,
                            interval_ms=round(statistics.median(intervals), 3), build_ms=_median(rows, "build"),
                            encode_ms=_median(rows, "encode"), wait_ms=_median(rows, "wait"), gpu_ms=clock.gpu_ms(),
                            decode_tok_s=round(1000 / statistics.fmean(intervals), 1),
                            tokens_ms=[[round(r.get(k, 0.0) * 1000, 2) for k in ("build", "encode", "wait")]
                                       for r in clock.per_token[prompt_passes:prompt_passes + 12]],
                            intervals_ms=[round(x, 2) for x in times[-1][:12]],
                            **({} if batch == 1 else dict(last_ttft_ms=[round(t, 2) for t in last_ttft], prompt_passes=passes))))
    finally:
        kernels.SPLIT_MAX_ITEMS, kernels.SPLIT_MAX_SCRATCH, block_kernels.SWIGLU_FUSED_MAX_VALUES = limits
        kernels.SHORT_MAX_ROWS = short_rows
        block_kernels.FORMED_COMPILED = formed_compiled
        Loop._launch, Loop.step = launch, step
        ops.start, ops.to_numpy, ops.sync = start, to_numpy, sync
    return out


def profile_mlx_lm(path, cases, gen, gpu_clock=False, dtype="float32"):
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    with tempfile.TemporaryDirectory() as tmp:
        model, _ = load_model(__import__("pathlib").Path(write_mlx_lm_model(path, tmp, dtype=dtype)))
    clock = Clock(gpu_clock)

    class Timed:
        """The model, its calls timed (graph building)."""

        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, *a, **k):
            t = time.perf_counter()
            out = clock.around(a[0], lambda: model(*a, **k))
            clock.add("build", time.perf_counter() - t)
            return out

    async_eval = mx.async_eval

    def timed_async_eval(*xs):
        t = time.perf_counter()
        async_eval(*xs, *clock.take_pending())
        clock.add("encode", time.perf_counter() - t)

    out = []
    for n in cases:
        ids = mx.array(prompt_ids(n, model.args.vocab_size))
        for _ in generate_step(ids, model, max_tokens=8):
            pass
        mx.async_eval = timed_async_eval
        try:
            intervals, rows, stamps, firsts = [], [], [], []
            for _ in range(2):
                clock.per_token.clear()
                clock.stamps.clear()
                t0 = time.perf_counter()
                for i, _ in enumerate(generate_step(ids, Timed(), max_tokens=gen)):
                    now = time.perf_counter()
                    clock.now["interval"] = now - t0
                    clock.token()
                    t0 = now
                    if i:
                        intervals.append(clock.per_token[-1]["interval"] * 1000)
                rows += clock.per_token[1:]
                stamps += clock.stamps[1:]  # its first model call is the prompt's
                f = clock.per_token[0]
                firsts.append(dict(ttft=f["interval"], build=f.get("build", 0.0), encode=f.get("encode", 0.0),
                                   rest=f["interval"] - f.get("build", 0.0) - f.get("encode", 0.0)))
        finally:
            mx.async_eval = async_eval
        clock.stamps = stamps
        for r in rows:
            r["wait"] = max(0.0, r["interval"] - r.get("build", 0.0) - r.get("encode", 0.0))
        first = {f"{k}_ms": _median(firsts, k) for k in firsts[0]}
        out.append(dict(engine=f"mlx-lm {mlx_lm.__version__}", dtype=dtype, prompt=n, gen=gen, tokens=len(rows),
                        first_token=first,
                        interval_ms=round(statistics.median(intervals), 3), build_ms=_median(rows, "build"),
                        encode_ms=_median(rows, "encode"), wait_ms=_median(rows, "wait"), gpu_ms=clock.gpu_ms(),
                        decode_tok_s=round(1000 / statistics.fmean(intervals), 1)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="17,511")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--engines", default="ours,mlx-lm")
    p.add_argument("--variants", default="default", help="ours: default, one-launch, no-short, separate, no-attention, unfused, swiglu-apart, swiglu-fused, norm-apart, prefill-mlx-ops, inline-headers, sliced-columns, pair-apart, formed-graph, formed-launched")
    p.add_argument("--model", default="qwen3-0.6b-synthetic", help="as mlxinfer bench's --model")
    p.add_argument("--device", default="gpu", help="gpu, or cpu to try the script without one")
    p.add_argument("--gpu-clock", action="store_true", help="add gpu_ms (CUDA; one CUDA graph per evaluation)")
    p.add_argument("--dtypes", default="float32", help="ours' --dtype and mlx-lm's, a row each")
    p.add_argument("--batch", type=int, default=1, help="ours: B sequences of each prompt length in one "
                   "generate_batch call (the rows: its decode passes; first_token: the first sequence's)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.device == "gpu" and not (mx.cuda.is_available() or mx.metal.is_available()):
        sys.exit("step_profile: needs an MLX GPU (CUDA or Metal), or --device cpu")
    if a.gpu_clock and not (a.device == "gpu" and mx.cuda.is_available()):
        sys.exit("step_profile: --gpu-clock needs MLX's CUDA backend")
    mx.set_default_device(mx.gpu if a.device == "gpu" else mx.cpu)
    path = model_path(a.model)
    env = {k: os.environ.get(k) for k in ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER", "MLX_USE_CUDA_GRAPHS")}
    cases = [int(x) for x in a.cases.split(",")]
    for dtype in a.dtypes.split(","):
        for engine in a.engines.split(","):
            for v in (a.variants.split(",") if engine == "ours" else [None]):
                rows = (profile_ours(path, cases, a.gen, v, a.device, a.gpu_clock, dtype, a.batch) if engine == "ours"
                        else profile_mlx_lm(path, cases, a.gen, a.gpu_clock, dtype))
                for row in rows:
                    row.update({k: v for k, v in env.items() if v is not None})
                    emit(row, a.out)

if __name__ == "__main__":
    main()
