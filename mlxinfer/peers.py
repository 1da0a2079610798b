"""The peer engines of `mlxinfer bench --peers`, on the same weights and the same prompts as ours, each
only where its package is installed:

- mlx-lm (`pip install mlx-lm`): the GGUF's weights as an mlx-lm model directory. MLX's own GGUF reader
  (`mx.load`) gives Q8_0, Q4_0 and Q4_1 tensors as MLX affine group-32 quantized weights, the same bits
  our MLX backend multiplies; other tensors as it reads them. Scales, biases and float weights are cast
  to the dtype asked (`--peer-dtypes`): float32 computes as ours does, bfloat16 is what mlx-lm's users
  run (its conversions default to the checkpoint's bfloat16). Batch 1 is `generate_step`; batch B is
  `BatchGenerator` (what `batch_generate` and `mlx_lm.server` run) on the same B prompts as our
  generate_batch rows, all inserted at once, every sequence running to the token budget.
- llama.cpp (`pip install llama-cpp-python`): the same GGUF file, the same thread count, greedy, batch 1.

Each peer runs in a process of its own (`python -m mlxinfer.peers`, the job as JSON on stdin, one JSON
row per line on stdout), so that a peer that crashes (llama.cpp builds that use CPU features the machine
reports but cannot run die with SIGILL) costs its rows, not the benchmark. Rows are shaped like
`mlxinfer.benchmark`'s: medians over runs with their min and max. Peak memory: MLX's peak allocation for
mlx-lm; not measured for llama.cpp (0).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from .errors import UnsupportedError
from .gguf_file import GGUFFile

# GGUF types that MLX's own reader (`mx.load`) returns with the file's exact values: as floats, or
# quantized with the same bits (affine, group 32); the mlx-lm peer gets every other type dequantized by
# gguf-py, as float
MX_LOAD_EXACT = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0,
                 GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1}
from .models import model_args
from .models.spec import tensors

ROOT = str(Path(__file__).resolve().parent.parent)  # the folder holding this mlxinfer: children import it
PEERS = {"mlx-lm": "mlx_lm", "llama.cpp": "llama_cpp"}  # peer name -> the module its package installs
PEER_ARCHITECTURES = ("llama", "qwen3")  # what write_mlx_lm_model converts (Gemma's norms are named otherwise)
PEER_DTYPES = ("float32", "bfloat16", "float16")  # mlx-lm's weights and activations
SPREAD_KEYS = ("time_to_first_token_ms", "decode_tokens_per_second", "total_tokens_per_second",
               "aggregate_decode_tokens_per_second", "peak_memory_mb", "wall_s")


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n token ids below the vocabulary's control tokens (the last few ids of our synthetic and of the
    real vocabularies' added tokens), fixed per n and seed: batch row b of every engine gets seed b."""
    rng = np.random.default_rng(seed + n)
    return rng.integers(0, min(vocab - 300, 50000) if vocab > 600 else 256, size=n).tolist()


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
    out.update(token_interval_ms_min=min(intervals), token_interval_ms_mean=statistics.fmean(intervals),
               token_interval_ms_max=max(intervals), runs=len(per_run))
    return out


def _run(engine, device, n_prompt, ttft, decode_times, peak_mb):
    """A peer's run of one sequence, shaped like the benchmark's per-run dicts."""
    wall_ms = ttft + sum(decode_times)
    return dict(engine=engine, device=device, attention="-", kv_cache="-", batch_size=1, prompt_tokens=n_prompt,
                generated=len(decode_times) + 1, time_to_first_token_ms=ttft,
                decode_tokens_per_second=1000.0 * len(decode_times) / sum(decode_times) if decode_times else 0.0,
                total_tokens_per_second=1000.0 * (len(decode_times) + 1) / wall_ms,
                peak_memory_mb=peak_mb, wall_s=wall_ms / 1000, intervals=list(decode_times))


def llama_cpp_rows(job) -> list[dict]:
    import llama_cpp

    threads = job["threads"]
    n_ctx = max(2048, max(job["prompts"]) + job["gen"])
    # n_batch = n_ctx: llama-cpp-python keeps last-token logits in an n_batch-row array when logits_all
    # is off and indexes it by position, which fails past n_batch.
    llm = llama_cpp.Llama(model_path=job["model"], n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                          n_threads_batch=threads, verbose=False, logits_all=False)
    name = f"llama.cpp {llama_cpp.__version__} ({threads} threads)"
    rows = []
    for n in job["prompts"]:
        ids = prompt_ids(n, llm.n_vocab())
        per_run = []
        for r in range(job["runs"] + 1):  # the first run is the warm-up
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            ttft = (time.perf_counter() - t0) * 1000
            times = []
            for _ in range(job["gen"] - 1):
                t0 = time.perf_counter()
                llm.eval([tok])
                tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                times.append((time.perf_counter() - t0) * 1000)
            if r:
                per_run.append(_run(name, "cpu", n, ttft, times, 0.0))
        rows.append(dict(summarize(per_run), max_tokens=job["gen"]))
    return rows


