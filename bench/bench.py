"""Benchmark: backends x attention paths x prompt lengths (x peer engines), on the same weights.

    python3 bench/bench.py                         # synthetic Qwen3-0.6B-shaped Q8_0 (made if absent)
    python3 bench/bench.py --model smollm2         # SmolLM2-135M-Instruct Q4_1 (the default model)
    python3 bench/bench.py --model path.gguf --backends cpu,mlx --sweep 16,128,512,1024,2048

Cases: the book chapter's two, a short prompt (17 tokens, 64 generated) and a long one (511 tokens,
64 generated), plus an optional sweep of context lengths (decode tokens/s vs tokens in the cache).
Each row is the median of --runs runs after one warm-up. Writes a Markdown table to stdout and to
OUT/results.md, JSON lines to OUT/results.jsonl and, when matplotlib is installed, OUT/decode_vs_context.png.

Peers, when installed: llama.cpp through llama-cpp-python on the same GGUF, same thread count, and
mlx-lm on the same weights (see bench/peers.py). Their rows sit in the same table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

import mlxinfer  # noqa: E402
from mlxinfer.backends import mlx_gpu_available  # noqa: E402
from mlxinfer.synthetic import SyntheticSpec, write_synthetic_model  # noqa: E402
from peers import prompt_ids, run_peers  # noqa: E402

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


def peak_memory_mb(engine) -> float:
    if engine.backend.name == "mlx":
        import mlx.core as mx

        return mx.get_peak_memory() / 1e6
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # Linux: KiB


def run_case(engine, n_prompt: int, n_gen: int, runs: int):
    ids = prompt_ids(n_prompt, engine.args.vocab_size)
    engine.generate(ids, max_tokens=4)  # warm-up: allocations, kernel compilation
    results = []
    for _ in range(runs):
        if engine.backend.name == "mlx":
            import mlx.core as mx

            mx.reset_peak_memory()
        g = engine.generate(ids, max_tokens=n_gen)
        m = g.metrics.as_dict()
        m["peak_memory_mb"] = peak_memory_mb(engine)
        m["generated"] = len(g.token_ids)
        results.append(m)
    keys = ["time_to_first_token_ms", "decode_tokens_per_second", "per_forward_ms_min", "per_forward_ms_mean",
            "per_forward_ms_max", "peak_memory_mb"]
    row = {k: statistics.median(r[k] for r in results) for k in keys}
    row.update(prompt_tokens=n_prompt, generated=results[0]["generated"], runs=runs)
    return row


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


def header(model_path) -> str:
    from importlib.metadata import version

    try:
        import mlx.core as mx

        mlx_v = f"mlx {mx.__version__}, default device {mx.default_device()}"
    except ImportError:
        mlx_v = "mlx not installed"
    gpu = ""
    try:
        import subprocess

        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return (f"date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}\n"
            f"machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} cpus"
            f"{', GPU ' + gpu if gpu else ''}\n"
            f"python {platform.python_version()}, numpy {np.__version__}, {mlx_v}, gguf {version('gguf')}, "
            f"mlxinfer {mlxinfer.__version__}\n"
            f"model: {model_path}\n")


def fmt_table(rows) -> str:
    cols = ["engine", "device", "attention", "prompt", "gen", "TTFT ms", "decode tok/s", "fwd min ms",
            "fwd mean ms", "fwd max ms", "peak MB", "fused/per-head"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["engine"], r.get("device") or "-", r["attention"], str(r["prompt_tokens"]), str(r["generated"]),
            f"{r['time_to_first_token_ms']:.1f}", f"{r['decode_tokens_per_second']:.2f}",
            f"{r['per_forward_ms_min']:.2f}", f"{r['per_forward_ms_mean']:.2f}", f"{r['per_forward_ms_max']:.1f}",
            f"{r['peak_memory_mb']:.0f}", r.get("ratio", ""),
        ]) + " |")
    return "\n".join(lines)


def add_ratios(rows):
    by = {(r["engine"], r.get("device"), r["prompt_tokens"], r["attention"]): r for r in rows}
    for r in rows:
        if r["attention"] == "fused":
            ph = by.get((r["engine"], r.get("device"), r["prompt_tokens"], "per-head"))
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
    for r in sweep_rows:
        label = f"{r['engine']}{'/' + r['device'] if r.get('device') else ''} {r['attention']}"
        series.setdefault(label, []).append((r["prompt_tokens"], r["decode_tokens_per_second"]))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the KV cache (prompt length)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("decode speed vs context")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b-synthetic", help="qwen3-0.6b-synthetic, smollm2 or a GGUF path")
    p.add_argument("--backends", default="cpu,mlx")
    p.add_argument("--attention", default="per-head,fused")
    p.add_argument("--cases", default="17,511", help="prompt lengths of the main cases (64 tokens generated)")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--sweep", default="", help="prompt lengths for the decode-vs-context sweep, e.g. 16,128,1024")
    p.add_argument("--sweep-gen", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--devices", default="gpu,cpu", help="MLX devices to run (where available)")
    p.add_argument("--sync", action="store_true", help="also run MLX rows without pipelined decoding")
    p.add_argument("--peers", default="llama.cpp,mlx-lm", help="peer engines, or 'none'")
    p.add_argument("--replot", default=None, help="only redraw the plot from a results.jsonl")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    p.add_argument("--cache", default=os.path.join(HERE, "models"))
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.replot:
        with open(a.replot) as f:
            plot([r for r in map(json.loads, f) if r.get("kind") == "sweep"], os.path.join(a.out, "decode_vs_context.png"))
        return
    path = resolve(a.model, a.cache)
    head = header(path)
    print(head)
    rows, sweep_rows = [], []
    log = open(os.path.join(a.out, "results.jsonl"), "w")
    cases = [int(x) for x in a.cases.split(",") if x]
    sweep = [int(x) for x in a.sweep.split(",") if x]
    for backend, device, attention in configs(a.backends.split(","), a.attention.split(","), a.devices.split(",")):
        t0 = time.perf_counter()
        engine = mlxinfer.load(path, backend=backend, attention=attention, device=device)
        load_s = time.perf_counter() - t0
        for pipeline in ([True, False] if a.sync and backend == "mlx" else [True]):
            engine.pipeline = pipeline
            name = f"mlxinfer {backend}" + ("" if pipeline or backend != "mlx" else " (sync)")
            for n in cases:
                row = run_case(engine, n, a.gen, a.runs)
                row.update(engine=name, device=device, attention=attention, load_s=load_s, kind="case")
                rows.append(row)
                print(json.dumps(row), file=log, flush=True)
            for n in sweep:
                row = run_case(engine, n, a.sweep_gen, a.runs)
                row.update(engine=name, device=device, attention=attention, kind="sweep")
                sweep_rows.append(row)
                print(json.dumps(row), file=log, flush=True)
        del engine
    peer_rows, peer_notes = run_peers([x for x in a.peers.split(",") if x != "none"], path, cases, a.gen, a.runs,
                                      a.threads)
    rows += peer_rows
    add_ratios(rows)
    add_ratios(sweep_rows)
    text = head + "\n" + fmt_table(rows)
    if peer_rows:
        text += "\n\n" + peer_ratios(rows)
    if peer_notes:
        text += "\n\n" + "\n".join(peer_notes)
    if sweep_rows:
        text += "\n\ndecode tokens/s vs context (" + str(a.sweep_gen) + " generated):\n\n" + fmt_table(sweep_rows)
    print(text)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(text + "\n")
    for r in peer_rows:
        print(json.dumps(r), file=log, flush=True)
    log.close()
    if sweep_rows:
        plot(sweep_rows, os.path.join(a.out, "decode_vs_context.png"))


def peer_ratios(rows) -> str:
    out = ["ours / peer, decode tokens/s:"]
    ours = [r for r in rows if r["engine"].startswith("mlxinfer")]
    peers = [r for r in rows if not r["engine"].startswith("mlxinfer")]
    for p in peers:
        for o in ours:
            if o["prompt_tokens"] == p["prompt_tokens"] and p["decode_tokens_per_second"] > 0:
                out.append(f"  {o['engine']}/{o.get('device') or '-'} {o['attention']} vs {p['engine']} "
                           f"(prompt {p['prompt_tokens']}): {o['decode_tokens_per_second'] / p['decode_tokens_per_second']:.2f}x")
    return "\n".join(out)


if __name__ == "__main__":
    main()
