"""The formed kernels (metal_kernels/blocks.cu's `affine_scales`, `affine_values` and `q6_k_values`,
`block_kernels.formed_scales`, `affine_values` and `formed_values`): what a prompt's products multiply (an
affine weight's scales and biases, or its values; Q6_K's values), written by one launch in the shape the
product takes, from the fields the decode kernels read.

The error model is none: each value is one or two float32 products of exact conversions, rounded once to
the products' dtype, as the graph's compiled functions (`mlx_weights.formed_scales`, `formed_values`)
compute it (an affine value: code * scale + bias, each step rounded in float32, as `mlx_weights.affine_values`'
ops), so the kernels equal them bit for bit (a NaN's sign and payload aside: float16's infinite scales);
in float32 Q6_K's values are gguf-py's, and so are the affine types' (+-0 aside). Here (no
GPU): blocks.cu run on the host (tests/cuda_host.py) against the graph; the launch, its errors and a row
slice of no rows; the weights' and backend's wiring (a weight with a `former` forms by the kernel, a row
slice and a dense product's slices keep it); a Q4_K_M model's prompt logits with the host-run kernels
equal the graph's, bit for bit; the self-check names a wrong value. On a GPU: the self-check passes."""

import tempfile

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from mlxinfer import block_kernels, quants
from mlxinfer.backends import mlx as mlx_mod
from mlxinfer.backends.mlx import MLXBackend, gpu_kind
from mlxinfer.backends import mlx_weights
from mlxinfer.backends.mlx_weights import affine_scales, dequantize, to_device

from .test_block_kernels import host_kernels  # noqa: F401 (the fixture: blocks.cu compiled for the host)

FORMED = list(block_kernels.FORMED)
DTYPES = [mx.float32, mx.bfloat16, mx.float16]
needs_gpu = pytest.mark.skipif(gpu_kind() is None, reason="needs an MLX GPU (Metal or CUDA)")


def _weight(qtype, rows, cols, dtype, seed=0, edges=True):
    raw = quants.random_blocks(np.random.default_rng(seed), qtype, rows, cols, edges=edges)
    return raw, to_device(qtype, quants.split(raw, qtype, rows, cols), (rows, cols), dtype=dtype)


def _graph(w):
    """What the graph forms for w (the ops `mlx_weights`' compiled functions fuse), as float32 arrays."""
    if block_kernels.FORMED[w.qtype] == "affine_scales":
        return tuple(np.array(a.astype(mx.float32)) for a in affine_scales(w.qtype, w.split or w.parts, w.dtype))
    return (np.array(dequantize(w.qtype, w.parts, *w.shape, w.dtype).astype(mx.float32)),)


