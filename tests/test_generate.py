"""The generation API: streaming events, sampling options, stop strings, chat messages, batched
generation, chunked prefill and the KV caches, on the cpu reference backend."""

import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlxinfer
from mlxinfer.batch import Batch
from mlxinfer.chat import render_chat
from mlxinfer.errors import MlxinferError, RequestError
from mlxinfer.kv_cache import BasicKVCache, PreallocKVCache
from mlxinfer.loop import FinishEvent, TokenEvent
from mlxinfer.metrics import Metrics
from mlxinfer.sampling import SamplingParams, filter_probs_numpy

SHAPE = dict(arch="qwen3", n_layers=2, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=320,
             context_length=256, tied_output=False, seed=11)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from mlxinfer.synthetic import write_synthetic_model

    return write_synthetic_model(tmp_path_factory.mktemp("g") / "m.gguf", **SHAPE)


@pytest.fixture(scope="module")
def engine(path):
    return mlxinfer.load(path, backend="cpu")


def test_greedy_is_argmax_of_logits_at_every_step(engine):
    prompt = [10, 20, 30]
    gen = engine.generate(prompt, max_tokens=8)
    ids = list(prompt)
    for tok, lp in zip(gen.token_ids, gen.logprobs):
        logits = engine.logits(ids)[-1].astype(np.float64)
        assert tok == int(np.argmax(logits))
        assert math.isclose(lp, logits[tok] - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max(),
                            abs_tol=1e-5)
        ids.append(tok)
    assert gen.finish_reason == "length" and len(gen.token_ids) == 8
    assert gen.metrics.generated_tokens == 8 and len(gen.metrics.token_intervals_ms) == 7


def test_stream_events(engine):
    events = list(engine.stream("the cat is", max_tokens=12, temperature=1.0, seed=9))
    tokens, finish = events[:-1], events[-1]
    assert all(isinstance(e, TokenEvent) for e in tokens) and isinstance(finish, FinishEvent)
    assert [e.index for e in tokens] == list(range(len(tokens)))
    gen = finish.generation
    assert [e.token_id for e in tokens] == gen.token_ids
    assert "".join(e.text for e in tokens) + finish.text == gen.text == engine.tokenizer.decode(gen.token_ids, skip_special=True)
    assert all(e.logprob <= 0 for e in tokens) and finish.finish_reason == gen.finish_reason


def test_bad_requests_raise_when_the_stream_is_made(engine):
    with pytest.raises(RequestError, match="max_tokens"):
        engine.stream("hi", max_tokens=0)


def test_sampling_is_reproducible_with_a_seed(engine):
    a = engine.generate("the cat", max_tokens=12, temperature=1.0, seed=3)
    b = engine.generate("the cat", max_tokens=12, temperature=1.0, seed=3)
    c = engine.generate("the cat", max_tokens=12, temperature=1.0, seed=4)
    assert a.token_ids == b.token_ids and a.seed == 3
    assert a.token_ids != c.token_ids


def test_negative_seed_means_random(engine):
    runs = [engine.generate("the cat", max_tokens=12, temperature=1.0, seed=-1) for _ in range(3)]
    assert len({tuple(r.token_ids) for r in runs}) > 1
    assert all(r.seed is not None and r.seed >= 0 for r in runs)
    again = engine.generate("the cat", max_tokens=12, temperature=1.0, seed=runs[0].seed)
    assert again.token_ids == runs[0].token_ids  # the reported seed reproduces the run


def test_sampling_options_reach_the_sampler(engine):
    greedy = engine.generate("the cat", max_tokens=10)
    # each option alone narrows sampling to the top token: equal to greedy only if it is applied
    assert engine.generate("the cat", max_tokens=10, temperature=1.0, top_k=1, seed=1).token_ids == greedy.token_ids
    assert engine.generate("the cat", max_tokens=10, temperature=1.0, top_p=1e-6, seed=1).token_ids == greedy.token_ids
    assert engine.generate("the cat", max_tokens=10, temperature=1.0, min_p=1.0, seed=1).token_ids == greedy.token_ids
    assert engine.generate("the cat", max_tokens=10, temperature=1e-4, seed=1).token_ids == greedy.token_ids
    # and without them, temperature 1 and a high temperature do sample
    hot = [engine.generate("the cat", max_tokens=10, temperature=5.0, seed=s).token_ids for s in range(3)]
    assert any(h != greedy.token_ids for h in hot)


