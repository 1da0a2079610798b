"""Benchmark: backends x attention paths x KV caches x batch sizes x prompt lengths (x peer engines).

    python3 bench/bench.py                         # synthetic Qwen3-0.6B-shaped Q8_0 (made if absent)
    python3 bench/bench.py --model smollm2         # SmolLM2-135M-Instruct Q4_1 (the default model)
    python3 bench/bench.py --model smollm2 --backends cpu --kv basic,prealloc --batch 1,8 --cases 17,511
    python3 bench/bench.py --model path.gguf --backends cpu,mlx --sweep 16,128,512,1024,2048

Cases: the book chapter's two, a short prompt (17 tokens) and a long one (511 tokens), --gen tokens
generated, plus an optional sweep of context lengths (decode tokens/s vs tokens in the cache).

Rows: one per backend/device, attention path, KV cache (--kv), batch size (--batch) and prompt length.
Batch 1 is `engine.generate` on one prompt; batch B is one `engine.generate_batch` call on B different
prompts of the case's length, computed together. Every run reports:
- TTFT: time to first token (batch B: the mean over the B sequences);
- decode tok/s: per sequence, tokens after the first over the time from the first to the last token
  (batch B: the mean over the sequences; each sequence gets one token per batched pass);
- total tok/s: every generated token of the call over the call's whole wall time (prefill included);
- peak MiB: the cpu backend's peak RSS during the run (the process's high-water mark is reset before
  each run through /proc/self/clear_refs where Linux allows it, else it is the process's peak so far:
  see `peak_memory_scope`; `memory_before_mb` is the RSS at the reset: the loaded model), MLX's peak
  allocation for MLX rows (reset before each run; `memory_before_mb`: MLX's active memory then).
Every row runs in a fresh child process (load, one warm-up, --runs runs), so that no row inherits the
heap of another; the row is the median of its runs, with the min and max over the runs beside it
(a row whose min-max range overlaps another's is not a difference). Writes a Markdown table to stdout
and to OUT/results.md, JSON lines to OUT/results.jsonl (a "header" line, then one dict per row, written
as measured) and, with a sweep and matplotlib installed, OUT/decode_vs_context.png.

Peers, when installed: llama.cpp through llama-cpp-python on the same GGUF, same thread count, and
mlx-lm on the same weights (see bench/peers.py). Their rows sit in the same table (batch 1; mlx-lm also at the --batch sizes, through its BatchGenerator).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import mlxinfer  # noqa: E402  (before numpy: it sets OpenBLAS's thread timeout, as for CLI users)
import numpy as np  # noqa: E402
from mlxinfer.backends import mlx_gpu_available  # noqa: E402
from mlxinfer.kv_cache import KV_CACHES  # noqa: E402
from mlxinfer.synthetic import SyntheticSpec, write_synthetic_model  # noqa: E402
from peers import prompt_ids, run_peers, summarize  # noqa: E402

QWEN3_06B = SyntheticSpec(arch="qwen3", n_layers=28, hidden=1024, ffn=3072, n_heads=16, n_kv_heads=8,
                          head_dim=128, vocab_size=151936, context_length=40960, tied_output=True,
                          qtype="Q8_0", seed=0)


def resolve(model: str, cache: str) -> str:
    if model == "qwen3-0.6b-synthetic":
        path = os.path.join(cache, "qwen3-0.6b-synthetic-q8_0.gguf")
        if not os.path.exists(path):
            os.makedirs(cache, exist_ok=True)
            print(f"writing {path} (Qwen3-0.6B shapes, random Q8_0 weights)...", file=sys.stderr)
            write_synthetic_model(path + ".tmp", QWEN3_06B)
            os.replace(path + ".tmp", path)
        return path
    if model == "smollm2":
        from mlxinfer.model_source import default_model_path

        return str(default_model_path())
    return model


def reset_peak_memory(engine) -> tuple[str, float]:
    """Reset the peak-memory counter the backend reports; returns the scope of the next reading,
    "run" (reset worked) or "process" (the process's peak so far), and the memory in use now (MiB)."""
    if engine.backend.name == "mlx":
        import mlx.core as mx

        mx.reset_peak_memory()
        return "run", mx.get_active_memory() / (1024 * 1024)
    rss = 0.0
    try:
        with open("/proc/self/status") as f:
            rss = next((int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:")), 0.0)
        with open("/proc/self/clear_refs", "w") as f:  # Linux: "5" resets the RSS high-water mark
            f.write("5")  # (VmHWM, and with it ru_maxrss)
        return "run", rss
    except OSError:
        return "process", rss


def one_run(engine, prompts, n_gen, sync: bool) -> dict:
    """One generate (one prompt) or generate_batch (several) call, as a per-run dict."""
    on_forward = (lambda name: None) if sync else None  # the engine pipelines only without on_forward
    scope, before = reset_peak_memory(engine)
    t0 = time.perf_counter()
    if len(prompts) == 1:
        gens = [engine.generate(prompts[0], max_tokens=n_gen, on_forward=on_forward)]
    else:
        gens = engine.generate_batch(prompts, max_tokens=n_gen, on_forward=on_forward)
    wall = time.perf_counter() - t0
    ms = [g.metrics for g in gens]
    generated = [m.generated_tokens for m in ms]
    decode = [m.decode_tokens_per_second for m in ms]
    return dict(
        kv_cache=ms[0].kv_cache, batch_size=len(gens), prefill_chunk=ms[0].prefill_chunk,
        generated=statistics.median(generated), generated_min=min(generated), generated_total=sum(generated),
        finish_reasons=sorted({g.finish_reason for g in gens}),
        time_to_first_token_ms=statistics.fmean(m.time_to_first_token_ms for m in ms),
        prompt_tokens_per_second=statistics.fmean(m.prompt_tokens_per_second for m in ms),
        decode_tokens_per_second=statistics.fmean(decode),
        aggregate_decode_tokens_per_second=sum(decode),
        total_tokens_per_second=sum(generated) / wall,
        wall_s=wall,
        peak_memory_mb=engine.backend.peak_memory_mb(), peak_memory_scope=scope, memory_before_mb=before,
        intervals=[x for m in ms for x in m.token_intervals_ms],
    )


def run_case(engine, n_prompt: int, n_gen: int, runs: int, batch: int = 1, sync: bool = False,
             warmup_tokens: int = 0) -> dict:
    vocab = engine.args.vocab_size
    prompts = [prompt_ids(n_prompt, vocab, seed=b) for b in range(batch)]  # batch 1: the old bench's prompt
    w = n_prompt if warmup_tokens <= 0 else min(warmup_tokens, n_prompt)
    one_run(engine, [p[:w] for p in prompts], min(4, n_gen), sync)  # warm-up: allocations, kernel compilation
    row = summarize([one_run(engine, prompts, n_gen, sync) for _ in range(runs)])
    row.update(prompt_tokens=n_prompt, max_tokens=n_gen, warmup_prompt_tokens=w)
    return row


def measure_row(job: dict) -> dict:
    """One row, in this process (a fresh child of the benchmark): load the engine, warm up, run."""
    t0 = time.perf_counter()
    on_cpu = job["backend"] == "cpu" or job["device"] == "cpu"  # the cpu backend's BLAS threads, MLX CPU's threads
    threads = dict(threads=job["threads"]) if on_cpu and job.get("threads") else {}
    engine = mlxinfer.load(job["model"], backend=job["backend"], attention=job["attention"], device=job["device"],
                           kv=job["kv"], prefill_chunk=job["prefill_chunk"], **threads)
    load_s = time.perf_counter() - t0
    engine.compile_decode = os.environ.get("MLXINFER_BENCH_COMPILE", "1") != "0"  # 0: decode eagerly
    row = run_case(engine, job["n"], job["gen"], job["runs"], job["batch"], job["sync"], job["warmup_tokens"])
    name = f"mlxinfer {job['backend']}" + (" (sync)" if job["sync"] else "")
    row.update(engine=name, device=job["device"], attention=job["attention"], backend=engine.backend.describe(),
               load_s=load_s, kind=job["kind"],
               compiled_decode=engine.compile_decode and engine.backend.compiles_decode, blas_threads=blas_threads() if job["backend"] == "cpu" else None,
               openblas_thread_timeout=os.environ.get("OPENBLAS_THREAD_TIMEOUT"))
    return row


def blas_threads():
    """The BLAS thread counts numpy runs with in this process (threadpoolctl), or None."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    return [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"] or None


def run_row_process(job: dict) -> dict:
    """Each row in a fresh process, so that its peak memory is its own (no heap left by an earlier row or
    engine) and a crash costs one row."""
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--row", json.dumps(job)], stdout=subprocess.PIPE,
                       text=True)
    got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode == 0 and got:
        row = got[-1]
        print(f"  {row['engine']} {row.get('device') or '-'} {row['attention']} kv={row['kv_cache']} "
              f"batch={row['batch_size']} prompt={row['prompt_tokens']}: TTFT "
              f"{spread(row, 'time_to_first_token_ms', '.1f')} ms, decode "
              f"{spread(row, 'decode_tokens_per_second', '.2f')} tok/s/seq, total "
              f"{spread(row, 'total_tokens_per_second', '.2f')} tok/s, peak {row['peak_memory_mb']:.0f} MiB",
              file=sys.stderr, flush=True)
        return row
    why = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
    print(f"  row {job} failed ({why})", file=sys.stderr, flush=True)
    return dict(engine=f"mlxinfer {job['backend']}", device=job["device"], attention=job["attention"],
                kv_cache=job["kv"], batch_size=job["batch"], prompt_tokens=job["n"], kind=job["kind"],
                error=why)


def configs(backends, attentions, devices):
    for b in backends:
        if b == "mlx":
            available = ["gpu", "cpu"] if mlx_gpu_available() else ["cpu"]
            for dev in [d for d in available if d in devices]:
                for a in attentions:
                    yield b, dev, a
        else:
            for a in attentions:
                yield b, None, a


def source_digest() -> str:
    """sha256 (12 hex digits) of the engine's sources (mlxinfer/**/*.py, metal_kernels/*), file names
    and contents in name order: identifies the code a result came from whatever the git metadata says."""
    import hashlib

    root = os.path.dirname(HERE)
    h = hashlib.sha256()
    for top in ("mlxinfer", "metal_kernels"):
        for d, dirs, files in sorted(os.walk(os.path.join(root, top))):
            dirs.sort()
            for f in sorted(files):
                if f.endswith((".py", ".cu", ".metal")):
                    path = os.path.join(d, f)
                    h.update(os.path.relpath(path, root).encode() + b"\0")
                    with open(path, "rb") as fh:
                        h.update(fh.read())
    return h.hexdigest()[:12]


def machine() -> dict:
    from importlib.metadata import version

    try:
        import mlx.core as mx

        mlx_v = f"mlx {mx.__version__}, default device {mx.default_device()}"
    except ImportError:
        mlx_v = "mlx not installed"
    gpu = ""
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    def git(*args):
        try:
            return subprocess.run(["git", "-C", os.path.dirname(HERE), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = git("status", "--porcelain", "--untracked-files=no", "mlxinfer")
    commit = git("rev-parse", "--short", "HEAD") + (" + uncommitted changes under mlxinfer/" if dirty else "")
    if os.environ.get("MLXINFER_COMMIT"):  # a copied tree whose git metadata is not its own (a lent GPU)
        commit = f"{os.environ['MLXINFER_COMMIT']} (given; the copy's git says {commit})"
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        commit=commit, source=source_digest(),
        machine=f"{platform.platform()}, {platform.machine()}, {os.cpu_count()} cpus" + (f", GPU {gpu}" if gpu else ""),
        versions=f"python {platform.python_version()}, numpy {np.__version__}, {mlx_v}, gguf {version('gguf')}, "
                 f"mlxinfer {mlxinfer.__version__}",
        load_average="{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()),
    )


def header(info: dict, model_path: str, argv: list[str]) -> str:
    return (f"date: {info['date']}\nmachine: {info['machine']}\n{info['versions']}\n"
            f"mlxinfer commit: {info['commit']} ({os.path.dirname(HERE)}); sources {info['source']}\n"
            f"load average at start (1, 5, 15 min): {info['load_average']}\n"
            f"model: {model_path}\ncommand: python3 bench/bench.py {' '.join(argv)}\n")


def spread(r, key, fmt) -> str:
    """"median [min-max]", or just the median for one run."""
    if key + "_min" not in r or r.get("runs", 1) < 2:
        return format(r[key], fmt)
    return f"{format(r[key], fmt)} [{format(r[key + '_min'], fmt)}-{format(r[key + '_max'], fmt)}]"


def fmt_table(rows) -> str:
    rounds = any(r.get("round", 1) > 1 for r in rows)
    cols = (["round"] if rounds else []) + [
        "engine", "device", "attention", "kv", "batch", "prompt", "gen", "TTFT ms", "decode tok/s/seq", "total tok/s",
        "interval ms min/mean/max", "peak MiB", "fused/per-head"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        first = f"{r.get('round', 1)} | " if rounds else ""
        if "error" in r:
            lines.append(f"| {first}{r['engine']} | {r.get('device') or '-'} | {r['attention']} | {r['kv_cache']} | "
                         f"{r['batch_size']} | {r['prompt_tokens']} | failed: {r['error']} |" + " |" * 6)
            continue
        gen = f"{r['generated']:g}" + (f" (min {r['generated_min']:g})" if r.get("generated_min", r["generated"])
                                        != r["generated"] else "")
        lines.append("| " + first + " | ".join([
            r["engine"], r.get("device") or "-", r["attention"], r.get("kv_cache", "-"), str(r.get("batch_size", 1)),
            str(r["prompt_tokens"]), gen,
            spread(r, "time_to_first_token_ms", ".1f"), spread(r, "decode_tokens_per_second", ".2f"),
            spread(r, "total_tokens_per_second", ".2f"),
            f"{r['token_interval_ms_min']:.1f}/{r['token_interval_ms_mean']:.1f}/{r['token_interval_ms_max']:.1f}",
            f"{r['peak_memory_mb']:.0f}" + ("" if r.get("peak_memory_scope", "run") == "run" else "*"),
            r.get("ratio", ""),
        ]) + " |")
    if any(r.get("peak_memory_scope") == "process" for r in rows):
        lines.append("\n*: the process's peak so far (the high-water mark could not be reset)")
    return "\n".join(lines)


def row_key(r, attention=None):
    return (r.get("round", 1), r["engine"], r.get("device"), r.get("kv_cache"), r.get("batch_size", 1), r["prompt_tokens"],
            attention or r["attention"])


def add_ratios(rows):
    rows = [r for r in rows if "error" not in r]
    by = {row_key(r): r for r in rows}
    for r in rows:
        if r["attention"] == "fused":
            ph = by.get(row_key(r, "per-head"))
            if ph and ph["decode_tokens_per_second"] > 0:
                r["ratio"] = f"{r['decode_tokens_per_second'] / ph['decode_tokens_per_second']:.2f}x"


def plot(sweep_rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install 'mlxinfer[bench]')", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    for r in [r for r in sweep_rows if "error" not in r]:
        label = (f"{r['engine']}{'/' + r['device'] if r.get('device') else ''} {r['attention']} "
                 f"{r.get('kv_cache', '')}{' B=' + str(r['batch_size']) if r.get('batch_size', 1) > 1 else ''}")
        med = r["decode_tokens_per_second"]
        lo, hi = r.get("decode_tokens_per_second_min", med), r.get("decode_tokens_per_second_max", med)
        series.setdefault(label, {}).setdefault(r["prompt_tokens"], []).append((med, lo, hi))
    for label, by_x in series.items():  # the median (over --rounds, their medians'), a bar from the slowest run to the fastest
        pts = sorted((x, statistics.median(m for m, _, _ in v), min(lo for _, lo, _ in v), max(hi for _, _, hi in v))
                     for x, v in by_x.items())
        x, med = [p[0] for p in pts], [p[1] for p in pts]
        ax.errorbar(x, med, yerr=[[m - p[2] for m, p in zip(med, pts)], [p[3] - m for m, p in zip(med, pts)]],
                    marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the KV cache (prompt length)")
    ax.set_ylabel("decode tokens/s (per sequence)")
    ax.set_title("decode speed vs context")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


def utc_now() -> str:
    """The time of day in UTC, as rows record when they finished."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S UTC")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b-synthetic",
                   help="qwen3-0.6b-synthetic (made under --cache if absent), smollm2 (the default model) or a "
                        "GGUF path (default: %(default)s)")
    p.add_argument("--backends", default="cpu,mlx", help="comma-separated backends: cpu, mlx (default: %(default)s)")
    p.add_argument("--attention", default="per-head,fused",
                   help="comma-separated attention paths: per-head, fused (default: %(default)s)")
    p.add_argument("--kv", default="prealloc",
                   help=f"comma-separated KV caches, one set of rows each: {', '.join(KV_CACHES)} "
                        "(default: %(default)s)")
    p.add_argument("--batch", default="1",
                   help="comma-separated batch sizes: 1 is engine.generate on one prompt, B > 1 one "
                        "engine.generate_batch call on B prompts of the case's length (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill pass (load(prefill_chunk=...); default: the engine's, 512)")
    p.add_argument("--cases", default="17,511", help="prompt lengths of the main cases (default: %(default)s)")
    p.add_argument("--gen", type=int, default=64, help="tokens generated per sequence in the main cases "
                                                       "(default: %(default)s)")
    p.add_argument("--sweep", default="", help="prompt lengths for the decode-vs-context sweep, e.g. 16,128,1024 "
                                               "(default: none)")
    p.add_argument("--sweep-gen", type=int, default=16, help="tokens generated per sweep point "
                                                             "(default: %(default)s)")
    p.add_argument("--runs", type=int, default=3, help="measured runs per row, after one warm-up; the row is "
                                                       "their median, with min and max (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every row, ours and the peers', this many times, alternating which engine goes "
                        "first (ours, peers; peers, ours; ...): on a machine whose speed drifts over minutes each "
                        "round compares engines measured minutes apart at most; the ratios are given per round "
                        "with their median (default: %(default)s)")
    p.add_argument("--warmup-tokens", type=int, default=0,
                   help="prompt tokens of the warm-up run (0: the case's whole prompt; a short warm-up saves "
                        "minutes where prefill is slow, e.g. MLX on a CPU) (default: %(default)s)")
    p.add_argument("--devices", default="gpu,cpu", help="MLX devices to run, where available (default: %(default)s)")
    p.add_argument("--sync", action="store_true",
                   help="also run MLX rows without pipelined decoding (each pass read before the next is built)")
    p.add_argument("--peers", default="llama.cpp,mlx-lm",
                   help="peer engines, comma-separated (llama.cpp, mlx-lm), or 'none' (default: %(default)s)")
    p.add_argument("--replot", default=None, help="only redraw the plot from a results.jsonl")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="BLAS threads of the cpu backend and threads of MLX's CPU device (load(threads=...)), "
                        "and threads of the llama.cpp peer "
                        "(default: the CPU count, %(default)s; the engine's own default follows the load average "
                        "at load time, which would make a row depend on what ran just before it)")
    p.add_argument("--out", default=os.path.join(HERE, "out"),
                   help="output folder for results.md, results.jsonl and the plot (default: bench/out)")
    p.add_argument("--cache", default=os.path.join(HERE, "models"),
                   help="folder for the synthetic model (default: bench/models)")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # internal: measure one row (a child)
    a = p.parse_args(argv)
    if a.row:
        print(json.dumps(measure_row(json.loads(a.row))), flush=True)
        return
    os.makedirs(a.out, exist_ok=True)
    if a.replot:
        with open(a.replot) as f:
            plot([r for r in map(json.loads, f) if r.get("kind") == "sweep"], os.path.join(a.out, "decode_vs_context.png"))
        return
    kvs = [k for k in a.kv.split(",") if k]
    unknown = [k for k in kvs if k not in KV_CACHES]
    if unknown:
        p.error(f"unknown KV cache {unknown[0]!r} (choose from {', '.join(KV_CACHES)})")
    batches = ints(a.batch)
    if not batches or min(batches) < 1:
        p.error("--batch needs positive batch sizes")
    if a.rounds < 1:
        p.error("--rounds needs at least 1")
    path = resolve(a.model, a.cache)
    info = machine()
    head = header(info, path, argv)
    print(head, flush=True)
    rows, sweep_rows = [], []
    log = open(os.path.join(a.out, "results.jsonl"), "w")
    print(json.dumps(dict(kind="header", model=path, command="python3 bench/bench.py " + " ".join(argv), **info)),
          file=log, flush=True)
    cases, sweep = ints(a.cases), ints(a.sweep)
    jobs = []
    for backend, device, attention in configs(a.backends.split(","), a.attention.split(","), a.devices.split(",")):
        for kv in kvs:
            for sync in ([False, True] if a.sync and backend == "mlx" else [False]):
                spec = dict(model=path, backend=backend, device=device, attention=attention, kv=kv,
                            prefill_chunk=a.prefill_chunk, runs=a.runs, sync=sync, warmup_tokens=a.warmup_tokens,
                            threads=a.threads)
                jobs += [dict(spec, kind="case", batch=b, n=n, gen=a.gen) for b in batches for n in cases]
                jobs += [dict(spec, kind="sweep", batch=1, n=n, gen=a.sweep_gen) for n in sweep]
    peers = [x for x in a.peers.split(",") if x and x != "none"]
    peer_rows, peer_notes = [], []

    def ours(rnd):
        for job in jobs:
            row = run_row_process(job)
            row.update(round=rnd, load_average_1min=round(os.getloadavg()[0], 2), finished_at=utc_now())
            (rows if job["kind"] == "case" else sweep_rows).append(row)
            print(json.dumps(row), file=log, flush=True)

    def theirs(rnd):
        got, notes = run_peers(peers, path, cases, a.gen, a.runs, a.threads, batches)
        for r in got:
            r.update(round=rnd, finished_at=utc_now())
        peer_rows.extend(got)
        peer_notes.extend(n for n in notes if n not in peer_notes)

    for rnd in range(1, a.rounds + 1):  # rounds alternate which engine goes first: ours, peers; peers, ours; ...
        for part in ((ours, theirs) if rnd % 2 else (theirs, ours)):
            part(rnd)
    rows += peer_rows
    rows.sort(key=lambda r: r.get("round", 1))  # stable: by round, ours before the peers in each
    add_ratios(rows)
    add_ratios(sweep_rows)
    text = fmt_table(rows)
    if peer_rows:
        text += "\n\n" + peer_ratios(rows)
    if peer_notes:
        text += "\n\n" + "\n".join(peer_notes)
    if sweep_rows:
        text += "\n\ndecode tokens/s vs context (" + str(a.sweep_gen) + " generated):\n\n" + fmt_table(sweep_rows)
    text += "\n\nload average at end (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    print(text)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(head + "\n" + text + "\n")
    for r in peer_rows:
        print(json.dumps(r), file=log, flush=True)
    log.close()
    if sweep_rows:
        plot(sweep_rows, os.path.join(a.out, "decode_vs_context.png"))


