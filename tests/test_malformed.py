"""Hardening: every malformed file of the corpus (tests/malformed.py) fails with its own one-line
message naming the file and the problem; random mutations only ever raise the documented types."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlxinfer
from mlxinfer import cli
from mlxinfer.errors import GGUFError, MlxinferError
from mlxinfer.gguf_file import GGUFFile

from .malformed import cases, valid_model_bytes

VALID = valid_model_bytes(os.environ.get("TMPDIR", "/tmp"))
CASES = list(cases(VALID))


def test_corpus_base_file_is_valid(tmp_path):
    p = tmp_path / "valid.gguf"
    p.write_bytes(VALID)
    assert len(mlxinfer.load(str(p), backend="cpu").generate([1, 2], max_tokens=2).token_ids) == 2


def test_corpus_covers_the_required_kinds():
    names = {c.name for c in CASES}
    for want in ["truncated-header-only", "truncated-mid-tensor-data", "bad-magic", "version-99", "tensor-count-2^40",
                 "metadata-count-2^40", "string-length-past-eof", "string-array-length-2^40", "tensor-offset-past-eof",
                 "tensors-overlap", "tensor-offset-misaligned", "unknown-value-type", "unknown-tensor-type",
                 "head-count-inconsistent", "missing-required-tensor", "vocab-size-differs-from-embedding",
                 "nan-in-norm"]:
        assert want in names


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_malformed_file_gives_its_message(case, tmp_path, capsys):
    p = tmp_path / f"{case.name}.gguf"
    p.write_bytes(case.data)
    if case.stage == "parse":
        with pytest.raises(GGUFError, match=case.pattern) as e:
            GGUFFile(p)
    else:
        GGUFFile(p).close()  # parses fine
        with pytest.raises(MlxinferError, match=case.pattern) as e:
            mlxinfer.load(str(p), backend="cpu")
    assert str(p) in str(e.value) and "\n" not in str(e.value)
    # the CLI: one line on stderr, status 1
    assert cli.main(["generate", "--model", str(p), "--backend", "cpu", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlxinfer: error: ") and str(p) in err[0]


@pytest.fixture(scope="module")
def fuzz_path(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "m.gguf"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # mutated weights may overflow: valid, if useless, data
@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8),
       cut=st.one_of(st.none(), st.integers(0, len(VALID))))
def test_random_mutations_raise_only_documented_errors(fuzz_path, edits, cut):
    data = bytearray(VALID)
    for pos, val in edits:
        data[pos] = val
    if cut is not None:
        data = data[:cut]
    p = fuzz_path
    p.write_bytes(bytes(data))
    try:
        engine = mlxinfer.load(str(p), backend="cpu")
        engine.generate([1, 2, 3], max_tokens=2)
    except MlxinferError:
        pass
