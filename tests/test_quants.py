"""Every GGUF weight type kept compact on the MLX backend (mlxinfer/quants.py, backends/mlx_weights.py):
its values equal gguf-py's dequantization bit for bit, on random blocks with edge values; MLX's memory
after loading stays within 1.15x of the file's tensor bytes; MLX and the numpy reference agree on the
logits of a synthetic model of each type.

Error model for the logits: both backends hold the same weights exactly (the first test), so they
differ only in the order of float32 products and sums (MLX's quantized_matmul and BLAS vs numpy's
OpenBLAS). Measured on this VM (2026-12-01 23:42 UTC, `SPEC` below, 16 prompt tokens + 12 decode
steps), the largest difference over the largest |logit| (~100-500 on these random weights): Q8_0 5.1e-7,
Q4_0 6.8e-7, Q4_1 9.3e-7, Q5_0 6.9e-7, Q5_1 9.4e-7, Q4_K 8.3e-7, Q5_K 9.0e-7, Q6_K 3.9e-7, Q3_K 3.7e-7,
Q2_K 9.7e-7, IQ4_NL 6.0e-7, IQ4_XS 6.0e-7, F16 5.4e-7, BF16 5.4e-7; the bound, 4e-6, is ~4x the worst.

Speed (not tested: `bench/probes/weight_types.py` measures it). One [1,1024] x [1024,3072] float32
product on this 2-core VM, MLX CPU, one thread, 2026-12-01 23:18 UTC (load ~2) / 23:31 UTC (load ~5):
F32 2.2 / 5.9 ms; affine Q8_0, Q4_0, Q4_1, Q4_K 3.4-3.6 / 8.0-8.4, Q5_K 3.6 / 8.3, Q5_0, Q5_1 4.2-4.5
/ 11.4-12.5; dequantized at use Q6_K 7.8 / 23.9, Q2_K 8.5 / 20.3, Q3_K 10.6 / 28.7, BF16 5.2 / 12.1,
F16 7.9 / 15.6, IQ4_NL 37 / 90, IQ4_XS 38 / 76 (MLX's CPU gather, ~8 ns a value, for the 16-entry
codebook). Exact 8-bit affine repacks exist (checked): IQ4_NL q' = k + 128 (1..241), scale d, bias
-128 d; IQ4_XS the same with scale d·(ls - 32) per 32 values (fp16 would not hold it: float32 scales);
Q3_K q' = (sc - 32)·q + 127 (3..255), scale d, bias -127 d. They would run at Q8_0's speed but take
1.9x (IQ4_NL), 2.0-2.5x (IQ4_XS) and 2.5x (Q3_K) the file's bytes: over the 1.15x bound, not taken.
"""

import gc
import re

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

import mlxinfer
from mlxinfer import quants
from mlxinfer.backends.mlx import MLXBackend, gpu_kind
from mlxinfer.backends import mlx_weights
from mlxinfer.backends.mlx_weights import BlockWeight, ExpertStack, QuantizedWeight, affine_scales, to_device
from mlxinfer.gguf_file import GGUFFile
from mlxinfer.synthetic import SyntheticSpec, write_synthetic_model

from .test_models import decode_logits

KEPT = [*quants.AFFINE_BITS, *quants.BLOCK_TYPES, *quants.HALF_TYPES]
# MLX's affine form computes scale·q' + bias; for the offset types that is d·q' + (-k·d), which for a
# zero weight is x + (-x) = +0 where gguf-py's d·(q - k) gives -0 when d < 0 (or d is -0): the same
# number, and the same in every sum it enters. Everywhere else: the same bits.
SIGNED_ZERO_ONLY = (Q.Q8_0, Q.Q4_0, Q.Q5_0)
ROWS, COLS = 12, 1024
SPEC = dict(hidden=256, ffn=512, n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=2048, random_blocks=True)
IDS = [1, 17, 250, 99, 3, 300, 42, 42, 7, 128, 255, 64, 5, 6, 7, 200]
REL_BOUND = 4e-6  # measured on MLX's CPU device; on a GPU (its own product order) not yet measured
# The MLX device the weights live on: this machine's CPU; a GPU where MLX has one (the lead's runs).
DEVICES = [pytest.param("cpu"), pytest.param("gpu", marks=pytest.mark.skipif(gpu_kind() is None,
                                                                             reason="needs an MLX GPU"))]


def same_bits(got: np.ndarray, want: np.ndarray, qtype) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    differ = got.view(np.uint32) != want.view(np.uint32)
    if qtype in SIGNED_ZERO_ONLY:
        assert np.all(want[differ] == 0) and np.all(got[differ] == 0), qtype.name
    else:
        assert not differ.any(), f"{qtype.name}: {int(differ.sum())} of {differ.size} values differ"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
def test_kept_weights_dequantize_to_gguf_py_bit_for_bit(qtype, device):
    """Random raw blocks, edge values included (all-zero and all-0xFF blocks: zero and maximal codes
    and sub-scales; d, dmin, m of +-0, fp16 subnormals, +-65504, negatives)."""
    MLXBackend(device=device)  # its device becomes MLX's default: the arrays and ops below run there
    rng = np.random.default_rng(int(qtype))
    raw = quants.random_blocks(rng, qtype, ROWS, COLS, edges=True)
    want = dequantize(raw, qtype).reshape(ROWS, COLS)
    assert np.isfinite(want).all()
    w = to_device(qtype, quants.split(raw, qtype, ROWS, COLS), (ROWS, COLS))
    if qtype in quants.AFFINE_BITS:
        assert isinstance(w, QuantizedWeight) and w.w.dtype == mx.uint32
    else:
        assert isinstance(w, BlockWeight)
    same_bits(np.array(w.dense()), want, qtype)  # (an affine type's: `mlx_weights.affine_values`' graph)
    ids = np.array([3, 0, 11, 3, 7])
    same_bits(np.array(w.rows(mx.array(ids))), want[ids], qtype)  # the embedding's row gather
    same_bits(np.array(w.row_slice(5, 9).rows(mx.arange(4))), want[5:9], qtype)