def peer_ratios(rows) -> str:
    """Ours / peer at the same prompt, batch size and round: decode tokens/s per sequence at batch 1,
    total generated tokens/s (whole call, prefill included) at batch B > 1; with several rounds, each
    round's ratio and then their median."""
    out = ["ours / peer, decode tokens/s per sequence (batch 1) and total tokens/s (batch B > 1):"]
    ours = [r for r in rows if r["engine"].startswith("mlxinfer") and "error" not in r]
    peers = [r for r in rows if not r["engine"].startswith("mlxinfer")]
    rounds = {}
    for p in peers:
        b = p.get("batch_size", 1)
        key = "decode_tokens_per_second" if b == 1 else "total_tokens_per_second"
        for o in ours:
            if (o["prompt_tokens"] == p["prompt_tokens"] and o.get("batch_size", 1) == b
                    and o.get("round", 1) == p.get("round", 1) and p[key] > 0):
                name = (f"{o['engine']}/{o.get('device') or '-'} {o['attention']} {o.get('kv_cache')} vs "
                        f"{p['engine']} (prompt {p['prompt_tokens']}, batch {b})")
                rounds.setdefault(name, []).append(o[key] / p[key])
    for name, ratios in rounds.items():
        if len(ratios) == 1:
            out.append(f"  {name}: {ratios[0]:.2f}x")
        else:
            out.append(f"  {name}: rounds {' '.join(f'{x:.2f}x' for x in ratios)}; median "
                       f"{statistics.median(ratios):.2f}x, at least 1.2x (unrounded) in {sum(x >= 1.2 for x in ratios)} of "
                       f"{len(ratios)}")
    return "\n".join(out)


if __name__ == "__main__":
    main()
