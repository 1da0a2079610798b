"""Prefix sharing through the pass loop (`mlxinfer.loop`, `block_manager`): a prompt that extends a
*running* sequence's prompt takes its full, written blocks; the reference counts stay right whichever
of the two leaves first (finished or cancelled); and a request served that way gives the tokens and
logprob bits of a cold run, on the cpu backend and on MLX's CPU device.

Why bitwise: a shared block holds prompt rows only (prefill products), and a prompt takes a cached
prefix only where its remaining rows get a cold run's bits (`Loop._reusable`): anywhere on MLX's CPU
device, whose product rows do not depend on the other rows; at whole prefill chunks on numpy.
"""

import pytest

import mlxinfer
from mlxinfer.loop import FinishEvent
from mlxinfer.sampling import SamplingParams

SHAPE = dict(arch="qwen3", n_layers=2, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=320,
             context_length=1024, tied_output=False, seed=5)
CHUNK = 16  # = the block size: a prompt's prefill takes one pass per block


@pytest.fixture(scope="module", params=["cpu", "mlx"])
def engine(request, tmp_path_factory):
    from mlxinfer.synthetic import write_synthetic_model

    path = write_synthetic_model(tmp_path_factory.mktemp("prefix") / "m.gguf", **SHAPE)
    return mlxinfer.load(path, backend=request.param, kv="paged", prefill_chunk=CHUNK)


def run(loop, events=None):
    """Step the loop until it is idle (a bounded number of passes); {sequence: its Generation}."""
    done = {} if events is None else events
    for _ in range(2000):
        if not loop.busy:
            return done
        for seq, ev in loop.step():
            if isinstance(ev, FinishEvent):
                done[seq] = ev.generation
    raise AssertionError("the loop did not become idle in 2000 passes")


def step_until(loop, cond, done):
    for _ in range(2000):
        if cond():
            return
        for seq, ev in loop.step():
            if isinstance(ev, FinishEvent):
                done[seq] = ev.generation


def same(gen, cold):
    return gen.token_ids == cold.token_ids and gen.logprobs == cold.logprobs  # logprobs as floats: bit for bit


