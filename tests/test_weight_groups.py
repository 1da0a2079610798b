"""Weight groups (`Backend.load_weight_group` / `linear_group`): a layer's Q, K, V and its gate, up load as
one handle; the MLX backend stacks them into one matrix and multiplies once, the default (cpu, tracer)
keeps one `linear` per matrix.

Measured on this machine's MLX CPU (mlx 0.32.4, 2026-11-30) before writing these: the stacked product's
column slices are bit-identical to the separate products for F32, F16, Q8_0, Q4_0 and Q4_1 weights at 1 to
33 rows (F16 then dequantized on load; kept 16-bit since issue 28, the same checks pass) on the QWEN3 shape below, and for SmolLM2's Q4_1 layers (576 -> 576+192+192, 576 -> 1536+1536) and
their F32 dequantization at 1 to 512 rows. So every comparison between the paths here is bitwise (float32
bits as uint32), no tolerance; only the check against float64 numpy has one (stated where it is).

The op-count formula (7 `linear` a layer + 1 on the tracer, both backends) is already
`test_tracing.py::test_op_counts_per_layer_head_and_sequence`; here only the tracer's handling of one group.
"""

import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

import mlx.core as mx
import mlxinfer
from mlxinfer.backend import Backend
from mlxinfer.backends.cpu import CPUBackend
from mlxinfer.backends.mlx import GROUP, BlockWeight, MLXBackend, PackedWeight, QuantizedWeight, WeightGroup, WeightRuns
from mlxinfer.gguf_file import GGUFFile
from mlxinfer.models.spec import WEIGHT_GROUPS
from mlxinfer.synthetic import _add_metadata
from mlxinfer.tracing import TracingBackend

# head_dim != hidden / heads and GQA: Q's output width differs from K's and V's, so a slice in the wrong
# place or the sizes in the wrong order cannot go unnoticed. ffn 96 != hidden.
QWEN3 = dict(arch="qwen3", n_layers=2, hidden=128, ffn=96, n_heads=4, n_kv_heads=2, head_dim=48, seed=3)
LLAMA = dict(arch="llama", n_layers=2, hidden=64, ffn=160, n_heads=8, n_kv_heads=2, head_dim=8, seed=4)
QTYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"]
QKV = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"]
GATE_UP = ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"]


def bits(a) -> np.ndarray:
    a = np.asarray(a, dtype=np.float32)
    return np.ascontiguousarray(a).view(np.uint32)


def assert_same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    assert np.array_equal(bits(got), bits(want)), f"{int((bits(got) != bits(want)).sum())} of {got.size} differ"


def group_sizes(args):
    return {"attn_qkv": (args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim,
                         args.n_kv_heads * args.head_dim),
            "ffn_gate_up": (args.ffn, args.ffn)}


def dequantized(w: QuantizedWeight):
    """[out, in] float32."""
    return mx.dequantize(w.w, w.scales, w.biases, group_size=GROUP, bits=w.bits)


def mlx_dense(w):
    """A `linear` handle of the MLX backend as the float32 [in, out] matrix it multiplies by."""
    if isinstance(w, BlockWeight):
        return mx.transpose(w.dense())
    return mx.transpose(dequantized(w)) if isinstance(w, QuantizedWeight) else w


def write_mixed(tmp_path, types: dict) -> str:
    """A copy of the synthetic QWEN3 model (F32) with some matrices stored in other types ({gguf name:
    type}): `mlxinfer.synthetic` writes one type for every matrix, so the mixed file is written here."""
    from mlxinfer.synthetic import write_synthetic_model

    src = write_synthetic_model(tmp_path / "f32.gguf", qtype="F32", **QWEN3)
    dst = tmp_path / "mixed.gguf"
    with GGUFFile(src) as g:
        w = GGUFWriter(str(dst), g.architecture)
        for k, v in g.metadata.items():
            if k != "general.architecture":
                _add_metadata(w, k, v)
        for name in g.tensors:
            data = np.ascontiguousarray(g.dequantize(name), dtype=np.float32)
            qtype = types.get(name, Q.F32)
            if qtype == Q.F32:
                w.add_tensor(name, data)
            else:
                w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return str(dst)


# -- 1. loading groups the matrices --------------------------------------------------------------

