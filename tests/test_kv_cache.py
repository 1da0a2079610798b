"""How the preallocated KV cache grows and shrinks: a prompt the loop announces is given its room in one
allocation (not one per prefill chunk), and the stores shrink to the longest sequence still live when a
longer one leaves. Each resize copies every layer's stores, so a resize per chunk costs a prompt of n
chunks n copies of a growing cache; and a cache that never shrinks holds one long request's memory for
as long as any short one runs."""

import numpy as np
import pytest

import mlxinfer
from mlxinfer.batch import Batch
from mlxinfer.kv_cache import PreallocKVCache
from mlxinfer import loop as loop_module
from mlxinfer.loop import FinishEvent
from mlxinfer.sampling import SamplingParams

SHAPE = dict(arch="qwen3", n_layers=2, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=320,
             context_length=512, tied_output=False, seed=3)
STEP, CHUNK = 16, 8


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from mlxinfer.synthetic import write_synthetic_model

    path = write_synthetic_model(tmp_path_factory.mktemp("kv") / "m.gguf", **SHAPE)
    return mlxinfer.load(path, backend="cpu", kv="prealloc", prefill_chunk=CHUNK)


def _recording(cache):
    """The (slots, capacity) of every resize the cache makes from now on."""
    sizes, resize = [], cache._resize

    def record(n_slots, capacity, window_capacity):
        if (n_slots, capacity) != (cache.n_slots, cache.capacity):
            sizes.append((n_slots, capacity))
        resize(n_slots, capacity, window_capacity)

    cache._resize = record
    return sizes


