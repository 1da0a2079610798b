"""mlxinfer bench: how fast this machine generates, by backend, device, attention path, KV cache, batch
size and prompt length, with mlx-lm and llama.cpp beside ours on the same weights where installed.

    mlxinfer bench                                             # the default model, -p 17,511 -n 64
    mlxinfer bench -m qwen3-0.6b-synthetic --backends mlx --devices gpu --batch 1,8,32 \\
        --peers mlx-lm --peer-dtypes float32,bfloat16 --rounds 3 --out results/
    mlxinfer bench --report results/results.jsonl              # the table (and plot) of an earlier run

Every row runs in a fresh child process (load, one warm-up run of the same prompts and length, --runs
measured runs), so that its peak memory is its own, no row inherits another's heap and a crash costs one
row. Batch 1 is `Engine.generate` on one prompt; batch B is one `Engine.generate_batch` call on B
different prompts of the row's length. Per row:
- TTFT: time to the first token (batch B: the mean over the sequences);
- decode tok/s: per sequence, the tokens after the first over the time from the first to the last
  (batch B: the mean over the sequences, each of which gets one token per batched pass);
- total tok/s: every generated token of the call over the call's wall time, prefill included;
- peak MiB: the cpu backend's peak resident memory during the run (its high-water mark reset before each
  run through /proc/self/clear_refs where Linux allows it; else the process's peak so far, marked *),
  MLX's peak allocation on the MLX backend (reset before each run).
A row is the median of its runs with the min and max beside it: rows whose ranges overlap do not differ.

A lent machine's speed drifts over minutes, so `--rounds R` measures every row, ours and the peers', R
times, alternating which engine goes first; ours / peer ratios pair rows of the same round only and are
given per round with their median.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from . import __version__
from .backend import DTYPES, KV_DTYPES
from .engine import DEFAULT_PREFILL_CHUNK, load
from .errors import MlxinferError, RequestError
from .model_source import cache_dir, resolve_model
from .peers import PEER_DTYPES, PEERS, ROOT, installed, prompt_ids, run_peer, summarize
from .synthetic import SyntheticSpec, write_synthetic_model
from .tokenizer import load_tokenizer

# the names load() takes (its docstring); checked here so that a bad name fails before any row runs
BACKENDS, DEVICES, ATTENTION = ("cpu", "mlx"), ("gpu", "cpu"), ("fused", "per-head")
KV_CACHES = ("prealloc", "paged", "basic")
_QWEN3_06B = dict(arch="qwen3", n_layers=28, hidden=1024, ffn=3072, n_heads=16, n_kv_heads=8, head_dim=128,
                 vocab_size=151936, context_length=40960, tied_output=True, seed=0)
_QWEN3_8B = dict(_QWEN3_06B, n_layers=36, hidden=4096, ffn=12288, n_heads=32, tied_output=False)
SYNTHETIC = {  # --model names for synthetic shapes, written once into the cache (random weights, seed 0)
    "qwen3-0.6b-synthetic": SyntheticSpec(**_QWEN3_06B, qtype="Q8_0"),
    # random blocks in the mix of types llama.cpp's Q4_K_M preset gives (`synthetic.MIXES`)
    "qwen3-0.6b-q4km-synthetic": SyntheticSpec(**_QWEN3_06B, qtype="Q4_K_M", random_blocks=True),
    "qwen3-8b-q4km-synthetic": SyntheticSpec(**_QWEN3_8B, qtype="Q4_K_M", random_blocks=True),
    "qwen3-8b-synthetic": SyntheticSpec(**_QWEN3_8B, qtype="Q8_0", random_blocks=True),
}


def add_arguments(p) -> None:
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("-m", "--model", default=None,
                   help=f"a GGUF path, org/repo/file.gguf, or {', '.join(SYNTHETIC)} (Qwen3-0.6B's and Qwen3-8B's "
                        "shapes, random Q8_0 weights or random blocks in Q4_K_M's mix of types, written once into "
                        "the cache) (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("-p", "--prompt-tokens", default="17,511", metavar="N,...", help="prompt lengths, one row each")
    p.add_argument("-n", "--gen-tokens", type=int, default=64, metavar="N", help="tokens generated per sequence")
    p.add_argument("--batch", default="1", metavar="B,...",
                   help="batch sizes: 1 is Engine.generate, B > 1 one Engine.generate_batch call on B prompts")
    p.add_argument("--backends", default="cpu,mlx", help=f"backends ({', '.join(BACKENDS)})")
    p.add_argument("--devices", default="gpu,cpu", help="MLX devices, where this machine has them (gpu, cpu)")
    p.add_argument("--attention", default="fused", help=f"attention paths ({', '.join(ATTENTION)})")
    p.add_argument("--kv", default="prealloc", help=f"KV caches ({', '.join(KV_CACHES)})")
    p.add_argument("--dtypes", default=None, metavar="DTYPE,...",
                   help=f"the MLX backend's --dtype, one set of rows each ({', '.join(DTYPES)}; default: its default)")
    p.add_argument("--prefill-chunks", default=None, metavar="N,...",
                   help="prompt tokens per prefill pass, one set of rows each (default: the engine's, "
                        f"{DEFAULT_PREFILL_CHUNK}; 2048 in bfloat16/float16 on CUDA)")
    p.add_argument("--kv-dtype", default=None, choices=KV_DTYPES,
                   help="the MLX backend's --kv-dtype (default: the dtype)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), metavar="N",
                   help="threads of the rows on a CPU and of llama.cpp (default: every core, %(default)s; the "
                        "engine's own default follows the load average, which would tie a row to the one before)")
    p.add_argument("-r", "--runs", type=int, default=3, help="measured runs per row, after one warm-up")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every row, ours and the peers', this many times, alternating which engine goes "
                        "first; the ratios are given per round with their median")
    p.add_argument("--warmup-tokens", type=int, default=0, metavar="N",
                   help="prompt tokens of the warm-up run (0: the row's whole prompt and every generated token; "
                        "shorter, with 4 tokens generated, saves minutes where prefill is slow)")
    p.add_argument("--peers", default="none", help=f"peer engines ({', '.join(PEERS)}) or none")
    p.add_argument("--peer-dtypes", default="float32,bfloat16", metavar="DTYPE,...",
                   help=f"mlx-lm's weights and activations, one set of rows each ({', '.join(PEER_DTYPES)})")
    p.add_argument("--peer-quant", default="file", metavar="Q,...",
                   help="mlx-lm's weights: 'file' (the GGUF's values, as --peer-dtypes describes) or BITS:GROUP "
                        "(e.g. 4:32,4:64: random weights of the file's shapes, quantized by mx.quantize, as "
                        "mlx_lm.convert -q makes them), one set of rows each")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="also write DIR/results.jsonl (a header line, then each row as measured), "
                        "DIR/results.md (the command and the table) and DIR/results.png (needs matplotlib)")
    p.add_argument("--report", nargs="+", default=None, metavar="FILE",
                   help="measure nothing: the table (and with --out, the plot) of earlier runs' results.jsonl")


def _ints(text: str, option: str, least: int = 1) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise RequestError(f"{option} takes comma-separated integers of at least {least}, got {text!r}")
    return values


def _names(text: str, option: str, choices) -> list[str]:
    names = text.split(",")
    bad = [n for n in names if n not in choices]
    if bad:
        raise RequestError(f"{option}: unknown {bad[0]!r} (choose from {', '.join(choices)})")
    return names


def model_path(model: str | None) -> str:
    """The GGUF file for --model: a synthetic shape's file in the cache (written on first use), or what
    load() would read."""
    if model in SYNTHETIC:
        path = cache_dir() / f"{model}-{SYNTHETIC[model].qtype.lower()}.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            print(f"mlxinfer: writing {path} ({model}, once)", file=sys.stderr, flush=True)
            write_synthetic_model(str(path) + ".tmp", SYNTHETIC[model])
            os.replace(str(path) + ".tmp", path)
        return str(path)
    return str(resolve_model(model).resolve())


def reset_peak_memory(on_mlx: bool) -> tuple[str, float]:
    """Reset the peak-memory counter the engine's metrics read; returns the scope of the next reading,
    "run" (reset worked) or "process" (the process's peak so far), and the memory in use now (MiB)."""
    if on_mlx:
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


def one_run(engine, on_mlx: bool, prompts, n_gen: int) -> dict:
    """One generate (one prompt) or generate_batch (several) call, as a per-run dict."""
    scope, before = reset_peak_memory(on_mlx)
    t0 = time.perf_counter()
    if len(prompts) == 1:
        gens = [engine.generate(prompts[0], max_tokens=n_gen)]
    else:
        gens = engine.generate_batch(prompts, max_tokens=n_gen)
    wall = time.perf_counter() - t0
    ms = [g.metrics for g in gens]
    generated = [m.generated_tokens for m in ms]
    decode = [m.decode_tokens_per_second for m in ms]
    return dict(
        backend=ms[0].backend, kv_cache=ms[0].kv_cache, batch_size=len(gens), prefill_chunk=ms[0].prefill_chunk,
        generated=statistics.median(generated), generated_min=min(generated), generated_total=sum(generated),
        finish_reasons=sorted({g.finish_reason for g in gens}),
        time_to_first_token_ms=statistics.fmean(m.time_to_first_token_ms for m in ms),
        prompt_tokens_per_second=statistics.fmean(m.prompt_tokens_per_second for m in ms),
        decode_tokens_per_second=statistics.fmean(decode), aggregate_decode_tokens_per_second=sum(decode),
        total_tokens_per_second=sum(generated) / wall, wall_s=wall,
        peak_memory_mb=max(m.peak_memory_mb for m in ms), peak_memory_scope=scope, memory_before_mb=before,
        intervals=[x for m in ms for x in m.token_intervals_ms],
    )


def measure_row(job: dict) -> dict:
    """One row, in this process (a fresh child of the benchmark): load, warm up, run."""
    on_cpu = job["backend"] == "cpu" or job["device"] == "cpu"
    t0 = time.perf_counter()
    engine = load(job["model"], backend=job["backend"], attention=job["attention"],
                  device=job["device"] if job["backend"] == "mlx" else None, kv=job["kv"],
                  threads=job["threads"] if on_cpu else None, dtype=job.get("dtype"), kv_dtype=job.get("kv_dtype"),
                  prefill_chunk=job.get("prefill_chunk"))
    load_s = time.perf_counter() - t0
    vocab = load_tokenizer(job["model"]).vocab_size
    n, gen, on_mlx = job["prompt"], job["gen"], job["backend"] == "mlx"
    prompts = [prompt_ids(n, vocab, seed=b) for b in range(job["batch"])]
    w = n if job["warmup_tokens"] <= 0 else min(job["warmup_tokens"], n)
    # warm-up: allocations, kernel compilation. The row's own prompts and length where the warm-up takes
    # the whole prompt, so that a measured run meets no shape (cache capacity, attention plan, compiled
    # step) the warm-up did not: GPU kernels compiled inside a measured run are not its speed.
    one_run(engine, on_mlx, [p[:w] for p in prompts], gen if w == n else min(4, gen))
    row = summarize([one_run(engine, on_mlx, prompts, gen) for _ in range(job["runs"])])
    # an MLX row is named by the dtype it ran, the default's too (it differs by device: bfloat16 on CUDA)
    ran = dict(job, dtype=job.get("dtype") or (engine.backend.dtype_name if on_mlx else None))
    row.update(engine=engine_name(ran), device=job["device"], attention=job["attention"],
               prompt_tokens=n, max_tokens=gen, warmup_prompt_tokens=w, load_s=load_s,
               threads=job["threads"] if on_cpu else None)
    return row


def engine_name(job: dict) -> str:
    """A row's engine: the backend, and the MLX dtype (and KV cache type, prefill chunk) where the job
    names one (`measure_row` names the dtype an MLX row ran)."""
    types = [t for t in (job.get("dtype"), job.get("kv_dtype") and f"kv {job['kv_dtype']}",
                         job.get("prefill_chunk") and f"chunk {job['prefill_chunk']}") if t]
    return " ".join([f"mlxinfer {job['backend']}", *types])


# A row's child process (`child_main`): reads the job on stdin, writes the row. bench/probes/setting.py
# puts itself in front, so that the module constants it changes are changed where the row runs.
CHILD = [sys.executable, "-m", "mlxinfer.benchmark"]


def run_row(job: dict) -> dict:
    """One row in a fresh child process (`CHILD`, the job on stdin); a failed row says why in its last
    line of stderr."""
    r = subprocess.run(CHILD, input=json.dumps(job), capture_output=True, text=True, cwd=ROOT)
    got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode == 0 and got:
        return got[-1]
    if r.returncode < 0:
        why = f"signal {-r.returncode}"
    else:
        why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
    return dict(engine=engine_name(job), device=job["device"], attention=job["attention"],
                kv_cache=job["kv"], batch_size=job["batch"], prompt_tokens=job["prompt"], error=why)


def mlx_has_gpu() -> bool:
    """Whether MLX has a GPU here (asked in a child process: the benchmark itself holds no GPU context)."""
    r = subprocess.run([sys.executable, "-c", "import mlx.core as mx; print(mx.is_available(mx.gpu))"],
                       capture_output=True, text=True)
    return r.stdout.strip() == "True"


def source_digest() -> str:
    """sha256 (12 hex digits) of the engine's sources (mlxinfer/**/*.py, metal_kernels/*), names and
    contents in name order: the code a result came from, whatever the git metadata of its copy says."""
    h = hashlib.sha256()
    for top in ("mlxinfer", "metal_kernels"):
        for path in sorted(Path(ROOT, top).rglob("*")):
            if path.suffix in (".py", ".cu", ".metal") and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def _git(*args) -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def header(model: str, command: str) -> dict:
    """The run's first JSON line: what was measured, where, on which code, by which command."""
    def v(dist):
        try:
            return version(dist)
        except PackageNotFoundError:
            return None

    gpu = ""
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    info = dict(kind="header", command=command, model=model,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                machine=f"{platform.platform()}, {platform.machine()}, {os.cpu_count()} cpus"
                        + (f", GPU {gpu}" if gpu else ""),
                versions={"python": platform.python_version(), "mlxinfer": __version__,
                          **{d: v(d) for d in ("numpy", "mlx", "gguf", "mlx-lm", "llama-cpp-python") if v(d)}},
                source=source_digest(), load_average="{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()),
                env={k: x for k, x in os.environ.items() if k.startswith(("MLX", "OPENBLAS", "OMP"))})
    commit = _git("rev-parse", "--short", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no", "mlxinfer"):
        commit += " + uncommitted changes under mlxinfer/"
    if os.environ.get("MLXINFER_COMMIT"):  # a copied tree whose git metadata is not its own (a lent GPU)
        commit = f"{os.environ['MLXINFER_COMMIT']} (given; the copy's git says {commit or 'nothing'})"
    if commit:
        info["commit"] = commit
    return info


def spread(r, key, fmt) -> str:
    """"median [min-max]", or just the value for one run."""
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
    runs = sorted({r["runs"] for r in rows if "runs" in r})
    if runs:
        lines.append(f"\n{'/'.join(map(str, runs))} run(s) a row" + ("; median [min-max]" if runs[-1] > 1 else ""))
    if any(r.get("peak_memory_scope") == "process" for r in rows):
        lines.append("*: the process's peak so far (the high-water mark could not be reset)")
    return "\n".join(lines)


def row_key(r, attention=None):
    return (r.get("round", 1), r["engine"], r.get("device"), r.get("kv_cache"), r.get("batch_size", 1),
            r["prompt_tokens"], attention or r["attention"])


def add_ratios(rows) -> None:
    """Each fused row's decode rate over its per-head twin's (same backend, device, cache, batch, prompt)."""
    rows = [r for r in rows if "error" not in r]
    by = {row_key(r): r for r in rows}
    for r in rows:
        if r["attention"] == "fused":
            ph = by.get(row_key(r, "per-head"))
            if ph and ph["decode_tokens_per_second"] > 0:
                r["ratio"] = f"{r['decode_tokens_per_second'] / ph['decode_tokens_per_second']:.2f}x"


def peer_ratios(rows) -> str:
    """Ours / peer at the same device, prompt, batch size and round: decode tokens/s per sequence at
    batch 1, total generated tokens/s (whole call, prefill included) at batch B > 1; with several rounds,
    each round's ratio and then their median."""
    out = ["ours / peer, decode tokens/s per sequence (batch 1) and total tokens/s (batch B > 1):"]
    ours = [r for r in rows if r["engine"].startswith("mlxinfer") and "error" not in r]
    peers = [r for r in rows if not r["engine"].startswith("mlxinfer")]
    rounds = {}
    for p in peers:
        b = p.get("batch_size", 1)
        key = "decode_tokens_per_second" if b == 1 else "total_tokens_per_second"
        for o in ours:
            if (o["prompt_tokens"] == p["prompt_tokens"] and o.get("batch_size", 1) == b
                    and o.get("device") == p.get("device")
                    and o.get("round", 1) == p.get("round", 1) and p[key] > 0):
                name = (f"{o['engine']}/{o.get('device') or '-'} {o['attention']} {o.get('kv_cache')} vs "
                        f"{p['engine']} (prompt {p['prompt_tokens']}, batch {b})")
                rounds.setdefault(name, []).append(o[key] / p[key])
    for name, ratios in rounds.items():
        if len(ratios) == 1:
            out.append(f"  {name}: {ratios[0]:.2f}x")
        else:
            out.append(f"  {name}: rounds {' '.join(f'{x:.2f}x' for x in ratios)}; median "
                       f"{statistics.median(ratios):.2f}x, at least 1.2x (unrounded) in "
                       f"{sum(x >= 1.2 for x in ratios)} of {len(ratios)}")
    return "\n".join(out)


def report(rows) -> str:
    """The table, then ours / peer ratios where a peer ran."""
    rows = sorted(rows, key=lambda r: r.get("round", 1))  # stable: by round, in measured order within one
    add_ratios(rows)
    text = fmt_table(rows)
    if any(not r["engine"].startswith("mlxinfer") for r in rows):
        text += "\n\n" + peer_ratios(rows)
    return text


def plot(rows, path) -> None:
    """Decode tokens/s per sequence and total tokens/s against the prompt length, one line per engine,
    device, attention path, KV cache and batch size: the median (over rounds, of their medians), a bar
    from the slowest run to the fastest."""
    rows = [r for r in rows if "error" not in r]
    if not rows:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("mlxinfer: note: matplotlib is not installed, so no plot (pip install 'mlxinfer[bench]')",
              file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, title in ((axes[0], "decode_tokens_per_second", "decode tokens/s per sequence"),
                           (axes[1], "total_tokens_per_second", "total tokens/s (prefill included)")):
        series = {}
        for r in rows:
            label = " ".join(x for x in (f"{r['engine']}/{r.get('device') or '-'}", r["attention"],
                                         r.get("kv_cache"), f"B={r.get('batch_size', 1)}") if x and x != "-")
            series.setdefault(label, {}).setdefault(r["prompt_tokens"], []).append(
                (r[key], r.get(key + "_min", r[key]), r.get(key + "_max", r[key])))
        for label, by_x in series.items():
            pts = sorted((x, statistics.median(m for m, _, _ in v), min(lo for _, lo, _ in v),
                          max(hi for _, _, hi in v)) for x, v in by_x.items())
            med = [p[1] for p in pts]
            ax.errorbar([p[0] for p in pts], med, yerr=[[m - p[2] for m, p in zip(med, pts)],
                                                         [p[3] - m for m, p in zip(med, pts)]],
                        marker="o", capsize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"mlxinfer: wrote {path}", file=sys.stderr)


def utc_now() -> str:
    """The time of day in UTC, as rows record when they finished."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S UTC")


def _progress(row: dict) -> None:
    where = f"{row['engine']} {row.get('device') or '-'} {row['attention']} kv={row['kv_cache']} " \
            f"batch={row['batch_size']} prompt={row['prompt_tokens']}"
    if "error" in row:
        print(f"  {where}: failed ({row['error']})", file=sys.stderr, flush=True)
        return
    print(f"  {where}: TTFT {spread(row, 'time_to_first_token_ms', '.1f')} ms, decode "
          f"{spread(row, 'decode_tokens_per_second', '.2f')} tok/s/seq, total "
          f"{spread(row, 'total_tokens_per_second', '.2f')} tok/s, peak {row['peak_memory_mb']:.0f} MiB",
          file=sys.stderr, flush=True)


def _write_outputs(out: str | None, text: str, rows, command: str | None) -> None:
    if out is None:
        return
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write((f"command: {command}\n\n" if command else "") + text + "\n")
    plot(rows, os.path.join(out, "results.png"))


def read_rows(files) -> list[dict]:
    """The rows of earlier runs' results.jsonl files (their header lines left out)."""
    rows = []
    for name in files:
        try:
            with open(name) as f:
                rows += [r for r in map(json.loads, filter(str.strip, f)) if r.get("kind") != "header"]
        except (OSError, ValueError) as e:
            raise RequestError(f"--report {name}: not a results.jsonl file ({e})") from None
    return rows


def measure(jobs, peer_jobs, rounds: int, log) -> tuple[list[dict], list[str]]:
    """Every row, ours (`jobs`) and the peers' (`peer_jobs`), `rounds` times, alternating which engine
    goes first (ours, peers; peers, ours; ...); each row also written to `log` (if any) as measured.
    Returns the rows and the peers' failure notes."""
    rows, notes = [], []

    def keep(row, rnd):
        row.update(round=rnd, finished_at=utc_now(), load_average_1min=round(os.getloadavg()[0], 2))
        rows.append(row)
        _progress(row)
        if log:
            print(json.dumps(row), file=log, flush=True)

    def ours(rnd):
        for job in jobs:
            keep(run_row(job), rnd)

    def theirs(rnd):
        for job in peer_jobs:
            got, note = run_peer(job)
            for row in got:
                keep(row, rnd)
            if note and note not in notes:
                notes.append(note)
                print(f"mlxinfer: note: {note}", file=sys.stderr)

    for rnd in range(1, rounds + 1):
        for part in ((ours, theirs) if rnd % 2 else (theirs, ours)):
            part(rnd)
    return rows, notes


def parse_peer_quant(text: str) -> tuple[int, int] | None:
    """--peer-quant's item: None for 'file', else (bits, group) as mx.quantize takes them."""
    if text == "file":
        return None
    try:
        bits, group = (int(x) for x in text.split(":"))
    except ValueError:
        bits = group = 0
    if bits not in (2, 3, 4, 5, 6, 8) or group not in (32, 64, 128):
        raise RequestError(f"--peer-quant takes 'file' or BITS:GROUP (bits 2-8, group 32, 64 or 128), got {text!r}")
    return bits, group


def plan(args) -> tuple[str | None, list[dict], list[dict], list[str]]:
    """The model file and the rows to measure: our jobs, the peers' jobs, and notes on what is left out
    and why. Refuses a bad option in one line (RequestError) before anything runs."""
    prompts = _ints(args.prompt_tokens, "-p/--prompt-tokens")
    batches = _ints(args.batch, "--batch")
    for option, value, least in (("-n/--gen-tokens", args.gen_tokens, 1), ("-r/--runs", args.runs, 1),
                                 ("--rounds", args.rounds, 1), ("--threads", args.threads, 1),
                                 ("--warmup-tokens", args.warmup_tokens, 0)):
        if value < least:
            raise RequestError(f"{option} must be at least {least}, got {value}")
    backends = _names(args.backends, "--backends", BACKENDS)
    devices = _names(args.devices, "--devices", DEVICES)
    attentions = _names(args.attention, "--attention", ATTENTION)
    kvs = _names(args.kv, "--kv", KV_CACHES)
    ours = [None] if args.dtypes is None else _names(args.dtypes, "--dtypes", DTYPES)
    chunks = [None] if args.prefill_chunks is None else _ints(args.prefill_chunks, "--prefill-chunks")
    peers = [] if args.peers == "none" else _names(args.peers, "--peers", tuple(PEERS))
    dtypes = _names(args.peer_dtypes, "--peer-dtypes", PEER_DTYPES)
    quants = [parse_peer_quant(q) for q in args.peer_quant.split(",")]
    if args.report:
        return None, [], [], []
    model, notes = model_path(args.model), []
    if ("mlx" in backends or "mlx-lm" in peers) and "gpu" in devices and not mlx_has_gpu():
        devices = [d for d in devices if d != "gpu"]
        notes.append("MLX has no GPU here: no gpu rows")
    spec = dict(model=model, gen=args.gen_tokens, runs=args.runs, warmup_tokens=args.warmup_tokens,
                threads=args.threads)
    typed = dict(kv_dtype=args.kv_dtype) if args.kv_dtype else {}
    jobs = [dict(spec, backend=b, device=d, attention=a, kv=kv, batch=n_batch, prompt=n,
                 **(dict(dtype=dt, **typed) if b == "mlx" and (dt or typed) else {}),
                 **(dict(prefill_chunk=c) if c else {}))
            for b in backends for d in (devices if b == "mlx" else ["cpu"]) for a in attentions for kv in kvs
            for dt in (ours if b == "mlx" else [None]) for c in chunks for n_batch in batches for n in prompts]
    peer_jobs = []
    for p in peers:
        if not installed(p):
            notes.append(f"peer {p}: not installed ({PEERS[p]} not found), no rows")
        elif p == "mlx-lm":
            peer_jobs += [dict(spec, peer=p, device=d, dtype=dt, quant=q, prompts=prompts, batches=batches)
                          for d in devices for dt in dtypes for q in quants]
        elif 1 in batches:
            peer_jobs.append(dict(spec, peer=p, device="cpu", prompts=prompts))
        else:
            notes.append(f"peer {p}: batch 1 only, no rows")
    if not jobs and not peer_jobs:
        raise RequestError("nothing to measure" + "".join(f"; {n}" for n in notes))
    return model, jobs, peer_jobs, notes


def run(args) -> int:
    """Measure every row (or read them back, --report) and print the table; 1 if a row of ours failed."""
    model, jobs, peer_jobs, notes = plan(args)
    if args.out is not None:
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as e:
            raise RequestError(f"--out {args.out}: cannot make the folder ({e.strerror})") from None
    if args.report:
        rows = read_rows(args.report)
        text = report(rows)
        print(text)
        _write_outputs(args.out, text, rows, None)
        return 0
    command = shlex.join(["mlxinfer", *getattr(args, "argv", sys.argv[1:])])
    head = header(model, command)
    print(f"{command}\n{head['date']}, {head['machine']}, commit {head.get('commit', '-')}\nmodel: {model}",
          file=sys.stderr, flush=True)
    for note in notes:
        print(f"mlxinfer: note: {note}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="mlxinfer-bench-") as tmp, \
            (open(os.path.join(args.out, "results.jsonl"), "w") if args.out else contextlib.nullcontext()) as log:
        for job in peer_jobs:
            if job["peer"] == "mlx-lm":  # its weights, written by the first process of each dtype
                job["dir"] = os.path.join(tmp, job["dtype"] + ("-q{}-g{}".format(*job["quant"]) if job["quant"] else ""))
        if log:
            print(json.dumps(head), file=log, flush=True)
        rows, failed = measure(jobs, peer_jobs, args.rounds, log)
    text = report(rows) + "".join(f"\n{n}" for n in notes + failed)
    print(text)
    _write_outputs(args.out, text, rows, command)
    return 1 if any("error" in r for r in rows) else 0


def child_main() -> None:
    """A child of run_row (`CHILD`): one row, its job on stdin, the row on stdout."""
    try:
        print(json.dumps(measure_row(json.loads(sys.stdin.read()))), flush=True)
    except MlxinferError as e:
        print(f"mlxinfer: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    child_main()
