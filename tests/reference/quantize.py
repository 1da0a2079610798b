"""Quantized GGUF files made the way users get them, by llama.cpp's own quantizer, and their perplexity
in llama.cpp beside ours.

    python3 -m tests.reference.quantize make                 # the files, into $MLXINFER_CACHE/quantized
    python3 -m tests.reference.quantize ppl --ctx 256        # llama.cpp vs ours (cpu, mlx): a table
    python3 -m tests.reference.quantize mixes                # llama.cpp's per-tensor types -> quant_mixes.json

`make` writes two sources and quantizes each with `llama_cpp.llama_model_quantize` and
`llama_model_quantize_default_params()` (what `llama-quantize SRC DST TYPE` does) into each preset in
PRESETS; files already there are kept. The sources:
- SmolLM2-135M-Instruct's F32 copy (`mlxinfer.synthetic.write_f32_copy` of the default Q4_1 file: its
  values are the Q4_1 file's, which is what we have; the presets re-quantize them);
- a synthetic Qwen3-shaped F16 file (random weights): Qwen3-0.6B's layer shape (hidden 1024, 16 query
  and 8 KV heads of 128, FFN 3072) but 4 layers and a vocabulary of 32,000 instead of 28 and 151,936, so
  that the perplexity runs take minutes on a 2-core machine (0.6B's would take an hour per engine). Its
  token embedding (also the output head: tied) is drawn with std 1024**-0.5, not 1: with std 1 the
  logits had a std of 32.3 (sqrt(hidden)) and a mean nll of 527.3 nats on pep-0257-head.txt (PPL 1e229),
  so llama.cpp's 1e-4 relative arithmetic differences came to 1.5-5.1% of PPL; with 1024**-0.5 the
  logits' std is 1.00 and the mean nll 10.85 (log 32,000 + 1/2: random logits of std 1), a trained
  model's scale (measured 2026-12-04 on the cpu backend, ctx 256). The stem says so (`-e32`: std 1/32),
  so that a cache's files of the old source are not reused.
Its manifest (`manifest.json`) says per file the tensor types llama.cpp chose: the mix a preset gives
differs from its name where a tensor's rows are not a multiple of the type's block (SmolLM2's 576:
256-value K-quant and IQ4_XS blocks do not fit, and llama.cpp falls back to another type).

`ppl` computes each file's perplexity on a text with llama.cpp (llama-cpp-python, logits of every
position, an F32 KV cache, the same windows, BOS and scored halves: `mlxinfer.perplexity`'s) and with
mlxinfer on the cpu backend and on MLX's CPU device, and prints the table for docs/perplexity.md. The
text: PEP 257 from the docutils 0.23 source distribution on PyPI (docs/peps/pep-0257.rst; "This
document has been placed in the public domain"), fetched with `pip download` once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from mlxinfer import load, load_tokenizer
from mlxinfer.errors import MlxinferError
from mlxinfer.gguf_file import GGUFFile
from mlxinfer.model_source import cache_dir, default_model_path
from mlxinfer.perplexity import estimate, perplexity, token_nll, windows
from mlxinfer.synthetic import SyntheticSpec, write_f32_copy, write_synthetic_model

PRESETS = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "Q4_0", "Q5_0", "Q8_0", "IQ4_XS"]
QWEN3_SHAPE = SyntheticSpec("qwen3", n_layers=4, hidden=1024, ffn=3072, n_heads=16, n_kv_heads=8, head_dim=128,
                            vocab_size=32000, context_length=4096, qtype="F16", seed=0, embedding_std=1024 ** -0.5)
QWEN3_STEM = "qwen3-4L-1024-e32"  # embedding (= output head) std 1/32: logits of std ~1
TEXT_PACKAGE, TEXT_MEMBER = "docutils==0.23", "docutils-0.23/docs/peps/pep-0257.rst"


def out_dir() -> Path:
    return cache_dir() / "quantized"


def sources(root: Path) -> dict[str, Path]:
    """The unquantized sources, written once: {stem: path}."""
    root.mkdir(parents=True, exist_ok=True)
    smol = root / "SmolLM2-135M-Instruct.F32.gguf"
    if not smol.exists():
        write_f32_copy(default_model_path(quiet=True), str(smol) + ".part")
        os.replace(str(smol) + ".part", smol)
    qwen = root / f"{QWEN3_STEM}.F16.gguf"
    if not qwen.exists():
        write_synthetic_model(str(qwen) + ".part", QWEN3_SHAPE)
        os.replace(str(qwen) + ".part", qwen)
    return {"SmolLM2-135M-Instruct": smol, QWEN3_STEM: qwen}


def quantize(src: Path, dst: Path, preset: str) -> None:
    """`llama-quantize src dst preset`, through llama-cpp-python, with llama.cpp's default parameters."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{preset}")
    params.nthread = 2
    part = str(dst) + ".part"
    rc = llama_cpp.llama_model_quantize(str(src).encode(), part.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}, {preset}) returned {rc}")
    os.replace(part, dst)


