"""Sliding-window layers in the preallocated KV cache (Gemma 2/3): they keep only the positions a query
can still see, from an origin per slot that follows the window in steps of the cache's step, while the
global layers keep every position. Attention reads a windowed store through the pass shifted by the
origins (positions and lengths less them), so the mask is the same, and the keys it drops were all
hidden: the logits are those of a cache that keeps everything, bit for bit on MLX's CPU device (its
products do not depend on the number of keys masked out) and within OpenBLAS's reassociation on numpy
(a row's product over fewer keys is another gemm shape). The paged cache (the server's) keeps every
position.

Error model for numpy: the windowed store makes each softmax x V product a sum over S - origin keys
instead of S (the dropped ones have weight exactly 0), which OpenBLAS blocks differently; each such
reassociation moves an output by a few ulps, carried through the layers to the logits, as in
test_models' decode-vs-prefill bound (16 ulps of the largest logit). Measured here: 5 ulps."""

import numpy as np
import pytest

import mlxinfer
from mlxinfer.backend import AttentionSpec
from mlxinfer.backends.mlx import gpu_kind
from mlxinfer.engine import _events
from mlxinfer.batch import Batch
from mlxinfer.kv_cache import PreallocKVCache
from mlxinfer.sampling import SamplingParams

WINDOW, CHUNK, STEP = 40, 64, 16
SHAPES = {arch: dict(arch=arch, n_layers=len(pattern), hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16,
                     vocab_size=320, sliding_window=WINDOW, embedding_std=64 ** -0.5, seed=1)
          for arch, pattern in (("gemma3", "wwwwwg"), ("gemma2", "wgwg"))}
GPU = pytest.mark.skipif(gpu_kind() is None, reason="needs a GPU (MLX's Metal or CUDA)")
BACKENDS = [("cpu", None), ("mlx", "cpu"), pytest.param("mlx", "gpu", marks=GPU)]


def _prompt(n, seed=0):
    return [int(x) for x in np.random.default_rng(seed).integers(3, 300, n)]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model(request, tmp_path_factory):
    from mlxinfer.synthetic import write_synthetic_model

    return write_synthetic_model(tmp_path_factory.mktemp("swa") / f"{request.param}.gguf", **SHAPES[request.param])


def _engine(model, backend, device, **kw):
    return mlxinfer.load(model, backend=backend, device=device, prefill_chunk=CHUNK, **kw)


def _score(engine, ids, step=STEP):
    """Every position's logits through a fresh cache of the engine's kind with the given step."""
    return engine.new_loop(engine.new_cache(step=step) if engine.kv == "prealloc" else None).score(ids)


def _close(a, b, backend, device):
    """Bit for bit on MLX's CPU; on numpy within 16 ulps of the largest logit (the module's error model);
    on a GPU, whose kernels split a row's keys into parts by its length, within 64 (not measured yet)."""
    if (backend, device) == ("mlx", "cpu"):
        assert np.array_equal(a, b)
    else:
        np.testing.assert_allclose(a, b, rtol=0, atol=(16 if backend == "cpu" else 64) * np.spacing(np.abs(b).max()))


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("step", [1, STEP])
def test_a_long_prompt_gives_the_full_caches_logits(model, backend, device, step):
    """700 positions through windowed stores whose origins moved on (to a multiple of `step`; step 1:
    the window's first position exactly, so a position too many dropped shows), against the paged
    cache that keeps every position; fused and per-head bit for bit on the windowed stores."""
    ids = _prompt(700)
    full = _score(_engine(model, backend, device, kv="paged"), ids)
    fused = _engine(model, backend, device)
    cache = fused.new_cache(step=step)
    got = fused.new_loop(cache).score(ids)
    assert cache.window_capacity < cache.capacity or not cache.held
    _close(got, full, backend, device)
    per_head = _score(_engine(model, backend, device, attention="per-head"), ids, step)
    assert np.array_equal(got, per_head)