@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
def test_kept_weights_multiply_as_their_values(qtype):
    """The product on the whole matrix and cut over CPU threads (bitwise the same), against numpy's
    product of gguf-py's values (float32 order only: a bound of ~1e-5 relative to the sum of |terms|)."""
    rng = np.random.default_rng(int(qtype) + 100)
    rows = 600  # >= 2 x SPLIT_MIN_ROWS: three threads cut it
    raw = quants.random_blocks(rng, qtype, rows, COLS, std=0.05)
    values = dequantize(raw, qtype).reshape(rows, COLS)
    x = rng.standard_normal((3, COLS)).astype(np.float32)
    one, three = MLXBackend(device="cpu", threads=1), MLXBackend(device="cpu", threads=3)
    w = to_device(qtype, quants.split(raw, qtype, rows, COLS), (rows, COLS))
    got = np.array(one.linear(one.from_numpy(x), w))
    cut = np.array(three.linear(three.from_numpy(x), w))
    assert np.array_equal(got.view(np.uint32), cut.view(np.uint32))
    want = x.astype(np.float64) @ values.T.astype(np.float64)
    assert np.all(np.abs(got - want) <= 1e-5 * (np.abs(x) @ np.abs(values).T) + 1e-30)


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q8_0])
def test_a_dense_product_dequantizes_a_slice_at_a_time(monkeypatch, qtype):
    """A dense product (a block type's prefill rows: no kernel; an affine type's many rows on CUDA,
    `dense_product`) forms its float32 matrix a slice of rows at a time (`DENSE_SLICE_BYTES`), so MLX's
    peak memory over the product stays far below the whole float32 matrix (a Qwen3-8B-shaped Q6_K head
    is 2.5 GB); the bits are the whole matrix's (on this CPU's products)."""
    from mlxinfer.backends import mlx_weights

    rng = np.random.default_rng(5)
    rows, cols = 4096, 1024  # 16 MiB as float32
    raw = quants.random_blocks(rng, qtype, rows, cols, std=0.05)
    w = to_device(qtype, quants.split(raw, qtype, rows, cols), (rows, cols))
    x = mx.array(rng.standard_normal((17, cols)).astype(np.float32))
    mx.eval(x)
    peaks, outs = [], []
    for limit in (1 << 40, 1 << 19):
        monkeypatch.setattr(mlx_weights, "DENSE_SLICE_BYTES", limit)
        gc.collect()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        y = mlx_weights.dense_product(w, x)
        mx.eval(y)
        peaks.append(mx.get_peak_memory() - base)
        outs.append(np.array(y))
        del y
    whole = rows * cols * 4
    assert peaks[0] >= whole and peaks[1] < whole / 4, (peaks, whole)  # measured here: 1.58x and 0.16x
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


def test_a_pass_of_dense_products_forms_one_weights_values_at_a_time():
    """Dense products one after another (a prompt's layers on CUDA: each weight dequantized, then
    multiplied) form each weight's values only once its x is ready (`dense_product` makes the first
    slice's fields wait for x): the pass's peak over its weights is about one product's (its transient
    values), not every layer's values formed ahead (left to itself MLX forms them all first: nothing
    they read waits). Measured here (16 layers of 2,048 x 2,048 Q4_0 weights in bfloat16, the graph's
    float32 intermediates, this VM, 2026-12-07): the pass's peak 6.7x one product's without the wait;
    bound: 2x."""
    from mlxinfer.backends import mlx_weights

    rng = np.random.default_rng(0)
    n, layers = 2048, 16
    raw = quants.random_blocks(rng, Q.Q4_0, n, n)
    ws = [to_device(Q.Q4_0, quants.split(raw.copy(), Q.Q4_0, n, n), (n, n), dtype=mx.bfloat16) for _ in range(layers)]
    mx.eval([w.w for w in ws])
    x = mx.array(rng.standard_normal((17, n)).astype(np.float32)).astype(mx.bfloat16)
    mx.eval(x)
    peaks = []
    for count in (1, layers):
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        y = x
        for w in ws[:count]:
            y = mx.tanh(mlx_weights.dense_product(w, y))
        mx.eval(y)
        peaks.append(mx.get_peak_memory() - base)
        del y
    assert peaks[1] < 2 * peaks[0], peaks


def test_an_affine_weights_kernel_fields_wait_too():
    """`QuantizedWeight.after` makes the kernels' views of its fields (what the affine_values kernel
    reads) wait for y as well as its codes, so a dense product's later slices by the kernel wait for the
    previous slice's product as the graph's do."""
    import tempfile

    from mlxinfer import block_kernels

    def depends(a) -> bool:
        with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
            mx.export_to_dot(f.name, a)
            return "Depends" in f.read()

    raw = quants.random_blocks(np.random.default_rng(0), Q.Q4_K, 64, 256)
    w = to_device(Q.Q4_K, quants.split(raw, Q.Q4_K, 64, 256), (64, 256))
    w.kernel_fields = block_kernels.kernel_fields(w)
    after = w.after(mx.zeros((1,)))
    assert depends(after.w) and len(after.kernel_fields) == 3 and all(depends(f) for f in after.kernel_fields)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0])
