"""Runs the `mlxinfer` command with module constants changed first, to time one setting against
another in one call (an A/B of a default), e.g. affine products of many rows through MLX's
quantized_matmul as before `DENSE_MIN_ROWS`:

    python3 bench/probes/setting.py mlxinfer.backends.mlx.DENSE_MIN_ROWS=None -- bench -m ... --out DIR

Each NAME=VALUE before `--` sets a module's constant (VALUE read as a Python literal); the rest is the
command's arguments. The bench's header does not name the change: the output folder should.
"""

from __future__ import annotations

import ast
import importlib
import sys


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit("usage: setting.py MODULE.NAME=VALUE ... -- MLXINFER-ARGS ...")
    cut = argv.index("--")
    for item in argv[:cut]:
        target, _, value = item.partition("=")
        module, _, name = target.rpartition(".")
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise SystemExit(f"setting.py: {module} has no {name}")
        setattr(mod, name, ast.literal_eval(value))
        print(f"setting.py: {target} = {getattr(mod, name)!r}", file=sys.stderr)
    from mlxinfer.cli import main as mlxinfer_main

    return mlxinfer_main(argv[cut + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
