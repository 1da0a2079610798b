"""Hostile chat templates in a model file: each fails fast, in one line naming the file and the
problem, with bounded memory (issue: a model file's chat template can hang or exhaust the machine)."""

import json
import os
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


# -- the real templates of the families issue 29 adds (Gemma, Llama 3, Phi-3, Mistral's [INST]) ------------
LLAMA_CPP_TEMPLATES = os.path.join(os.path.dirname(__file__), "data", "llama-cpp-chat-templates.json")


def llama_cpp_templates():
    with open(LLAMA_CPP_TEMPLATES, encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("case", llama_cpp_templates()["cases"], ids=lambda c: c["name"][:40])
def test_family_templates_render_as_llama_cpp_does(case):
    """llama.cpp's own chat-template test cases (tests/data/llama-cpp-chat-templates.json says where they
    come from): the template text as the model ships it, llama.cpp's six-message conversation with a
    system message, and llama.cpp's expected text. Templates without a system role (Gemma raises on
    one, Phi-3 mini and medium, Mistral v0.2 drop it) get the system text joined to the first user message,
    as llama.cpp does; nothing is dropped."""
    data = llama_cpp_templates()
    got = render_chat(case["template"], data["conversation"], bos_token=case["bos_token"],
                      eos_token=case["eos_token"], add_generation_prompt=True)
    assert got == case["expected"]


def test_gemma2_and_llama31_file_templates_through_the_engine(tmp_path):
    """The templates Gemma 2 and Llama 3.1 files carry, in a GGUF, through Engine.encode_prompt (what
    --chat and the server call): Gemma 2's is gemma-7b-it's with the BOS token first, so it renders
    llama.cpp's expected gemma-7b-it text after BOS, the system message kept; Llama 3.1's puts the
    system message after its knowledge-date header."""
    import mlxinfer

    data = llama_cpp_templates()
    gemma = next(c for c in data["cases"] if c["name"] == "google/gemma-7b-it")
    src = write_synthetic_model(tmp_path / "g2.gguf", arch="gemma2", n_layers=1, hidden=64, ffn=128, n_heads=4,
                                n_kv_heads=2, head_dim=16)
    for name, want in (("google/gemma-2-2b-it", "<|endoftext|>" + gemma["expected"]),
                       ("meta-llama/Llama-3.1-8B-Instruct",
                        "<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December "
                        "2023\nToday Date: 26 Jul 2024\n\nYou are a helpful assistant<|eot_id|><|start_header_id|>user"
                        "<|end_header_id|>\n\nHello<|eot_id|>")):
        path = rewrite_gguf(src, tmp_path / "chat.gguf", edits={"tokenizer.chat_template": data["templates"][name]})
        engine = mlxinfer.load(path, backend="cpu")
        text = engine.tokenizer.decode(engine.encode_prompt(data["conversation"]), skip_special=False)
        assert text == want if name.startswith("google") else text.startswith(want)
    assert text.endswith("Another question<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