@pytest.mark.parametrize("float_scales", [False, True])
def test_a_sliced_dense_product_keeps_the_weights_dtype_and_fields(monkeypatch, qtype, float_scales):
    """In bfloat16 (a GPU's default), an affine weight's dense form and its dense product, whole or in
    slices (`after` rebuilds each slice from all of the weight's fields: its dtype, formed scales, split
    scale fields), are bfloat16, and the sliced product has the whole one's bits (on this CPU)."""
    from mlxinfer.backends import mlx_weights

    rng = np.random.default_rng(int(qtype) + 11)
    rows, cols = 256, 256
    raw = quants.random_blocks(rng, qtype, rows, cols, std=0.05)
    w = to_device(qtype, quants.split(raw, qtype, rows, cols), (rows, cols), float_scales=float_scales, dtype=mx.bfloat16)
    x = mx.array(rng.standard_normal((5, cols)).astype(np.float32)).astype(mx.bfloat16)
    assert w.dense().dtype == mx.bfloat16
    outs = []
    for limit in (1 << 40, 64 * 4 * cols):  # whole; four slices of 64 rows
        monkeypatch.setattr(mlx_weights, "DENSE_SLICE_BYTES", limit)
        y = mlx_weights.dense_product(w, x)
        assert y.dtype == mx.bfloat16
        outs.append(np.array(y.astype(mx.float32)))
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K])
def test_many_rows_of_an_affine_product_take_the_dense_form_on_cuda(monkeypatch, qtype):
    """On CUDA (`dense_rows`), an affine weight's product of DENSE_MIN_ROWS rows of x or more is
    `dense_product` (the weight dequantized, then one product), fewer rows stay MLX's quantized_matmul;
    elsewhere (`dense_rows` None: this CPU's backend, Metal) never. Here a CPU backend is given the CUDA
    rule. The dense form's values are gguf-py's (test above), so its product is within float32's
    rounding of the exact one (a bound of ~1e-5 relative to the sum of |terms|)."""
    from mlxinfer.backends import mlx as mlx_backend

    be = MLXBackend(device="cpu", threads=1)
    assert be.dense_rows is None
    rng = np.random.default_rng(int(qtype) + 7)
    rows = 64
    raw = quants.random_blocks(rng, qtype, rows, COLS, std=0.05)
    values = dequantize(raw, qtype).reshape(rows, COLS)
    w = to_device(qtype, quants.split(raw, qtype, rows, COLS), (rows, COLS))
    n = mlx_backend.DENSE_MIN_ROWS
    x = rng.standard_normal((n, COLS)).astype(np.float32)
    calls, real = [], mlx_weights.dense_product
    monkeypatch.setattr(mlx_backend, "dense_product", lambda w, x: calls.append(x.shape[0]) or real(w, x))
    be.linear(be.from_numpy(x), w)
    assert calls == []
    be.dense_rows = n
    for m in (n - 1, n):
        got = np.array(be.linear(be.from_numpy(x[:m]), w))
    assert calls == [n]
    assert np.array_equal(got.view(np.uint32), np.array(real(w, mx.array(x))).view(np.uint32))
    want = x.astype(np.float64) @ values.T.astype(np.float64)
    assert np.all(np.abs(got - want) <= 1e-5 * (np.abs(x) @ np.abs(values).T) + 1e-30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("quants")


def synthetic(model_dir, qtype) -> str:
    return write_synthetic_model(model_dir / f"{qtype.name}.gguf", SyntheticSpec(qtype=qtype.name, **SPEC))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
def test_memory_after_loading_is_within_1_15x_of_the_file(model_dir, qtype, device):
    """MLX's active memory after loading is exactly what `quants.memory_bytes` says each tensor takes
    (one copy of a tied embedding), and at most 1.15x the file's tensor bytes (measured: 1.0 for every
    type but Q4_K 1.028 and Q5_K 1.023, whose 6-bit sub-scales are kept a byte each)."""
    path = synthetic(model_dir, qtype)
    with GGUFFile(path) as g:
        file_bytes = sum(t.nbytes for t in g.tensors.values())
        expected = sum(quants.memory_bytes(t.ggml_type, t.shape) for t in g.tensors.values())
        arrays = sum(len(quants.split(g.raw(t.name), t.ggml_type, *t.shape)) if len(t.shape) == 2 else 1
                     for t in g.tensors.values())
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    engine = mlxinfer.Engine(path, MLXBackend(device=device))
    used = mx.get_active_memory() - before
    # MLX's CPU allocator counts the bytes asked for; a GPU build's allocator may round each buffer up
    # (not measured here: allowed at most 16 KiB an array)
    slack = 0 if gpu_kind() is None else 16384 * arrays
    assert expected <= used <= expected + slack, (used, expected)
    assert used <= 1.15 * file_bytes + slack, used / file_bytes
    handles = vars(engine.model.w.layers[0]).values()
    assert not [w for w in handles if isinstance(w, mx.array) and w.ndim == 2]  # no matrix expanded to float


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
def test_mlx_logits_match_the_cpu_reference_per_type(model_dir, qtype, device):
    path = synthetic(model_dir, qtype)
    cpu = mlxinfer.load(path, backend="cpu")
    ml = mlxinfer.load(path, backend="mlx", device=device)
    a = np.concatenate([cpu.logits(IDS), decode_logits(cpu, IDS, 4)])
    b = np.concatenate([ml.logits(IDS), decode_logits(ml, IDS, 4)])
    scale = np.max(np.abs(a))
    assert np.max(np.abs(a - b)) <= REL_BOUND * scale, (np.max(np.abs(a - b)) / scale)


MOE_TYPES = [Q.Q4_K, Q.Q5_1, Q.Q8_0, Q.Q6_K, Q.IQ4_XS, Q.F16]  # affine (gather_qmm), block/16-bit (dequantized)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", MOE_TYPES, ids=lambda q: q.name)
def test_quantized_experts_stay_compact_and_match_the_reference(model_dir, qtype, device):
    """A Qwen3-MoE file whose expert stacks are of a kept type: MLX keeps them in that type (memory as
    `quants.memory_bytes` says, at most 1.15x the file's tensor bytes; no stack expanded to float32), and
    its logits agree with the cpu reference's (which dequantizes) within the dense models' bound (the
    same error model: the same values, another order of float32 sums; measured on this VM 2026-12-02:
    4.8e-7 x the largest |logit| for Q4_K, 8e-7 for Q8_0, Q6_K, Q5_0)."""
    spec = SyntheticSpec(arch="qwen3moe", qtype=qtype.name, n_layers=2, n_experts=8, n_experts_used=2, ffn_expert=256,
                         **SPEC)
    path = write_synthetic_model(model_dir / f"moe-{qtype.name}.gguf", spec)
    with GGUFFile(path) as g:
        file_bytes = sum(t.nbytes for t in g.tensors.values())
        expected = sum(quants.memory_bytes(t.ggml_type, t.shape) for t in g.tensors.values())
        assert g.tensor("blk.1.ffn_down_exps.weight").ggml_type == qtype
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    ml = mlxinfer.Engine(path, MLXBackend(device=device))
    used = mx.get_active_memory() - before
    slack = 0 if device == "cpu" else 16384 * 8 * len(ml.model.w.layers)  # a GPU allocator's rounding, as above
    assert expected <= used <= expected + slack and used <= 1.15 * file_bytes + slack, (used, expected, file_bytes)
    cpu = mlxinfer.load(path, backend="cpu")
    a = np.concatenate([cpu.logits(IDS), decode_logits(cpu, IDS, 4)])
    b = np.concatenate([ml.logits(IDS), decode_logits(ml, IDS, 4)])
    assert np.max(np.abs(a - b)) <= REL_BOUND * np.max(np.abs(a)), np.max(np.abs(a - b)) / np.max(np.abs(a))


def whole_stack(stack, ids):
    """`ExpertStack.chosen` replaced by the stack itself: every expert dequantized, the ids as given
    (the path block and 16-bit stacks took before they read only the chosen experts)."""
    return stack.weight, ids


def expert_stack(rng, qtype, e, out, n_in, edges=False) -> ExpertStack:
    raw = quants.random_blocks(rng, qtype, e * out, n_in, std=n_in ** -0.5, edges=edges)
    weight = to_device(qtype, quants.split(raw, qtype, e * out, n_in), (e * out, n_in))
    return ExpertStack((e, out, n_in), weight=weight)


def same_products(got, want) -> None:
    got, want = np.array(got), np.array(want)
    assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32))


