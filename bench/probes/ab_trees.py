"""A/B of two versions of the engine on one machine, by decode token intervals (issue 10's way of telling
a change from a lent GPU's drift).

A lent machine's host speed moves by up to 2x over minutes, and a decode token of a 0.6B model is
host-bound, so two single runs of `mlxinfer bench` minutes apart cannot tell a 10% change (2026-11-30 23:20:
one build's tok/s moved 2.3x within four minutes). This runs `bench/probes/step_profile.py --engines ours` from
each tree in turn, `--rounds` times, alternating which goes first (A B, B A, A B, ...), each run in its
own process, and compares the median interval between decode tokens (each run's median over
2 x --gen tokens; step_profile's `interval_ms`): per round and case, then the median over rounds and in
how many rounds B's was shorter.

    python3 bench/probes/ab_trees.py --a HEAD~1 --b HEAD --out /tmp/ab            # trees made with git archive
    python3 bench/probes/ab_trees.py --a-tree /path/a --b-tree /path/b --out /tmp/ab   # trees already there (a
                                                                            # lent GPU's copy has no usable git)

Writes OUT/ab.jsonl (every run's rows, with "tree" and "round") and prints the comparison. Both trees
share one model file (in mlxinfer's cache). `--device cpu` tries it here (MLX's CPU device).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from mlxinfer.model_source import cache_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARTS = ["mlxinfer", "metal_kernels", "bench"]  # what a tree needs to run its step_profile.py


def make_tree(rev: str, dst: str) -> str:
    """The engine of git revision `rev` of this checkout, extracted into dst (git archive)."""
    os.makedirs(dst, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, *PARTS], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", dst], input=archive, check=True)
    return dst


def profile_script(tree: str) -> tuple[str, list[str]]:
    """The tree's step_profile.py, and the options its version needs: before bench/probes/ it lived in
    bench/ and took the model folder as --cache."""
    script = os.path.join(tree, "bench", "probes", "step_profile.py")
    if os.path.isfile(script):
        return script, []
    return os.path.join(tree, "bench", "step_profile.py"), ["--cache", str(cache_dir())]


def run_profile(tree: str, args) -> list[dict]:
    """One step_profile.py run of ours from `tree` (its own engine first on the path); its JSON rows."""
    script, extra = profile_script(tree)
    cmd = [sys.executable, script, "--engines", "ours", "--cases", args.cases, "--gen", str(args.gen),
           "--model", args.model, "--device", args.device, *extra]
    r = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=args.timeout,
                       env=dict(os.environ, PYTHONPATH=tree))
    if r.returncode != 0:
        raise SystemExit(f"ab_trees: step_profile in {tree} failed (exit {r.returncode}): "
                         f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def compare(rows: list[dict]) -> str:
    """The table of intervals by round and case, then per case the medians and B's wins."""
    cases = sorted({r["prompt"] for r in rows})
    by = {(r["round"], r["tree"], r["prompt"]): r["interval_ms"] for r in rows}
    rounds = sorted({r["round"] for r in rows})
    out = ["| round | first | " + " | ".join(f"A, {n} | B, {n}" for n in cases) + " |",
           "|---|---|" + "---|---|" * len(cases)]
    for k in rounds:
        cells = [f"{by.get((k, t, n), float('nan')):.3f}" for n in cases for t in "AB"]
        out.append(f"| {k} | {'A' if k % 2 else 'B'} | " + " | ".join(cells) + " |")
    out.append("")
    for n in cases:
        pairs = [(by[(k, "A", n)], by[(k, "B", n)]) for k in rounds if (k, "A", n) in by and (k, "B", n) in by]
        if not pairs:
            continue
        a, b = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        out.append(f"prompt {n}: median interval A {a:.3f} ms, B {b:.3f} ms (B/A {b / a:.3f}; "
                   f"{1000 / a:.1f} vs {1000 / b:.1f} tok/s); B shorter in {sum(y < x for x, y in pairs)} of "
                   f"{len(pairs)} rounds")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", help="git revision of tree A (extracted under OUT/a)")
    p.add_argument("--b", help="git revision of tree B (extracted under OUT/b)")
    p.add_argument("--a-tree", help="tree A as a folder holding mlxinfer/, metal_kernels/, bench/")
    p.add_argument("--b-tree", help="tree B, likewise")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--cases", default="17,511")
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--model", default="qwen3-0.6b-synthetic", help="as mlxinfer bench's --model")
    p.add_argument("--device", default="gpu")
    p.add_argument("--timeout", type=int, default=300, help="seconds a run may take")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds needs at least 1")
    trees = {}
    for t in "AB":
        rev, tree = getattr(a, t.lower()), getattr(a, f"{t.lower()}_tree")
        if (rev is None) == (tree is None):
            p.error(f"give exactly one of --{t.lower()} and --{t.lower()}-tree")
        if tree is not None and not os.path.isfile(profile_script(tree)[0]):
            p.error(f"--{t.lower()}-tree {tree}: no bench/probes/step_profile.py (or bench/step_profile.py) there")
        trees[t] = os.path.abspath(tree) if tree else make_tree(rev, os.path.join(a.out, t.lower()))
    os.makedirs(a.out, exist_ok=True)
    rows = []
    with open(os.path.join(a.out, "ab.jsonl"), "a") as log:
        for k in range(1, a.rounds + 1):
            for t in ("AB" if k % 2 else "BA"):
                got = run_profile(trees[t], a)
                for r in got:
                    r.update(tree=t, round=k)
                    print(json.dumps(r), file=log, flush=True)
                rows += got
                print(f"round {k} {t}: " + ", ".join(f"{r['prompt']}: {r['interval_ms']:.3f} ms" for r in got),
                      file=sys.stderr, flush=True)
    print(compare(rows))


if __name__ == "__main__":
    main()
