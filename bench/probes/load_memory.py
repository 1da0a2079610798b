"""Memory used by opening and loading a large GGUF file (hardening: no eager reads, bounded memory).

    python3 bench/probes/load_memory.py [PATH]     # default: a Qwen3-0.6B-shaped all-F32 file (~2.4 GB), made if absent

Each measurement runs in a fresh process and reports peak RSS split into anonymous memory (what the
process allocated) and file-backed pages (the memory-mapped model file, shared with the page cache and
reclaimable).
"""

import os
import subprocess
import sys

STEPS = {
    "parse (header, metadata, tensor index)": "from mlxinfer.gguf_file import GGUFFile; g = GGUFFile(P)",
    "parse + tokenizer": "from mlxinfer.gguf_file import GGUFFile; from mlxinfer.tokenizer import GGUFTokenizer; "
                         "g = GGUFFile(P); t = GGUFTokenizer.from_metadata(g.metadata)",
    "load, cpu backend": "import mlxinfer; e = mlxinfer.load(P, backend='cpu')",
    "load + 1 token, cpu backend": "import mlxinfer; e = mlxinfer.load(P, backend='cpu'); e.generate([1, 2, 3], max_tokens=1)",
    "load, mlx backend": "import mlxinfer; e = mlxinfer.load(P, backend='mlx')",
}
PROBE = """
import sys; P = sys.argv[1]
{code}
st = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)
kb = lambda k: int(st[k].split()[0]) if k in st else 0
print(kb('VmHWM'), kb('RssAnon'), kb('RssFile'))
"""


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default=None,
                   help="GGUF file (default: a Qwen3-0.6B-shaped all-F32 file in mlxinfer's cache, ~2.4 GB, made if absent)")
    a = p.parse_args(argv)
    if a.path:
        path = a.path
    else:
        from mlxinfer.benchmark import SYNTHETIC
        from mlxinfer.model_source import cache_dir
        from mlxinfer.synthetic import write_synthetic_model

        path = str(cache_dir() / "qwen3-0.6b-synthetic-f32.gguf")
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_synthetic_model(path, SYNTHETIC["qwen3-0.6b-synthetic"], qtype="F32")
    size = os.path.getsize(path)
    print(f"file: {path} ({size / 1e9:.2f} GB)\n")
    print("| step | peak RSS | anonymous | file-backed (mmap) |\n|---|---|---|---|")
    for name, code in STEPS.items():
        r = subprocess.run([sys.executable, "-c", PROBE.format(code=code), path], capture_output=True, text=True)
        if r.returncode:
            print(f"| {name} | failed: {r.stderr.strip().splitlines()[-1]} | | |")
            continue
        hwm, anon, filed = map(int, r.stdout.split()[-3:])
        print(f"| {name} | {hwm / 1e6:.2f} GB | {anon / 1e6:.2f} GB | {filed / 1e6:.2f} GB |", flush=True)


if __name__ == "__main__":
    main()