def type_mix(path: Path) -> dict[str, list[str]]:
    """{tensor type: the tensors of that type, layers folded (blk.*.attn_q.weight)}."""
    mix: dict[str, set] = {}
    with GGUFFile(path) as g:
        for name, t in g.tensors.items():
            mix.setdefault(t.ggml_type.name, set()).add(re.sub(r"^blk\.\d+\.", "blk.*.", name))
    return {k: sorted(v) for k, v in sorted(mix.items())}


def make(root: Path | None = None, presets=PRESETS) -> list[dict]:
    """Every source x preset file (made where missing) and the manifest: [{file, source, preset, bytes,
    types}]."""
    root = root or out_dir()
    rows = []
    for stem, src in sources(root).items():
        for preset in presets:
            dst = root / f"{stem}.{preset}.gguf"
            if not dst.exists():
                t0 = time.perf_counter()
                quantize(src, dst, preset)
                print(f"{dst.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            rows.append(dict(file=dst.name, path=str(dst), source=stem, preset=preset, bytes=dst.stat().st_size,
                             types=type_mix(dst)))
    (root / "manifest.json").write_text(json.dumps(rows, indent=1))
    return rows


def public_domain_text(root: Path | None = None) -> str:
    """PEP 257 (public domain) from the docutils source distribution, fetched once with pip."""
    root = root or out_dir()
    path = root / "pep-0257.txt"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                            "-d", tmp, TEXT_PACKAGE], check=True)
            (sdist,) = Path(tmp).glob("docutils-*.tar.gz")
            with tarfile.open(sdist) as t:
                path.write_bytes(t.extractfile(TEXT_MEMBER).read())
    return path.read_text(encoding="utf-8")


def llama_cpp_perplexity(path: str, text: str, ctx: int, ours_tokens: list[int], bos_id: int | None):
    """llama.cpp's PPL and standard error on the same windows: its logits of every position (F32 KV
    cache, one decode per window from an empty cache), scored by the same arithmetic as ours. Its
    tokenization must equal ours (checked), so that the windows are the same tokens."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, type_k=0,
                          type_v=0, n_threads=2, n_threads_batch=2, verbose=False)
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=bos_id is not None, special=False)
    if tokens != ours_tokens:
        first = next((i for i, (a, b) in enumerate(zip(tokens, ours_tokens)) if a != b), min(len(tokens), len(ours_tokens)))
        raise RuntimeError(f"{path}: llama.cpp's tokens differ from ours at {first}")
    first, nll, t0 = ctx // 2, [], time.perf_counter()
    for i, w in enumerate(windows(tokens, ctx, bos_id)):
        llm.reset()
        llm.eval(w)
        logits = np.array(llm.scores[:ctx], dtype=np.float32)
        nll.append(token_nll(logits[first:ctx - 1], np.asarray(tokens[i * ctx + first + 1:(i + 1) * ctx])))
    seconds = time.perf_counter() - t0
    nll = np.concatenate(nll)
    return (*estimate(nll), len(nll), seconds)


def compare(rows: list[dict], text: str, ctx: int, backends=("cpu", "mlx")) -> list[dict]:
    """Each file's PPL in llama.cpp and ours per backend (None where we cannot read the file: the error)."""
    out = []
    for row in rows:
        r = dict(file=row["file"], preset=row["preset"], bytes=row["bytes"], types=sorted(row["types"]))
        tok = load_tokenizer(row["path"])  # (also where we cannot read the weights: llama.cpp's figure still)
        tokens = tok.encode(text, add_special=True, parse_special=False)
        bos = tok.bos_id if tok.add_bos else None
        r["llama.cpp"], r["llama.cpp_stderr"], r["scored"], r["llama.cpp_s"] = \
            llama_cpp_perplexity(row["path"], text, ctx, tokens, bos)
        try:
            engine = load(row["path"], backend="cpu")
        except MlxinferError as e:
            r["error"] = str(e)
            out.append(r)
            print(json.dumps(r), flush=True)
            continue
        for backend in backends:
            try:
                e = engine if backend == "cpu" else load(row["path"], backend=backend, device="cpu")
                res = perplexity(e, text, ctx=ctx, batch=2)
                r[backend], r[backend + "_stderr"], r[backend + "_s"] = res.ppl, res.stderr, res.seconds
                r[backend + "_diff_%"] = 100 * (res.ppl / r["llama.cpp"] - 1)
            except MlxinferError as err:
                r[backend + "_error"] = str(err)
        out.append(r)
        print(json.dumps(r), flush=True)
    return out


