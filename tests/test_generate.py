import numpy as np
import pytest

import mlxinfer
from mlxinfer.chat import render_chat
from mlxinfer.errors import RequestError
from mlxinfer.metrics import Metrics
from mlxinfer.sampling import sample


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from mlxinfer.synthetic import write_synthetic_model

    p = write_synthetic_model(tmp_path_factory.mktemp("g") / "m.gguf", arch="qwen3", n_layers=2, hidden=64,
                              ffn=128, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=320,
                              context_length=128, tied_output=False, seed=11)
    return mlxinfer.load(p, backend="cpu")


def test_greedy_is_argmax_of_logits_at_every_step(engine):
    prompt = [10, 20, 30]
    gen = engine.generate(prompt, max_tokens=8)
    ids = list(prompt)
    for tok in gen.token_ids:
        assert tok == int(np.argmax(engine.logits(ids)[-1]))
        ids.append(tok)
    assert gen.finish_reason == "length" and len(gen.token_ids) == 8
    assert gen.metrics.forward_ms and len(gen.metrics.forward_ms) == 8


def test_sampling_is_reproducible_with_a_seed(engine):
    a = engine.generate("the cat", max_tokens=12, temperature=1.0, seed=3)
    b = engine.generate("the cat", max_tokens=12, temperature=1.0, seed=3)
    c = engine.generate("the cat", max_tokens=12, temperature=1.0, seed=4)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_1_is_greedy(engine):
    greedy = engine.generate("the cat", max_tokens=10)
    topk1 = engine.generate("the cat", max_tokens=10, temperature=0.7, top_k=1, seed=1)
    assert topk1.token_ids == greedy.token_ids


def test_sample_respects_top_k_and_top_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    rng = np.random.default_rng(0)
    draws = {sample(logits, rng, 1.0, top_k=2) for _ in range(300)}
    assert draws == {0, 1}
    draws = {sample(logits, rng, 1.0, top_p=0.79) for _ in range(300)}
    assert draws == {0, 1}
    draws = {sample(logits, rng, 1.0, top_p=0.81) for _ in range(300)}
    assert draws == {0, 1, 2}


def test_streaming_pieces_concatenate_to_the_text(engine):
    pieces = []
    gen = engine.generate("the cat is", max_tokens=20, temperature=1.0, seed=9, on_text=pieces.append)
    assert "".join(pieces) == gen.text
    assert len(pieces) > 1


def test_stops_at_end_of_generation_token(engine, monkeypatch):
    free = engine.generate([1, 2, 3], max_tokens=6)
    stopper = free.token_ids[3]
    assert stopper not in free.token_ids[:3]
    monkeypatch.setattr(engine.tokenizer, "eog_ids", frozenset({stopper}))
    gen = engine.generate([1, 2, 3], max_tokens=6)
    assert gen.finish_reason == "stop"
    assert gen.token_ids == free.token_ids[:3]  # the stop token itself is not returned
    assert len(gen.metrics.forward_ms) == 4


def test_chat_template_renders_chatml(engine):
    text = render_chat(engine.tokenizer.chat_template, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = engine.encode_prompt("hi", chat=True)
    tok = engine.tokenizer
    assert ids[0] == tok.tokens.index("<|im_start|>") and tok.decode(ids) == text


def test_context_and_request_errors(engine):
    with pytest.raises(RequestError, match="exceeds the model's context length 128"):
        engine.generate(list(range(100)), max_tokens=40)
    with pytest.raises(RequestError, match="empty prompt"):
        engine.generate("")
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.generate([5, 100000])
    with pytest.raises(RequestError, match="not valid UTF-8"):
        engine.generate(b"\xff\xfe")
    for bad in (dict(temperature=float("nan")), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2)):
        with pytest.raises(RequestError, match="bad sampling options"):
            engine.generate("hi", **bad)


def test_metrics_block_format():
    m = Metrics("cpu", "basic", "fused", forward_ms=[263.908, 20.0, 30.0, 22.0])
    text = m.format()
    assert text.splitlines()[:2] == ["backend: cpu", "kv cache: basic"]
    assert "  time_to_first_token_ms: 263.908" in text
    assert "  decode_tokens_per_second: 41.667" in text  # 3 decode passes in 72 ms
    assert "  per_forward_ms: min 20.000  max 263.908  mean 83.977  (n=4)" in text