@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("shape", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_mlx_model_loads_qkv_and_gate_up_as_weight_groups(synthetic, shape, qtype):
    engine = mlxinfer.load(synthetic(**shape, qtype=qtype), backend="mlx", device="cpu")
    want = group_sizes(engine.args)
    for layer in engine.model.w.layers:
        for group, keys in WEIGHT_GROUPS.items():
            g = getattr(layer, group)
            assert isinstance(g, WeightGroup), group
            assert g.sizes == want[group]
            packed = qtype != "F32"  # F16 too: kept 16-bit, [out, in] rows like the quantized types
            assert isinstance(g.merged, QuantizedWeight) == qtype.startswith("Q")
            assert isinstance(g.merged, PackedWeight) == packed
            assert g.merged.shape == ((sum(g.sizes), engine.args.hidden) if packed
                                      else (engine.args.hidden, sum(g.sizes)))
            for k in keys:  # the grouped matrices are not also loaded one by one
                assert not hasattr(layer, k)


def test_smollm2_q4_1_layers_are_grouped(smollm2_path):
    """SmolLM2's file mixes types (Q8_0 embedding, Q4_1 layer matrices, F32 norms); its Q, K, V (576,
    192, 192) and gate, up (1536 each) are all Q4_1, so every layer's groups stack."""
    engine = mlxinfer.load(smollm2_path, backend="mlx", device="cpu")
    a = engine.args
    assert (a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.ffn) == (576, 192, 1536)
    want = group_sizes(a)
    for layer in engine.model.w.layers:
        for group in WEIGHT_GROUPS:
            g = getattr(layer, group)
            assert isinstance(g, WeightGroup) and isinstance(g.merged, QuantizedWeight) and g.merged.bits == 4
            assert g.sizes == want[group]


# Which mixes stack: the MLX backend keeps each type's own scale fields (Q4_0: d; Q4_1: d and m) and
# F16 in 16 bits, so only matrices of one type stack; a mix stacks each run of consecutive matrices of
# one type (its runs' sizes here: Q is 192 columns, K and V 96 each).
MIXES = [
    ((Q.Q8_0, Q.Q4_0, Q.Q8_0), ((192,), (96,), (96,))),
    ((Q.F32, Q.Q8_0, Q.Q8_0), ((192,), (96, 96))),
    ((Q.Q4_1, Q.Q4_1, Q.F32), ((192, 96), (96,))),
    ((Q.Q4_0, Q.Q4_1, Q.Q4_1), ((192,), (96, 96))),
    ((Q.F32, Q.F16, Q.F32), ((192,), (96,), (96,))),
    ((Q.F16, Q.F16, Q.F16), ((192, 96, 96),)),
    ((Q.Q4_1, Q.Q4_1, Q.Q4_1), ((192, 96, 96),)),
]


@pytest.mark.parametrize("types,runs", MIXES,
                         ids=lambda m: "-".join(t.name for t in m) if isinstance(m[0], Q) else None)
def test_mixed_types_stack_by_runs_of_one_type(tmp_path, types, runs):
    """Q, K, V of layer 0 in `types`; everything else F32. Where the three cannot share one MLX layout the
    group is its runs of consecutive matrices of one layout, each a `WeightGroup` (a Q4_K_M file's Q and
    K beside its Q6_K V: two products, not three), whose matrices are, bit for bit, `load_weight` of
    each; the model still loads, and its logits are those of a model loaded with no grouping at all."""
    path = write_mixed(tmp_path, dict(zip(QKV, types)))
    b = MLXBackend(device="cpu")
    with GGUFFile(path) as g:
        group = b.load_weight_group(g, QKV)
        separate = [b.load_weight(g, n) for n in QKV]
    if len(runs) == 1:
        assert isinstance(group, WeightGroup) and group.sizes == runs[0]
    else:
        assert isinstance(group, WeightRuns) and tuple(r.sizes for r in group.runs) == runs
        assert all(isinstance(r, WeightGroup) for r in group.runs)
        for got, want in zip(group, separate, strict=True):
            assert_same_bits(mlx_dense(got), mlx_dense(want))
        x = mx.array(np.random.default_rng(0).standard_normal((3, QWEN3["hidden"]), dtype=np.float32))
        for got, want in zip(b.linear_group(x, group), [b.linear(x, w) for w in separate], strict=True):
            assert_same_bits(got, want)

    engine = mlxinfer.load(path, backend="mlx", device="cpu")
    assert isinstance(engine.model.w.layers[0].attn_qkv, WeightGroup if len(runs) == 1 else WeightRuns)
    assert isinstance(engine.model.w.layers[1].attn_qkv, WeightGroup)  # layer 1 is all F32
    ids = [1, 17, 250, 99, 3, 300, 42]
    grouped = engine.logits(ids)
    ungrouped = mlxinfer.Engine(path, Ungrouped(device="cpu")).logits(ids)
    assert_same_bits(grouped, ungrouped)


class Ungrouped(MLXBackend):
    """The MLX backend with the protocol's default groups: a tuple of separate handles, one product each."""

    def load_weight_group(self, gguf, names):
        return Backend.load_weight_group(self, gguf, names)


@pytest.mark.parametrize("qtype", ["F32", "Q4_1"])
def test_grouped_model_logits_equal_ungrouped(synthetic, qtype):
    """The whole model, prefill then decode through the engine: grouping changes no bit of the logits."""
    path = synthetic(**QWEN3, qtype=qtype)
    ids = [1, 17, 250, 99, 3, 300, 42, 42, 7]
    grouped = mlxinfer.Engine(path, MLXBackend(device="cpu"), prefill_chunk=4)
    plain = mlxinfer.Engine(path, Ungrouped(device="cpu"), prefill_chunk=4)
    assert isinstance(grouped.model.w.layers[0].attn_qkv, WeightGroup)
    assert isinstance(plain.model.w.layers[0].attn_qkv, tuple)
    assert_same_bits(grouped.logits(ids), plain.logits(ids))
    a = grouped.generate(ids, max_tokens=6)
    b = plain.generate(ids, max_tokens=6)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


# -- 2. the views are the separate matrices --------------------------------------------------------

@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("names", [QKV, GATE_UP], ids=["qkv", "gate_up"])
def test_views_of_a_group_are_the_separately_loaded_matrices(synthetic, qtype, names):
    b = MLXBackend(device="cpu")  # one backend per file: load_weight caches by tensor name
    with GGUFFile(synthetic(**QWEN3, qtype=qtype)) as g:
        group = b.load_weight_group(g, names)
        separate = [b.load_weight(g, n) for n in names]
    assert isinstance(group, WeightGroup)
    views = list(group)
    assert len(views) == len(names)
    for view, want in zip(views, separate):
        assert type(view) is type(want)
        if isinstance(want, BlockWeight):
            assert view.shape == want.shape and view.qtype == want.qtype
            assert_same_bits(view.dense(), want.dense())
        elif isinstance(want, QuantizedWeight):
            assert view.shape == want.shape and view.bits == want.bits
            assert np.array_equal(np.array(view.w), np.array(want.w))
            assert_same_bits(view.scales, want.scales)
            assert_same_bits(view.biases, want.biases)
            assert_same_bits(dequantized(view), dequantized(want))
        else:
            assert view.shape == want.shape
            assert_same_bits(view, want)


# -- 3. one product equals the separate products ---------------------------------------------------

@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("names", [QKV, GATE_UP], ids=["qkv", "gate_up"])
def test_linear_group_equals_separate_linears_bitwise(synthetic, qtype, names, rows, tmp_path):
    b = MLXBackend(device="cpu")
    with GGUFFile(synthetic(**QWEN3, qtype=qtype)) as g:
        group = b.load_weight_group(g, names)
        separate = [b.load_weight(g, n) for n in names]
        dense = [g.dequantize(n).astype(np.float64).T for n in names]  # gguf's own dequantization
    x = b.from_numpy(np.random.default_rng(rows).standard_normal((rows, 128)).astype(np.float32) * 3)
    got = b.linear_group(x, group)
    assert len(got) == len(names)
    # The matrices' columns are views of the one product by one Split primitive (no slice each: each view
    # primitive is the host's work at every layer of every pass)
    dot = tmp_path / "g.dot"
    mx.export_to_dot(str(dot), *got)
    prims = re.findall(r'label ="([A-Za-z]+)', dot.read_text())
    assert prims.count("Split") == 1 and "Slice" not in prims, prims
    for y, w, n in zip(got, separate, group.sizes):
        want = b.linear(x, w)
        assert y.shape == (rows, n)
        assert_same_bits(y, want)
    # And the products are right to begin with: float64 numpy on gguf's dequantized matrices. Measured
    # 5.9e-6 at most (outputs up to ~12) over these types, shapes and row counts; bound ~4x that.
    x64 = np.array(x).astype(np.float64)
    for y, w in zip(got, dense):
        np.testing.assert_allclose(np.array(y), x64 @ w, rtol=0, atol=2.5e-5)


# -- 4. the default: cpu backend and tracer ---------------------------------------------------------

def test_cpu_backend_groups_are_tuples_of_its_own_handles(synthetic):
    path = synthetic(**QWEN3, qtype="Q8_0")
    b = CPUBackend()
    with GGUFFile(path) as g:
        group = b.load_weight_group(g, QKV)
        separate = [b.load_weight(g, n) for n in QKV]
    assert isinstance(group, tuple) and len(group) == 3
    for got, want in zip(group, separate):
        assert_same_bits(got, want)
    engine = mlxinfer.load(path, backend="cpu")
    for layer in engine.model.w.layers:
        assert isinstance(layer.attn_qkv, tuple) and len(layer.attn_qkv) == 3
        assert isinstance(layer.ffn_gate_up, tuple) and len(layer.ffn_gate_up) == 2
    x = np.random.default_rng(0).standard_normal((3, 128)).astype(np.float32)
    for y, w in zip(b.linear_group(x, group), separate):
        assert_same_bits(y, b.linear(x, w))


@pytest.mark.parametrize("names", [QKV, GATE_UP], ids=["qkv", "gate_up"])
def test_tracer_counts_one_linear_per_matrix_of_an_mlx_group(synthetic, names):
    """The tracer over MLX multiplies the group's views one by one (one counted `linear` each, the
    formula's count) and gets the bits of the MLX backend's single product."""
    inner = MLXBackend(device="cpu")
    with GGUFFile(synthetic(**QWEN3, qtype="Q4_0")) as g:
        group = inner.load_weight_group(g, names)
    assert isinstance(group, WeightGroup)
    tracer = TracingBackend(inner)
    x = inner.from_numpy(np.random.default_rng(1).standard_normal((4, 128)).astype(np.float32))
    traced = tracer.linear_group(x, group)
    assert tracer.counts["linear"] == len(names)
    assert set(tracer.counts) == {"linear"}
    for a, b in zip(traced, inner.linear_group(x, group)):
        assert_same_bits(a, b)


# -- 5. per-sequence products ------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_per_sequence_linear_multiplies_each_sequence_on_its_own_in_a_group(synthetic, qtype, monkeypatch):
    """With `per_sequence_linear` the stacked product still runs once per sequence (row counts of the
    products seen), and a batch of two sequences' rows gives each the bits it gets alone. On this CPU
    the bits would match anyway (MLX's CPU products are row-invariant), so the row counts are what
    fails when the groups are dropped."""
    b = MLXBackend(device="cpu", per_sequence_linear=True)
    with GGUFFile(synthetic(**QWEN3, qtype=qtype)) as g:
        group = b.load_weight_group(g, QKV)
    assert isinstance(group, WeightGroup)
    rng = np.random.default_rng(5)
    first = rng.standard_normal((3, 128)).astype(np.float32)
    second = rng.standard_normal((2, 128)).astype(np.float32)
    alone = [b.linear_group(b.from_numpy(part), group) for part in (first, second)]

    seen = []
    for fn in ("matmul", "quantized_matmul"):
        real = getattr(mx, fn)
        monkeypatch.setattr(mx, fn, lambda a, *rest, _real=real, **kw: seen.append(a.shape[0]) or _real(a, *rest, **kw))
    together = b.linear_group(b.from_numpy(np.concatenate([first, second])), group, ((0, 3), (3, 5)))
    assert seen == [3, 2]  # one stacked product per sequence, not one per matrix, not one for both
    for i, y in enumerate(together):
        assert_same_bits(y, np.concatenate([np.array(alone[0][i]), np.array(alone[1][i])]))

    seen.clear()
    MLXBackend(device="cpu").linear_group(b.from_numpy(np.concatenate([first, second])), group, ((0, 3), (3, 5)))
    assert seen == [5]  # without the option: one product for the whole batch