def _mlx_lm_weights(g, gguf: dict, args, cast) -> tuple[dict, dict]:
    """(mlx-lm weights by name, bits by module of each quantized one) from the GGUF `g`, whose tensors
    `mx.load` read into `gguf`: those of a type it reads exactly as they are, the others dequantized by
    gguf-py."""
    import mlx.core as mx

    weights, module_bits = {}, {}  # module_bits: mlx-lm module path -> bits, for every quantized tensor
    for _, _, name, hf_name, _ in tensors(args):
        if not hf_name.endswith(".weight"):
            raise ValueError(f"{name}: Hugging Face name {hf_name!r} does not end in '.weight'")
        key, base = hf_name[:-len(".weight")], name[:-len(".weight")]
        if g.tensor(name).ggml_type not in MX_LOAD_EXACT:  # mx.load mis-decodes Q4_K, rounds BF16 to F16
            weights[key + ".weight"] = mx.array(g.dequantize(name)).astype(cast)
        elif base + ".scales" in gguf:
            w, scales = gguf[name], gguf[base + ".scales"]
            weights[key + ".weight"] = w
            weights[key + ".scales"] = scales.astype(cast)
            weights[key + ".biases"] = gguf[base + ".biases"].astype(cast)
            module_bits[key] = w.shape[-1] // scales.shape[-1]  # 32-bit words per group of 32 inputs
        else:
            weights[key + ".weight"] = gguf[name].astype(cast)
    return weights, module_bits


def _mlx_lm_random_quantized(args, cast, bits: int, group: int) -> tuple[dict, dict]:
    """(weights, module_bits) of `args`' shapes: random normal matrices (std 1/sqrt(in), the embedding 1)
    quantized by mx.quantize to `bits` with `group`, as `mlx_lm.convert -q` quantizes a checkpoint; norms
    ones. For speed rows beside a file of another quantization (a Q4_K_M against mlx-lm's 4-bit): the
    values are not the file's, the shapes and byte counts per weight are mlx-lm's own format's."""
    import mlx.core as mx

    weights, module_bits = {}, {}
    key = mx.random.key(0)
    for _, _, _, hf_name, shape in tensors(args):
        name = hf_name[:-len(".weight")]
        if len(shape) == 1:
            weights[hf_name] = mx.ones(shape, dtype=cast)
            continue
        key, sub = mx.random.split(key)
        w = mx.random.normal(shape, key=sub) * (1.0 if "embed" in name else shape[1] ** -0.5)
        q, scales, biases = mx.quantize(w, group_size=group, bits=bits)
        weights.update({hf_name: q, name + ".scales": scales.astype(cast), name + ".biases": biases.astype(cast)})
        module_bits[name] = bits
        mx.eval(q, scales, biases)
    return weights, module_bits


def write_mlx_lm_model(path, out_dir, dtype: str = "float32", quant: tuple[int, int] | None = None) -> str:
    """The GGUF's weights as an mlx-lm model directory (config.json + model.safetensors), floats in
    `dtype`; with `quant` (bits, group) random weights of its shapes quantized that way instead
    (`_mlx_lm_random_quantized`). Names come from the model spec (`mlxinfer.models.spec.tensors`): an
    mlx-lm module path is the Hugging Face name without its trailing ".weight"."""
    import mlx.core as mx

    cast = getattr(mx, dtype)
    with GGUFFile(path) as g:
        args = model_args(g)
        if args.arch not in PEER_ARCHITECTURES or args.n_experts:
            raise UnsupportedError(f"{g.path}: the mlx-lm peer is written for dense {' and '.join(PEER_ARCHITECTURES)} "
                                   f"files, not {args.arch} (its Hugging Face names and config are not mapped)")
        if quant:
            weights, module_bits = _mlx_lm_random_quantized(args, cast, *quant)
        else:
            weights, module_bits = _mlx_lm_weights(g, mx.load(str(path)), args, cast)
    config = {
        "model_type": args.arch, "hidden_size": args.hidden, "num_hidden_layers": args.n_layers,
        "intermediate_size": args.ffn, "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim, "rms_norm_eps": args.rms_eps, "vocab_size": args.vocab_size,
        "rope_theta": args.rope_base, "tie_word_embeddings": args.tied_output,
        "max_position_embeddings": args.context_length,
        "rope_traditional": args.rope_traditional,  # llama GGUFs keep Q/K permuted for interleaved RoPE
        "torch_dtype": dtype,
    }
    if module_bits:
        # mlx-lm's quantization config: a default, plus per-module entries where a file mixes types
        # (SmolLM2: Q4_1 blocks, Q8_0 embedding); float modules are marked False.
        default = max(set(module_bits.values()), key=list(module_bits.values()).count)
        group = quant[1] if quant else 32
        q = {"group_size": group, "bits": default}
        for key, bits in module_bits.items():
            if bits != default:
                q[key] = {"group_size": group, "bits": bits}
        for key in {k.rsplit(".", 1)[0] for k in weights if k.endswith(".weight")} - set(module_bits):
            if not key.endswith(("norm", "layernorm")):
                q[key] = False
        config["quantization"] = q
    os.makedirs(out_dir, exist_ok=True)
    mx.save_safetensors(os.path.join(out_dir, "model.safetensors"), weights)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return str(out_dir)