def test_the_windowed_layers_hold_their_window(model):
    """After a 700-token prompt in chunks of 64 and 60 tokens of decode, each windowed store holds
    window + step - 2 + chunk positions a slot (rounded up to the step), the others the whole sequence;
    once a slot holds a whole window that size stays (no resize up and down as its origin moves on);
    nbytes counts both."""
    e = _engine(model, "cpu", None)
    cache = e.new_cache(step=STEP)
    sizes, resize = [], cache._resize
    cache._resize = lambda *size: sizes.append(size[2]) or resize(*size)
    loop = e.new_loop(cache)
    seq = loop.admit(_prompt(700), SamplingParams(temperature=0.0), 61, keep=True)
    list(_events(loop))
    windowed = [i for i, spec in enumerate(e.specs) if spec.window]
    assert 0 < len(windowed) < len(e.specs)
    bound = STEP * -(-(WINDOW + STEP - 2 + CHUNK) // STEP)
    assert sizes[-1] == bound and sizes.index(bound) <= 2 and len(set(sizes[sizes.index(bound):])) == 1
    assert cache.origin[seq.slot] > 0 and cache.held[seq.slot] == 760
    for i in range(len(e.specs)):
        assert cache.keys[i].shape[1] == (cache.window_capacity if i in windowed else cache.capacity)
    assert cache.window_capacity == bound < 760 <= cache.capacity
    layers_bytes = (len(e.specs) - len(windowed)) * cache.capacity + len(windowed) * cache.window_capacity
    assert cache.nbytes() == 2 * layers_bytes * cache.width * 4


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_batched_generation_gives_the_full_caches_tokens(model, backend, device):
    """Three sequences of different lengths decoding together (MLX: the compiled, pipelined step, its
    windowed stores addressed through the shift of its index arrays), their origins moving at different
    steps: the tokens and log-probabilities of the paged cache that keeps everything."""
    prompts = [_prompt(n, seed=n) for n in (90, 300, 170)]
    runs = [_engine(model, backend, device, kv=kv).generate_batch(prompts, max_tokens=70) for kv in ("prealloc", "paged")]
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
        if (backend, device) == ("mlx", "cpu"):
            assert a.logprobs == b.logprobs
        else:
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("diverge,kept", [(None, True), (5, False), (-2, False), (-1, True)])
def test_a_chats_next_turn_keeps_or_starts_over(model, diverge, kept):
    """A second turn continuing the first keeps its rows (prefills only what it adds); one whose prompt
    leaves the first turn's before the windowed rows still held starts over: at position 5 (long
    dropped), and at origin + window - 2 (its first row would see origin - 1), not at origin + window - 1
    (-2 and -1: relative to origin + window). Either way its tokens are a cold run's."""
    e = _engine(model, "mlx", "cpu")
    conv = e.conversation()
    first = _prompt(300)
    out = [ev for ev in conv.stream(first, max_tokens=8) if hasattr(ev, "token_id")]
    second = first + [ev.token_id for ev in out] + _prompt(20, seed=9)
    if diverge is not None:
        origin = conv.loop.cache.origin[conv.last.slot]
        assert origin > 0
        diverge = diverge if diverge > 0 else origin + WINDOW + diverge
        second[diverge] = (second[diverge] + 1) % 300 + 3
    got = [ev.token_id for ev in conv.stream(second, max_tokens=8) if hasattr(ev, "token_id")]
    assert (conv.prefilled < len(second)) == kept
    assert got == e.generate(second, max_tokens=8).token_ids


def test_other_caches_and_models_have_no_windowed_layers(model, synthetic):
    """Only the preallocated cache is given the windows; a model without windowed layers has none."""
    assert _engine(model, "cpu", None, kv="paged").new_cache().step_config == frozenset()
    assert _engine(model, "cpu", None, kv="basic").new_cache().step_config == frozenset()
    e = mlxinfer.load(synthetic(arch="qwen3", n_layers=2), backend="cpu")
    cache = e.new_cache()
    assert cache.windowed == frozenset() and cache.window is None
    with pytest.raises(ValueError, match="3 windows for 2 layers"):
        PreallocKVCache(e.backend, 2, 8, windows=[None, 4, 4])


def _pass(cache, ops, slots_starts_lengths, layer=0):
    """One pass's rows written to `layer` (values coding their positions); -> the layer's view."""
    slots, starts, lengths = zip(*slots_starts_lengths)
    batch = Batch(ops, slots, starts, lengths)
    cache.reserve(batch)
    k = np.concatenate([np.arange(s, s + n, dtype=np.float32) for s, n in zip(starts, lengths)])
    x = ops.from_numpy(np.repeat(k[:, None], cache.width, axis=1))
    return cache.update(ops, layer, x, x, batch), batch


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_each_slot_reads_its_rows_from_its_origin_and_a_reused_slot_from_0(backend):
    """Cache alone, layer 0 windowed (window 20, step 8): after passes that move slot 0's origin and not
    slot 1's, each sequence's rows are its positions origin .. n-1 (values coding them) and the view's
    batch gives positions and lengths less the origin; the compiled step's shift of the index arrays
    (step_inputs / step_cache) gives the same, and follows an origin that moves on; a slot released and
    given again starts at origin 0."""
    from mlxinfer.backends import make_backend

    ops = make_backend(backend, device="cpu" if backend == "mlx" else None)
    cache = PreallocKVCache(ops, 2, 4, step=8, windows=[20, None])
    a, b = cache.alloc(), cache.alloc()
    _pass(cache, ops, [(a, 0, 30), (b, 0, 5)])
    view, batch = _pass(cache, ops, [(a, 30, 1), (b, 5, 1)])
    assert cache.origin == {a: 8}  # the last multiple of 8 at or before 30 - 20 + 1
    for i, (slot, n) in enumerate(((a, 31), (b, 6))):
        keys, _ = view.sequence(ops, i)
        first = cache.origin.get(slot, 0)
        assert np.array_equal(ops.to_numpy(keys)[:, 0], np.arange(first, n, dtype=np.float32))
    assert list(ops.to_numpy(view.batch.positions)) == [22, 5] and view.batch.kv_lens == (23, 6)
    for _ in range(2):  # the compiled step's view of the same pass, and after slot a's origin moved on
        stores = PreallocKVCache.step_cache(cache.keys, cache.values, cache.step_inputs(ops, batch), cache.step_config)
        traced = stores.shift(ops, batch)
        assert list(ops.to_numpy(traced.positions)) == list(ops.to_numpy(cache._origin_batch(ops, batch).positions))
        assert list(ops.to_numpy(traced.row_lens)) == list(ops.to_numpy(cache._origin_batch(ops, batch).row_lens))
        _pass(cache, ops, [(a, batch.kv_lens[0], 8), (b, batch.kv_lens[1], 1)])
        batch = Batch(ops, [a, b], [cache.held[a], cache.held[b]], [1, 1])
        cache.reserve(batch)
    assert cache.origin[a] == 24
    cache.release(a)
    assert cache.alloc() == a
    view, _ = _pass(cache, ops, [(a, 0, 3), (b, cache.held[b], 1)])
    keys, _ = view.sequence(ops, 0)
    assert np.array_equal(ops.to_numpy(keys)[:, 0], [0, 1, 2]) and view.batch.starts == (0, batch.kv_lens[1])


@pytest.mark.parametrize("plan", ["split", "split, short", "one-launch"])
def test_the_cuda_kernels_read_a_windowed_store_as_the_reference(plan, monkeypatch, tmp_path):
    """attention.cu's kernels, run on the host (tests/cuda_host.py: g++, a fiber per CUDA thread), read
    a windowed store in place at the shifted positions: MLX's override on an MLX backend made to take
    the CUDA path equals the per-head reference (whose products and softmax are the published-order
    kernels, run on the host too), in the split plan (its two launches, or one: attn_short) and the
    one-launch kernel, for a decode row and a 3-row chunk whose slots' origins moved (64 and 32)."""
    from mlxinfer import kernels
    from mlxinfer.testing import AttentionCase, assert_matches_default

    from . import cuda_host

    if not cuda_host.available():
        pytest.skip("needs g++ (C++20) to run the CUDA kernels on the host")
    launched = cuda_host.launch_on_host(tmp_path, monkeypatch)
    split = plan.startswith("split")
    monkeypatch.setattr(kernels, "SPLIT_MAX_ITEMS", 10**9 if split else 0)
    monkeypatch.setattr(kernels, "SPLIT_MAX_SCRATCH", 10**18 if split else 0)
    monkeypatch.setattr(kernels, "SHORT_MAX_ROWS", 10**9 if plan == "split, short" else 0)
    b = cuda_host.cuda_path()
    rng = np.random.default_rng(5)
    spec = AttentionSpec.standard(2, 1, 16, window=20)
    keys, values = ([rng.standard_normal((s, 16), dtype=np.float32) for s in (90, 60)] for _ in range(2))
    case = AttentionCase(rng.standard_normal((4, 32), dtype=np.float32), keys, values, [1, 3], spec)
    assert_matches_default(b, case, kv="windowed")
    first = {"split": "attn_scores", "split, short": "attn_short", "one-launch": "fused_attention"}[plan]
    assert launched and first in launched and ("attn_scores" in launched) == (plan == "split"), launched
