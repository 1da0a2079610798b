"""Prefill benchmark: time to first token and peak memory for long prompts (the core-v2 CPU targets).

    python3 bench/prefill.py                                   # SmolLM2, cpu backend, 500..8000 tokens
    python3 bench/prefill.py --cases 500,1000 --prefill-chunk 256 --kv basic
    python3 bench/prefill.py --mlxinfer /tmp/before --cases 500,1000,2000   # another checkout's engine

Each case is one prompt of N token ids (`bench/peers.py`'s `prompt_ids`, below the control tokens) and
one generated token, run in a fresh child process so that its peak memory is that case's alone:
- TTFT: the engine's time to first token (the whole prefill, chunk by chunk, plus picking the token);
- prefill tok/s: N / TTFT;
- peak RSS: the child's peak resident set over its whole life (ru_maxrss: model load included);
  load RSS: its peak when the model was loaded, before any prompt; prefill peak: the peak during the
  measured generate call alone (the high-water mark is reset through /proc/self/clear_refs just before
  it; absent where Linux does not allow the reset), and RSS before: the resident set at that moment,
  so prefill peak - RSS before is what the prefill added.
Before the measured call the child runs a short warm-up (--warmup-tokens). With --runs > 1 the
measured call repeats in the same child (TTFT: median, min, max; peaks: over all runs).
Prints a header (machine, versions, load average) once, a JSON line per case (also written to --out),
then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_CASES = "500,1000,2000,4000,8000"


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(spec: dict) -> dict:
    """One case, in this (fresh) process: load, warm up, prefill N tokens + 1 generated token."""
    sys.path.insert(0, spec["mlxinfer"])
    sys.path.insert(1, HERE)
    import mlxinfer
    from peers import prompt_ids

    kwargs = dict(backend=spec["backend"], attention=spec["attention"])
    if spec.get("device"):
        kwargs["device"] = spec["device"]
    if spec.get("kv"):  # the previous design's load() has neither option
        kwargs["kv"] = spec["kv"]
    if spec.get("prefill_chunk"):
        kwargs["prefill_chunk"] = spec["prefill_chunk"]
    import inspect

    if spec["backend"] == "cpu" and spec.get("threads") and "threads" in inspect.signature(mlxinfer.load).parameters:
        kwargs["threads"] = spec["threads"]  # (older load() has no threads: numpy's BLAS default, all cores)
    t0 = time.perf_counter()
    engine = mlxinfer.load(spec["model"], **kwargs)
    load_s = time.perf_counter() - t0
    load_rss = _status_kb("VmHWM") / 1024
    n = spec["n"]
    ids = prompt_ids(n, engine.args.vocab_size)
    if spec["warmup_tokens"] > 0:
        engine.generate(prompt_ids(spec["warmup_tokens"], engine.args.vocab_size), max_tokens=1)
    rss_before = _status_kb("VmRSS") / 1024
    reset = _reset_hwm()
    mlx_peak = None
    if engine.backend.name == "mlx":
        import mlx.core as mx

        mx.reset_peak_memory()
    ttft, wall = [], []
    for _ in range(spec["runs"]):
        t0 = time.perf_counter()
        g = engine.generate(ids, max_tokens=1)
        wall.append(time.perf_counter() - t0)
        ttft.append(g.metrics.time_to_first_token_ms)
    if engine.backend.name == "mlx":
        mlx_peak = mx.get_peak_memory() / (1024 * 1024)
    m = g.metrics
    med = statistics.median(ttft)
    return dict(
        prompt_tokens=n, generated=len(g.token_ids), runs=spec["runs"],
        backend=engine.backend.describe() if hasattr(engine.backend, "describe") else engine.backend.name,
        attention=m.attention, kv_cache=m.kv_cache, prefill_chunk=getattr(m, "prefill_chunk", None),
        time_to_first_token_ms=med, time_to_first_token_ms_min=min(ttft), time_to_first_token_ms_max=max(ttft),
        prefill_tokens_per_second=1000.0 * n / med, wall_s=statistics.median(wall),
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        load_rss_mb=load_rss, rss_before_mb=rss_before,
        prefill_peak_rss_mb=_status_kb("VmHWM") / 1024 if reset else None,
        mlx_peak_memory_mb=mlx_peak, load_s=load_s,
        mlxinfer=os.path.dirname(os.path.abspath(mlxinfer.__file__)), blas_threads=_blas_threads() if spec["backend"] == "cpu" else None,
        openblas_thread_timeout=os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
    )


def _blas_threads():
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    return [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"] or None


def header(spec: dict) -> dict:
    import numpy as np

    def git(*args):
        try:
            return subprocess.run(["git", "-C", spec["mlxinfer"], *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    try:
        import mlx.core as mx

        mlx_v = f"mlx {mx.__version__}"
    except ImportError:
        mlx_v = "mlx not installed"
    dirty = git("status", "--porcelain", "--untracked-files=no", "mlxinfer")
    return dict(
        kind="header",
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=f"{platform.platform()}, {platform.machine()}, {os.cpu_count()} cpus",
        versions=f"python {platform.python_version()}, numpy {np.__version__}, {mlx_v}",
        mlxinfer=spec["mlxinfer"],
        commit=git("rev-parse", "--short", "HEAD") + (" + uncommitted changes under mlxinfer/" if dirty else ""),
        model=spec["model"],
        load_average="{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()),
        command="python3 bench/prefill.py " + " ".join(sys.argv[1:]),
    )


def fmt_table(rows) -> str:
    cols = ["prompt", "chunk", "kv", "BLAS threads", "TTFT ms", "prefill tok/s", "peak RSS MiB", "load RSS MiB",
            "prefill peak - RSS before MiB", "load avg"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['prompt_tokens']} | | | | failed: {r['error']} | | | | | |")
            continue
        ttft = f"{r['time_to_first_token_ms']:.0f}"
        if r["runs"] > 1:
            ttft += f" [{r['time_to_first_token_ms_min']:.0f}-{r['time_to_first_token_ms_max']:.0f}]"
        added = (f"{r['prefill_peak_rss_mb'] - r['rss_before_mb']:.0f}" if r.get("prefill_peak_rss_mb") is not None
                 else "-")
        lines.append("| " + " | ".join([
            str(r["prompt_tokens"]), str(r.get("prefill_chunk") or "-"), r["kv_cache"],
            ",".join(map(str, r.get("blas_threads") or [])) or "-", ttft,
            f"{r['prefill_tokens_per_second']:.1f}", f"{r['peak_rss_mb']:.0f}", f"{r['load_rss_mb']:.0f}", added,
            str(r.get("load_average_1min", "")),
        ]) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated prompt lengths, one child process "
                                                          "each (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill pass (default: the engine's, 512)")
    p.add_argument("--kv", default=None, help="KV cache: prealloc or basic (default: the engine's, prealloc)")
    p.add_argument("--backend", default="cpu", help="cpu or mlx (default: %(default)s)")
    p.add_argument("--attention", default="fused", help="fused or per-head (default: %(default)s)")
    p.add_argument("--device", default=None, help="MLX device, cpu or gpu (default: the backend's)")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="the cpu backend's BLAS threads, load(threads=...) where load() has it (default: the CPU "
                        "count, %(default)s; the engine's own default follows the load average)")
    p.add_argument("--model", default=None, help="GGUF path (default: the default model, SmolLM2-135M-Instruct)")
    p.add_argument("--runs", type=int, default=1, help="measured calls per case, in the same child "
                                                       "(default: %(default)s)")
    p.add_argument("--warmup-tokens", type=int, default=16,
                   help="prompt tokens of the warm-up call before the measured one; 0: none (default: %(default)s)")
    p.add_argument("--mlxinfer", default=REPO,
                   help="checkout whose mlxinfer package the children import, e.g. a worktree of an older "
                        "commit (its load() may lack --kv and --prefill-chunk) (default: this one)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per case before the child is stopped "
                                                               "(default: %(default)s)")
    p.add_argument("--out", default=os.path.join(HERE, "out", "prefill.jsonl"),
                   help="JSON lines file, header line first (default: bench/out/prefill.jsonl)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))), flush=True)
        return
    if a.model is None:
        sys.path.insert(0, REPO)
        from mlxinfer.model_source import default_model_path

        a.model = str(default_model_path())
    spec = dict(model=a.model, backend=a.backend, attention=a.attention, device=a.device, kv=a.kv, threads=a.threads,
                prefill_chunk=a.prefill_chunk, runs=a.runs, warmup_tokens=a.warmup_tokens,
                mlxinfer=os.path.abspath(a.mlxinfer))
    head = header(spec)
    print("\n".join(f"{k}: {v}" for k, v in head.items() if k != "kind") + "\n", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    rows = []
    with open(a.out, "w") as log:
        print(json.dumps(head), file=log, flush=True)
        for n in [int(x) for x in a.cases.split(",") if x]:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(dict(spec, n=n))]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
                got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
                if r.returncode or not got:
                    why = (f"signal {-r.returncode}" if r.returncode < 0
                           else (r.stderr.strip().splitlines() or ["no output"])[-1])
                    row = dict(prompt_tokens=n, error=why)
                else:
                    row = got[-1]
            except subprocess.TimeoutExpired:
                row = dict(prompt_tokens=n, error=f"timed out after {a.timeout:.0f} s")
            row.update(kind="prefill", load_average_1min=round(os.getloadavg()[0], 2),
                       finished_at=time.strftime("%H:%M:%S UTC", time.gmtime()))
            rows.append(row)
            print(json.dumps(row), flush=True)
            print(json.dumps(row), file=log, flush=True)
    print("\n" + fmt_table(rows))
    print("\nload average at end (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