def test_filter_probs_top_k_top_p_min_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))

    def kept(**kw):
        return set(np.nonzero(filter_probs_numpy(logits, SamplingParams(temperature=1.0, **kw)))[0].tolist())

    assert kept() == {0, 1, 2, 3}
    assert kept(top_k=2) == {0, 1}
    assert kept(top_p=0.79) == {0, 1} and kept(top_p=0.81) == {0, 1, 2}
    assert kept(min_p=0.5) == {0, 1} and kept(min_p=0.29) == {0, 1, 2}
    p = filter_probs_numpy(logits, SamplingParams(temperature=2.0))
    want = np.sqrt([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(p, want / want.sum(), rtol=1e-6)  # temperature 2 = square root of the probabilities


def test_stop_strings(engine):
    free = engine.generate([1, 2, 3], max_tokens=30)
    text = free.text
    assert len(text) > 8
    stop = text[5:8]
    first = text.find(stop)
    gen = engine.generate([1, 2, 3], max_tokens=30, stop=[stop, "never-seen-string"])
    assert gen.finish_reason == "stop" and gen.text == text[:first]
    pieces = []
    engine.generate([1, 2, 3], max_tokens=30, stop=stop, on_text=pieces.append)
    assert "".join(pieces) == text[:first]  # the stop string was never streamed


def test_a_stop_string_across_two_tokens_is_never_streamed(engine):
    """The stop string starts inside one token's text and ends in the next: the first part must be held
    back, not streamed before the stop is seen."""
    texts = [e.text for e in list(engine.stream([1, 2, 3], max_tokens=30))[:-1]]
    full = "".join(texts)
    ends = [len("".join(texts[:i + 1])) for i in range(len(texts))]  # where token i's text ends
    i = next(i for i in range(len(texts) - 1) if texts[i] and texts[i + 1]
             and full.find(full[ends[i] - 1:ends[i] + 1]) == ends[i] - 1)
    stop = full[ends[i] - 1:ends[i] + 1]  # token i's last character and token i+1's first
    pieces = []
    gen = engine.generate([1, 2, 3], max_tokens=30, stop=stop, on_text=pieces.append)
    assert gen.finish_reason == "stop" and len(gen.token_ids) == i + 2
    assert gen.text == "".join(pieces) == full[:ends[i] - 1]


def test_two_stop_strings_completed_by_one_token_end_the_text_at_the_earlier(engine):
    """A stop string and its own last character, both completed by the same token: the text ends where
    the earlier one (the longer) starts, in whichever order they are given."""
    text = engine.generate([1, 2, 3], max_tokens=30).text
    end = next(j for j in range(2, len(text)) if text[j] not in text[:j])  # a character's first occurrence
    longer, last = text[end - 2:end + 1], text[end]
    assert text.find(longer) == end - 2 and text.find(last) == end
    for stop in ([longer, last], [last, longer]):
        pieces = []
        gen = engine.generate([1, 2, 3], max_tokens=30, stop=stop, on_text=pieces.append)
        assert gen.finish_reason == "stop" and gen.text == "".join(pieces) == text[:end - 2], stop


def test_stops_at_end_of_generation_token(engine, monkeypatch):
    free = engine.generate([1, 2, 3], max_tokens=6)
    stopper = free.token_ids[3]
    assert stopper not in free.token_ids[:3]
    monkeypatch.setattr(engine.tokenizer, "eog_ids", frozenset({stopper}))
    gen = engine.generate([1, 2, 3], max_tokens=6)
    assert gen.finish_reason == "stop"
    assert gen.token_ids == free.token_ids[:3]  # the stop token itself is not returned
    assert gen.metrics.generated_tokens == 4


def test_chat_template_renders_chatml(engine):
    text = render_chat(engine.tokenizer.chat_template, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = engine.encode_prompt("hi", chat=True)
    tok = engine.tokenizer
    assert ids[0] == tok.tokens.index("<|im_start|>") and tok.decode(ids) == text
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.decode(engine.encode_prompt(messages)) == render_chat(tok.chat_template, messages)
    assert engine.generate(messages, max_tokens=3).prompt_ids == engine.encode_prompt(messages)


def test_chat_prompt_has_one_bos_when_the_template_writes_it(engine, monkeypatch):
    tok = engine.tokenizer
    monkeypatch.setattr(tok, "add_bos", True)
    monkeypatch.setattr(tok, "bos_id", tok.tokens.index("<|endoftext|>"))
    assert engine.encode_prompt("hi")[0] == tok.bos_id  # plain text: BOS added, as the file asks
    monkeypatch.setattr(tok, "chat_template", "{{ bos_token }}" + tok.chat_template)
    ids = engine.encode_prompt("hi", chat=True)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1


def test_request_errors(engine):
    with pytest.raises(RequestError, match="exceeds the model's context length 256"):
        engine.generate(list(range(256)), max_tokens=1)  # no room left for a token
    # max_tokens past the context is capped to the room the prompt leaves (the CLI's rule too, with a
    # notice): the generation ends where the context does
    out = engine.generate(list(range(250)), max_tokens=60)
    assert len(out.token_ids) <= 6 and (out.finish_reason == "stop" or len(out.token_ids) == 6)
    assert engine.room(250, 60) == 6 and engine.room(200, 6) == 6
    with pytest.raises(RequestError, match="empty prompt"):
        engine.generate("")
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.generate([5, 100000])
    with pytest.raises(RequestError, match=rf"token id {SHAPE['vocab_size']} is outside the vocabulary"):
        engine.generate([5, SHAPE["vocab_size"]])  # the first id past the end (an off-by-one would take it)
    with pytest.raises(RequestError, match="token id -1 is outside"):
        engine.generate([5, -1])
    assert engine.generate([5, SHAPE["vocab_size"] - 1, 0], max_tokens=1).prompt_ids == [5, SHAPE["vocab_size"] - 1, 0]
    with pytest.raises(RequestError, match="not valid UTF-8"):
        engine.generate(b"\xff\xfe")
    with pytest.raises(RequestError, match="role 'wizard'"):
        engine.generate([{"role": "wizard", "content": "hi"}])
    with pytest.raises(RequestError, match="stop string must be non-empty"):
        engine.generate("hi", stop=[""])
    with pytest.raises(RequestError, match="stop must be a string or a list of strings, got int"):
        engine.generate("hi", stop=5)
    with pytest.raises(RequestError, match="at most 16 stop strings, got 17"):  # each is checked every token
        engine.generate("hi", stop=[f"s{i}" for i in range(17)])
    with pytest.raises(RequestError, match="at most 256 characters, got 257"):
        engine.generate("hi", stop=["x" * 257])
    assert engine.generate("hi", stop=[f"s{i}" for i in range(15)] + ["x" * 256], max_tokens=2)
    with pytest.raises(RequestError, match=r"lone surrogate U\+DCFF at character 1"):
        engine.generate("a\udcff")
    for ids, what in (([1.9], "1.9"), ([3, True], "True"), (np.array([1.0, 2.0]), "float64"), (["5"], "'5'")):
        with pytest.raises(RequestError, match=f"token ids must be integers.*, got .*{re.escape(what)}"):
            engine.generate(ids)
    assert engine.encode_prompt(np.array([3, 4], dtype=np.int64)) == [3, 4]
    assert engine.encode_prompt((np.int32(3), 4)) == [3, 4]
    with pytest.raises(RequestError, match=r"in one dimension, got an array of int64 with shape \(2, 2\)"):
        engine.generate(np.array([[3, 4], [5, 6]]))  # a batch is generate_batch's, not one prompt
    with pytest.raises(RequestError, match="token ids must be integers"):
        engine.tokenizer.decode(["a"])
    assert engine.tokenizer.decode(range(3, 6)) == engine.tokenizer.decode([3, 4, 5])
    for model in (123, b"m.gguf", object()):
        with pytest.raises(MlxinferError, match="model should be a path"):
            mlxinfer.load(model, backend="cpu")
    with pytest.raises(RequestError, match="at least one prompt"):
        engine.generate_batch([])
    for bad in (dict(temperature=float("nan")), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2),
                dict(min_p=2.0), dict(top_k=1.5), dict(seed="x")):
        with pytest.raises(RequestError, match="bad sampling option"):
            engine.generate("hi", **bad)
    for chunk in (0, -3, 2.5):
        with pytest.raises(RequestError, match="prefill chunk must be a positive integer"):
            mlxinfer.Engine(engine.path, engine.backend, prefill_chunk=chunk)
    with pytest.raises(RequestError, match="unknown KV cache 'pages'"):
        mlxinfer.Engine(engine.path, engine.backend, kv="pages")


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prefill_chunk_sizes_give_the_same_greedy_text(path, engine, chunk):
    prompt = list(range(3, 3 + 90))
    whole = engine.generate(prompt, max_tokens=20)
    chunked = mlxinfer.load(path, backend="cpu", prefill_chunk=chunk).generate(prompt, max_tokens=20)
    assert chunked.token_ids == whole.token_ids
    np.testing.assert_allclose(chunked.logprobs, whole.logprobs, atol=1e-5)


def test_basic_and_prealloc_caches_give_identical_logits(path):
    ids = list(range(5, 60))
    pre = mlxinfer.load(path, backend="cpu", kv="prealloc", prefill_chunk=16)
    basic = mlxinfer.load(path, backend="cpu", kv="basic", prefill_chunk=16)
    assert np.array_equal(pre.logits(ids).view(np.uint32), basic.logits(ids).view(np.uint32))
    a = pre.generate_batch([ids[:9], ids[:30]], max_tokens=12)
    b = basic.generate_batch([ids[:9], ids[:30]], max_tokens=12)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]


def test_paged_cache_gives_the_logits_of_the_prealloc_cache(path):
    ids = list(range(5, 60))
    pre = mlxinfer.load(path, backend="cpu", kv="prealloc", prefill_chunk=16)
    paged = mlxinfer.load(path, backend="cpu", kv="paged", prefill_chunk=16)
    assert np.array_equal(pre.logits(ids).view(np.uint32), paged.logits(ids).view(np.uint32))
    a = pre.generate_batch([ids[:9], ids[:30], ids[:17]], max_tokens=40)
    b = paged.generate_batch([ids[:9], ids[:30], ids[:17]], max_tokens=40)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]


