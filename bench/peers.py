"""Peer engines on the same weights, each only when installed:

- llama.cpp (`pip install llama-cpp-python`): the same GGUF file, the same thread count, greedy.
- mlx-lm (`pip install mlx-lm`): the GGUF's weights written as an mlx-lm model directory with the same
  quantization (Q8_0/Q4_0/Q4_1 repacked exactly to MLX affine group-32, as our MLX backend does;
  other types as float32), then `mlx_lm.stream_generate`.

Each returns rows shaped like bench.py's (no KV cache choice): median decode tokens/s and time to first
token with their min and max over runs, token intervals, whole-call tokens/s. Batch 1 only for
llama.cpp; mlx-lm also at batch B > 1: its `BatchGenerator` (what `batch_generate` and `mlx_lm.server`
run) on the same B prompts as bench.py's generate_batch rows, all inserted at once, every sequence
running to the token budget (no stop tokens). Peak memory: MLX's peak allocation (MiB) for mlx-lm; not
measured for llama.cpp (0).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n token ids below the vocabulary's control tokens (the last few ids of our synthetic and of the
    real vocabularies' added tokens), fixed per n."""
    rng = np.random.default_rng(seed + n)
    return rng.integers(0, min(vocab - 300, 50000) if vocab > 600 else 256, size=n).tolist()


def emit(row: dict, out: str | None) -> None:
    """Print a result row as a JSON line, and append it to the file `out` (if given)."""
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


SPREAD_KEYS = ("time_to_first_token_ms", "decode_tokens_per_second", "total_tokens_per_second",
               "aggregate_decode_tokens_per_second", "peak_memory_mb", "wall_s")


def summarize(per_run: list[dict]) -> dict:
    """One row from the runs of a case: the first run's fields, then for every SPREAD_KEYS key the
    median over runs (under the key itself) with its min and max (`key_min`, `key_max`), and the
    token intervals pooled over all runs (min, mean, max)."""
    out = {k: v for k, v in per_run[0].items() if k != "intervals"}
    for k in SPREAD_KEYS:
        if k in per_run[0]:
            values = [r[k] for r in per_run]
            out[k], out[k + "_min"], out[k + "_max"] = statistics.median(values), min(values), max(values)
    intervals = [x for r in per_run for x in r.get("intervals", [])] or [0.0]
    out.update(token_interval_ms_min=min(intervals), token_interval_ms_mean=float(np.mean(intervals)),
               token_interval_ms_max=max(intervals), runs=len(per_run))
    return out


def _row(engine, n_prompt, ttft, decode_times, peak_mb):
    """A peer's run, shaped like bench.py's per-run dicts (one sequence, no KV cache choice)."""
    wall_ms = ttft + sum(decode_times)
    return dict(engine=engine, device=None, attention="-", kv_cache="-", batch_size=1, prefill_chunk=None,
                prompt_tokens=n_prompt, generated=len(decode_times) + 1, time_to_first_token_ms=ttft,
                decode_tokens_per_second=1000.0 * len(decode_times) / sum(decode_times) if decode_times else 0.0,
                total_tokens_per_second=1000.0 * (len(decode_times) + 1) / wall_ms,
                peak_memory_mb=peak_mb, wall_s=wall_ms / 1000, intervals=list(decode_times), kind="case")


def llama_cpp_rows(path, cases, n_gen, runs, threads):
    import llama_cpp

    # n_batch = n_ctx: llama-cpp-python keeps last-token logits in an n_batch-row array when logits_all
    # is off and indexes it by position, which fails past n_batch.
    llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_batch=2048, n_threads=threads, n_threads_batch=threads,
                          verbose=False, logits_all=False)
    vocab = llm.n_vocab()
    rows = []
    for n in cases:
        ids = prompt_ids(n, vocab)
        per_run = []
        for r in range(runs + 1):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            ttft = (time.perf_counter() - t0) * 1000
            times = []
            for _ in range(n_gen - 1):
                t0 = time.perf_counter()
                llm.eval([tok])
                tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                times.append((time.perf_counter() - t0) * 1000)
            if r:  # the first run is the warm-up
                per_run.append(_row(f"llama.cpp {llama_cpp.__version__} ({threads} threads)", n, ttft, times, 0.0))
        rows.append(summarize(per_run))
    return rows


