"""The probes' output: a result row as a JSON line on stdout, appended to a file too when one is given."""

import json


def emit(row: dict, out: str | None) -> None:
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
