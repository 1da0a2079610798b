"""Time to read a GGUF file's metadata and build its tokenizer (the 152k-token Qwen vocabulary).

    python3 bench/probes/vocab_load.py [PATH] [--gguf-reader]

--gguf-reader also times `gguf.GGUFReader` on the same file for comparison (~50 s here).
"""

import os
import statistics
import time

from mlxinfer.gguf_file import GGUFFile
from mlxinfer.tokenizer import GGUFTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default=os.path.join(ROOT, "tests", "data", "ggml-vocab-qwen2.gguf"),
                   help="GGUF file (default: tests/data/ggml-vocab-qwen2.gguf)")
    p.add_argument("--gguf-reader", action="store_true", help="also time gguf.GGUFReader on the same file")
    a = p.parse_args(argv)
    path = a.path
    meta, tok = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        g = GGUFFile(path)
        t1 = time.perf_counter()
        GGUFTokenizer.from_metadata(g.metadata, source=path)
        t2 = time.perf_counter()
        g.close()
        meta.append(t1 - t0)
        tok.append(t2 - t1)
    print(f"{path}: metadata {statistics.median(meta):.3f} s, tokenizer {statistics.median(tok):.3f} s, "
          f"together {statistics.median(m + t for m, t in zip(meta, tok)):.3f} s (median of 5)")
    if a.gguf_reader:
        import gguf

        t0 = time.perf_counter()
        gguf.GGUFReader(path)
        print(f"gguf.GGUFReader: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