def write_mlx_lm_model(path, out_dir):
    """The GGUF's weights as an mlx-lm model directory (config.json + model.safetensors). Names come from
    the model spec (`mlxinfer.models.spec.tensors`): an mlx-lm module path is the Hugging Face name
    without its trailing ".weight"."""
    import mlx.core as mx

    from mlxinfer.backends.mlx import REPACK
    from mlxinfer.gguf_file import GGUFFile
    from mlxinfer.models import model_args
    from mlxinfer.models.spec import tensors

    g = GGUFFile(path)
    args = model_args(g)
    module_bits = {}  # mlx-lm module path -> bits, for every tensor we keep quantized
    config = {
        "model_type": args.arch, "hidden_size": args.hidden, "num_hidden_layers": args.n_layers,
        "intermediate_size": args.ffn, "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim, "rms_norm_eps": args.rms_eps, "vocab_size": args.vocab_size,
        "rope_theta": args.rope_base, "tie_word_embeddings": args.tied_output, "max_position_embeddings": args.context_length,
        "rope_traditional": args.rope_traditional,  # llama GGUFs keep Q/K permuted for interleaved RoPE
    }
    weights = {}
    for _, _, name, hf_name, _ in tensors(args):
        if not hf_name.endswith(".weight"):
            raise ValueError(f"{name}: Hugging Face name {hf_name!r} does not end in '.weight'")
        key = hf_name[:-len(".weight")]
        t = g.tensor(name)
        if t.ggml_type in REPACK and len(t.shape) == 2:
            repack, bits = REPACK[t.ggml_type]
            w, s, b = repack(g.raw(name), *t.shape)
            weights[key + ".weight"], weights[key + ".scales"], weights[key + ".biases"] = (mx.array(w), mx.array(s), mx.array(b))
            module_bits[key] = bits
        else:
            weights[key + ".weight"] = mx.array(np.ascontiguousarray(g.dequantize(name), dtype=np.float32))
    if module_bits:
        # mlx-lm's quantization config: a default, plus per-module entries where a file mixes types
        # (SmolLM2: Q4_1 blocks, Q8_0 embedding); float modules are marked False.
        default = max(set(module_bits.values()), key=list(module_bits.values()).count)
        q = {"group_size": 32, "bits": default}
        for key, bits in module_bits.items():
            if bits != default:
                q[key] = {"group_size": 32, "bits": bits}
        for key in {k.rsplit(".", 1)[0] for k in weights if k.endswith(".weight")} - set(module_bits):
            if not key.endswith(("norm", "layernorm")):
                q[key] = False
        config["quantization"] = q
    os.makedirs(out_dir, exist_ok=True)
    mx.save_safetensors(os.path.join(out_dir, "model.safetensors"), weights)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