ROUTINGS = [[[5, 2]],  # one decode row's experts
            [[1, 6], [6, 0], [3, 1]],  # rows sharing experts (6 selections of 8)
            [[7, 6, 5, 4, 3, 0, 1]]]  # nearly all: 7 of 8


@pytest.mark.parametrize("qtype", [*quants.BLOCK_TYPES, *quants.HALF_TYPES], ids=lambda q: q.name)
def test_chosen_experts_multiply_as_the_whole_stack(qtype, monkeypatch):
    """A block or 16-bit stack's products over only the selected experts (`ExpertStack.chosen`) have
    the bits of the whole stack's (every expert dequantized, then `gather_mm` by the router's ids), for
    one row, rows that share experts and a row taking 7 of 8, on edge blocks (module docstring):
    dequantization is exact per value and the products are gather_mm's over the same values (no error
    model: bits). float32 only: MLX's CPU gather_mm takes no other dtype (a GPU's bfloat16 not run)."""
    MLXBackend(device="cpu")
    rng = np.random.default_rng(int(qtype) + 300)
    stack = expert_stack(rng, qtype, 8, 48, 256, edges=True)
    for routing in ROUTINGS:
        ids = mx.array(np.array(routing, np.uint32))
        x = mx.array(rng.standard_normal((ids.shape[0], 1, 1, 256)).astype(np.float32))
        got = stack.products(x, ids)
        with monkeypatch.context() as m:
            m.setattr(ExpertStack, "chosen", whole_stack)
            same_products(got, stack.products(x, ids))


def test_a_decode_row_dequantizes_only_its_experts(monkeypatch):
    """One row's products over 2 of 64 Q6_K experts take a transient a fraction of the whole stack's
    float32 (MLX's peak memory over the call, this machine's CPU): the chosen experts alone are
    dequantized. The whole-stack path, measured the same way, takes at least the stack's float32."""
    MLXBackend(device="cpu")
    e, out, n_in = 64, 128, 512
    stack = expert_stack(np.random.default_rng(5), Q.Q6_K, e, out, n_in)
    x, ids = mx.ones((1, 1, 1, n_in)), mx.array([[9, 40]], dtype=mx.uint32)

    def peak():
        mx.eval(stack.products(x, ids))
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(stack.products(x, ids))
        return mx.get_peak_memory() - before

    chosen = peak()
    monkeypatch.setattr(ExpertStack, "chosen", whole_stack)
    whole = peak()
    assert whole >= e * out * n_in * 4 > 8 * chosen, (chosen, whole)


