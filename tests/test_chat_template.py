"""Hostile chat templates in a model file: each fails fast, in one line naming the file and the
problem, with bounded memory (issue: a model file's chat template can hang or exhaust the machine)."""

import resource
import subprocess
import sys
import time

import pytest

from mlxinfer.chat import MAX_ITEMS, render_chat
from mlxinfer.errors import RequestError
from mlxinfer.synthetic import CHATML_TEMPLATE, rewrite_gguf, write_synthetic_model

HOSTILE = {
    "huge string": ("{{ 'x' * 1000000000 }}", "builds a value of 1000000000 items"),
    "chained products": ("{% set s = 'x' * 1000 %}{{ s * 1000 * 1000 }}", "builds a value of"),
    "huge list": ("{{ [0] * 10 ** 9 }}", "builds a value of"),
    "concatenation": ("{% set s = 'x' * 600000 %}{{ (s + s) | length }}", "builds a value of 1200000 items"),
    "big power": ("{{ 2 ** 100 }}", "raises to the power 100"),
    "nested ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      "work limit"),
    "nested loops over a string": ("{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}"
                                   "{% endfor %}", "work limit"),
    "self-recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion too deep"),
    "huge output": ("{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}", "rendered text passes"),
    "huge range": ("{{ range(10 ** 12) | length }}", "range of"),
    "attribute escape": ("{{ ''.__class__.__mro__ }}", "unsafe"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_fails_fast_in_one_line(name):
    template, fragment = HOSTILE[name]
    t0 = time.perf_counter()
    with pytest.raises(RequestError, match="chat template failed") as e:
        render_chat(template, [{"role": "user", "content": "hi"}])
    assert time.perf_counter() - t0 < 3.0
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_ordinary_templates_still_render():
    out = render_chat(CHATML_TEMPLATE, [{"role": "user", "content": "x" * (MAX_ITEMS // 2)}])
    assert out.endswith("<|im_start|>assistant\n")
    loop = "{% for m in messages %}{% for i in range(3) %}{{ m['content'] }}{% endfor %}{% endfor %}"
    assert render_chat(loop, [{"role": "user", "content": "ab"}]) == "ababab"
    with pytest.raises(RequestError, match="no system role"):
        render_chat("{{ raise_exception('no system role') }}", [])


def test_work_is_bounded_by_steps_and_by_time(monkeypatch):
    """Each bound on its own: a loop stops at the step limit however fast it runs, and at the time
    limit however few its steps (a clock that jumps 10 s at every look)."""
    import itertools
    import types

    import mlxinfer.chat as chat

    loop = "{% for i in range(3000) %}{% endfor %}done"
    assert render_chat(loop, []) == "done"
    monkeypatch.setattr(chat, "MAX_STEPS", 1000)
    with pytest.raises(RequestError, match="work limit"):
        render_chat(loop, [])
    monkeypatch.setattr(chat, "MAX_STEPS", 10**9)
    clock = itertools.count(0.0, 10.0)
    monkeypatch.setattr(chat, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    with pytest.raises(RequestError, match="work limit"):
        render_chat("{% for i in range(30000) %}{% endfor %}done", [])


@pytest.mark.parametrize("name", ["huge string", "nested ranges", "self-recursive macro"])
def test_cli_with_a_hostile_model_file(tmp_path, name):
    src = write_synthetic_model(tmp_path / "ok.gguf", arch="llama", n_layers=1)
    bad = rewrite_gguf(src, tmp_path / "hostile.gguf", edits={"tokenizer.chat_template": HOSTILE[name][0]})
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
            "from mlxinfer.cli import main; sys.exit(main(sys.argv[1:]))")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, "generate", "--model", bad, "--backend", "cpu", "--chat", "hi"],
                       capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - t0 < 30
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "hostile.gguf: chat template failed" in lines[0], r.stderr
    assert HOSTILE[name][1] in lines[0]