def test_paged_cache_reuses_a_finished_prefix_and_evicts_least_recently_used(engine):
    from mlxinfer.kv_cache import PagedKVCache

    ops, a = engine.backend, engine.args
    cache = PagedKVCache(ops, a.n_layers, a.n_kv_heads * a.head_dim, block_size=4, max_blocks=6)
    prompt = list(range(20, 31))  # 11 tokens: two full blocks of 4, and 3 in a third
    slot = cache.alloc()
    batch = Batch(ops, [slot], [0], [len(prompt)])
    cache.reserve(batch)
    assert cache.blocks.used == 3
    for layer in range(a.n_layers):
        rows = np.full((len(prompt), cache.width), layer, np.float32) + np.arange(len(prompt), dtype=np.float32)[:, None]
        cache.update(ops, layer, rows, -rows, batch)
    first_blocks = list(cache.blocks.tables[slot])
    cache.release(slot, prompt)
    assert (cache.blocks.used, cache.blocks.n_cached) == (0, 2)  # the partial third block is freed
    other = cache.alloc()
    assert cache.match_prefix(other, prompt[:8] + [99]) == 8 and cache.blocks.tables[other] == first_blocks[:2]
    rows = [cache.blocks.tables[other][p // 4] * 4 + p % 4 for p in range(8)]  # what a pass's gather reads
    k, v = cache.keys[0].reshape(-1, cache.width)[rows], cache.values[0].reshape(-1, cache.width)[rows]
    assert np.array_equal(k[:, 0], np.arange(8, dtype=np.float32)) and np.array_equal(v, -k)
    cache.release(other)
    third = cache.alloc()
    assert cache.match_prefix(third, prompt[:8]) == 4  # one token always left to prefill
    cache.release(third)
    fresh = cache.alloc()
    assert cache.match_prefix(fresh, [0, 1, 2, 3, 4]) == 0  # another prefix: nothing to reuse
    cache.release(fresh)
    fresh = cache.alloc()  # the prompt's second block at the start: other keys (positions, context)
    assert cache.match_prefix(fresh, prompt[4:8] + [0, 1, 2, 3, 4]) == 0
    # fill the pool: the cached blocks are evicted, least recently used first, then the pool is full
    cache.reserve(Batch(ops, [fresh], [0], [16]))
    assert cache.blocks.used == 4 and cache.blocks.n_cached == 2
    s3 = cache.alloc()
    cache.reserve(Batch(ops, [s3], [0], [4]))  # one block: the least recently used cached one goes
    assert list(cache.blocks.lru) == [first_blocks[0]]  # block 0 was matched last (by `third`)
    cache.reserve(Batch(ops, [s3], [4], [4]))
    assert cache.blocks.n_cached == 0 and cache.blocks.used == 6
    with pytest.raises(RequestError, match="KV cache full"):
        cache.reserve(Batch(ops, [s3], [8], [1]))


def _write_prompt(ops, cache, slot, prompt, n_layers):
    """Prefill `prompt` into `slot` with recognisable keys and values: position p of every layer holds p."""
    batch = Batch(ops, [slot], [0], [len(prompt)])
    cache.reserve(batch)
    rows = np.repeat(np.arange(len(prompt), dtype=np.float32)[:, None], cache.width, axis=1)
    for layer in range(n_layers):
        cache.update(ops, layer, rows, -rows, batch)


@pytest.mark.parametrize("collide", ["every hash", "the parent ignored"])
def test_prefixes_whose_hashes_collide_never_share_blocks(engine, collide):
    """The prefix lookup compares token ids and the parent block, not only the hash: with a hash that
    collides for every block, or one that ignores what came before (so a block's tokens at positions
    4..7 hash like the same tokens at 0..3), a different prefix takes nothing, and a prompt sharing
    only its first block takes only that block."""
    from mlxinfer.kv_cache import PagedKVCache

    hash_fn = (lambda parent, tokens: 0) if collide == "every hash" else (lambda parent, tokens: hash(tokens))
    ops, a = engine.backend, engine.args
    cache = PagedKVCache(ops, a.n_layers, a.n_kv_heads * a.head_dim, block_size=4, hash_fn=hash_fn)
    p, t = [20, 21, 22, 23], [30, 31, 32, 33]
    slot = cache.alloc()
    _write_prompt(ops, cache, slot, p + t + [40], a.n_layers)
    cache.release(slot, p + t + [40])
    for prompt, shared in ((t + p + [41], 0), ([50, 51, 52, 53] + t + [41], 0), (p + [60, 61, 62, 63, 41], 4),
                           (p + t + [41], 4 if collide == "every hash" else 8)):
        other = cache.alloc()
        assert cache.match_prefix(other, prompt) == shared, prompt
        taken = cache.blocks.tables[other]
        for i, block in enumerate(taken):  # what it took holds exactly its own positions' values
            k = cache.keys[0][block]
            assert np.array_equal(k[:, 0], np.arange(4 * i, 4 * i + 4, dtype=np.float32))
        cache.release(other)


def test_a_prompt_after_a_colliding_prefix_generates_its_cold_text(path):
    """End to end, through the loop the server runs: with every block hash colliding, a prompt that
    starts with another cached prompt's second block generates exactly the tokens and logprobs of a
    cold run (it would read the other prompt's keys at the wrong positions if it took that block)."""
    engine = mlxinfer.load(path, backend="cpu", kv="paged")
    first, second = list(range(40, 72)), list(range(56, 72)) + list(range(100, 120))
    cold = engine.generate(second, max_tokens=8)
    loop = engine.new_loop(engine.new_cache(hash_fn=lambda parent, tokens: hash(tokens)))
    for prompt in (first, second):
        seq = loop.admit(prompt, SamplingParams(), 8)
        events = []
        while loop.busy:
            events += [e for _, e in loop.step()]
    assert seq.cached_tokens == 0  # second[:16] are first[16:32]: the same tokens, not the same prefix
    assert events[-1].generation.token_ids == cold.token_ids and events[-1].generation.logprobs == cold.logprobs


def test_generate_batch_equals_each_prompt_alone(engine, monkeypatch):
    prompts = [[7, 8, 9], list(range(40, 90)), "the cat is on", [300, 12]]
    alone = [engine.generate(p, max_tokens=10) for p in prompts]
    together = engine.generate_batch(prompts, max_tokens=10)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # bitwise: batch invariance
    assert all(g.metrics.batch_size == 4 for g in together)
    # sequences finish on their own: stop one of them early on an end-of-generation token
    stopper = alone[1].token_ids[2]
    monkeypatch.setattr(engine.tokenizer, "eog_ids", engine.tokenizer.eog_ids | {stopper})
    mixed = engine.generate_batch(prompts, max_tokens=10)
    assert [m.finish_reason for m in mixed] != [a.finish_reason for a in alone]
    for a, m in zip(alone, mixed):
        cut = a.token_ids.index(stopper) if stopper in a.token_ids else len(a.token_ids)
        assert m.token_ids == a.token_ids[:cut]
        assert m.finish_reason == ("stop" if cut < len(a.token_ids) else a.finish_reason)


def test_generate_batch_samples_as_each_prompt_alone(engine):
    """Sampling options and the seed reach every sequence of a batch: each draws what it draws alone."""
    prompts = [[7, 8, 9], "the cat is on", list(range(40, 70))]
    options = dict(max_tokens=10, temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=5)
    alone = [engine.generate(p, **options) for p in prompts]
    together = engine.generate_batch(prompts, **options)
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert [g.logprobs for g in together] == [g.logprobs for g in alone] and {g.seed for g in together} == {5}
    greedy = [g.token_ids for g in engine.generate_batch(prompts, max_tokens=10)]
    for narrow in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        assert [g.token_ids for g in engine.generate_batch(prompts, max_tokens=10, temperature=1.0, seed=1,
                                                           **narrow)] == greedy, narrow


PER_SEQUENCE = [dict(repetition_penalty=1.4), dict(presence_penalty=0.8, frequency_penalty=0.5),
                dict(logit_bias={42: 2.0, 76: -100}), {}, dict(temperature=0.9, seed=2, repetition_penalty=1.2),
                dict(top_logprobs=3, frequency_penalty=1.0),
                dict(logit_bias={42: 4.0}, presence_penalty=2.0)]  # 42 once: the penalty must see the newest token


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_penalties_and_bias_are_per_sequence_and_batch_invariant(path, backend):
    """Seven sequences with their own options in one loop, each with neighbours that differ in every
    option: each gives the tokens, logprobs and alternatives it gives alone (bit for bit), and on
    MLX, whose passes are pipelined (a penalty must see the token of the pass still in flight), the
    greedy ones give the numpy reference's tokens. Options that change nothing would pass this too:
    the penalised texts differ from the plain one."""
    if backend == "mlx":
        pytest.importorskip("mlx.core")
    engine = mlxinfer.load(path, backend=backend)
    prompts = [[7, 8, 9], list(range(40, 60)), [10, 11], [300, 12], [7, 8, 9], [10, 11], [10, 11]]
    alone = [engine.generate(p, max_tokens=12, **o) for p, o in zip(prompts, PER_SEQUENCE)]
    loop = engine.new_loop()
    seqs = [loop.admit(engine.encode_prompt(p), engine.sampling_params(**{"temperature": 0.0, **o}), 12)
            for p, o in zip(prompts, PER_SEQUENCE)]
    done = {}
    while loop.busy:
        for s, ev in loop.step():
            if isinstance(ev, FinishEvent):
                done[id(s)] = ev.generation
    for a, s in zip(alone, seqs):
        b = done[id(s)]
        assert (a.token_ids, a.logprobs, a.top_logprobs) == (b.token_ids, b.logprobs, b.top_logprobs)
    plain = [engine.generate(p, max_tokens=12).token_ids for p in prompts]
    assert all(a.token_ids != t for a, t, o in zip(alone, plain, PER_SEQUENCE) if o) and alone[3].token_ids == plain[3]
    assert 76 in plain[2] and 76 not in alone[2].token_ids and len(alone[5].top_logprobs[0]) == 3
    assert alone[6].token_ids[0] == 42 != alone[6].token_ids[1]
    if backend == "mlx":
        ref = mlxinfer.load(path, backend="cpu")
        for p, o, a in zip(prompts, PER_SEQUENCE, alone):
            if o.get("temperature", 0) == 0:
                assert ref.generate(p, max_tokens=12, **o).token_ids == a.token_ids, o


def test_prefill_chunks_keep_their_boundaries_when_passes_are_full(path, monkeypatch):
    """Six prompts prefilled in chunks of 4 compete for the prefill rows of each pass: a sequence that
    waits keeps its boundaries (chunks start at multiples of 4, even where a short last chunk of
    another prompt leaves room for part of one), and its tokens and logprobs are bitwise those it gets
    alone."""
    import mlxinfer.loop as loop

    engine = mlxinfer.load(path, backend="cpu", prefill_chunk=4)
    prompts = [list(range(10 + i, 21 + 2 * i)) for i in range(6)]  # 11..21 tokens: last chunks are short
    passes = []

    class Recorded(Batch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            passes.append((self.slots, self.starts, self.lengths))

    monkeypatch.setattr(loop, "Batch", Recorded)
    together = engine.generate_batch(prompts, max_tokens=5)
    monkeypatch.undo()
    per_pass = [[(slot, start, n) for slot, start, n in zip(*p) if start < len(prompts[slot])]  # slot i: prompt i
                for p in passes]
    assert max(sum(n for _, _, n in chunks) for chunks in per_pass) == engine.prefill_chunk  # some waited: one chunk's rows a pass
    assert sorted(c for chunks in per_pass for c in chunks) == sorted(
        (i, s, min(4, len(p) - s)) for i, p in enumerate(prompts) for s in range(0, len(p), 4))
    alone = [engine.generate(p, max_tokens=5) for p in prompts]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert [g.logprobs for g in together] == [g.logprobs for g in alone]


def test_batch_rows_carry_their_slot_position_and_length(engine):
    """The per-row arrays kernels read: row i's cache slot, position and its sequence's length after
    the pass; the logit rows are each sampling sequence's last row."""
    ops = engine.backend
    b = Batch(ops, slots=[2, 0, 1], starts=[5, 0, 9], lengths=[1, 3, 2], logits_for=[True, False, True])
    assert b.rows == ((0, 1), (1, 4), (4, 6)) and b.kv_lens == (6, 3, 11) and b.n_rows == 6
    assert b.positions.tolist() == [5, 0, 1, 2, 9, 10]
    assert b.row_slots.tolist() == [2, 0, 0, 0, 1, 1]
    assert b.row_lens.tolist() == [6, 3, 3, 3, 11, 11]
    assert b.logit_rows.tolist() == [0, 5] and b.logit_groups == ((0, 1), (1, 2))
    assert b.positions_of(ops, 2).tolist() == [9, 10]
    every = Batch(ops, [0, 1], [4, 0], [3, 2], all_logits=True)
    assert every.logit_rows.tolist() == [0, 1, 2, 3, 4] and every.logits_of_every_row
    assert every.logit_groups == ((0, 3), (3, 5))


def test_index_arrays_share_one_buffer_of_at_least_four_entries_each():
    """MLX's CUDA allocator keeps arrays of up to 8 bytes in host memory, which the GPU reads across
    the bus: a pass's index arrays (and the paged cache's) are slices of one array in which each has at
    least MIN_INDEX_ENTRIES entries, even for one row (the cpu backend's numpy views show the buffer)."""
    from mlxinfer.backends.cpu import CPUBackend
    from mlxinfer.batch import MIN_INDEX_ENTRIES, pack_index_arrays

    ops = CPUBackend()
    b = Batch(ops, slots=[3], starts=[7], lengths=[1])
    arrays = (b.positions, b.row_slots, b.row_lens, b.logit_rows)
    assert [a.tolist() for a in arrays] == [[7], [3], [8], [0]]
    assert all(a.base is b.packed for a in arrays) and b.packed.size == 4 * MIN_INDEX_ENTRIES
    assert MIN_INDEX_ENTRIES * 4 > 8  # bytes: past MLX's small pool
    _, (blocks, offsets) = pack_index_arrays(ops, ([5], [7, 8]))
    assert blocks.tolist() == [5] and offsets.tolist() == [7, 8]
    assert blocks.base is offsets.base and blocks.base.size == 2 * MIN_INDEX_ENTRIES


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_batch_invariance_of_logits(engine, data):
    """A sequence's logits inside any batch are bitwise those of the same sequence run alone, whatever
    the other sequences are doing (prefilling a chunk, decoding) and whenever it joins."""
    ops, chunk = engine.backend, data.draw(st.sampled_from([1, 3, 8, 64]))
    n = data.draw(st.integers(2, 4))
    prompts = [data.draw(st.lists(st.integers(0, 310), min_size=1, max_size=40)) for _ in range(n)]
    feeds = [data.draw(st.lists(st.integers(0, 310), min_size=0, max_size=4)) for _ in range(n)]
    joins = [data.draw(st.integers(0, 3)) for _ in range(n)]

    def schedule(i):  # (start, ids) of each pass of sequence i: prefill chunks, then decode steps
        steps = [(s, prompts[i][s:s + chunk]) for s in range(0, len(prompts[i]), chunk)]
        return steps + [(len(prompts[i]) + j, [t]) for j, t in enumerate(feeds[i])]

    def run(members):
        cache, out = engine.new_cache(), {i: [] for i in members}
        slots = {i: cache.alloc() for i in members}
        plans = {i: [None] * joins[i] + schedule(i) for i in members}
        for step in range(max(len(p) for p in plans.values())):
            active = [i for i in members if step < len(plans[i]) and plans[i][step] is not None]
            if not active:
                continue
            batch = Batch(ops, [slots[i] for i in active], [plans[i][step][0] for i in active],
                          [len(plans[i][step][1]) for i in active])
            cache.reserve(batch)
            ids = ops.index_array([t for i in active for t in plans[i][step][1]])
            logits = engine.model(ops, ids, batch, cache)
            for row, i in enumerate(active):
                out[i].append(logits[row].copy())
        return out

    together = run(list(range(n)))
    for i in range(n):
        alone = run([i])[i]
        assert len(alone) == len(together[i])
        for a, b in zip(alone, together[i]):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_kv_slots_are_released_reused_and_memory_follows_the_tokens(engine):
    cache = PreallocKVCache(engine.backend, n_layers=1, width=8, step=16)
    a, b, c = cache.alloc(), cache.alloc(), cache.alloc()
    assert (a, b, c) == (0, 1, 2)
    ops = engine.backend
    batch = Batch(ops, [a, b, c], [0, 0, 0], [5, 40, 3])
    cache.reserve(batch)
    assert (cache.n_slots, cache.capacity) == (3, 48)
    cache.update(ops, 0, np.ones((48, 8), np.float32), np.ones((48, 8), np.float32), batch)
    cache.release(b)
    assert cache.capacity == 16 and cache.n_slots == 3  # the long one left: capacity shrinks
    assert cache.alloc() == b  # the free slot is reused
    cache.release(c)
    cache.release(b)
    assert cache.n_slots == 1 and cache.nbytes() == 2 * 1 * 1 * 16 * 8 * 4
    with pytest.raises(RequestError, match="slot 1 is not in use"):
        cache.release(b)
    cache.release(a)
    assert cache.nbytes() == 0 and cache.in_use == 0


def test_prealloc_cache_grows_in_steps_and_keeps_what_it_holds(engine):
    ops = engine.backend
    cache = PreallocKVCache(ops, n_layers=1, width=4, step=16)
    slot = cache.alloc()
    rows = np.arange(40 * 4, dtype=np.float32).reshape(40, 4)
    for start, n, capacity in [(0, 15, 16), (15, 1, 16), (16, 1, 32), (17, 20, 48)]:  # prefill, then decode
        batch = Batch(ops, [slot], [start], [n])
        cache.reserve(batch)
        assert cache.capacity == capacity
        view = cache.update(ops, 0, rows[start:start + n], -rows[start:start + n], batch)
        k, v = view.sequence(ops, 0)
        assert np.array_equal(k, rows[:start + n]) and np.array_equal(v, -rows[:start + n])


def test_basic_cache_release_frees_the_sequence(engine):
    ops = engine.backend
    cache = BasicKVCache(ops, n_layers=2, width=4)
    a, b = cache.alloc(), cache.alloc()
    batch = Batch(ops, [a, b], [0, 0], [3, 2])
    cache.reserve(batch)
    for layer in range(2):
        cache.update(ops, layer, np.ones((5, 4), np.float32), np.ones((5, 4), np.float32), batch)
    assert cache.nbytes() == 2 * 2 * 5 * 4 * 4 and len(cache.arrays()) == 8
    cache.release(a)
    assert cache.nbytes() == 2 * 2 * 2 * 4 * 4 and len(cache.arrays()) == 4 and cache.in_use == 1
    assert cache.alloc() == a and len(cache.arrays()) == 4


def test_metrics_block_format():
    m = Metrics("cpu", "prealloc", "fused", prompt_tokens=5, prefill_chunk=512, time_to_first_token_ms=250.0,
                token_intervals_ms=[20.0, 30.0, 22.0], finish_reason="stop", peak_memory_mb=512.25)
    text = m.format()
    assert text.splitlines()[:3] == ["backend: cpu", "kv cache: prealloc", "attention: fused"]
    assert "  time_to_first_token_ms: 250.000" in text
    assert "  prompt_tokens_per_second: 20.000" in text
    assert "  generated_tokens: 4" in text
    assert "  decode_tokens_per_second: 41.667" in text  # 3 intervals in 72 ms
    assert "  token_interval_ms: min 20.000  max 30.000  mean 24.000  (n=3)" in text
    assert "  finish_reason: stop" in text and "  peak_memory_mb: 512.2" in text


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_a_temperature_too_small_to_divide_by_samples_as_greedy(path, backend):
    """Temperatures below sampling.GREEDY_BELOW (1e-5) are greedy on both backends: 1e-310 overflowed
    numpy's float64 (NaN probabilities: a ValueError) and 1e-40 MLX's float32 (an empty completion)."""
    from mlxinfer.sampling import GREEDY_BELOW

    e = mlxinfer.load(path, backend=backend)
    want = e.generate([5, 6, 7], max_tokens=8)
    for t in (1e-310, 1e-40, GREEDY_BELOW / 2):
        got = e.generate([5, 6, 7], max_tokens=8, temperature=t, seed=1)
        assert got.token_ids == want.token_ids and got.seed is None, t
    assert not SamplingParams(GREEDY_BELOW).greedy


def test_time_to_first_token_and_intervals_from_their_stamps(engine, monkeypatch):
    """With a clock that ticks one second a reading, the loop's metrics (what the CLI prints and bench
    averages) count time to first token from admission to the first token read (one tick: a pass whose
    chunk samples nothing reads no clock) and each interval between consecutive tokens (one tick each).
    Where the server stamps a request's arrival: test_server's test_time_to_first_token_counts_from_arrival."""
    import types

    import mlxinfer.loop as loop_module

    ticks = iter(range(10_000))
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    monkeypatch.setattr(engine, "pipeline", False)
    monkeypatch.setattr(engine, "prefill_chunk", 8)  # 5 prefill passes, the last one samples
    m = engine.generate(list(range(3, 40)), max_tokens=5).metrics
    assert m.time_to_first_token_ms == 1000.0
    assert m.token_intervals_ms == [1000.0] * (m.generated_tokens - 1) and m.generated_tokens >= 2