@pytest.mark.parametrize("used", [2, 7], ids=lambda k: f"{k}-of-8")
def test_moe_logits_equal_the_whole_stack_paths(model_dir, used, monkeypatch):
    """A Q6_K Qwen3-MoE model on MLX: prefill and decode logits with the experts of few (2 of 8) and
    nearly all (7 of 8) read alone have the bits of the whole-stack path's (`whole_stack`)."""
    spec = SyntheticSpec(arch="qwen3moe", qtype="Q6_K", n_layers=2, n_experts=8, n_experts_used=used, ffn_expert=256,
                         **SPEC)
    ml = mlxinfer.load(write_synthetic_model(model_dir / f"moe-used{used}.gguf", spec), backend="mlx", device="cpu")
    got = np.concatenate([ml.logits(IDS[:3]), decode_logits(ml, IDS[:8], 3)])
    monkeypatch.setattr(ExpertStack, "chosen", whole_stack)
    want = np.concatenate([ml.logits(IDS[:3]), decode_logits(ml, IDS[:8], 3)])
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_type_that_is_not_kept_is_refused_in_one_line(model_dir, monkeypatch):
    """A type mlxinfer does not read (here IQ2_XXS, as the index says) is an UnsupportedError naming
    the tensor and the type, never a silent expansion."""
    from dataclasses import replace

    from mlxinfer.errors import UnsupportedError

    g = GGUFFile(synthetic(model_dir, Q.Q4_K))
    name = "blk.0.attn_output.weight"
    monkeypatch.setitem(g.tensors, name, replace(g.tensors[name], ggml_type=Q.IQ2_XXS))
    with pytest.raises(UnsupportedError, match=f"{name}.*IQ2_XXS"):
        MLXBackend(device="cpu").load_weight(g, name)


@pytest.mark.parametrize("qtype", list(quants.FIELDS) + list(quants.HALF_TYPES) + [Q.F32], ids=lambda t: t.name)
def test_nonfinite_finds_each_block_with_an_inf_or_nan_scale(qtype):
    """`quants.nonfinite`: a block any of whose fp16 fields (its scales: d, dmin, m) is +inf, -inf or a
    NaN (exponent bits all ones, whatever the mantissa), or for F32/F16/BF16 a value that is one, is
    flagged, each such block and no other; random blocks with the edge scales `random_blocks` sets
    (zeros, subnormals, large finite values) are not, nor the largest finite numbers, nor an inf's bit
    pattern in a field that is not a scale (codes, sub-scales)."""
    rows, cols = 3, 1024
    rng = np.random.default_rng(1)
    raw = (rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint8) if qtype == Q.F32
           else quants.random_blocks(rng, qtype, rows, cols, edges=True).reshape(rows, -1))
    assert not quants.nonfinite(raw, qtype).any()
    if qtype in quants.FIELDS:
        size = quants.GGML_QUANT_SIZES[qtype][1]
        fields = [(start, dtype == np.float16) for _, start, _, dtype in quants.FIELDS[qtype]]
    else:
        size, fields = {Q.F32: 4, Q.F16: 2, Q.BF16: 2}[qtype], [(0, True)]
    inf = {Q.F32: [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001]}.get(qtype, [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF])
    if qtype == Q.BF16:
        inf = [0x7F80, 0xFF80, 0x7FC0, 0x7F81]
    fmt = "<u4" if qtype == Q.F32 else "<u2"
    # the largest finite numbers (bfloat16's 0x7C00 is 2^121: fp16's exponent bits, yet finite)
    finite = {Q.F32: [0x7F7FFFFF, 0xFF7FFFFF], Q.BF16: [0x7F7F, 0xFF7F, 0x7C00, 0xFC00]}.get(qtype, [0x7BFF, 0xFBFF])
    for start, scale in fields:
        for bits in finite:
            ok = raw.copy().reshape(rows, -1, size)
            ok[1, 2, start:start + np.dtype(fmt).itemsize] = np.array([bits], fmt).view(np.uint8)
            assert not quants.nonfinite(ok.reshape(rows, -1), qtype).any(), (start, hex(bits))
        for bits in inf:
            bad = raw.copy().reshape(rows, -1, size)
            for r, b in ((2, 1), (0, 3)):
                bad[r, b, start:start + np.dtype(fmt).itemsize] = np.array([bits], fmt).view(np.uint8)
            got = quants.nonfinite(bad.reshape(rows, -1), qtype)
            assert got.shape == bad.shape[:2]
            assert sorted(zip(*np.nonzero(got))) == ([(0, 3), (2, 1)] if scale else []), (start, hex(bits))


def _with_fp16_bits(path, at: int, bits: int, out):
    """A copy of the file at `path` as `out` with the fp16 at byte `at` set to `bits`."""
    data = bytearray(open(path, "rb").read())
    data[at:at + 2] = np.array([bits], "<u2").tobytes()
    out.write_bytes(bytes(data))
    return out