def mlx_lm_batch_run(model, prompts, n_gen) -> dict:
    """One BatchGenerator run over `prompts` (B > 1), shaped like bench.py's generate_batch runs."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    b = len(prompts)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    gen = BatchGenerator(model, max_tokens=n_gen, completion_batch_size=b, prefill_batch_size=b)
    uids = gen.insert(prompts, [n_gen] * b)
    stamps = {u: [] for u in uids}
    while responses := gen.next_generated():
        now = time.perf_counter()
        for r in responses:
            stamps[r.uid].append(now)
    gen.close()
    wall = time.perf_counter() - t0
    ttft = [(ts[0] - t0) * 1000 for ts in stamps.values()]
    decode = [1000.0 * (len(ts) - 1) / ((ts[-1] - ts[0]) * 1000) for ts in stamps.values() if len(ts) > 1]
    generated = [len(ts) for ts in stamps.values()]
    return dict(engine=f"mlx-lm {mlx_lm.__version__} BatchGenerator ({mx.default_device()})", device=None,
                attention="-", kv_cache="-", batch_size=b, prefill_chunk=None, prompt_tokens=len(prompts[0]),
                generated=statistics.median(generated), generated_total=sum(generated),
                time_to_first_token_ms=statistics.fmean(ttft),
                decode_tokens_per_second=statistics.fmean(decode) if decode else 0.0,
                aggregate_decode_tokens_per_second=sum(decode), total_tokens_per_second=sum(generated) / wall,
                peak_memory_mb=mx.get_peak_memory() / (1024 * 1024), wall_s=wall,
                intervals=[(y - x) * 1000 for ts in stamps.values() for x, y in zip(ts, ts[1:])], kind="case")


def mlx_lm_rows(path, cases, n_gen, runs, batches=(1,)):
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    with tempfile.TemporaryDirectory() as tmp:
        model, _ = load_model(__import__("pathlib").Path(write_mlx_lm_model(path, tmp)))
    rows = []
    for b in (x for x in batches if x > 1):
        for n in cases:
            prompts = [prompt_ids(n, model.args.vocab_size, seed=i) for i in range(b)]  # bench.py's prompts
            mlx_lm_batch_run(model, [p[:min(n, 16)] for p in prompts], 4)  # warm-up, as bench.py's
            row = summarize([mlx_lm_batch_run(model, prompts, n_gen) for _ in range(runs)])
            row.update(max_tokens=n_gen)
            rows.append(row)
    for n in (cases if 1 in batches else []):
        ids = mx.array(prompt_ids(n, model.args.vocab_size))
        per_run = []
        for r in range(runs + 1):
            mx.reset_peak_memory()
            times, t0 = [], time.perf_counter()
            for i, (tok, _) in enumerate(generate_step(ids, model, max_tokens=n_gen)):
                now = time.perf_counter()
                times.append((now - t0) * 1000)
                t0 = now
            if r:
                per_run.append(_row(f"mlx-lm {mlx_lm.__version__} ({mx.default_device()})", n, times[0], times[1:],
                                    mx.get_peak_memory() / (1024 * 1024)))
        rows.append(summarize(per_run))
    return rows


def run_peers(names, path, cases, n_gen, runs, threads, batches=(1,)):
    """Each peer in its own process, so a peer that crashes (llama.cpp builds that use CPU features the
    machine reports but cannot run die with SIGILL) costs its rows, not the benchmark."""
    import subprocess

    rows, notes = [], []
    for name in names:
        cmd = [sys.executable, os.path.abspath(__file__), name, path, ",".join(map(str, cases)), str(n_gen),
               str(runs), str(threads), ",".join(map(str, batches))]
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        rows += got
        if r.returncode != 0:
            why = f"signal {-r.returncode}" if r.returncode < 0 else (r.stderr.strip().splitlines() or ["?"])[-1]
            notes.append(f"peer {name}: failed ({why}); no row")
        elif not got:
            notes.append(f"peer {name}: not installed; no row")
    for n in notes:
        print(n, file=sys.stderr)
    return rows, notes


def _main():
    name, path, cases, n_gen, runs, threads = sys.argv[1:7]
    cases = [int(c) for c in cases.split(",") if c]
    batches = [int(b) for b in (sys.argv[7] if len(sys.argv) > 7 else "1").split(",") if b]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        if name == "llama.cpp":
            rows = llama_cpp_rows(path, cases, int(n_gen), int(runs), int(threads)) if 1 in batches else []
        elif name == "mlx-lm":
            rows = mlx_lm_rows(path, cases, int(n_gen), int(runs), batches)
        else:
            raise SystemExit(f"unknown peer {name!r}")
    except ImportError:
        return
    for r in rows:
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    _main()
