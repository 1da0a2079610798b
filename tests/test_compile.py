"""The compiled decode step (mlxinfer.decode_step, MLX's mx.compile): a decode pass traced once per batch
size and cache capacity, the cache stores carried as state.

On a GPU the MLX backend compiles its own attention kernel (tests/test_mlx_backend.py checks it against
the eager engine there). On this CPU its graph attention slices the cache by host lengths and is never
compiled, so these tests give the MLX CPU backend a length-from-array attention (`LengthMasked`: each
decode row over its slot's whole capacity, later keys masked) and check the plumbing: compiled equals
eager bit for bit, across cache growth (a retrace), several batch sizes, slots freed and reused.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlxinfer
from mlxinfer.backends.mlx import MLXBackend
from mlxinfer.decode_step import DecodeStep
from mlxinfer.engine import Engine


class LengthMasked(MLXBackend):
    """MLX CPU with a decode attention that reads positions and lengths from arrays only."""

    @property
    def compiles_decode(self):
        return True

    def fused_attention_override(self, q, kv, batch, spec):
        if batch.n_rows != len(batch) or (kv.store is None and not hasattr(kv, "batch_rows")):
            return super().fused_attention_override(q, kv, batch, spec)  # not a decode pass: the usual path
        n = q.shape[0]
        if kv.store is not None:
            keys, values = kv.store
            k, v = keys[batch.row_slots], values[batch.row_slots]  # [N, cap, KV*D]
        else:  # paged: every sequence's rows gathered from the blocks, padded to S_max
            rows, row_seq, s_max = kv.batch_rows(self)
            w = kv.keys.shape[2]
            k = kv.keys.reshape(-1, w)[rows].reshape(n, s_max, w)[row_seq]
            v = kv.values.reshape(-1, w)[rows].reshape(n, s_max, w)[row_seq]
        cap = k.shape[1]
        kh = mx.reshape(k, (n, cap, spec.n_kv_heads, spec.head_dim)).transpose(0, 2, 1, 3)
        vh = mx.reshape(v, (n, cap, spec.n_kv_heads, spec.head_dim)).transpose(0, 2, 1, 3)
        qh = mx.reshape(q, (n, spec.n_kv_heads, spec.group, spec.head_dim))
        scores = (qh @ mx.swapaxes(kh, -1, -2)) * spec.scale  # [N, KV, G, cap]
        hidden = mx.arange(cap)[None, :] >= batch.row_lens[:, None]
        if spec.window:  # (positions as the store addresses them: a windowed store's less its origin)
            hidden = hidden | (mx.arange(cap)[None, :] <= batch.positions[:, None] - spec.window)
        scores = mx.where(hidden[:, None, None, :], -np.inf, scores)
        ctx = mx.softmax(scores, axis=-1, precise=True) @ vh  # [N, KV, G, D]
        return mx.reshape(ctx, (n, spec.n_heads * spec.head_dim))


def engines(path, kv="prealloc"):
    out = []
    for compiled in (False, True):
        e = Engine(path, LengthMasked(device="cpu"), kv=kv)
        e.compile_decode = compiled
        out.append(e)
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mlxinfer.synthetic import write_synthetic_model

    return write_synthetic_model(tmp_path_factory.mktemp("c") / "m.gguf", arch="qwen3", n_layers=2, hidden=64,
                                 ffn=128, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=320, tied_output=False)


@pytest.mark.parametrize("kv", ["prealloc", "paged"])
def test_compiled_decode_equals_eager_across_cache_growth(model, kv):
    eager, compiled = engines(model, kv)
    prompt = list(range(3, 250))  # the cache grows past 256 positions while decoding: a new shape
    a = eager.generate(prompt, max_tokens=20)
    b = compiled.generate(prompt, max_tokens=20)
    assert b.token_ids == a.token_ids and b.logprobs == a.logprobs  # bitwise: the same floats
    steps = compiled.decode_step.steps
    assert list(steps) == [(type(compiled.new_cache()), 1, frozenset())]  # one step for batch size 1
    step = steps[(type(compiled.new_cache()), 1, frozenset())]
    c = compiled.generate(prompt, max_tokens=20)  # a new request, a new cache: the same compiled step
    assert c.token_ids == a.token_ids and steps[(type(compiled.new_cache()), 1, frozenset())] is step


@pytest.mark.parametrize("kv", ["prealloc", "paged"])
def test_compiled_batch_decode_with_sequences_finishing_apart(model, kv):
    eager, compiled = engines(model, kv)
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 17)]
    kw = dict(max_tokens=12, temperature=0.9, seed=7)
    want = eager.generate_batch(prompts, **kw)
    got = compiled.generate_batch(prompts, **kw)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    short = compiled.generate_batch(prompts, max_tokens=4)  # a second batch reuses slots
    assert [g.token_ids for g in short] == [w.token_ids for w in eager.generate_batch(prompts, max_tokens=4)]


def test_compiled_step_is_actually_used(model, monkeypatch):
    _, compiled = engines(model)
    calls = []
    real = DecodeStep.covers

    def spy(self, *args):
        out = real(self, *args)
        calls.append(out)
        return out

    monkeypatch.setattr(DecodeStep, "covers", spy)
    compiled.generate([3, 4, 5], max_tokens=6)
    assert calls[0] is False and calls.count(True) == 5  # the prompt's pass eager, five decode passes compiled


def test_decode_steps_carry_their_index_arrays_on_the_device(model, monkeypatch):
    """A run of compiled steps over the same sequences makes its positions and lengths on the device
    (each step returns the next's): the host builds index arrays for the prompt's pass and the first
    decode step only, and again only when the batch changes; the tokens equal the eager engine's."""
    from mlxinfer import batch

    eager, compiled = engines(model)
    built = []  # the rows of each pass whose index arrays the host builds
    real = batch.pack_index_arrays
    monkeypatch.setattr(batch, "pack_index_arrays",
                        lambda ops, lists, *a: built.append(len(lists[0])) or real(ops, lists, *a))
    want = eager.generate([3, 4, 5], max_tokens=8).token_ids
    built.clear()
    assert compiled.generate([3, 4, 5], max_tokens=8).token_ids == want
    assert built == [3, 1]  # the prompt's pass, then the first of seven decode steps
    prompts = [list(range(5, 5 + n)) for n in (3, 9)]
    want = [g.token_ids for g in eager.generate_batch(prompts, max_tokens=6)]
    built.clear()
    assert [g.token_ids for g in compiled.generate_batch(prompts, max_tokens=6)] == want
    assert built.count(2) == 1  # both sequences decode together from the first step on


def test_paged_decode_lists_its_gather_rows_only_when_tables_or_s_max_change(model, monkeypatch):
    """The paged cache's compiled decode step takes every sequence's pool rows, padded to S_max (a
    multiple of 256): they follow the block tables and S_max alone, so the host lists them again when
    one of those changes, not for every token; the tokens equal the eager engine's."""
    from mlxinfer.block_manager import BlockManager

    eager, compiled = engines(model, "paged")
    listed = []
    real = BlockManager.pool_rows
    monkeypatch.setattr(BlockManager, "pool_rows", lambda self, slot, n: listed.append(n) or real(self, slot, n))
    prompt = list(range(3, 250))  # 247 tokens: decoding to 267 passes S_max = 256, the gather rows' bucket
    want = eager.generate(prompt, max_tokens=20).token_ids
    listed.clear()
    assert compiled.generate(prompt, max_tokens=20).token_ids == want
    assert listed == [247, 256, 512]  # the prompt's pass, the first step, the step past 256 (not 20 steps)


def test_graph_attention_and_tracing_never_compile(model):
    plain = mlxinfer.load(model, backend="mlx", device="cpu")
    assert not plain.backend.compiles_decode  # the graph path reads host lengths
    from mlxinfer.tracing import install_tracer

    assert not install_tracer(engines(model)[1]).compiles_decode


def gpu_kernel():
    return mx.cuda.is_available() and "cuda" or (mx.metal.is_available() and "metal") or None


@pytest.mark.skipif(not gpu_kernel(), reason="needs an MLX GPU (CUDA or Metal) for the attention kernel")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv", ["prealloc", "paged"])
def test_gpu_compiled_decode_equals_eager_bitwise(model, kv, dtype):
    kind = gpu_kernel()
    runs = []
    for compiled in (False, True):
        e = Engine(model, MLXBackend(device="gpu", kernel=kind, dtype=dtype), kv=kv)
        e.compile_decode = compiled
        assert e.backend.compiles_decode
        one = e.generate(list(range(3, 300)), max_tokens=24)
        many = e.generate_batch([list(range(5, 5 + n)) for n in (3, 40, 17)], max_tokens=12, temperature=0.9,
                                seed=3)
        runs.append((one.token_ids, one.logprobs, [g.token_ids for g in many], [g.logprobs for g in many]))
    assert runs[1] == runs[0]


def test_a_pass_the_kernel_would_not_take_is_never_compiled(model):
    """The graph path slices the cache by host lengths: a pass that would take it (here: few rows over
    a long cache) runs eagerly, and a traced batch's host fields cannot be read by mistake."""
    from mlxinfer.backend import AttentionSpec
    from mlxinfer.batch import Batch

    b = LengthMasked(device="cpu")
    spec = AttentionSpec.standard(4, 2, 32)
    assert b.compiles_pass(Batch(b, [0], [100], [1]), spec)
    assert not b.compiles_pass(Batch(b, [0], [2000], [1]), spec)  # few long rows: graph path, eager
    assert not b.compiles_pass(Batch(b, [0], [10], [1]), AttentionSpec.standard(2, 1, 512))  # past the kernel
    t = Batch.traced_decode(b, 2, Batch(b, [0, 1], [5, 6], [1, 1]).packed)
    assert len(t) == 2 and t.n_rows == 2 and t.max_kv_len is None
    assert b.compiles_pass(t, spec)  # no host length to take the graph path on
    with pytest.raises(TypeError):
        max(t.kv_lens)


def test_compiled_decode_over_windowed_layers(tmp_path):
    """Gemma 3's windowed layers (window 24) in the preallocated cache: the compiled step addresses their
    stores through its index arrays less each slot's origin (`Batch.traced_shift`; one step per batch
    size and set of windowed layers). Two sequences decode together while one's origin moves on (at
    position 279 = 256 + 24 - 1) and the other's stays 0: the tokens and log-probabilities of the eager
    engine, whose passes shift on the host (`Batch.shifted`)."""
    from mlxinfer.synthetic import write_synthetic_model

    path = write_synthetic_model(tmp_path / "g3.gguf", arch="gemma3", n_layers=6, hidden=64, ffn=128, n_heads=4,
                                 n_kv_heads=2, head_dim=16, vocab_size=320, sliding_window=24,
                                 embedding_std=64 ** -0.5, seed=2)
    eager, compiled = engines(path)
    prompts = [list(np.random.default_rng(n).integers(3, 300, n)) for n in (230, 100)]
    kw = dict(max_tokens=80, temperature=0.9, seed=3)
    want, got = eager.generate_batch(prompts, **kw), compiled.generate_batch(prompts, **kw)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.logprobs for g in got] == [w.logprobs for w in want]
    windowed = frozenset(i for i in range(6) if i % 6 != 5)
    assert (type(compiled.new_cache()), 2, windowed) in compiled.decode_step.steps