def mlx_lm_batch_run(model, name, device, prompts, n_gen) -> dict:
    """One BatchGenerator run over `prompts` (B > 1), shaped like the benchmark's generate_batch runs."""
    import mlx.core as mx
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
    decode = [(len(ts) - 1) / (ts[-1] - ts[0]) for ts in stamps.values() if len(ts) > 1]
    generated = [len(ts) for ts in stamps.values()]
    return dict(engine=name, device=device, attention="-", kv_cache="-", batch_size=b, prompt_tokens=len(prompts[0]),
                generated=statistics.median(generated), generated_total=sum(generated),
                time_to_first_token_ms=statistics.fmean(ttft),
                decode_tokens_per_second=statistics.fmean(decode) if decode else 0.0,
                aggregate_decode_tokens_per_second=sum(decode), total_tokens_per_second=sum(generated) / wall,
                peak_memory_mb=mx.get_peak_memory() / (1024 * 1024), wall_s=wall,
                intervals=[(y - x) * 1000 for ts in stamps.values() for x, y in zip(ts, ts[1:])])


def mlx_lm_rows(job) -> list[dict]:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    mx.set_default_device(mx.gpu if job["device"] == "gpu" else mx.cpu)
    folder = Path(job["dir"])
    if not (folder / "config.json").exists():  # written once per dtype, by the first round's process
        write_mlx_lm_model(job["model"], folder, job["dtype"], job.get("quant"))
    model, _ = load_model(folder)
    quant = "{}-bit g{}, ".format(*job["quant"]) if job.get("quant") else ""
    name = f"mlx-lm {mlx_lm.__version__} ({quant}{job['dtype']})"
    n_gen, runs, vocab = job["gen"], job["runs"], model.args.vocab_size
    rows = []
    for b in (x for x in job["batches"] if x > 1):
        for n in job["prompts"]:
            prompts = [prompt_ids(n, vocab, seed=i) for i in range(b)]
            mlx_lm_batch_run(model, name, job["device"], prompts, n_gen)  # warm-up: the same shapes as the runs
            rows.append(dict(summarize([mlx_lm_batch_run(model, name, job["device"], prompts, n_gen)
                                        for _ in range(runs)]), max_tokens=n_gen))
    for n in (job["prompts"] if 1 in job["batches"] else []):
        ids = mx.array(prompt_ids(n, vocab))
        per_run = []
        for r in range(runs + 1):  # the first run is the warm-up
            mx.reset_peak_memory()
            times, t0 = [], time.perf_counter()
            for _ in generate_step(ids, model, max_tokens=n_gen):
                now = time.perf_counter()
                times.append((now - t0) * 1000)
                t0 = now
            if r:
                per_run.append(_run(name, job["device"], n, times[0], times[1:], mx.get_peak_memory() / (1024 * 1024)))
        rows.append(dict(summarize(per_run), max_tokens=n_gen))
    return rows


def installed(peer: str) -> bool:
    return find_spec(PEERS[peer]) is not None


def run_peer(job) -> tuple[list[dict], str | None]:
    """The rows of one peer job, measured in a child process; and a one-line note when it failed."""
    r = subprocess.run([sys.executable, "-m", "mlxinfer.peers"], input=json.dumps(job), capture_output=True,
                       text=True, cwd=ROOT)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode == 0:
        return rows, None
    why = f"signal {-r.returncode}" if r.returncode < 0 else (r.stderr.strip().splitlines() or ["?"])[-1]
    return rows, f"peer {job['peer']}: failed ({why})"


if __name__ == "__main__":
    job = json.loads(sys.stdin.read())
    for row in (mlx_lm_rows if job["peer"] == "mlx-lm" else llama_cpp_rows)(job):
        print(json.dumps(row), flush=True)