def table(results: list[dict]) -> str:
    """The markdown table of docs/perplexity.md; "d nll" is ours minus llama.cpp's mean negative
    log-likelihood in nats (log of the PPL ratio), the figure that does not grow with the PPL itself."""
    lines = ["| file | types | MB | PPL llama.cpp | PPL ours cpu | PPL ours mlx | diff % cpu / mlx | d nll cpu |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        def ppl(k):
            return "n/a" if k not in r else f"{r[k]:.4f}" if r[k] < 1e6 else f"{r[k]:.4e}"

        diff = " / ".join(f"{r[b + '_diff_%']:+.3f}" if b + "_diff_%" in r else "n/a" for b in ("cpu", "mlx"))
        if "error" in r:
            diff = "not read: " + r["error"].split(", which")[0].split(": ", 1)[-1]
        nats = f"{math.log(r['cpu'] / r['llama.cpp']):+.4f}" if "cpu" in r else ""
        stderr = f" ± {r['llama.cpp_stderr']:.3g}" if "llama.cpp_stderr" in r else ""
        lines.append(f"| {r['file']} | {', '.join(r['types'])} | {r['bytes'] / 1e6:.1f} | {ppl('llama.cpp')}{stderr} | "
                     f"{ppl('cpu')} | {ppl('mlx')} | {diff} | {nats} |")
    return "\n".join(lines)


MIX_FIXTURE = Path(__file__).with_name("quant_mixes.json")
MIX_LAYERS = (28, 36)  # Qwen3-0.6B's and Qwen3-8B's layer counts (llama.cpp's choice depends on the layer)


def mixes(root: Path | None = None) -> dict:
    """{"<preset> <layers>L": {tensor: type}} of llama.cpp's quantizer on small Qwen3-shaped F16 files
    (rows of 256, tied and untied output) of MIX_LAYERS layers: what `mlxinfer.synthetic.MIXES` must
    reproduce; written to quant_mixes.json for tests/test_quantized_files.py (no llama.cpp needed there)."""
    root = root or out_dir()
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for layers in MIX_LAYERS:
        for tied in (True, False):
            spec = SyntheticSpec("qwen3", n_layers=layers, hidden=256, ffn=512, n_heads=4, n_kv_heads=2, head_dim=64,
                                 vocab_size=1024, qtype="F16", tied_output=tied, seed=0)
            src = root / f"mix-{layers}L-{'tied' if tied else 'untied'}.F16.gguf"
            if not src.exists():
                write_synthetic_model(str(src), spec)
            for preset in ("Q4_K_M", "Q5_K_M"):
                dst = root / f"{src.stem[:-4]}.{preset}.gguf"
                if not dst.exists():
                    quantize(src, dst, preset)
                with GGUFFile(dst) as g:
                    out[f"{preset} {layers}L {'tied' if tied else 'untied'}"] = {
                        n: t.ggml_type.name for n, t in g.tensors.items() if len(t.shape) == 2}
    MIX_FIXTURE.write_text(json.dumps(out, separators=(",", ":"), sort_keys=True) + "\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["make", "ppl", "mixes"])
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--sources", default=f"SmolLM2-135M-Instruct,{QWEN3_STEM}")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--text", default=None, help="default: PEP 257 from docutils' sdist (public domain)")
    p.add_argument("--backends", default="cpu,mlx")
    p.add_argument("--out", default=None, help="JSON lines of the results")
    a = p.parse_args(argv)
    if a.what == "mixes":
        print(f"{MIX_FIXTURE}: {len(mixes())} files")
        return 0
    rows = [r for r in make() if r["source"] in a.sources.split(",") and r["preset"] in a.presets.split(",")]
    if a.what == "make":
        for r in rows:
            print(f"{r['file']}: {r['bytes'] / 1e6:.1f} MB; {json.dumps(r['types'])}")
        return 0
    text = Path(a.text).read_text(encoding="utf-8") if a.text else public_domain_text()
    results = compare(rows, text, a.ctx, a.backends.split(","))
    if a.out:
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in results))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
