"""`mlxinfer perplexity`: llama-perplexity's method (mlxinfer/perplexity.py) against a direct computation.

The direct computation is written out here from llama.cpp's perplexity.cpp independently of the module:
each window scored alone through `Engine.logits` (all positions, one sequence), a numpy log-softmax in
float64, the scored half and the targets picked by explicit indices, the standard error through
`np.var`. Both sides see the same float32 logits (the cpu backend's, which do not depend on the batch),
so what differs is only float64 summation order: bounds of 1e-9 relative."""

import os
import subprocess
import sys

import numpy as np
import pytest

from mlxinfer import load
from mlxinfer.perplexity import perplexity, windows
from mlxinfer.synthetic import rewrite_gguf

from .test_cli import assert_one_line_error

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be "
         "or had not but one have they you all their has been there who more when").split()


def text_of(n_words: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, n_words))


@pytest.fixture(scope="module")
def tiny(synthetic, tmp_path_factory):
    """A tiny synthetic Qwen3 (no BOS added) and the same file with add_bos_token set."""
    path = synthetic(n_layers=2, hidden=64, ffn=128, vocab_size=320, context_length=64)
    bos = str(tmp_path_factory.mktemp("ppl") / "bos.gguf")
    rewrite_gguf(path, bos, edits={"tokenizer.ggml.add_bos_token": True})
    return path, bos


def direct(engine, text: str, ctx: int):
    """nll of every scored token, and (PPL, standard error), computed the long way."""
    tok = engine.tokenizer
    tokens = tok.encode(text, add_special=True)
    nll = []
    for w in range(len(tokens) // ctx):
        ids = tokens[w * ctx:(w + 1) * ctx]
        if tok.add_bos:
            ids = [tok.bos_id] + ids[1:]
        logits = engine.logits(ids).astype(np.float64)
        logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        for j in range(ctx // 2, ctx - 1):  # position j predicts token j + 1 of the window
            nll.append(-logp[j, tokens[w * ctx + j + 1]])
    nll = np.array(nll)
    ppl = np.exp(nll.mean())
    return nll, ppl, ppl * np.sqrt(np.var(nll) / (len(nll) - 1))


@pytest.mark.parametrize("ctx", [16, 15])
@pytest.mark.parametrize("which", ["plain", "bos"])
def test_matches_the_direct_computation(tiny, ctx, which):
    engine = load(tiny[which == "bos"], backend="cpu")
    assert engine.tokenizer.add_bos == (which == "bos")
    text = text_of(60)
    n_tokens = len(engine.tokenizer.encode(text, add_special=True))
    r = perplexity(engine, text, ctx=ctx, batch=2)
    nll, ppl, err = direct(engine, text, ctx)
    assert r.windows == n_tokens // ctx >= 3
    assert r.scored == r.windows * (ctx - ctx // 2 - 1) == len(nll)
    np.testing.assert_allclose(r.nll, nll, rtol=1e-9, atol=1e-12)
    assert r.ppl == pytest.approx(ppl, rel=1e-9)
    assert r.stderr == pytest.approx(err, rel=1e-9)


def test_windows_are_cut_as_llama_cpp_cuts_them():
    """Non-overlapping windows of N, the tail dropped, each one's first token overwritten by BOS (the
    window keeps N tokens) where the model adds BOS; the targets stay the text's own tokens."""
    tokens = list(range(100, 135))
    assert windows(tokens, 10, None) == [tokens[0:10], tokens[10:20], tokens[20:30]]
    assert windows(tokens, 10, 7) == [[7] + tokens[1:10], [7] + tokens[11:20], [7] + tokens[21:30]]
    assert tokens[0] == 100  # not changed in place


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_batch_of_three_equals_one_at_a_time(tiny, backend):
    """A window's logits do not depend on what shares its pass (cpu backend, MLX's CPU device): the
    same bits for B=1 and B=3, with 7 windows (a last pass of 1)."""
    engine = load(tiny[1], backend=backend, device="cpu" if backend == "mlx" else None)
    text = text_of(60, seed=1)
    one = perplexity(engine, text, ctx=8, batch=1)
    three = perplexity(engine, text, ctx=8, batch=3)
    assert one.windows >= 7 and one.windows % 3 != 0
    assert np.array_equal(one.nll, three.nll)
    assert (one.ppl, one.stderr) == (three.ppl, three.stderr)


def test_chunked_windows_equal_whole_ones(tiny):
    """A window longer than the prefill chunk goes in several passes (all windows of a batch together):
    within the cpu backend's chunking noise of the one-pass result."""
    text = text_of(60, seed=2)
    whole = perplexity(load(tiny[0], backend="cpu"), text, ctx=16, batch=2)
    chunked = perplexity(load(tiny[0], backend="cpu", prefill_chunk=5), text, ctx=16, batch=2)
    np.testing.assert_allclose(chunked.nll, whole.nll, rtol=1e-4, atol=1e-5)


def run_ppl(*args):
    return subprocess.run([sys.executable, "-m", "mlxinfer.cli", "perplexity", *args], capture_output=True,
                          text=True, timeout=300)


def test_cli_prints_ppl_and_its_error(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(text_of(60))
    r = run_ppl(tiny[0], "--text", str(text), "--ctx", "16", "--batch", "2", "--backend", "cpu")
    assert r.returncode == 0, r.stderr
    expected = perplexity(load(tiny[0], backend="cpu"), text.read_text(), ctx=16)
    assert r.stdout.startswith(f"PPL = {expected.ppl:.4f} +/- {expected.stderr:.5f} ({expected.windows} windows "
                               f"of 16 tokens, {expected.scored} scored; "), r.stdout
    assert "tokens/s)" in r.stdout


@pytest.mark.parametrize("args,fragment", [
    (["--ctx", "2"], "--ctx must be an integer of at least 3"),
    (["--ctx", "65"], "--ctx 65 exceeds the model's context length 64"),
    (["--ctx", "32", "--text-words", "5"], "needs at least 64 (two windows)"),
    (["--batch", "0"], "--batch must be a positive integer"),
])
def test_bad_options_are_one_line(tiny, tmp_path, args, fragment):
    words = 60
    if "--text-words" in args:
        words, args = int(args[-1]), args[:-2]
    text = tmp_path / "t.txt"
    text.write_text(text_of(words))
    assert_one_line_error(run_ppl(tiny[0], "--text", str(text), "--backend", "cpu", *args), fragment)


def test_bad_text_is_one_line(tiny, tmp_path):
    assert_one_line_error(run_ppl(tiny[0], "--text", str(tmp_path / "none.txt")), "none.txt: cannot read the text")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe")
    assert_one_line_error(run_ppl(tiny[0], "--text", str(bad)), "bad.txt: not UTF-8 text (byte 3)")
    r = run_ppl(tiny[0])
    assert r.returncode == 1 and "--text" in r.stderr and len(r.stderr.strip().splitlines()) == 1
