"""The GPU self-check's verdicts kept per machine and code (mlxinfer/backends/kernel_checks.py): run once,
then read back in this process and in the next; any change of key (dtypes, code, MLX, device) runs it
again; a damaged file runs it again; an unwritable one warns in one line. (No GPU needed: the check is
a stand-in that counts its runs.)"""

import json

import pytest

from mlxinfer.backends import kernel_checks


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_checks, "_file", lambda: tmp_path / "kernel-checks.json")
    monkeypatch.setattr(kernel_checks, "_VERDICTS", {})
    monkeypatch.setattr(kernel_checks, "device_name", lambda kind: "Test GPU")
    runs = []

    def check(problem=None):
        def run():
            runs.append(problem)
            return problem
        return run

    return tmp_path / "kernel-checks.json", runs, check


def test_a_verdict_is_kept_in_the_process_and_on_disk(store, monkeypatch):
    path, runs, check = store
    assert kernel_checks.verdict("cuda", "float32", "float32", check()) is None
    assert kernel_checks.verdict("cuda", "float32", "float32", check("never run")) is None
    assert len(runs) == 1
    monkeypatch.setattr(kernel_checks, "_VERDICTS", {})  # the next process
    assert kernel_checks.verdict("cuda", "float32", "float32", check("never run")) is None
    assert len(runs) == 1
    assert list(json.loads(path.read_text()).values()) == [{"problem": None}]


def test_a_failure_is_kept_too_and_another_key_checks_again(store):
    _, runs, check = store
    assert kernel_checks.verdict("cuda", "bfloat16", "q8_0", check("kernel differs")) == "kernel differs"
    assert kernel_checks.verdict("cuda", "bfloat16", "q8_0", check()) == "kernel differs"
    assert kernel_checks.verdict("cuda", "bfloat16", "bfloat16", check()) is None  # another KV dtype
    assert kernel_checks.verdict("metal", "bfloat16", "q8_0", check()) is None  # another GPU kind
    assert runs == ["kernel differs", None, None]


def test_fresh_runs_it_again_and_keeps_the_new_verdict(store, monkeypatch):
    """`mlxinfer inspect --kernels` asks for a fresh run: the check runs whatever is remembered, and its
    verdict replaces the old one for the next process."""
    _, runs, check = store
    kernel_checks.verdict("cuda", "float32", "float32", check())
    assert kernel_checks.verdict("cuda", "float32", "float32", check("now differs"), fresh=True) == "now differs"
    monkeypatch.setattr(kernel_checks, "_VERDICTS", {})
    assert kernel_checks.verdict("cuda", "float32", "float32", check()) == "now differs"
    assert runs == [None, "now differs"]


def test_the_key_follows_the_code(store, monkeypatch):
    _, runs, check = store
    kernel_checks.verdict("cuda", "float32", "float32", check())
    monkeypatch.setattr(kernel_checks, "sources_digest", lambda: "another-version")
    kernel_checks.verdict("cuda", "float32", "float32", check())
    assert len(runs) == 2


def test_the_digest_covers_the_kernel_sources():
    kernel_checks.sources_digest.cache_clear()
    files = [n for n in kernel_checks.SOURCES]
    assert "../metal_kernels" in files and "backends/mlx.py" in files and "backend.py" in files
    assert len(kernel_checks.sources_digest()) == 16


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"k": 3}'])
def test_a_damaged_file_means_checking_again(store, damage, monkeypatch):
    path, runs, check = store
    path.write_text(damage)
    assert kernel_checks.verdict("cuda", "float32", "float32", check()) is None
    assert len(runs) == 1


def test_an_unwritable_store_warns_once_and_still_answers(store, monkeypatch, capsys, tmp_path):
    _, runs, check = store
    (tmp_path / "blocked").write_text("a file where the folder should be")
    monkeypatch.setattr(kernel_checks, "_file", lambda: tmp_path / "blocked" / "kernel-checks.json")
    assert kernel_checks.verdict("cuda", "float32", "float32", check()) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlxinfer: warning: cannot keep the kernel self-check's verdict")