def _depends(a) -> bool:
    """Whether a's graph ends in a Depends primitive (made to wait for another array)."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, a)
        return "Depends" in f.read()


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def _same_bits(got, want) -> bool:
    """got's float32 bits are want's, a NaN for a NaN (its sign and payload are the platform's)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return got.shape == want.shape and bool(np.all((_bits(got) == _bits(want)) | (np.isnan(got) & np.isnan(want))))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", list(block_kernels.VALUES), ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols", [(40, 1280), (3, 4096), (9, 12288)])
def test_the_affine_values_kernel_run_on_the_host_gives_the_graphs_bits(host_kernels, qtype, rows, cols, dtype):  # noqa: F811
    """blocks.cu's affine_values run on the host as `block_kernels.affine_values` launches it: every value
    equals `mlx_weights.affine_values`' (the graph's ops) bit for bit on random blocks with edge values
    (zero and extreme fp16 scales, every code), whole weights and row slices, every dtype; in float32
    they are gguf-py's values (+-0 aside: a zero code times d plus the offset's bias is +0). Each input
    ends before an unreadable page and the output is guarded (a read or write past an end fails)."""
    raw, w = _weight(qtype, rows, cols, dtype, seed=rows * cols + int(qtype))
    for part in (w, w.row_slice(rows // 3, rows)):
        got = host_kernels.affine_values(part)
        want = np.array(mlx_weights.affine_values(part).astype(mx.float32))
        assert got.shape == (part.shape[0], cols) and _same_bits(got, want)
    if dtype == mx.float32:
        values = gguf_dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
        assert np.array_equal(host_kernels.affine_values(w), values)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", FORMED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols", [(40, 1280), (3, 4096), (1, 256), (9, 12288)])
def test_the_formed_kernels_run_on_the_host_give_the_graphs_bits(host_kernels, qtype, rows, cols, dtype):  # noqa: F811
    """blocks.cu's formed kernels run on the host as `block_kernels` launches them: their scales, biases
    or values equal the graph's bit for bit on random blocks with edge values (zero and extreme fp16
    scales, every code), whole weights and row slices (a dense product's), every dtype; in float32,
    Q6_K's values are gguf-py's. Each input ends before an unreadable page and each output is guarded,
    so a read or write past an end fails the test."""
    raw, w = _weight(qtype, rows, cols, dtype, seed=rows * cols)
    for part in (w, w.row_slice(rows // 3, rows)):
        got = host_kernels.formed_scales(part) if block_kernels.FORMED[qtype] == "affine_scales" else (
            host_kernels.formed_values(part),)
        want = _graph(part)
        assert len(got) == len(want)
        for g, x in zip(got, want):
            assert g.shape == x.shape and np.array_equal(_bits(g), _bits(x))
    if qtype == Q.Q6_K and dtype == mx.float32:
        values = gguf_dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
        assert np.array_equal(_bits(host_kernels.formed_values(w)), _bits(values))


def test_the_launch_is_what_mlx_custom_kernels_take(monkeypatch):
    """A launch hands MLX the weight's kernel fields (the decode kernels' own arrays, no copy), [rows,
    columns] as dims, a thread an output value in blocks of 256, outputs of the products' dtype in the
    product's shape; SCALES 2 for the K-quants, 1 for Q4_1 and Q5_1."""
    seen = []

    def launch(**kw):
        seen.append(kw)
        return [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    monkeypatch.setattr(block_kernels, "_kernel", lambda kind, name, blocks=1: seen.append(name) or launch)
    monkeypatch.setattr(block_kernels, "FORMED_COMPILED", False)  # (the compiled form replays this launch: below)
    for qtype, consts in ((Q.Q4_K, 2), (Q.Q5_K, 2), (Q.Q4_1, 1), (Q.Q5_1, 1)):
        _, w = _weight(qtype, 24, 512, mx.bfloat16)
        w.kernel_fields = block_kernels.kernel_fields(w)
        scales, biases = block_kernels.formed_scales("cuda", w)
        name, kw = seen[-2:]
        assert name == "affine_scales" and scales.shape == biases.shape == (24, 16) and scales.dtype == mx.bfloat16
        assert all(a is b for a, b in zip(kw["inputs"][:2], w.kernel_fields[1:], strict=True))
        assert np.array(kw["inputs"][2])[:2].tolist() == [24, 16]
        assert kw["template"] == [("T", mx.bfloat16), ("SCALES", consts)]
        assert kw["grid"] == (256 * 2, 1, 1) and kw["threadgroup"] == (256, 1, 1)
    _, w = _weight(Q.Q6_K, 24, 512, mx.float16)
    values = block_kernels.formed_values("metal", w)
    name, kw = seen[-2:]
    assert name == "q6_k_values" and values.shape == (24, 512) and values.dtype == mx.float16
    assert np.array(kw["inputs"][4])[:2].tolist() == [24, 512] and kw["grid"] == (256 * 48, 1, 1)
    # affine_values: the weight's codes and scale fields, [rows, groups] as dims, 8 values a thread
    for qtype in block_kernels.VALUES:
        _, w = _weight(qtype, 24, 1024, mx.bfloat16)
        w.kernel_fields = block_kernels.kernel_fields(w)
        values = block_kernels.affine_values("cuda", w)
        name, kw = seen[-2:]
        assert name == "affine_values" and values.shape == (24, 1024) and values.dtype == mx.bfloat16
        assert all(a is b for a, b in zip(kw["inputs"][:3], w.kernel_fields, strict=True))
        assert np.array(kw["inputs"][3])[:2].tolist() == [24, 32]
        assert kw["template"] == [("T", mx.bfloat16), *block_kernels.KERNELS[qtype][1]]
        assert kw["grid"] == (256 * 12, 1, 1) and kw["output_shapes"] == [(24, 1024)]


def test_the_compiled_setting_launches_once_a_form_and_replays_the_same_values(monkeypatch):
    """By default (FORMED_COMPILED) a formed kernel's launch is traced once for each kernel, shape and
    dtype, then replayed (a second weight of one shape launches nothing more on the host side), with the
    values the bare launch gives; a new shape or dtype traces again."""
    traced = []

    launches = []

    def launch(**kw):  # a stand-in that computes from its inputs, dims included (a wrong replay would show)
        traced.append((kw["output_shapes"][0], kw["output_dtypes"][0]))
        launches.append((kw["grid"], np.array(kw["inputs"][-1]).tolist()))  # (the grid and dims, as launched)
        total = sum(mx.sum(a.astype(mx.float32)) for a in kw["inputs"])
        return [(mx.zeros(s, mx.float32) + total + i).astype(d)
                for i, (s, d) in enumerate(zip(kw["output_shapes"], kw["output_dtypes"]))]

    monkeypatch.setattr(block_kernels, "_kernel", lambda kind, name, blocks=1: launch)
    weights = [_weight(Q.Q4_K, 24, 512, mx.bfloat16, seed=s)[1] for s in (1, 2)] + [
        _weight(Q.Q4_K, 24, 1024, mx.bfloat16, seed=3)[1], _weight(Q.Q4_K, 24, 512, mx.float16, seed=4)[1]]
    compiled = [block_kernels.formed_scales("cuda", w) for w in weights]
    assert traced == [((24, 16), mx.bfloat16), ((24, 32), mx.bfloat16), ((24, 16), mx.float16)]
    monkeypatch.setattr(block_kernels, "FORMED_COMPILED", False)
    for w, got in zip(weights, compiled, strict=True):
        want = block_kernels.formed_scales("cuda", w)
        assert all(g.dtype == e.dtype and np.array_equal(np.array(g.astype(mx.float32)), np.array(e.astype(mx.float32)))
                   for g, e in zip(got, want, strict=True))
    assert len(traced) == 3 + 4
    # affine_values (its own thread count and dims): compiled, the bare launch's values
    traced.clear()
    monkeypatch.setattr(block_kernels, "FORMED_COMPILED", True)
    got = block_kernels.affine_values("cuda", weights[2])
    monkeypatch.setattr(block_kernels, "FORMED_COMPILED", False)
    want = block_kernels.affine_values("cuda", weights[2])
    assert traced == [((24, 1024), mx.bfloat16)] * 2 and launches[-2] == launches[-1]
    assert launches[-1][0] == (24 * 1024 // 8, 1, 1) and launches[-1][1][:2] == [24, 32]
    assert np.array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


def test_a_prebuild_pass_leaves_no_trace_of_its_zeros(monkeypatch):
    """Inside `cuda_jit.collecting()` (the self-check's prebuild pass) a launch records its job and returns
    zeros: the formed kernels launch bare there, so the compiled form traced afterwards launches for real
    and gives the bare launch's values, and each form's job is recorded."""
    from mlxinfer import cuda_jit

    def launch(**kw):  # as cuda_jit.Kernel: zeros while collecting, else values from its inputs
        if cuda_jit.is_collecting():
            cuda_jit._STATE.jobs.append(kw["output_shapes"][0])
            return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
        total = sum(mx.sum(a.astype(mx.float32)) for a in kw["inputs"][:-1]) + 1
        return [(mx.zeros(s, mx.float32) + total).astype(d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    monkeypatch.setattr(block_kernels, "_kernel", lambda kind, name, blocks=1: launch)
    _, w = _weight(Q.Q4_K, 8, 256, mx.bfloat16, seed=5)
    for _ in range(2):
        with cuda_jit.collecting() as jobs:
            mx.eval(block_kernels.formed_scales("cuda", w))
        assert jobs == [(8, 8)]
    got = block_kernels.formed_scales("cuda", w)
    monkeypatch.setattr(block_kernels, "FORMED_COMPILED", False)
    want = block_kernels.formed_scales("cuda", w)
    assert all(np.array_equal(np.array(g.astype(mx.float32)), np.array(e.astype(mx.float32))) and np.array(g.astype(mx.float32)).any()
               for g, e in zip(got, want, strict=True))


def test_a_slice_of_no_rows_launches_nothing_and_bad_weights_are_one_line_errors(monkeypatch):
    """A row slice of no rows forms empty arrays without a launch (a grid of no blocks is no launch);
    a weight whose type the kernel does not form, or whose scales were formed at load, is a one-line
    ValueError naming the kernel and the type."""
    monkeypatch.setattr(block_kernels, "_kernel", lambda *a, **k: pytest.fail("launched for no rows"))
    _, w = _weight(Q.Q4_K, 8, 256, mx.float32)
    scales, biases = block_kernels.formed_scales("cuda", w.row_slice(3, 3))
    assert scales.shape == biases.shape == (0, 8)
    _, w6 = _weight(Q.Q6_K, 8, 256, mx.float32)
    assert block_kernels.formed_values("cuda", w6.row_slice(8, 8)).shape == (0, 256)
    assert block_kernels.affine_values("cuda", w.row_slice(3, 3)).shape == (0, 256)
    _, q8 = _weight(Q.Q8_0, 8, 256, mx.float32)
    floated = to_device(Q.Q4_K, quants.split(quants.random_blocks(np.random.default_rng(0), Q.Q4_K, 8, 256), Q.Q4_K, 8, 256),
                        (8, 256), float_scales=True)
    for call, weight, words in ((block_kernels.formed_scales, q8, "not Q8_0's"), (block_kernels.formed_scales, w6, "not Q6_K's"),
                                (block_kernels.formed_scales, floated, "not Q4_K's"), (block_kernels.formed_values, w, "not Q4_K's"),
                                (block_kernels.formed_values, object(), "not object's"),
                                (block_kernels.affine_values, w6, "not Q6_K's"), (block_kernels.affine_values, floated, "not Q4_K's")):
        with pytest.raises(ValueError, match=words) as e:
            call("cuda", weight)
        assert "\n" not in str(e.value)


def _host_formers(monkeypatch, host, calls):
    """block_kernels' formed kernels replaced by blocks.cu run on the host (each call counted by kernel)."""
    real_scales, real_values, real_affine = block_kernels.formed_scales, block_kernels.formed_values, block_kernels.affine_values

    def scales(kind, w):
        calls.append("affine_scales")
        return tuple(mx.array(a).astype(w.dtype) for a in host._launch(lambda: real_scales("cuda", w), outputs=2))

    def values(kind, w):
        calls.append("q6_k_values")
        return mx.array(host._launch(lambda: real_values("cuda", w))).astype(w.dtype)

    def affine(kind, w):
        calls.append("affine_values")
        return mx.array(host._launch(lambda: real_affine("cuda", w))).astype(w.dtype)

    monkeypatch.setattr(block_kernels, "formed_scales", scales)
    monkeypatch.setattr(block_kernels, "formed_values", values)
    monkeypatch.setattr(block_kernels, "affine_values", affine)


def test_a_weight_with_a_former_forms_by_its_kernel_and_keeps_it_in_slices(host_kernels, monkeypatch):  # noqa: F811
    """Where the backend's formed kernels passed their check, a weight of a FORMED or VALUES type it loads
    gets a `former` (no other type does), its product forms by the kernel (the same product bits), and a row
    slice and a dense product's slices keep it; a dense product's slices of a Q6_K weight still wait for
    the previous slice's product (the kernel's fields depend on it, so the transient values stay one
    slice)."""
    calls = []
    _host_formers(monkeypatch, host_kernels, calls)
    be = MLXBackend(device="cpu")
    be.block_kind = be.formed_kind = "cuda"
    rng = np.random.default_rng(5)
    x = mx.array(rng.standard_normal((11, 512), dtype=np.float32))
    metal = MLXBackend(device="cpu")  # (no dense products: an 8-bit or offset type's values are never formed)
    metal.block_kind = metal.formed_kind = "metal"
    assert not metal.uses_values()
    assert metal._to_device(Q.Q8_0, quants.split(quants.random_blocks(rng, Q.Q8_0, 48, 512), Q.Q8_0, 48, 512), (48, 512)).former is None
    be.values_rows = block_kernels.MAX_ROWS + 1  # as on CUDA
    for qtype in (Q.Q4_K, Q.Q4_1, Q.Q6_K, Q.Q8_0, Q.Q3_K):
        raw = quants.random_blocks(rng, qtype, 48, 512)
        w = be._to_device(qtype, quants.split(raw, qtype, 48, 512), (48, 512))
        assert w.former == ("cuda" if qtype in block_kernels.FORMED or qtype in block_kernels.VALUES else None)
        assert w.row_slice(8, 40).former == w.former
        calls.clear()
        got = np.array(w.product(x))
        w.former = None
        want = np.array(w.product(x))
        assert np.array_equal(_bits(got), _bits(want)) and calls == ([block_kernels.FORMED[qtype]] if qtype in block_kernels.FORMED else [])
    _, w6 = _weight(Q.Q6_K, 64, 256, mx.float32)
    w6.kernel_fields, w6.former = block_kernels.kernel_fields(w6), "cuda"
    after = w6.after(mx.zeros((1,)))
    assert after.former == "cuda" and len(after.kernel_fields) == 4 and all(_depends(f) for f in after.kernel_fields)
    from mlxinfer.backends import mlx_weights

    monkeypatch.setattr(mlx_weights, "DENSE_SLICE_BYTES", 16 * 256 * 4)
    calls.clear()
    sliced = np.array(mlx_weights.dense_product(w6, x[:, :256]))
    w6.former = None
    assert calls == ["q6_k_values"] * 4 and np.array_equal(_bits(sliced), _bits(np.array(mlx_weights.dense_product(w6, x[:, :256]))))


def test_a_prompts_product_of_a_large_weight_of_fewer_than_8_bits_is_dequantized_by_the_kernel_first(
        host_kernels, monkeypatch):  # noqa: F811
    """On CUDA (`values_rows`: MAX_ROWS + 1) a product of that many rows or more by an affine weight with
    a `former`, of fewer than 8 bits a value, at least DENSE_VALUES_MIN values and no more than WIDE rows
    (not an output head) is `dense_product` (affine_values, then one matmul), with the bits of the graph's
    values multiplied; one row fewer, an 8-bit weight, a weight without a former, one value fewer than the
    bound or a head stay quantized_matmul's. Here a CPU backend is given CUDA's setting and the kernels
    run on the host."""
    calls = []
    _host_formers(monkeypatch, host_kernels, calls)
    be = MLXBackend(device="cpu")
    be.block_kind = be.formed_kind = "cuda"
    be.block_types = frozenset()  # (no decode kernel: the products below are the prompt's)
    assert be.values_rows is None
    be.values_rows = block_kernels.MAX_ROWS + 1
    monkeypatch.setattr(mlx_mod, "DENSE_VALUES_MIN", 48 * 512)
    monkeypatch.setattr(block_kernels, "WIDE", 48)
    rng = np.random.default_rng(9)
    dense, real = [], mlx_weights.dense_product
    monkeypatch.setattr(mlx_mod, "dense_product", lambda w, x: dense.append((w.qtype, x.shape[0])) or real(w, x))

    def weight(qtype, rows=48):
        return be._to_device(qtype, quants.split(quants.random_blocks(rng, qtype, rows, 512), qtype, rows, 512), (rows, 512))

    x = mx.array(rng.standard_normal((be.values_rows, 512), dtype=np.float32))
    for qtype in (Q.Q4_K, Q.Q5_K, Q.Q4_0, Q.Q5_1):
        w = weight(qtype)
        dense.clear(), calls.clear()
        got = np.array(be.linear(x, w))
        assert dense == [(qtype, be.values_rows)] and "affine_values" in calls
        want = np.array(mx.matmul(x, mx.transpose(mlx_weights.affine_values(w))))
        assert np.array_equal(_bits(got), _bits(want))
        dense.clear()
        be.linear(x[1:], w)  # one row fewer
        assert dense == []
    for w in (weight(Q.Q8_0), weight(Q.Q4_K, 47), weight(Q.Q4_K, 56)):  # 8 bits; too small; a head (past WIDE)
        be.linear(x, w)
        assert dense == []
    w = weight(Q.Q4_K)
    w.former = None
    be.linear(x, w)
    assert dense == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_q4_k_m_prompts_logits_are_the_graphs_bits_with_the_formed_kernels(synthetic, host_kernels, monkeypatch, dtype):  # noqa: F811
    """A Q4_K_M Qwen3 (Q4_K and Q6_K matrices, a Q6_K V in one layer) on an MLX backend whose formed
    kernels passed: a 12-token prompt's products (more rows than the decode kernels take) form every
    Q4_K scale and Q6_K value by the kernels (run on the host here), and the logits are the bits of the
    same backend forming them by the graph. (The products in the dtype, as on a GPU.)"""
    import mlxinfer

    calls = []
    _host_formers(monkeypatch, host_kernels, calls)
    path = synthetic(arch="qwen3", n_layers=2, qtype="Q4_K_M", hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                     head_dim=64, random_blocks=True)
    real, logits = MLXBackend.__init__, {}
    for formed in ("cuda", None):
        def init(self, *a, formed=formed, **k):
            real(self, *a, **k)
            # as on a GPU whose formed kernels passed (or not): the kernels' fields made at load, no decode
            # kernel taking a product (the head's one row: the graph's)
            self.weight_dtype, self.block_kind, self.formed_kind, self.block_types = self.dtype, formed, formed, frozenset()

        monkeypatch.setattr(MLXBackend, "__init__", init)
        engine = mlxinfer.load(path, backend="mlx", device="cpu", dtype=dtype)
        calls.clear()
        logits[formed] = np.array(engine.logits(list(range(3, 15))))
        if formed:  # Q/K, O, gate/up a layer in Q4_K; V in one layer and down in both in Q6_K (llama.cpp's rule)
            assert calls.count("affine_scales") >= 6 and calls.count("q6_k_values") >= 2
        else:
            assert calls == []
    assert np.array_equal(_bits(logits["cuda"]), _bits(logits[None]))


def test_a_q4_k_m_prompts_logits_with_the_values_kernel_are_the_graphs_bits(synthetic, host_kernels, monkeypatch):  # noqa: F811
    """The same model with the values path on (as on CUDA, every Q4_K weight above the size bound): a
    12-token prompt's Q4_K products dequantize each weight by the affine_values kernel (run on the host)
    and multiply, and the logits are the bits of the same path with `mlx_weights.affine_values`' graph
    forming the values; they differ from quantized_matmul's path by roundings alone (a value here is
    rounded once to bfloat16; quantized_matmul multiplies the codes by the bfloat16 scales in its own
    order): about one bfloat16 ulp (2^-8 relative) a product, then bfloat16 activations through two
    layers: 0.0195 of the logits' range (this VM, 2026-12-07), bounded by 0.05 (~13 ulps of 2^-8), and
    not 0 (the paths do differ)."""
    import mlxinfer

    calls = []
    _host_formers(monkeypatch, host_kernels, calls)
    monkeypatch.setattr(mlx_mod, "DENSE_VALUES_MIN", 1)
    path = synthetic(arch="qwen3", n_layers=2, qtype="Q4_K_M", hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                     head_dim=64, random_blocks=True)
    real, host_affine, logits = MLXBackend.__init__, block_kernels.affine_values, {}
    for how in ("kernel", "graph", "quantized_matmul"):
        def init(self, *a, how=how, **k):
            real(self, *a, **k)
            self.weight_dtype, self.block_kind, self.formed_kind, self.block_types = self.dtype, "cuda", "cuda", frozenset()
            self.values_rows = None if how == "quantized_matmul" else block_kernels.MAX_ROWS + 1

        monkeypatch.setattr(MLXBackend, "__init__", init)
        monkeypatch.setattr(block_kernels, "affine_values", host_affine if how == "kernel" else (
            lambda kind, w: calls.append("graph") or mlx_weights.affine_values(w)))
        engine = mlxinfer.load(path, backend="mlx", device="cpu", dtype="bfloat16")
        calls.clear()
        logits[how] = np.asarray(engine.logits(list(range(3, 15))), np.float32)
        if how != "quantized_matmul":  # Q/K, O, gate/up in Q4_K in each layer (V and down Q6_K in some)
            assert calls.count("affine_values" if how == "kernel" else "graph") >= 6
    assert np.array_equal(_bits(logits["kernel"]), _bits(logits["graph"]))
    spread = float(np.ptp(logits["quantized_matmul"]))
    assert 0 < np.max(np.abs(logits["kernel"] - logits["quantized_matmul"])) <= 0.05 * spread


def test_the_self_check_names_a_wrong_value(host_kernels, monkeypatch):  # noqa: F811
    """`verify_formed_kernels` passes with blocks.cu's kernels (run on the host) and names the kernel, the
    type and what differs when one value of one output is wrong: each of the three outputs, and values
    wrong only in a row slice (a kernel that missed the slice's first row: a dense product's slices)."""
    calls = []
    _host_formers(monkeypatch, host_kernels, calls)
    be = MLXBackend(device="cpu")
    be.block_kind = be.formed_kind = "cuda"
    assert mlx_mod.verify_formed_kernels(be) is None
    assert set(calls) == {"affine_scales", "q6_k_values"}  # (no dense products here: no affine values)
    be.values_rows = block_kernels.MAX_ROWS + 1  # as on CUDA
    calls.clear()
    assert mlx_mod.verify_formed_kernels(be) is None
    assert set(calls) == {"affine_scales", "q6_k_values", "affine_values"}
    good_scales, good_values, good_affine = block_kernels.formed_scales, block_kernels.formed_values, block_kernels.affine_values

    def off(a):
        flat = np.array(a.astype(mx.float32)).reshape(-1)
        flat[5] = flat[5] * 2 + 1
        return mx.array(flat.reshape(a.shape)).astype(a.dtype)

    for which in range(6):
        scales, values, affine = good_scales, good_values, good_affine
        if which < 2:
            scales = lambda kind, w, i=which: tuple(off(a) if j == i else a for j, a in enumerate(good_scales(kind, w)))  # noqa: E731
        elif which == 2:
            values = lambda kind, w: off(good_values(kind, w))  # noqa: E731
        elif which == 3:  # right for a whole weight, a slice's values a row late
            values = lambda kind, w: good_values(kind, w) if w.shape[0] == 40 else mx.concatenate(  # noqa: E731
                [good_values(kind, w)[1:], good_values(kind, w)[:1]])
        elif which == 4:
            affine = lambda kind, w: off(good_affine(kind, w))  # noqa: E731
        else:  # wrong for Q5_0's values alone (the last type the check forms)
            affine = lambda kind, w: off(good_affine(kind, w)) if w.qtype == Q.Q5_0 else good_affine(kind, w)  # noqa: E731
        monkeypatch.setattr(block_kernels, "formed_scales", scales)
        monkeypatch.setattr(block_kernels, "formed_values", values)
        monkeypatch.setattr(block_kernels, "affine_values", affine)
        problem = mlx_mod.verify_formed_kernels(be)
        want = ["the affine_scales kernel's Q4_K scales differ", "the affine_scales kernel's Q4_K biases differ",
                "the q6_k_values kernel's Q6_K values differ", "the q6_k_values kernel's Q6_K values differ",
                "the affine_values kernel's Q4_K values differ", "the affine_values kernel's Q5_0 values differ"][which]
        assert problem and problem.startswith(want) and "from the graph's in " in problem and "\n" not in problem
        assert ("rows 7-28" in problem) == (which == 3)


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gpu_formed_kernels_pass_their_self_check(dtype):
    """On the GPU: the formed kernels equal the graph's compiled functions bit for bit (the self-check,
    run fresh)."""
    be = MLXBackend(device="gpu", dtype=dtype, verify=None)
    if be.block_kind is None:
        pytest.skip("no block kernels on this GPU")
    assert mlx_mod.verify_formed_kernels(be) is None


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("compiled", [False, True], ids=["launched", "compiled"])
def test_gpu_a_q4_k_m_prompts_logits_are_the_graphs_bits(synthetic, monkeypatch, dtype, compiled):
    """On the GPU: a Q4_K_M Qwen3's logits for a 12-token prompt (the formed kernels' path) and its greedy
    tokens are the same bits with the formed kernels (each launch in mx.compile or not: FORMED_COMPILED)
    and with the graph's compiled ones."""
    import mlxinfer

    monkeypatch.setattr(block_kernels, "FORMED_COMPILED", compiled)

    path = synthetic(arch="qwen3", n_layers=2, qtype="Q4_K_M", hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                     head_dim=64, random_blocks=True)
    real, out = MLXBackend.__init__, {}
    for formed in (True, False):
        def init(self, *a, formed=formed, **k):
            real(self, *a, **k)
            if not formed:
                self.formed_kind = None

        monkeypatch.setattr(MLXBackend, "__init__", init)
        engine = mlxinfer.load(path, backend="mlx", device="gpu", dtype=dtype)
        assert (engine.backend.formed_kind is not None) == formed
        out[formed] = (np.array(engine.logits(list(range(3, 15)))),
                       engine.generate(list(range(3, 15)), max_tokens=6).token_ids)
    assert np.array_equal(_bits(out[True][0]), _bits(out[False][0])) and out[True][1] == out[False][1]
