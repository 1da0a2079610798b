"""The catalogue of deliberate bugs (tests/mutants.py) stays runnable: every entry's edits apply to the
code as it is now (each old string occurs exactly once in its file) and every test it names exists, so
that moving code cannot silently turn an entry into one that catches nothing ("DOES NOT APPLY")."""

import os
import re

import pytest

from . import mutants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("bug", mutants.M, ids=[b[0] for b in mutants.M])
def test_every_entry_applies_and_names_existing_tests(bug):
    mid, _, name, edits, tests, _ = bug
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        source = f.read()
    for old, new in edits:
        assert source.count(old) == 1, f"{mid}: its string occurs {source.count(old)} times in {name}: {old[:80]!r}"
        assert old != new, f"{mid}: an edit that changes nothing"
    for test in tests:
        path, _, func = test.partition("::")
        assert os.path.isfile(os.path.join(ROOT, path)), f"{mid}: no test file {path}"
        if func:
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                assert re.search(rf"^def {re.escape(func.split('[')[0])}\(", f.read(), re.M), f"{mid}: no test {test}"


def test_ids_are_unique():
    ids = [b[0] for b in mutants.M]
    assert len(ids) == len(set(ids))
