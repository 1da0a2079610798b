"""Runs the `mlxinfer` command with module constants changed first, to time one setting against
another in one call (an A/B of a default), e.g. affine products of many rows through MLX's
quantized_matmul as before `DENSE_MIN_ROWS`:

    python3 bench/probes/setting.py mlxinfer.backends.mlx.DENSE_MIN_ROWS=None -- bench -m ... --out DIR

Each NAME=VALUE before `--` sets a module's constant (VALUE read as a Python literal); the rest is the
command's arguments. `mlxinfer bench` measures each row in a child process (`benchmark.CHILD`): this
script puts itself in front of that child with the same settings (`setting.py --child NAME=VALUE ...`,
which applies them, then runs `benchmark.child_main`), so the row runs with them (before 2026-12-06
21:00 it did not: a bench "A/B" through this script ran the default both ways). Both processes import
this checkout's mlxinfer (its root first on sys.path), not an installed copy. A constant that another
module copied at import (`from m import NAME`) is not reached. The bench's header does not name the
change: the output folder should.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # this checkout's mlxinfer, in this process and in the rows' children


def apply(items: list[str]) -> None:
    """Sets each MODULE.NAME=VALUE (a module's existing constant), saying so on stderr."""
    for item in items:
        target, _, value = item.partition("=")
        module, _, name = target.rpartition(".")
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise SystemExit(f"setting.py: {module} has no {name}")
        setattr(mod, name, ast.literal_eval(value))
        print(f"setting.py: {target} = {getattr(mod, name)!r}", file=sys.stderr)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:  # a bench row's child (benchmark.CHILD), the settings after the flag
        apply(argv[1:])
        from mlxinfer import benchmark

        benchmark.child_main()
        return 0
    if "--" not in argv:
        raise SystemExit("usage: setting.py MODULE.NAME=VALUE ... -- MLXINFER-ARGS ...")
    cut = argv.index("--")
    apply(argv[:cut])
    from mlxinfer import benchmark
    from mlxinfer.cli import main as mlxinfer_main

    benchmark.CHILD = [sys.executable, os.path.abspath(__file__), "--child", *argv[:cut]]
    return mlxinfer_main(argv[cut + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