def test_a_tensor_with_an_inf_or_nan_is_refused_in_the_files_rows(model_dir):
    """`GGUFFile.check_finite` names the tensor, its type and the first block (or value) with an inf or
    NaN, in the file's rows, reading a bounded run of rows at a time (here 2 rows: the bad one is not in
    the first run); a view's cut (`ShardedGGUF`: a rank's rows, Phi-3's K rows of its fused QKV) checks
    its own rows but names them as the file does; rows before the bad one pass."""
    from mlxinfer.errors import GGUFError
    from mlxinfer.gguf_file import ShardedGGUF

    path = synthetic(model_dir, Q.Q4_K)
    name = "blk.0.ffn_up.weight"
    with GGUFFile(path) as g:
        t = g.tensor(name)
        row_bytes = t.nbytes // t.shape[0]
        at = t.offset + 5 * row_bytes + 144 * (1 if t.shape[1] > 256 else 0) + 2  # row 5's dmin
        block = 1 if t.shape[1] > 256 else 0
    bad = _with_fp16_bits(path, at, 0x7E00, model_dir / "nan-dmin.gguf")
    with GGUFFile(bad) as g:
        g.CHECK_BYTES = 2 * row_bytes
        with pytest.raises(GGUFError, match=rf"tensor '{name}' \(Q4_K\) has an inf or NaN scale: block {block} of row 5$"):
            g.check_finite(name)
        g.check_finite(name, (0, 5))  # (rows before it: fine)
        view = ShardedGGUF(g, {"blk.0.attn_k.weight": (0, 4, 8, None), "blk.0.attn_v.weight": (0, 0, 4, None)},
                           {"blk.0.attn_k.weight": name, "blk.0.attn_v.weight": name})
        view.check_finite("blk.0.attn_v.weight")
        with pytest.raises(GGUFError, match=rf"tensor '{name}' \(Q4_K\) has an inf or NaN scale: block {block} of row 5$"):
            view.check_finite("blk.0.attn_k.weight")


def test_an_expert_stacks_inf_or_nan_is_named_by_row_and_expert(model_dir):
    """In an expert stack ([experts, rows, in]) the first bad block is named by its row and expert: a NaN
    scale written into expert 5's row 3 (of a Q8_0 `ffn_up_exps`) reads `block 0 of row 3 of expert 5`."""
    from mlxinfer.errors import GGUFError

    spec = SyntheticSpec(arch="qwen3moe", qtype="Q8_0", n_layers=1, n_experts=8, n_experts_used=2, ffn_expert=64, **SPEC)
    path = write_synthetic_model(model_dir / "moe-nan.gguf", spec)
    name = "blk.0.ffn_up_exps.weight"
    with GGUFFile(path) as g:
        t = g.tensor(name)
        experts, rows = t.shape[0], t.shape[1]
        row_bytes = t.nbytes // (experts * rows)
        at = t.offset + (5 * rows + 3) * row_bytes  # expert 5, row 3, block 0's d
    bad = _with_fp16_bits(path, at, 0xFC00, model_dir / "moe-nan-bad.gguf")  # -inf
    with GGUFFile(bad) as g:
        assert g.tensor(name).shape[:2] == (8, 64)
        with pytest.raises(GGUFError, match=rf"tensor '{name}' \(Q8_0\) has an inf or NaN scale: block 0 of row 3 of expert 5$"):
            g.check_finite(name)


def test_inspect_says_how_each_type_is_kept(model_dir):
    from mlxinfer.inspect import describe

    out = describe(synthetic(model_dir, Q.Q6_K))
    assert "MLX bytes" in out
    line = next(s for s in out.splitlines() if s.strip().startswith("Q6_K") and "tensors" in s)
    assert "file blocks, dequantized at use" in line
    assert "(1.000x)" in out  # Q6_K blocks and F32 norms: the file's bytes
    out = describe(synthetic(model_dir, Q.Q4_K))
    assert "MLX affine 4-bit, group 32" in out and "(1.028x)" in out  # 148 bytes a block of 144


def _ints(lo, hi):
    return np.arange(lo, hi + 1, dtype=np.float64)


# The integers each type multiplies an fp16 scale by, in gguf-py's order ((d·a)·b; quants' doc), over
# their whole ranges; the repacks' MLX-side forms (d·q' with q' = q + offset, and offset·d) as well.
FACTORS = {
    Q.Q8_0: [(_ints(-128, 127), None), (_ints(0, 255), None), (np.array([-128.0]), None)],
    Q.Q4_0: [(_ints(-8, 7), None), (_ints(0, 15), None), (np.array([-8.0]), None)],
    Q.Q5_0: [(_ints(-16, 15), None), (_ints(0, 31), None), (np.array([-16.0]), None)],
    Q.Q4_1: [(_ints(0, 15), None)],
    Q.Q5_1: [(_ints(0, 31), None)],
    Q.Q4_K: [(_ints(0, 63), _ints(0, 15))],  # (d·sc)·q; dmin·m is the first factor alone
    Q.Q5_K: [(_ints(0, 63), _ints(0, 31))],
    Q.Q6_K: [(_ints(-128, 127), _ints(-32, 31))],
    Q.Q3_K: [(_ints(-32, 31), _ints(-4, 3))],
    Q.Q2_K: [(_ints(0, 15), _ints(0, 3))],
    Q.IQ4_NL: [(quants.IQ4_VALUES.astype(np.float64), None)],
    Q.IQ4_XS: [(_ints(-32, 31), quants.IQ4_VALUES.astype(np.float64))],
}


