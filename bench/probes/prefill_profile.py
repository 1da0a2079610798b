"""Where the time to the first token goes (issue 30): each prompt length and dtype, the first token's
wall time untraced (median of `--runs`), then one traced run: the tracing backend evaluates every op as
it is called, so each op's share of the prefill is real (the traced total is longer: no pipelining,
one synchronisation an op). `fused_attention` is one op however the override runs it.

    python3 bench/probes/prefill_profile.py --cases 511,8191 --dtypes float32,bfloat16 [--chunk 512] [--out F]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time

import mlxinfer
from mlxinfer.benchmark import model_path
from mlxinfer.peers import prompt_ids
from mlxinfer.tracing import install_tracer

from jsonl import emit


def first_token_ms(engine, ids) -> float:
    t0 = time.perf_counter()
    engine.generate(ids, max_tokens=1)
    return (time.perf_counter() - t0) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen3-0.6b-synthetic")
    ap.add_argument("--cases", default="511,8191")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--device", default="gpu")
    ap.add_argument("--out")
    args = ap.parse_args()
    path = model_path(args.model)
    for dtype in args.dtypes.split(","):
        engine = mlxinfer.load(path, backend="mlx", device=args.device, dtype=dtype, prefill_chunk=args.chunk)
        vocab = engine.args.vocab_size
        for n in (int(c) for c in args.cases.split(",")):
            ids = prompt_ids(n, vocab)
            first_token_ms(engine, ids)  # warm: every kernel form this length launches
            wall = [first_token_ms(engine, ids) for _ in range(args.runs)]
            backend = engine.backend
            tracer = install_tracer(engine, io.StringIO())
            t0 = time.perf_counter()
            engine.generate(ids, max_tokens=1, on_forward=tracer.end_pass)
            traced = (time.perf_counter() - t0) * 1000
            engine.backend = backend
            ops = sorted(((op, tracer.run_counts[op], tracer.run_times[op] * 1000) for op in tracer.run_counts),
                         key=lambda r: -r[2])
            emit({"model": args.model, "dtype": dtype, "prompt": n, "chunk": engine.prefill_chunk,
                  "first_token_ms": statistics.median(wall), "first_token_ms_runs": wall, "traced_ms": traced,
                  "ops": {op: {"calls": c, "ms": round(ms, 3)} for op, c, ms in ops}}, args.out)
            print(f"# {dtype} {n}: first token {statistics.median(wall):.1f} ms; traced {traced:.0f} ms: "
                  + ", ".join(f"{op} {ms:.1f} ({c})" for op, c, ms in ops[:8]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