@pytest.mark.parametrize("after_passes", [1, 3, 5])
def test_a_prompt_extending_a_running_prompt_takes_its_written_blocks(engine, after_passes):
    """A runs; B's prompt starts with A's 64 prompt tokens and is admitted after A's k-th pass: B takes
    exactly A's blocks written so far (k of them, at most A's four full prompt blocks), no block A has
    not written yet, and both give their cold runs' tokens and logprobs."""
    a_prompt = list(range(40, 110))  # 70 tokens: 4 full blocks, then 6 positions
    b_prompt = a_prompt[:64] + list(range(200, 211))
    cold_a, cold_b = (engine.generate(p, max_tokens=12) for p in (a_prompt, b_prompt))
    loop = engine.new_loop()
    a = loop.admit(a_prompt, SamplingParams(), 12)
    done = {}
    for _ in range(after_passes):
        done.update(run_one(loop))
    assert a.finish is None and a.cached == min(70, after_passes * CHUNK)
    b = loop.admit(b_prompt, SamplingParams(), 12)
    assert b.cached_tokens == min(64, after_passes * CHUNK)  # written full blocks only
    assert loop.cache.blocks.tables[b.slot] == loop.cache.blocks.tables[a.slot][:b.cached_tokens // 16]
    run(loop, done)
    assert same(done[a], cold_a) and same(done[b], cold_b)
    assert loop.cache.blocks.used == 0 and loop.cache.in_use == 0


def run_one(loop):
    return {seq: ev.generation for seq, ev in loop.step() if isinstance(ev, FinishEvent)}


@pytest.mark.parametrize("first", ["sharer cancelled", "owner cancelled", "owner finishes"])
def test_shared_blocks_are_counted_whoever_leaves_first(engine, first):
    """A shares its four prompt blocks with B while both run. Whichever leaves first (cancelled, or
    finished), the blocks keep one reference for the other, which still reads its own tokens (its
    cold run's output); when both are gone no block is in use and the four stay cached."""
    a_prompt = list(range(60, 130))
    b_prompt = a_prompt[:64] + list(range(220, 230))
    cold_a, cold_b = (engine.generate(p, max_tokens=30) for p in (a_prompt, b_prompt))
    loop, done = engine.new_loop(), {}
    blocks = loop.cache.blocks
    a = loop.admit(a_prompt, SamplingParams(), 30 if first == "sharer cancelled" else 6)
    step_until(loop, lambda: a.cached >= 70, done)
    b = loop.admit(b_prompt, SamplingParams(), 30 if first == "owner finishes" else 6)
    shared = blocks.tables[a.slot][:4]
    assert b.cached_tokens == 64 and blocks.tables[b.slot][:4] == shared
    assert [blocks.blocks[i].refs for i in shared] == [2] * 4
    if first == "sharer cancelled":
        loop.release(b)
    elif first == "owner cancelled":
        loop.release(a)
    else:
        step_until(loop, lambda: a in done, done)
    assert [blocks.blocks[i].refs for i in shared] == [1] * 4
    run(loop, done)
    for seq, cold in ((a, cold_a), (b, cold_b)):
        if seq in done:  # (a cancelled one has no generation)
            n = len(done[seq].token_ids)
            assert done[seq].token_ids == cold.token_ids[:n] and done[seq].logprobs == cold.logprobs[:n]
    assert [blocks.blocks[i].refs for i in shared] == [0] * 4 and blocks.used == 0
    assert all(i in blocks.lru for i in shared)  # still cached for later prompts
    again = loop.admit(b_prompt, SamplingParams(), 30)
    assert again.cached_tokens == 64
    assert same(run(loop)[again], cold_b)


@pytest.mark.parametrize("n_prompt", [33, 49, 50, 600])
def test_a_cached_prefix_ends_where_the_backend_gives_a_cold_runs_bits(engine, n_prompt, monkeypatch):
    """With prefill chunks of 512: on MLX's CPU device, where a row of a product does not depend on the
    others, a prompt takes every full cached block; on numpy, where a row of `q @ k.T` changes with the
    chunk's row count, only whole chunks (512 of the 600-token prompt, none of the shorter ones). Either
    way the tokens and logprobs are the cold run's."""
    monkeypatch.setattr(engine, "prefill_chunk", 512)
    prompt = [100 + i % 200 for i in range(n_prompt)]
    cold = engine.generate(prompt, max_tokens=6)
    loop = engine.new_loop()
    loop.admit(prompt + [7, 8], SamplingParams(), 1)
    run(loop)  # its blocks stay cached
    again = loop.admit(prompt, SamplingParams(), 6)
    full = (n_prompt - 1) // 16 * 16
    assert again.cached_tokens == (full if engine.backend.rows_independent else full // 512 * 512)
    assert same(run(loop)[again], cold)


@pytest.mark.parametrize("answerer", ["finished", "running"])
def test_an_answer_is_not_shared_only_its_prompt(engine, answerer):
    """B's prompt is A's prompt and answer (a next chat turn, or a client extending a stream): B takes
    A's prompt blocks, not the blocks A's decode steps wrote (one-row products: on numpy other bits than
    B's cold prefill of them), whether A has finished or still runs."""
    a_prompt = list(range(30, 70))  # 40 tokens: 2 full blocks
    loop, done = engine.new_loop(), {}
    a = loop.admit(a_prompt, SamplingParams(), 40)
    step_until(loop, lambda: a in done if answerer == "finished" else len(a.out) >= 16, done)
    answer = list(a.out)
    assert len(answer) >= 16 and (a in done) == (answerer == "finished")
    b_prompt = a_prompt + answer + [5, 6]
    cold = engine.generate(b_prompt, max_tokens=6)
    b = loop.admit(b_prompt, SamplingParams(), 6)
    assert b.cached_tokens == 32  # (blocks 2 and 3, positions 32..63, hold decode rows)
    assert same(run(loop, done)[b], cold)


def test_n_choices_take_one_prefill_and_share_the_prompt_blocks(engine, monkeypatch):
    """Four choices of a 40-token prompt (2 full blocks and 8 positions): one prefill pass, the full
    blocks shared by all four (4 references each), the partial block copied once per fork: 3 blocks for
    the prompt + 3 copies, not 12. At temperature 0 each choice is the single greedy answer, bit for bit;
    sampled with seed s + i, choice i is a single request's run with seed s + i."""
    monkeypatch.setattr(engine, "prefill_chunk", 512)
    prompt = list(range(50, 90))
    for params, seeds in ((dict(), [None] * 4), (dict(temperature=0.9), [7, 8, 9, 10])):
        cold = [engine.generate(prompt, max_tokens=10, seed=s, **params) for s in seeds]
        loop = engine.new_loop()
        blocks = loop.cache.blocks
        taken = []
        take = blocks._take
        monkeypatch.setattr(blocks, "_take", lambda: taken.append(1) or take())
        first = loop.admit(prompt, SamplingParams(seed=seeds[0], **params), 10)
        forks = [loop.admit(prompt, SamplingParams(seed=s, **params), 10, fork_of=first) for s in seeds[1:]]
        loop.step()
        assert loop.passes == 1 and all(not f.prefilling for f in forks)
        shared = blocks.tables[first.slot][:2]
        assert all(blocks.tables[f.slot][:2] == shared for f in forks)
        assert [blocks.blocks[b].refs for b in shared] == [4, 4] and len(taken) == 3 + 3 and blocks.used == 6
        done = run(loop)
        for seq, c in zip([first] + forks, cold):
            assert same(done[seq], c)
        assert blocks.used == 0 and loop.cache.in_use == 0


@pytest.mark.parametrize("who", ["first", "fork"])
def test_a_choice_cancelled_during_the_prefill_leaves_the_others_whole(engine, who):
    """Cancelling the first choice after its first prefill chunk (of three): its forks take the block it
    wrote, prefill the rest themselves and still give the greedy answer; cancelling a waiting fork: it
    never takes a block."""
    prompt = list(range(50, 90))
    cold = engine.generate(prompt, max_tokens=8)
    loop = engine.new_loop()
    first = loop.admit(prompt, SamplingParams(), 8)
    forks = [loop.admit(prompt, SamplingParams(), 8, fork_of=first) for _ in range(2)]
    loop.step()
    loop.release(first if who == "first" else forks[0])
    if who == "first":
        assert [f.cached_tokens for f in forks] == [16, 16]
    done = run(loop)
    alive = forks if who == "first" else [first, forks[1]]
    assert all(same(done[s], cold) for s in alive) and set(done) == set(alive)
    assert loop.cache.blocks.used == 0 and loop.cache.in_use == 0


# -- prompt blocks on disk (--prompt-cache-dir) -------------------------------------------------------

def reload(engine, directory, **options):
    """A fresh engine on the same model file and backend (a restarted server), with a prompt cache."""
    spec = dict(backend="mlx" if engine.backend.name == "mlx" else "cpu", kv="paged", prefill_chunk=CHUNK)
    return mlxinfer.load(engine.path, **{**spec, **options}, prompt_cache_dir=directory)


def admit_one(engine, prompt, max_tokens=8):
    loop = engine.new_loop()
    seq = loop.admit(prompt, SamplingParams(), max_tokens)
    return seq, run(loop)[seq]


def test_prompt_blocks_on_disk_serve_a_restarted_engine_with_cold_bits(engine, tmp_path):
    """A prompt's full blocks are written to the directory when its request ends; a new engine (a
    restart) that gets a prompt extending it reads them instead of prefilling, and gives the tokens and
    logprobs of a cold run."""
    prompt = list(range(40, 110))  # 4 full blocks
    first = reload(engine, tmp_path)
    admit_one(first, prompt)
    assert len(list(tmp_path.glob("*.kvblock"))) == 4 and not list(tmp_path.glob("*.tmp"))
    longer = prompt[:64] + [3, 4, 5, 6, 7]
    cold = engine.generate(longer, max_tokens=8)
    again = reload(engine, tmp_path)
    seq, gen = admit_one(again, longer)
    assert seq.cached_tokens == 64 and again.prompt_cache.hits == 4
    assert same(gen, cold)


def test_prompt_blocks_on_disk_are_never_read_by_another_model_backend_or_chunk(engine, tmp_path):
    """The files are named by the model file's digest, the backend and its kernels and the prefill chunk
    too: another model file (same shapes), the other backend or another chunk size finds nothing."""
    prompt = list(range(40, 110))
    admit_one(reload(engine, tmp_path), prompt)
    other_model = mlxinfer.load(write_other(tmp_path.parent), backend="cpu", kv="paged", prefill_chunk=CHUNK,
                                prompt_cache_dir=tmp_path)
    other_backend = reload(engine, tmp_path, backend="cpu" if engine.backend.name == "mlx" else "mlx")
    other_chunk = reload(engine, tmp_path, prefill_chunk=32)
    for other in (other_model, other_backend, other_chunk):
        cold = mlxinfer.load(other.path, backend=other.backend.name, kv="paged", prefill_chunk=other.prefill_chunk)
        seq, gen = admit_one(other, prompt + [1, 2])
        assert seq.cached_tokens == 0 and other.prompt_cache.hits == 0
        assert same(gen, cold.generate(prompt + [1, 2], max_tokens=8))


def write_other(directory):
    from mlxinfer.synthetic import write_synthetic_model

    return write_synthetic_model(directory / "other.gguf", **{**SHAPE, "seed": 6})


@pytest.mark.parametrize("damage", ["truncated", "one bit flipped", "empty", "another block's bytes"])
def test_a_damaged_block_file_is_one_warning_and_a_miss(engine, tmp_path, damage, caplog):
    """The third of four block files damaged: the first two are read, the rest prefilled; one warning
    line names the file; the tokens and logprobs are a cold run's; the damaged file is gone."""
    prompt = list(range(40, 110))
    first = reload(engine, tmp_path)
    admit_one(first, prompt)
    disk = first.prompt_cache
    third = disk._path(disk._name(prompt[:48]))
    data = open(third, "rb").read()
    damaged = {"truncated": data[:len(data) // 2], "empty": b"",
               "one bit flipped": data[:1000] + bytes([data[1000] ^ 1]) + data[1001:],
               "another block's bytes": open(disk._path(disk._name(prompt[:32])), "rb").read()}[damage]
    open(third, "wb").write(damaged)
    cold = engine.generate(prompt, max_tokens=8)
    with caplog.at_level("WARNING", logger="mlxinfer.prompt_cache"):
        seq, gen = admit_one(reload(engine, tmp_path), prompt)
    assert seq.cached_tokens == 32 and same(gen, cold)
    warnings = [r for r in caplog.records if r.name == "mlxinfer.prompt_cache"]
    assert len(warnings) == 1 and third in warnings[0].getMessage() and "\n" not in warnings[0].getMessage()
    assert open(third, "rb").read() != damaged  # removed, then written again whole when the request ended


def test_the_prompt_cache_directory_is_bounded_least_recently_used_first(engine, tmp_path):
    """Room for 5 blocks: prompts A, B (2 blocks each), a hit on A, then C (2 blocks): the one block
    removed is B's older one, the least recently used; A's (read since) and C's stay."""
    import time

    prompts = {k: [k * 50 + i for i in range(33)] for k in (1, 2, 3)}  # 2 full blocks each (+1 token)
    probe = reload(engine, tmp_path)
    size = probe.prompt_cache.block_bytes * 5
    eng = reload(engine, tmp_path, prompt_cache_size=size)
    files = {k: [eng.prompt_cache._path(eng.prompt_cache._name(p[:e])) for e in (16, 32)] for k, p in prompts.items()}
    for step in ("A", "B", "hit A", "C"):
        k = {"A": 1, "B": 2, "hit A": 1, "C": 3}[step]
        seq, _ = admit_one(reload(engine, tmp_path, prompt_cache_size=size), prompts[k] + [9], max_tokens=2)
        assert seq.cached_tokens == (32 if step == "hit A" else 0)
        time.sleep(0.05)  # apart in the files' modification times
    import os

    exists = {k: [os.path.exists(f) for f in fs] for k, fs in files.items()}
    assert exists == {1: [True, True], 2: [False, True], 3: [True, True]}