def _rounded(n):
    return STEP * -(-n // STEP)


def test_an_announced_prompt_is_given_its_room_in_one_allocation(engine, monkeypatch):
    """A prompt and the tokens it may generate (up to RESERVE_AHEAD) get their room at admission."""
    cache = engine.new_cache(step=STEP)
    sizes = _recording(cache)
    loop = engine.new_loop(cache)
    prompt = list(range(5, 5 + 100))  # 13 chunks of 8
    seq = loop.admit(prompt, SamplingParams(temperature=0.0), max_tokens=6)
    while loop.busy:
        loop.step()
    assert len(seq.out) >= 1
    # one allocation holds the prompt and the 6 tokens it may generate
    assert sizes[0] == (1, _rounded(len(prompt) + 6)), sizes
    assert sizes[1:] == [(0, 0)], f"resized while prefilling or decoding: {sizes}"

    no_eos = SamplingParams(temperature=0.0, logit_bias={t: -100.0 for t in engine.tokenizer.eog_ids})
    # 40 tokens: past the prompt's rounding (112), so without the room ahead the stores would grow at
    # 113 and 129 mid-generation (each growth holds the old and the new stores at once)
    sizes.clear()
    seq = loop.admit(prompt, no_eos, max_tokens=40)
    while loop.busy:
        loop.step()
    assert len(seq.out) == 40
    assert sizes == [(1, _rounded(len(prompt) + 40)), (0, 0)], sizes

    # past RESERVE_AHEAD the room stops there: the cache grows as the tokens come
    sizes.clear()
    monkeypatch.setattr(loop_module, "RESERVE_AHEAD", 20)
    seq = loop.admit(prompt, no_eos, max_tokens=40)
    while loop.busy:
        loop.step()
    assert sizes[0] == (1, _rounded(len(prompt) + 20)) and len(sizes) > 2, sizes

    sizes.clear()
    engine.new_loop(cache).score(prompt)  # all-position scoring announces its prompt too
    assert sizes == [(1, _rounded(len(prompt))), (0, 0)], sizes


def test_stores_shrink_to_the_longest_live_sequence(engine):
    ops = engine.backend
    cache = PreallocKVCache(ops, n_layers=1, width=4, step=STEP)
    long_, short = cache.alloc(), cache.alloc()  # the long one in slot 0: slots stay 2
    rows = np.arange(400, dtype=np.float32).reshape(100, 4)
    for slot, n in ((long_, 100), (short, 10)):
        batch = Batch(ops, [slot], [0], [n])
        cache.reserve(batch)
        cache.update(ops, 0, rows[:n], rows[:n], batch)
    assert (cache.n_slots, cache.capacity) == (2, _rounded(100))
    cache.release(long_)
    assert (cache.n_slots, cache.capacity) == (2, _rounded(10)), "the long sequence's memory is given back"
    batch = Batch(ops, [short], [10], [1])  # one more row, then read all eleven back
    cache.reserve(batch)
    k, v = cache.update(ops, 0, 2 * rows[:1], 3 * rows[:1], batch).sequence(ops, 0)
    assert np.array_equal(k, np.concatenate([rows[:10], 2 * rows[:1]])), "the short sequence keeps what it holds"
    assert np.array_equal(v, np.concatenate([rows[:10], 3 * rows[:1]]))


def test_a_released_slots_announced_prompt_no_longer_holds_room(engine):
    """A prompt announced (`expect`, as the loop does when it admits one) and then released before it
    ran (a cancelled request): the stores shrink to the sequences still live, as for a released one."""
    ops = engine.backend
    cache = PreallocKVCache(ops, n_layers=1, width=4, step=STEP)
    long_, short = cache.alloc(), cache.alloc()
    cache.expect(long_, 100)
    rows = np.arange(40, dtype=np.float32).reshape(10, 4)
    batch = Batch(ops, [short], [0], [10])
    cache.reserve(batch)
    cache.update(ops, 0, rows, rows, batch)
    assert (cache.n_slots, cache.capacity) == (2, _rounded(100)), "the announced prompt's room in one allocation"
    cache.release(long_)
    assert (cache.n_slots, cache.capacity) == (2, _rounded(10)), "the released announcement still holds room"
    assert cache.nbytes() == cache.nbytes_for({long_: 0, short: 10})


@pytest.mark.parametrize("kv", ["prealloc", "paged", "basic"])
def test_the_server_budget_holds_the_cache_as_it_sizes_itself(tmp_path, kv):
    """Requests of 20-60 tokens under a budget of two 256-position prealloc slots: the cache rounds
    every slot up to its 256-position step and keeps slots up to the highest in use, so the budget must
    count that (counting tokens, 8 of these fit in two slots' bytes and the cache takes 4x the budget).
    Every request still completes; the cache's bytes never pass the budget."""
    import threading

    from mlxinfer.scheduler import Scheduler
    from mlxinfer.synthetic import write_synthetic_model

    path = write_synthetic_model(tmp_path / "m.gguf", **SHAPE)
    engine = mlxinfer.load(path, backend="cpu", kv=kv)
    per_token = 2 * SHAPE["n_layers"] * SHAPE["n_kv_heads"] * SHAPE["head_dim"] * 4
    budget = 2 * 256 * per_token
    sched = Scheduler(engine, max_batch=8, max_queue=16, kv_memory=budget)
    peak, done = [0], []
    resize = sched.cache._resize if kv == "prealloc" else None
    if kv == "prealloc":
        def record(*size):
            resize(*size)
            peak[0] = max(peak[0], sched.cache.nbytes())
        sched.cache._resize = record
    finished = threading.Semaphore(0)

    def on_event(e):  # on the worker thread, after each pass's events: the cache as that pass left it
        peak[0] = max(peak[0], sched.cache.nbytes())
        if isinstance(e, FinishEvent):
            done.append(e)
            finished.release()

    try:
        for i in range(8):
            sched.submit(list(range(3, 3 + 10 + 5 * i)), SamplingParams(temperature=0.0), 10, [], on_event)
        for _ in range(8):
            assert finished.acquire(timeout=120)
    finally:
        sched.close()
    assert len(done) == 8 and all(e.finish_reason in ("stop", "length") for e in done)
    assert peak[0] <= budget, f"the cache took {peak[0]} bytes under a budget of {budget}"