@pytest.mark.parametrize("qtype", list(FACTORS), ids=lambda q: q.name)
def test_the_exactness_argument_holds_per_type(qtype):
    """Every product of an fp16 scale and a type's integers is exact in float32 (so its order and fma
    cannot change a bit): the float32 products equal the exact (float64) ones for every integer in range
    and fp16 scales of every 11-bit significand, at the smallest subnormal, around one and at the largest
    exponent."""
    mantissas = np.arange(1024, 2048, dtype=np.float64)
    d = np.concatenate([mantissas * 2.0 ** -10, mantissas * 2.0 ** 5, [2.0 ** -24, 1023 * 2.0 ** -24]])
    d = np.concatenate([d, -d]).astype(np.float16)
    assert np.isfinite(d).all() and np.array_equal(d.astype(np.float64), d.astype(np.float32).astype(np.float64))
    for a, b in FACTORS[qtype]:
        p32 = d.astype(np.float32)[:, None] * a.astype(np.float32)[None, :]
        p64 = d.astype(np.float64)[:, None] * a[None, :]
        assert np.array_equal(p32.astype(np.float64), p64)
        if b is not None:
            q32 = p32[:, :, None] * b.astype(np.float32)[None, None, :]
            assert np.array_equal(q32.astype(np.float64), p64[:, :, None] * b[None, None, :])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_float_scales_give_the_same_bits_in_more_memory(model_dir, qtype):
    """MLXBackend(float_scales=True) forms the affine types' float32 scales and biases once at load:
    the logits are bitwise those of forming them at each use, and the memory is the quants plus 8
    bytes (a float32 scale and bias) a group of 32."""
    path = synthetic(model_dir, qtype)
    with GGUFFile(path) as g:
        bits = quants.AFFINE_BITS[qtype]
        expected = sum(t.n_elements * 4 if len(t.shape) != 2 else t.n_elements * bits // 8 + t.n_elements // 32 * 8
                       for t in g.tensors.values())
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    fast = mlxinfer.Engine(path, MLXBackend(device="cpu", float_scales=True))
    if gpu_kind() is None:  # (a GPU build's allocator may round buffers up: see the test above)
        assert mx.get_active_memory() - before == expected
    compact = mlxinfer.Engine(path, MLXBackend(device="cpu"))
    a = np.concatenate([fast.logits(IDS), decode_logits(fast, IDS, 2)])
    b = np.concatenate([compact.logits(IDS), decode_logits(compact, IDS, 2)])
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("qtype", list(quants.AFFINE_BITS), ids=lambda q: q.name)
def test_scales_formed_by_one_compiled_kernel_are_float32_ones_rounded_once(qtype, dtype, tmp_path):
    """An affine weight's scales and biases in the products' dtype come from one compiled function
    on a GPU (`formed_scales`: one fused kernel a product for both; a row slice's too), elsewhere and for gathered
    rows from the same function uncompiled (`affine_scales`): both the float32 values (as gguf-py's
    arithmetic forms them) rounded once to the dtype, bit for bit, edge values included (fp16
    subnormals, +-65504, zeros, negatives: an offset type's bias is the rounded scale times a power of
    two). (That the float32 values are gguf-py's: test_kept_weights_dequantize_to_gguf_py_bit_for_bit.)"""
    mdt = getattr(mx, dtype)
    raw = quants.random_blocks(np.random.default_rng(int(qtype) + 7), qtype, ROWS, COLS, edges=True)
    w = to_device(qtype, quants.split(raw, qtype, ROWS, COLS), (ROWS, COLS), dtype=mdt, compiled=True)
    f32 = affine_scales(qtype, w.parts)  # float32
    bits = mx.uint32 if dtype == "float32" else mx.uint16
    part = w.row_slice(3, 9)  # (a weight group's view: strided fields, another shape to trace)
    for name, formed, want_all in (("compiled", w.affine(), f32), ("uncompiled", affine_scales(qtype, w.parts, mdt), f32),
                                   ("compiled row slice", part.affine(), tuple(a[3:9] for a in f32))):
        for got, want in zip(formed, want_all):
            assert got.dtype == mdt
            assert np.array_equal(np.array(mx.view(got, bits)), np.array(mx.view(want.astype(mdt), bits))), name
    assert part.compiled and not to_device(qtype, quants.split(raw, qtype, ROWS, COLS), (ROWS, COLS)).compiled
    for empty in (part.row_slice(2, 2), to_device(qtype, quants.split(raw, qtype, ROWS, COLS), (ROWS, COLS), dtype=mdt).row_slice(2, 2)):
        assert [a.shape for a in empty.affine()] == [(0, COLS // 32)] * 2  # (no row: shapes still known)
    # one launch for both: a single fused kernel; where the bias is not made from the scale, the two are
    # views of its output's halves by one reshape and one split (no other primitive: each is the host's
    # work at every product of a prompt's pass)
    mx.export_to_dot(str(tmp_path / "g.dot"), *part.affine())
    prims = re.findall(r'label ="([A-Za-z]+)', (tmp_path / "g.dot").read_text())
    views = [] if qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_0) else ["Reshape", "Split"]
    assert prims[0].startswith("Compiled") and sorted(prims[1:]) == views, prims


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K], ids=lambda q: q.name)
def test_k_quant_scale_fields_are_split_once_at_load_without_a_copy(tmp_path, qtype):
    """A Q4_K or Q5_K weight keeps its scale fields also as the four views `affine_scales` multiplies
    (`split`: d, sub-scales, dmin, mins), evaluated at load over the fields' own memory (no byte more),
    so that a product's graph does not slice the fields again: no Slice or Squeeze primitive before the
    compiled kernel that forms the scales and biases (a prompt's pass of the 0.6B Q4_K_M shape: 2,556
    primitives, 1,968 so; step_graph.py --host), with the same bits as the fields sliced in the graph
    (the test above)."""
    raw = quants.random_blocks(np.random.default_rng(3), qtype, ROWS, COLS, edges=True)
    fields = [mx.array(a) for a in quants.split(raw, qtype, ROWS, COLS)]
    mx.eval(*fields)
    before = mx.get_active_memory()
    split = mlx_weights.split_scale_fields(fields[1:])
    mx.eval(*split)
    if gpu_kind() is None:
        assert mx.get_active_memory() == before
    w = to_device(qtype, quants.split(raw, qtype, ROWS, COLS), (ROWS, COLS), compiled=True)
    assert [a.shape for a in w.split] == [(ROWS, COLS // 256, 1), (ROWS, COLS // 256, 8)] * 2
    x = mx.array(np.random.default_rng(4).standard_normal((3, COLS)).astype(np.float32))
    mx.export_to_dot(str(tmp_path / "g.dot"), w.product(x))
    prims = re.findall(r'label ="([A-Za-z]+)', (tmp_path / "g.dot").read_text())
    # the fields go straight into the one compiled kernel (`formed_scales`), whose output's two halves
    # (the scales, the biases) are the only views: one reshape, one split
    assert sorted(prims) == sorted([prims[0], "Reshape", "Split", "QuantizedMatmul"]), prims
    assert prims[0].startswith("Compiled") and prims[0].endswith("Select"), prims


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", list(quants.BLOCK_TYPES), ids=lambda q: q.name)
def test_block_values_formed_by_one_compiled_function_are_the_graphs(qtype, dtype, monkeypatch, tmp_path):
    """A FUSABLE block type's dequantized values (a prompt's product on a GPU: `formed_values`, compiled
    into a few fused kernels, a row slice's too) are the graph's `dequantize` bit for bit, edge values
    included; Q2_K stays in the graph (its dl * q - ml could become one fma in a fused kernel), and a
    weight made without `compiled` too."""
    mdt = getattr(mx, dtype)
    raw = quants.random_blocks(np.random.default_rng(int(qtype) + 11), qtype, ROWS, COLS, edges=True)
    parts = quants.split(raw, qtype, ROWS, COLS)
    w = to_device(qtype, parts, (ROWS, COLS), dtype=mdt, compiled=True)
    assert (qtype in mlx_weights.FUSABLE) == (qtype != Q.Q2_K)
    want = mlx_weights.dequantize(qtype, w.parts, ROWS, COLS).astype(mdt)
    bits = mx.uint32 if dtype == "float32" else mx.uint16
    part = w.row_slice(3, 9)
    for name, got, expected in (("compiled", w.dense(), want), ("compiled row slice", part.dense(), want[3:9])):
        assert got.dtype == mdt and got.shape == expected.shape, name
        assert np.array_equal(np.array(mx.view(got, bits)), np.array(mx.view(expected, bits))), name
    calls = []
    real = mlx_weights.formed_values
    monkeypatch.setattr(mlx_weights, "formed_values", lambda q, d: calls.append(q) or real(q, d))
    w.dense(), to_device(qtype, parts, (ROWS, COLS), dtype=mdt).dense()
    assert calls == ([qtype] if qtype in mlx_weights.FUSABLE else []) and part.compiled
    if qtype == Q.Q6_K:  # one launch: the cast to the dtype fused too (after the final reshape it was one more)
        mx.export_to_dot(str(tmp_path / "g.dot"), w.dense())
        prims = re.findall(r'label ="([A-Za-z]+)', (tmp_path / "g.dot").read_text())
        assert len([p for p in prims if p != "Reshape"]) == 1, prims


def test_scales_are_formed_at_each_use_unless_asked():
    """The compact form is the default on every device (memory within 1.15x of the file's bytes; on a
    GPU decode rows read it through the block kernels); `float_scales=True` forms them once."""
    assert MLXBackend(device="cpu").float_scales is False
    assert MLXBackend(device="cpu", float_scales=True).float_scales is True
    if gpu_kind() is not None:
        assert MLXBackend(device="gpu").float_scales is False


def test_synthetic_mixes_give_each_tensor_the_type_llama_cpps_quantizer_gives():
    """`mlxinfer.synthetic.MIXES` (the Q4_K_M / Q5_K_M files of the speed rows) against llama.cpp's own
    quantizer's choice for every matrix of Qwen3-shaped files of 28 and 36 layers, tied and untied
    (tests/reference/quant_mixes.json, made by `python3 -m tests.reference.quantize mixes`)."""
    import json
    import re
    from pathlib import Path

    from mlxinfer.synthetic import MIXES

    fixture = json.loads((Path(__file__).parent / "reference" / "quant_mixes.json").read_text())
    assert len(fixture) == 8
    for key, types in fixture.items():
        preset, layers, tying = key.split()
        head = "token_embd.weight" if tying == "tied" else "output.weight"
        for name, want in types.items():
            layer = re.match(r"blk\.(\d+)\.", name)
            got = MIXES[preset](name, int(layer.group(1)) if layer else None, int(layers[:-1]), name == head)
            assert got.name == want, f"{key}: {name} is {want} in llama.cpp's file, {got.name} in ours"
