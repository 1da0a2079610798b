"""The block kernels (mlxinfer/block_kernels.py, metal_kernels/blocks.cu and blocks.metal): decode products
that read a weight's compact fields directly (Q6_K's blocks; the affine types' packed codes and fp16
scale fields).

Here (no GPU): the numpy emulation of the published order forms exactly gguf-py's values and is a dot
product within its error model; the CUDA source compiles with NVRTC for every row count and dtype it is
launched with, and, compiled by g++ for the host (tests/cuda_host.py), runs as launched and equals the
emulation bit for bit; the Metal twin parses with clang against the Metal stand-in; the MLX backend
sends a decode row's product to the kernel only on a GPU. On a GPU: the kernel equals the emulation bit for bit,
through `MLXBackend.linear`, and its self-check passes."""

import collections
import re
import types

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from mlxinfer import block_kernels, quants
from mlxinfer.backends.mlx import MLXBackend, _check_block_products, gpu_kind
from mlxinfer.backends.mlx_weights import to_device

from . import cuda_host, metal_clang
from .test_kernels import _nvrtc, _nvrtc_compile

SHAPES = [(16, 256), (40, 512), (8, 1024)]
# K with a last partial tile after full ones (tiles of 8,192 / M columns in 1,024s: 1,024 from 5 rows of x,
# 2,048 at 3, 8,192 at 1), K above 4,096, and for the 32-value types K not a multiple of 256 (Qwen2.5-0.5B's
# 896 and 4,864, Qwen2.5-1.5B's 1,536, Qwen3-8B's 12,288)
TILE_SHAPES = [(42, 1536), (70, 4864), (67, 12288), (29, 896), (9, 1056), (5, 32)]
TYPES = list(block_kernels.KERNELS)


def _fields(rng, rows, cols, edges, qtype=Q.Q6_K):
    raw = quants.random_blocks(rng, qtype, rows, cols, edges=edges)
    return raw, quants.split(raw, qtype, rows, cols)


def _values(raw, qtype, rows, cols):
    return dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)


@pytest.mark.parametrize("edges", [False, True])
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_the_values_formed_are_gguf_pys_bit_for_bit(rows, cols, edges):
    """Every value the kernel forms in registers (`q6_k_values`, the kernel's indexing) is gguf-py's
    dequantization, bit for bit, on random blocks and on blocks of extreme codes and scales."""
    raw, parts = _fields(np.random.default_rng(rows + cols), rows, cols, edges)
    got = block_kernels.q6_k_values(*parts).reshape(rows, cols)
    want = dequantize(raw, Q.Q6_K).reshape(rows, cols).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, block_kernels.MAX_ROWS])
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_the_emulated_order_is_a_dot_product_within_its_error_model(rows, cols, m, qtype):
    """Against float64: each lane sums K/32 rounded products in sequence, then 5 butterfly additions, so
    |error| <= (K/32 + 6) u sum|x w| (u = 2^-24, first order). A unit's columns taken wrongly (a value
    added twice, another skipped) is off by the size of a term, far outside it."""
    rng = np.random.default_rng(cols)
    raw, _ = _fields(rng, rows, cols, False, qtype)
    x = rng.standard_normal((m, cols), dtype=np.float32)
    w = _values(raw, qtype, rows, cols)
    got = block_kernels.emulate(x, block_kernels.terms(raw, qtype, rows, cols), qtype)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    bound = (cols / 32 + 6) * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ np.abs(w.astype(np.float64)).T)
    assert got.shape == (m, rows) and got.dtype == np.float32
    assert np.all(np.abs(got - exact) <= bound)


@pytest.mark.parametrize("edges", [False, True])
@pytest.mark.parametrize("qtype", list(block_kernels.RUNS), ids=lambda t: t.name)
def test_the_terms_of_a_run_make_gguf_pys_values_bit_for_bit(qtype, edges):
    """The types added by runs: each value's code, and its run's scale and bias as the kernel forms them,
    give scale * code + bias = gguf-py's dequantization bit for bit (scale * code is exact: an fp16 scale
    times a 6-bit sub-scale times a code of at most 6 bits), on random blocks and blocks of extreme codes
    and scales; each run of RUNS[qtype] values has one scale and bias, and every code is a small integer."""
    rows, cols = 7, 512
    raw, _ = _fields(np.random.default_rng(11), rows, cols, edges, qtype)
    t = block_kernels.terms(raw, qtype, rows, cols)
    assert isinstance(t, block_kernels.Terms) and (t.biases is None) == (qtype in (Q.Q4_0, Q.Q5_0, Q.Q6_K))
    assert np.array_equal(t.codes, np.round(t.codes)) and np.abs(t.codes).max() <= 63
    values = t.scales * t.codes if t.biases is None else t.scales * t.codes + t.biases
    want = _values(raw, qtype, rows, cols)
    assert np.array_equal(values.view(np.uint32), want.view(np.uint32))
    run = block_kernels.RUNS[qtype]
    for a in (t.scales,) if t.biases is None else (t.scales, t.biases):
        per_run = a.reshape(rows, cols // run, run)
        assert np.array_equal(per_run, np.repeat(per_run[..., :1], run, axis=2))
    with pytest.raises(TypeError, match="given by its Terms"):
        block_kernels.emulate(np.zeros((1, cols), np.float32), want, qtype)


def test_the_runs_order_is_a_dot_product_within_its_error_model():
    """Against float64, by runs: a run's sum of RUN products code * x (rounded: float32 x) and x's sum
    of RUN values, scale * s (+ bias * sx), the run added to a lane's partial sum (K / (32 RUN) of them),
    then 5 butterfly additions: |error| <= (RUN + K / (32 RUN) + 10) u (sum|scale code x| + sum|bias x|)
    (u = 2^-24, first order), which a run's scale or bias taken from another run exceeds."""
    rng = np.random.default_rng(5)
    for qtype in block_kernels.RUNS:
        rows, cols, run = 9, 2048, block_kernels.RUNS[qtype]
        raw, _ = _fields(rng, rows, cols, False, qtype)
        t = block_kernels.terms(raw, qtype, rows, cols)
        x = rng.standard_normal((3, cols), dtype=np.float32)
        got = block_kernels.emulate(x, t, qtype)
        f64 = lambda a: a.astype(np.float64)  # noqa: E731
        bias = np.zeros_like(f64(t.scales)) if t.biases is None else f64(t.biases)
        exact = f64(x) @ (f64(t.scales) * f64(t.codes) + bias).T
        size = np.abs(f64(x)) @ (np.abs(f64(t.scales) * f64(t.codes)) + np.abs(bias)).T
        bound = (run + cols / (32 * run) + 10) * 2.0 ** -24 * size
        assert np.all(np.abs(got - exact) <= bound), qtype.name


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q4_K])
def test_every_column_is_in_exactly_one_unit(qtype):
    for k in (256, 1024, 4096):
        cols = block_kernels.unit_columns(qtype, k)
        assert sorted(cols.reshape(-1).tolist()) == list(range(k))


def test_each_rows_result_does_not_depend_on_the_other_rows():
    """The order is the same for every row count: row i of an 8-row product is the 1-row product of row i."""
    rng = np.random.default_rng(3)
    raw, _ = _fields(rng, 24, 512, False)
    w = block_kernels.terms(raw, Q.Q6_K, 24, 512)
    x = rng.standard_normal((block_kernels.MAX_ROWS, 512), dtype=np.float32)
    many = block_kernels.emulate(x, w, Q.Q6_K)
    for i in range(x.shape[0]):
        one = block_kernels.emulate(x[i:i + 1], w, Q.Q6_K)[0]
        assert np.array_equal(many[i].view(np.uint32), one.view(np.uint32))


CUDA_STUB = """
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
struct __half { unsigned short x; __device__ __half(float f) : x(0) {} __device__ operator float() const { return 0.0f; } };
"""


ELEMENTWISE = ("rms_norm", "swiglu", "affine_scales", "affine_values", "q6_k_values")  # blocks.cu's kernels besides the products (no M)
# the formed kernels' template constants (`block_kernels.formed_scales`: 2 for the K-quants, 1 for Q4_1 and Q5_1;
# `affine_values`: each affine type's own, as its matvec's)
FORMED_LAUNCHES = [("affine_scales", (("SCALES", 1),)), ("affine_scales", (("SCALES", 2),)), ("q6_k_values", ())] + sorted(
    {("affine_values", block_kernels.KERNELS[t][1]) for t in block_kernels.VALUES})


def _launches():
    """(kernel, template constants) of every type's launch (its ADD, NORM and SWIGLU forms are the same
    kernel, chosen at launch), and the norm's and SwiGLU's own kernels (no constants)."""
    pairs = [(block_kernels.PAIR, block_kernels.KERNELS[t][1]) for t in block_kernels.PAIR_FIRST]
    return (sorted({(name, consts) for name, consts in block_kernels.KERNELS.values()}) + pairs
            + [(n, ()) for n in ELEMENTWISE if n not in dict(FORMED_LAUNCHES)] + FORMED_LAUNCHES)


def _cuda_source(name: str, consts, dtype: str, m: int) -> str:
    """What MLX's cuda_kernel compiles for a launch: the header, then the kernel, named as MLX names it
    (custom_kernel_, the name, each template argument, a hash: mlx/backend/cuda/custom_kernel.cpp), with
    each input typed by its array's dtype, the template constants, the body; the header cut to what the
    body reaches (`block_kernels.kernel_parts`), as MLX gets it."""
    header, body = block_kernels.kernel_parts("cuda", name)
    types = cuda_host.input_types(consts, dtype)
    params = ", ".join([f"const {types[i]}* {i}" for i in block_kernels.INPUTS[name]]
                       + [f"{dtype}* {o}" for o in block_kernels.OUTPUTS.get(name, ["out"])])
    extra = "".join(f"  constexpr int {k} = {v};\n" for k, v in consts)
    fn = f"custom_kernel_mlxinfer_{name}_cuda_{ {'float': 'float', '__half': 'float16'}[dtype]}_{m}" + "".join(
        f"_{v}" for _, v in consts) + "_52e4a46224f4393e"
    return (f"{CUDA_STUB}{header}\n__global__ void {fn}({params}) {{\n  using T = {dtype};\n"
            f"  constexpr int M = {m};\n{extra}{body}\n}}\n")


def test_block_kernels_go_to_mlx_with_only_the_header_they_use():
    """MLX hashes a CUDA kernel's whole source on every launch and a decode token launches ~140 block
    kernels: each gets its body and the header definitions it reaches (a type's reader and its base, the
    frame and what it calls), not the other types' readers (the pair launch: its two types'); the norm and
    SwiGLU kernels only their own functions. (That the cut sources compile: the NVRTC test below.)"""
    full, _ = block_kernels.kernel_source("cuda")
    defined = lambda header: set(re.findall(r"(?:struct\s+|\b)(mlxi_\w+)\s*(?=[({:])", header))  # noqa: E731
    header, _ = block_kernels.kernel_parts("cuda", "affine_matvec")
    assert {"mlxi_affine", "mlxi_groups32", "mlxi_block_matvec", "mlxi_stage_x", "mlxi_swiglu_value", "mlxi_exp",
            "mlxi_rms_inv"} <= defined(header)
    assert not {"mlxi_q6k", "mlxi_iq4", "mlxi_q3k", "mlxi_q2k", "mlxi_half_values", "mlxi_iq4_value"} & defined(header)
    header, _ = block_kernels.kernel_parts("cuda", "q6_k_matvec")
    assert "mlxi_q6k" in defined(header) and "mlxi_affine" not in defined(header)
    header, _ = block_kernels.kernel_parts("cuda", "swiglu")
    assert defined(header) == {"mlxi_exp", "mlxi_swiglu_value"}
    header, _ = block_kernels.kernel_parts("cuda", "rms_norm")
    assert defined(header) == {"mlxi_rms_inv", "mlxi_norm_value", "mlxi_warp_total"}
    for name in block_kernels.INPUTS:
        header, body = block_kernels.kernel_parts("cuda", name)
        assert "//" not in header + body and len(header) < (0.75 if name == block_kernels.PAIR else 0.7) * len(full)
        assert header.startswith("#define MLXI_THREADS 256\n")


@pytest.mark.parametrize("dtype", ["float", "__half"])
def test_cuda_source_compiles_with_nvrtc_for_every_row_count(dtype):
    """blocks.cu's kernels compile (NVRTC, sm_90) for 1..MAX_ROWS rows, as MLX's cuda_kernel builds them."""
    lib = _nvrtc()
    if lib is None:
        pytest.skip("needs NVRTC (pip install 'nvidia-cuda-nvrtc>=13'; Linux x86-64)")
    opts = [b"--gpu-architecture=compute_90", b"-default-device", b"--std=c++17"]
    assert {name for name, _ in _launches()} == set(block_kernels.kernel_source("cuda")[1])
    for name, consts in _launches():
        for m in ((1,) if name in ELEMENTWISE else range(1, block_kernels.MAX_ROWS + 1)):
            rc, log = _nvrtc_compile(lib, name, _cuda_source(name, consts, dtype, m), opts)
            assert rc == 0, f"{name} {consts} M={m} {dtype}: {log}"


METAL_EXTRA = """
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
struct half { half(float); operator float() const; };
"""


def _metal_source(name: str, consts, m: int) -> str:
    header, bodies = block_kernels.kernel_source("metal")
    types = cuda_host.input_types(consts, "float")
    params = [f"  const {'constant' if n == 'dims' else 'device'} {types[n]}* {n} [[buffer({i})]]"
              for i, n in enumerate(block_kernels.INPUTS[name])]
    params += [f"  device float* {o} [[buffer({len(params) + i})]]" for i, o in enumerate(block_kernels.OUTPUTS.get(name, ["out"]))]
    body = bodies[name]
    params += [f"  {t} {a} [[{a}]]" for a, t in metal_clang_attributes().items() if a in body]
    decl = ", ".join(["typename T", "int M", *(f"int {k}" for k, _ in consts)])
    args = ", ".join(["float", str(m), *(str(v) for _, v in consts)])
    return (f"{METAL_EXTRA}{header}template <{decl}>\n[[kernel]] void k_{name}(\n" + ",\n".join(params)
            + ") {\n" + body + "\n}\n" + f"template void k_{name}<{args}>(" +
            ", ".join(p.split("[[")[0].rsplit(" ", 2)[0].strip() for p in params) + ");\n")


def metal_clang_attributes():
    from mlxinfer.kernels import METAL_ATTRIBUTES

    return METAL_ATTRIBUTES


@pytest.mark.skipif(not metal_clang.available(), reason="needs libclang (pip install libclang)")
@pytest.mark.parametrize("m", [1, block_kernels.MAX_ROWS])
def test_metal_twin_parses_with_clang(m):
    """blocks.metal's kernels parse without an error against the Metal stand-in, instantiated for m rows,
    and declare no threadgroup memory."""
    assert {name for name, _ in _launches()} == set(block_kernels.kernel_source("metal")[1])
    for name, consts in _launches():
        tu = metal_clang.parse(_metal_source(name, consts, m))
        errs = metal_clang.errors(tu)
        assert not errs, f"{name}:\n" + "\n".join(errs[:5])
        assert metal_clang.threadgroup_arrays(tu) == {}


def test_the_backend_sends_decode_rows_to_the_kernel_only_on_a_gpu(monkeypatch):
    """On MLX's CPU a Q6_K product is the graph's (dequantize, then matmul); `applies` takes decode-sized
    products of whole 256-value blocks only, and of an affine weight of more than WIDE rows (a head) at
    most WIDE_MAX_ROWS rows (7 by default); a Q6_K head every decode size."""
    calls = []
    monkeypatch.setattr(block_kernels, "product", lambda *a: calls.append(a))
    rng = np.random.default_rng(0)
    raw, parts = _fields(rng, 16, 256, False)
    w = to_device(Q.Q6_K, parts, (16, 256))
    be = MLXBackend(device="cpu")
    import mlx.core as mx

    x = mx.array(rng.standard_normal((2, 256), dtype=np.float32))
    got = np.array(be.linear(x, w))
    assert calls == []
    want = np.array(x) @ dequantize(raw, Q.Q6_K).reshape(16, 256).T
    assert np.allclose(got, want, rtol=1e-5, atol=1e-4)
    assert block_kernels.applies(w, x)
    assert not block_kernels.applies(w, mx.zeros((block_kernels.MAX_ROWS + 1, 256)))
    # a weight of more than WIDE rows (a head) of an affine type takes at most WIDE_MAX_ROWS rows; a Q6_K
    # one all MAX_ROWS (past the kernels its product would form every value)
    raw8 = quants.random_blocks(rng, Q.Q8_0, 16, 256)
    w8 = to_device(Q.Q8_0, quants.split(raw8, Q.Q8_0, 16, 256), (16, 256))
    rows = lambda m: mx.zeros((m, 256))  # noqa: E731
    monkeypatch.setattr(block_kernels, "WIDE", 15)
    # by default 7 rows stay, 8 go to quantized_matmul (its tiled form from 8 rows: bench/RESULTS.md 2026-12-07)
    assert block_kernels.applies(w8, rows(7)) and not block_kernels.applies(w8, rows(8))
    monkeypatch.setattr(block_kernels, "WIDE_MAX_ROWS", 4)
    assert block_kernels.applies(w8, rows(4)) and not block_kernels.applies(w8, rows(5))
    assert block_kernels.applies(w, rows(block_kernels.MAX_ROWS))
    monkeypatch.setattr(block_kernels, "WIDE", 16)
    assert block_kernels.applies(w8, rows(block_kernels.MAX_ROWS))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, block_kernels.MAX_ROWS])
@pytest.mark.parametrize("per_warp", [1, 3, block_kernels.MAX_ROWS_PER_WARP])
def test_each_launch_is_what_mlx_custom_kernels_take(qtype, m, per_warp, monkeypatch):
    """The arguments `product` hands MLX's kernel (run here against a recorder, as no GPU is): the kernel's
    inputs in its order with the dtypes its source reads (fp16 fields as uint16 bits; res and nw: x
    itself, unread, or with a residual that residual and dims' forms bit 0, the same compiled form),
    template values that are a dtype or an int (M the row count), dims [N, K, rows a warp, eps bits,
    forms], a grid with a warp for every `per_warp` output rows, an [M, N] output in x's dtype."""
    import mlx.core as mx

    calls = []

    def fake(name):
        def launch(**kw):
            calls.append((name, kw))
            return [mx.zeros(kw["output_shapes"][0], dtype=kw["output_dtypes"][0])]
        return launch

    monkeypatch.setattr(block_kernels, "_kernel", lambda kind, name, blocks=1: fake(name))
    rows, cols = 33, 512  # (4 a warp: 8 warps and one for the last row)
    _, parts = _fields(np.random.default_rng(0), rows, cols, False, qtype)
    w = to_device(qtype, parts, (rows, cols))
    x = mx.zeros((m, cols), dtype=mx.bfloat16)
    out = block_kernels.product("cuda", x, w, per_warp)
    res = mx.ones((m, rows), dtype=mx.bfloat16)
    block_kernels.product("cuda", x, w, per_warp, residual=res)
    (name, kw), (_, kw_add) = calls
    assert kw_add["inputs"][1] is res and kw_add["inputs"][-1].tolist() == [rows, cols, per_warp, 0, 1]
    assert kw_add["template"] == kw["template"]  # (one compiled kernel for every form)
    assert kw_add["inputs"][0] is x and all(
        np.array_equal(np.array(a), np.array(b)) for a, b in zip(kw_add["inputs"][block_kernels.FIELDS_AT:-1], kw["inputs"][block_kernels.FIELDS_AT:-1], strict=True))
    with pytest.raises(ValueError, match="residual must be"):
        block_kernels.product("cuda", x, w, per_warp, residual=res.astype(mx.float32))
    assert out.shape == (m, rows) and out.dtype == mx.bfloat16 and name == block_kernels.KERNELS[qtype][0]
    ins = kw["inputs"]
    assert len(ins) == len(block_kernels.INPUTS[name]) and ins[0] is x and ins[1] is x and ins[2] is x
    assert ins[-1].tolist() == [rows, cols, per_warp, 0, 0]  # (no norm: eps 0; the product alone)
    want = {"ql": mx.uint8, "qh": mx.uint8, "scales": mx.int8, "d_bits": mx.uint16, "s0": mx.uint16, "qs": mx.uint8,
            "sc_h": mx.uint16, "sc_l": mx.uint8, "hmask": mx.uint8, "sc3": mx.uint8, "sc2": mx.uint8,
            "dmin_bits": mx.uint16, "v": mx.uint16, "res": mx.bfloat16, "nw": mx.bfloat16,
            "w": mx.uint32, "s1": mx.uint8 if qtype in (Q.Q4_K, Q.Q5_K) else mx.uint16, "dims": mx.int32}
    for n, a in zip(block_kernels.INPUTS[name][1:], ins[1:]):
        assert a.dtype == want[n], (n, a.dtype)
    template = dict(kw["template"])
    assert template["T"] == mx.bfloat16 and template["M"] == m
    assert all(isinstance(v, mx.Dtype) or type(v) is int for v in template.values()), kw["template"]
    assert kw["threadgroup"] == (32 * block_kernels.WARPS, 1, 1)
    assert kw["grid"][0] * kw["grid"][1] == 32 * block_kernels.WARPS * -(-(-(-rows // per_warp)) // block_kernels.WARPS)
    assert kw["output_shapes"] == [(m, rows)]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_kernels_inputs_are_made_once_at_load(qtype, monkeypatch):
    """Where the backend runs the block kernels, a weight it loads carries the kernel's inputs
    (`kernel_fields`: views of its fields, fp16 ones as uint16 bits) made and evaluated at load, and a
    product hands MLX those very arrays, so a compiled decode step replays no view of its own; a row
    slice's are the slices of them, bit for bit what it would make itself. Elsewhere (no block kernels)
    a weight carries none."""
    import mlx.core as mx

    inputs = []

    def launch(**kw):
        inputs.append(kw["inputs"])
        return [mx.zeros(kw["output_shapes"][0], dtype=kw["output_dtypes"][0])]

    monkeypatch.setattr(block_kernels, "_kernel", lambda kind, name, blocks=1: launch)
    rows, cols = 33, 512
    _, parts = _fields(np.random.default_rng(1), rows, cols, True, qtype)
    assert MLXBackend(device="cpu")._to_device(qtype, parts, (rows, cols)).kernel_fields == ()
    be = MLXBackend(device="cpu")
    be.block_kind = "cuda"  # (as on a GPU whose block kernels passed their self-check)
    w = be._to_device(qtype, parts, (rows, cols))
    fresh = block_kernels.kernel_fields(w)
    assert len(w.kernel_fields) == len(fresh) == len(block_kernels.INPUTS[block_kernels.KERNELS[qtype][0]]) - block_kernels.FIELDS_AT - 1
    for a, b in zip(w.kernel_fields, fresh, strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.array(a), np.array(b))
    block_kernels.product("cuda", mx.zeros((1, cols)), w)
    assert all(a is b for a, b in zip(inputs[-1][block_kernels.FIELDS_AT:-1], w.kernel_fields, strict=True))
    part = w.row_slice(5, 21)
    for a, b in zip(part.kernel_fields, block_kernels.kernel_fields(part), strict=True):
        assert a.shape[0] == 16 and np.array_equal(np.array(a), np.array(b))


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    """blocks.cu's kernels compiled for the host (tests/cuda_host.py): every type's form, x float32 (1 and
    5 rows) and bfloat16 (1 and 3); SwiGLU's in float16 too."""
    if not cuda_host.available():
        pytest.skip("needs g++ (C++20) to run the CUDA kernels on the host")
    forms = [(name, consts, t, m) for name, consts in _launches() for t in ("float", "__nv_bfloat16")
             for m in ((1,) if name in ELEMENTWISE else (1, 5) if t == "float" else (1, 3))]  # (ADD, NORM,
    # SWIGLU: the same kernels; 1, 3 and 5 rows: tiles of x of 8,192, 2,048 and 1,024 columns)
    forms += [("swiglu", (), "__half", 1)] + [(name, consts, "__half", 1) for name, consts in FORMED_LAUNCHES]
    return cuda_host.HostKernels(tmp_path_factory.mktemp("cuda_host"), forms)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols", [(41, 512), (3, 4096), *TILE_SHAPES])
def test_the_cuda_kernels_run_on_the_host_give_their_published_order(host_kernels, rows, cols, qtype):
    """blocks.cu itself (not a transcription), run on the host as `product` launches it on CUDA: its
    bits equal the numpy emulation of its published order on random blocks with edge values, for one
    row of x and 1, 2, 3 or 4 output rows a warp (the bounded forms' rows known at compile time:
    blocks.cu's mlxi_block_rows; at 3, 4 computed, the last a copy), 5 rows of x and 4 a warp, 3 rows of
    bfloat16 x and 3 a warp (a last warp with fewer rows), over full tiles of x (8,192, 1,024 and 2,048 columns for those row
    counts), partial ones after full ones, and 32-value rows that are not whole 256-value blocks; each
    input ends before a page the process may not read, so a read past one stops the test. The GPU's
    compiler and memory are not in it: the GPU test below and the self-check are."""
    if cols % block_kernels.row_multiple(qtype):
        pytest.skip(f"{qtype.name} takes rows of whole 256-value blocks")
    rng = np.random.default_rng(rows * cols)
    raw, parts = _fields(rng, rows, cols, True, qtype)
    w = to_device(qtype, parts, (rows, cols))
    values = block_kernels.terms(raw, qtype, rows, cols)
    for m, per_warp, dtype in ((1, 1, mx.float32), (1, 2, mx.float32), (1, 3, mx.bfloat16), (1, 4, mx.bfloat16),
                               (5, 4, mx.float32), (3, 3, mx.bfloat16)):
        xd = mx.array(rng.standard_normal((m, cols), dtype=np.float32)).astype(dtype)
        x = np.array(xd.astype(mx.float32))
        narrow = lambda a: np.array(mx.array(a).astype(dtype).astype(mx.float32))  # noqa: E731
        fma16 = dtype != mx.float32
        sums = block_kernels.emulate(x, values, qtype, fma16)
        got = host_kernels.product(xd, w, per_warp)
        want = narrow(sums)
        same = got.view(np.uint32) == want.view(np.uint32)
        assert same.all(), f"{int((~same).sum())} of {same.size} differ ({m} rows, {per_warp} a warp, {dtype})"
        # the ADD form: a residual of the sums' size (so that its additions round) plus the product
        res = mx.array(rng.standard_normal((m, rows), dtype=np.float32) * np.abs(want) + want).astype(dtype)
        got = host_kernels.product(xd, w, per_warp, residual=res)
        want = block_kernels.with_residual(sums, np.array(res.astype(mx.float32)), narrow)
        same = got.view(np.uint32) == want.view(np.uint32)
        assert same.all(), f"ADD: {int((~same).sum())} of {same.size} differ ({m} rows, {per_warp} a warp, {dtype})"
        # the NORM form: the product of x's rows normed as the rms_norm kernel norms them
        nw = mx.array(rng.uniform(0.5, 2.0, cols).astype(np.float32)).astype(dtype)
        normed = block_kernels.emulate_rms_norm(x, np.array(nw.astype(mx.float32)), 1e-5, narrow)
        got = host_kernels.product(xd, w, per_warp, norm=(nw, 1e-5))
        want = narrow(block_kernels.emulate(normed, values, qtype, fma16))
        same = got.view(np.uint32) == want.view(np.uint32)
        assert same.all(), f"NORM: {int((~same).sum())} of {same.size} differ ({m} rows, {per_warp} a warp, {dtype})"
        # the SWIGLU form with ADD: residual + the product of silu(gate) * up as the swiglu kernel writes it
        gud = mx.array(rng.standard_normal((m, 2 * cols), dtype=np.float32) * 4).astype(dtype)
        act = block_kernels.emulate_swiglu(np.array(gud.astype(mx.float32)), narrow)
        got = host_kernels.product(gud, w, per_warp, residual=res, swiglu=True)
        want = block_kernels.with_residual(block_kernels.emulate(act, values, qtype, fma16), np.array(res.astype(mx.float32)), narrow)
        same = got.view(np.uint32) == want.view(np.uint32)
        assert same.all(), f"SWIGLU: {int((~same).sum())} of {same.size} differ ({m} rows, {per_warp} a warp, {dtype})"


@pytest.mark.parametrize("m", [1, 3])
def test_a_bfloat16_run_past_float32s_range_is_one_fma_a_product(host_kernels, m):
    """A 16-bit x's products code * x are summed by one fma each: exact products, but a bfloat16 x can
    take one past float32's range (|x| above ~5e36), where the fma's single rounding is the published
    order. A Q4_0 row with codes -1 then +2 times x = 3e38 twice: the run's sum is 3e38 by fma (finite:
    -3e38 + 6e38 rounded once), inf by a rounded product then an add; the host-run kernel (one row of x,
    and three: the rows-in-turn form) gives `emulate(..., fma16=True)`'s bits, which are finite."""
    d = np.float16(2.0 ** -14)
    codes = np.full(32, 8, np.uint8)  # (code 8: the value 0)
    codes[0], codes[1] = 7, 10  # -1, +2
    block = np.concatenate([np.frombuffer(d.tobytes(), np.uint8), codes[:16] | (codes[16:] << 4)])
    raw = np.tile(block, (8, 1)).reshape(8, 18)  # 8 rows of one block each: a [8, 32] weight
    w = to_device(Q.Q4_0, quants.split(raw, Q.Q4_0, 8, 32), (8, 32))
    x = np.zeros((m, 32), np.float32)
    x[:, :2] = 3.0e38
    xd = mx.array(x).astype(mx.bfloat16)
    xs = np.array(xd.astype(mx.float32))
    t = block_kernels.terms(raw, Q.Q4_0, 8, 32)
    narrow = lambda a: np.array(mx.array(a).astype(mx.bfloat16).astype(mx.float32))  # noqa: E731
    want = narrow(block_kernels.emulate(xs, t, Q.Q4_0, fma16=True))
    assert np.isfinite(want).all() and not np.isfinite(block_kernels.emulate(xs, t, Q.Q4_0)).any()
    got = host_kernels.product(xd, w, 1)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("first", block_kernels.PAIR_FIRST, ids=lambda t: t.name)
@pytest.mark.parametrize("na,nb,cols", [(20, 13, 512), (16, 8, 4096), (3, 5, 1280)])
def test_a_pair_launch_run_on_the_host_gives_each_runs_bits(host_kernels, first, na, nb, cols):
    """blocks.cu's pair launch (`pair_product`: a group's Q4_K or Q5_K run and its Q6_K run, one launch)
    run on the host: its [M, Na + Nb] output is the two products' published orders side by side, bit for
    bit, alone and of normed rows (NORM), for 1 and 5 rows of float32 x and 1 and 3 of bfloat16 (tiles of
    8,192, 1,024 and 2,048 columns: one partial, several full), with runs whose last block has idle
    warps (20, 13, 3, 5 rows) and rows of one and of several tiles; nothing written past the output."""
    rng = np.random.default_rng(na * cols)
    raw_a, parts_a = _fields(rng, na, cols, True, first)
    raw_b, parts_b = _fields(rng, nb, cols, True, Q.Q6_K)
    a, b = to_device(first, parts_a, (na, cols)), to_device(Q.Q6_K, parts_b, (nb, cols))
    va, vb = block_kernels.terms(raw_a, first, na, cols), block_kernels.terms(raw_b, Q.Q6_K, nb, cols)
    for m, dtype in ((1, mx.float32), (5, mx.float32), (1, mx.bfloat16), (3, mx.bfloat16)):
        xd = mx.array(rng.standard_normal((m, cols), dtype=np.float32)).astype(dtype)
        x = np.array(xd.astype(mx.float32))
        narrow = lambda v: np.array(mx.array(v).astype(dtype).astype(mx.float32))  # noqa: E731
        nw = mx.array(rng.uniform(0.5, 2.0, cols).astype(np.float32)).astype(dtype)
        for norm in (None, (nw, 1e-5)):
            xs = x if norm is None else block_kernels.emulate_rms_norm(x, np.array(nw.astype(mx.float32)), 1e-5, narrow)
            fma16 = dtype != mx.float32
            want = np.concatenate([narrow(block_kernels.emulate(xs, va, first, fma16)),
                                   narrow(block_kernels.emulate(xs, vb, Q.Q6_K, fma16))], axis=1)
            got = host_kernels.pair_product(xd, a, b, norm)
            same = got.view(np.uint32) == want.view(np.uint32)
            assert same.all(), (f"{int((~same).sum())} of {same.size} differ ({m} rows, {dtype}, "
                                f"{'NORM' if norm else 'alone'}; columns {np.flatnonzero(~same.all(0))[:8]})")


def test_every_block_kernel_indexes_a_grid_of_several_rows_of_blocks(host_kernels, monkeypatch):
    """A launch of more than 65,535 blocks takes several rows of blocks (`kernels.launch_grid`: a 152k-row
    head's products, a Q4_K head's 19M scale groups); each kernel numbers its block (y, x) as
    y * gridDim.x + x and the blocks past the last idle. Here the rows are capped at 2 blocks and every
    launch below is of an odd number of blocks (3 to 93: 2 to 47 rows, the last with an idle block):
    each product type, the NORM form, the pair launch, the norm, SwiGLU and the formed kernels give the
    bits of their one-row launch."""
    import functools

    from mlxinfer import kernels

    rng = np.random.default_rng(7)
    rows, cols, formed_rows = 37, 768, 31  # 5 blocks of 8 warps; formed: 3 (744 scale groups) and 93 (Q6_K)
    x = mx.array(rng.standard_normal((1, cols), dtype=np.float32))
    gu = mx.array(rng.standard_normal((3, 2 * cols), dtype=np.float32)).astype(mx.bfloat16)  # 9 blocks
    nw = mx.array(rng.uniform(0.5, 2.0, cols).astype(np.float32))
    weights = {t: to_device(t, _fields(rng, rows, cols, True, t)[1], (rows, cols))
               for t in block_kernels.KERNELS if cols % block_kernels.row_multiple(t) == 0}
    formed = {t: to_device(t, _fields(rng, formed_rows, cols, True, t)[1], (formed_rows, cols), dtype=mx.bfloat16)
              for t in block_kernels.FORMED}
    pair = [to_device(t, _fields(rng, n, cols, True, t)[1], (n, cols)) for t, n in ((Q.Q4_K, 20), (Q.Q6_K, 13))]  # 3 + 2
    calls = [*((f"{t.name} product", lambda w=w: host_kernels.product(x, w, 1)) for t, w in weights.items()),
             ("Q6_K NORM product", lambda: host_kernels.product(x, weights[Q.Q6_K], 1, norm=(nw, 1e-5))),
             ("pair", lambda: host_kernels.pair_product(x, *pair)),
             ("rms_norm", lambda: host_kernels.rms_norm(mx.tile(x, (rows, 1)), nw, 1e-6)),
             ("swiglu", lambda: host_kernels.swiglu(gu)),
             *((f"{t.name} formed", lambda w=w, t=t: host_kernels.formed_scales(w) if block_kernels.FORMED[t] == "affine_scales"
                else (host_kernels.formed_values(w),)) for t, w in formed.items())]
    one_row = {name: call() for name, call in calls}
    grids = []
    capped = functools.partial(kernels.launch_grid, columns=2)
    monkeypatch.setattr(block_kernels, "launch_grid", lambda blocks, *a: grids.append((blocks, capped(blocks, *a))) or grids[-1][1])
    for name, call in calls:
        before = len(grids)
        got = call()
        assert len(grids) == before + 1, f"{name}: {len(grids) - before} launches"
        blocks, (_, gy, _) = grids[-1]
        assert blocks % 2 == 1 and gy == (blocks + 1) // 2 > 1, f"{name}: {blocks} blocks, {gy} rows"
        for g, want in zip(got if isinstance(got, tuple) else (got,), one_row[name] if isinstance(got, tuple) else (one_row[name],)):
            assert np.array_equal(np.asarray(g).view(np.uint32), np.asarray(want).view(np.uint32)), name


def test_rows_a_warp_takes():
    """CUDA warps take 4 output rows; Metal's simdgroups one; a count outside the kernel's registers is
    refused."""
    assert block_kernels.rows_per_warp("cuda") == block_kernels.MAX_ROWS_PER_WARP
    assert block_kernels.rows_per_warp("metal") == 1
    x, w = mx.zeros((1, 256)), to_device(Q.Q8_0, quants.split(quants.random_blocks(np.random.default_rng(0), Q.Q8_0, 8, 256),
                                                              Q.Q8_0, 8, 256), (8, 256))
    for kind, r in (("cuda", block_kernels.MAX_ROWS_PER_WARP + 1), ("cuda", 0), ("metal", 2)):
        with pytest.raises(ValueError, match="output rows a warp"):
            block_kernels.product(kind, x, w, r)


needs_gpu = pytest.mark.skipif(gpu_kind() is None, reason="needs an MLX GPU (Metal or CUDA)")


@needs_gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 5, block_kernels.MAX_ROWS])
@pytest.mark.parametrize("rows,cols", [(41, 512), (1000, 1024), (3, 4096)])
@pytest.mark.parametrize("per_warp", [1, 2, 4])
def test_gpu_kernel_equals_its_published_order_bit_for_bit(rows, cols, m, qtype, per_warp):
    """Whatever rows a warp takes (a last warp with fewer left), each output is its published order's."""
    import mlx.core as mx

    rng = np.random.default_rng(rows * m)
    raw, parts = _fields(rng, rows, cols, True, qtype)
    w = to_device(qtype, parts, (rows, cols))
    x = rng.standard_normal((m, cols), dtype=np.float32)
    with mx.stream(mx.gpu):  # (an earlier test's CPU backend may have made the CPU MLX's default device)
        per_warp = per_warp if gpu_kind() == "cuda" else 1
        got = np.array(block_kernels.product(gpu_kind(), mx.array(x), w, per_warp))  # the kernel itself, whatever the verdict
    want = block_kernels.emulate(x, block_kernels.terms(raw, qtype, rows, cols), qtype)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@needs_gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("rows,cols", TILE_SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_kernel_partial_tiles_equal_the_published_order(rows, cols, m, qtype, dtype):
    """Shapes whose last tile of x is partial, after full ones (a wrong count of that tile's columns
    passes every shape of the test above), 4 rows a warp with a remainder, x in float32 and bfloat16."""
    import mlx.core as mx

    rng = np.random.default_rng(rows + cols + m)
    x = rng.standard_normal((m, cols), dtype=np.float32)
    if cols % block_kernels.row_multiple(qtype):
        pytest.skip(f"{qtype.name} takes rows of whole 256-value blocks")
    raw, parts = _fields(rng, rows, cols, True, qtype)
    w = to_device(qtype, parts, (rows, cols))
    assert block_kernels.applies(w, mx.array(x))
    xd = mx.array(x).astype(getattr(mx, dtype))
    x = np.array(xd.astype(mx.float32))  # (bfloat16's values, widened exactly)
    with mx.stream(mx.gpu):
        got = np.array(block_kernels.product(gpu_kind(), xd, w).astype(mx.float32))
    want = np.array(mx.array(block_kernels.emulate(x, block_kernels.terms(raw, qtype, rows, cols), qtype)).astype(xd.dtype)
                    .astype(mx.float32))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gpu_self_check_of_the_block_kernels_passes(dtype):
    """Every type's kernel, and its ADD, NORM and SWIGLU forms, bit for bit their published order on the GPU."""
    b = MLXBackend(device="gpu", dtype=dtype)
    assert _check_block_products(b) is None and _check_block_products(b, fused=True) is None
    assert _check_block_products(b, swiglu=True) is None


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gpu_pair_launch_passes_its_self_check(dtype):
    """The pair launch (Q4_K or Q5_K with Q6_K, one launch) on the GPU, bit for bit its two products'
    published orders side by side, alone and of normed rows (`verify_pair_launch`)."""
    from mlxinfer.backends.mlx import verify_pair_launch

    b = MLXBackend(device="gpu", dtype=dtype)
    assert verify_pair_launch(b) is None and b.pair_launch


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("kernel", ["rms_norm", "swiglu"])
def test_gpu_norm_and_swiglu_kernels_pass_their_self_checks(dtype, kernel):
    """blocks.cu's rms_norm and swiglu on the GPU, bit for bit `emulate_rms_norm` and `emulate_swiglu`
    (`verify_rms_norm`; `verify_swiglu`, with the SWIGLU form)."""
    from mlxinfer.backends.mlx import verify_rms_norm, verify_swiglu

    b = MLXBackend(device="gpu", dtype=dtype)
    b.norm_kind, b.swiglu_kind = b.norm_kind or b.gpu_kernels, b.swiglu_kind or b.gpu_kernels
    assert (verify_rms_norm if kernel == "rms_norm" else verify_swiglu)(b) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_block_self_check_compares_in_the_products_dtype(monkeypatch, dtype):
    """The block kernels' self-check launches them with x in the products' dtype (a 16-bit x widened
    exactly, the float32 sum rounded once to it, `(T)s`), for each number of rows a CUDA warp takes, and
    expects exactly that (the ADD form: with the residual added as `with_residual` says; the NORM form:
    of the rows `emulate_rms_norm` norms; the SWIGLU form: of `emulate_swiglu`'s values, with ADD): a stand-in kernel that is the emulation so rounded passes; one whose largest value is one unit in the last place off fails, naming the type, rows and dtype. (Stand-in kernel on MLX's CPU.)"""
    from mlxinfer.backends import mlx as mlx_mod

    seen = {}
    real = block_kernels.terms

    def terms_seen(raw, qtype, rows, cols):  # the weight the check expects the kernel to multiply
        seen["v"] = real(raw, qtype, rows, cols)
        return seen["v"]

    monkeypatch.setattr(block_kernels, "terms", terms_seen)
    b = MLXBackend(device="cpu", dtype=dtype)
    b.weight_dtype, b.block_kind = b.dtype, "cuda"  # (as on a GPU: products in the dtype)
    off = {"by": 0}

    per_warp_seen, added = set(), []
    narrow = lambda a: np.array(mx.array(a).astype(b.dtype).astype(mx.float32))  # noqa: E731

    def kernel(kind, x, w, per_warp=None, residual=None, norm=None, swiglu=False):
        per_warp_seen.add(per_warp)
        added.append("glu" if swiglu else "add" if residual is not None else "norm" if norm is not None else "")
        xs = np.array(x.astype(mx.float32))
        assert x.dtype == b.dtype and np.array_equal(np.array(mx.array(xs).astype(x.dtype).astype(mx.float32)), xs)
        if norm is not None:
            xs = block_kernels.emulate_rms_norm(xs, np.array(norm[0].astype(mx.float32)), norm[1], narrow)
        if swiglu:
            assert residual is not None  # (the self-check's SWIGLU form adds the residual too, as a layer does)
            xs = block_kernels.emulate_swiglu(xs, narrow)
        s = block_kernels.emulate(xs, seen["v"], w.qtype)
        out = narrow(s) if residual is None else block_kernels.with_residual(s, np.array(residual.astype(mx.float32)), narrow)
        big = np.unravel_index(np.argmax(np.abs(out)), out.shape)  # (a normal number in every dtype)
        out.view(np.uint32)[big] += off["by"] << (16 if dtype == "bfloat16" else 13 if dtype == "float16" else 0)
        return mx.array(out).astype(x.dtype)

    monkeypatch.setattr(block_kernels, "product", kernel)
    assert _check_block_products(b) is None and _check_block_products(b, fused=True) is None
    assert "glu" not in added  # (the SWIGLU form is the swiglu kernel's verdict's, not the fused forms')
    assert _check_block_products(b, swiglu=True) is None
    assert per_warp_seen == {1, 2, block_kernels.MAX_ROWS_PER_WARP}  # every layout a CUDA warp may take
    assert set(added) == {"", "add", "norm", "glu"}  # the product alone, the ADD, NORM and SWIGLU forms
    off["by"] = 1
    first = next(iter(block_kernels.KERNELS)).name
    assert _check_block_products(b) == (f"the {first} block kernel differs from its published order in 1 of 42 "
                                        f"values (1 rows, 1 a warp, {dtype})")
    assert _check_block_products(b, fused=True) == (
        f"the {first} block kernel (adding a residual) differs from its published order in 1 of 42 values "
        f"(1 rows, {block_kernels.MAX_ROWS_PER_WARP} a warp, {dtype})")
    assert _check_block_products(b, swiglu=True) == (
        f"the {first} block kernel (of SwiGLU's values, adding a residual) differs from its published order in "
        f"1 of 42 values (1 rows, {block_kernels.MAX_ROWS_PER_WARP} a warp, {dtype})")


def test_the_swiglu_verdict_answers_for_the_swiglu_form(monkeypatch):
    """`verify_swiglu` checks the block kernels' SWIGLU form after the swiglu kernel (both compute
    SwiGLU's values by one function): a failing form is the swiglu verdict's failure, which turns off
    SwiGLU alone, and the fused forms' check (ADD, NORM) does not launch it."""
    from mlxinfer.backends import mlx as mlx_mod

    asked = []
    monkeypatch.setattr(block_kernels, "swiglu", lambda kind, x: mx.array(block_kernels.emulate_swiglu(
        np.array(x.astype(mx.float32)), lambda a: a)))
    monkeypatch.setattr(mlx_mod, "_check_block_products",
                        lambda b, kernel=None, fused=False, swiglu=False: asked.append((fused, swiglu)) or "form off")
    b = MLXBackend(device="cpu")
    b.swiglu_kind = "cuda"
    assert mlx_mod.verify_swiglu(b) == "form off" and asked == [(False, True)]
    assert mlx_mod.verify_fused_forms(b) == "form off" and asked[-1] == (True, False)


def _stand_in_kernels(monkeypatch, calls: list):
    """The block kernels replaced by stand-ins on MLX's CPU that record each launch's form in `calls`: the
    norm as `emulate_rms_norm`, SwiGLU as `emulate_swiglu`, a product as the weight's own graph product
    rounded to the dtype (the ADD form: `with_residual`)."""
    def narrow_to(dtype):
        return lambda a: np.array(mx.array(a).astype(dtype).astype(mx.float32))

    f32 = lambda a: np.array(a.astype(mx.float32))  # noqa: E731

    def norm(kind, x, weight, eps):
        calls.append("norm")
        return mx.array(block_kernels.emulate_rms_norm(f32(x), f32(weight), eps, narrow_to(x.dtype))).astype(x.dtype)

    def swiglu(kind, x):
        calls.append("swiglu")
        return mx.array(block_kernels.emulate_swiglu(f32(x), narrow_to(x.dtype))).astype(x.dtype)

    def kernel(kind, x, w, per_warp=None, residual=None, norm=None, swiglu=False):
        calls.append("product" + ("+norm" if norm else "") + ("+swiglu" if swiglu else "") + ("+add" if residual is not None else ""))
        narrow = narrow_to(x.dtype)
        xs = f32(x)
        if norm is not None:
            xs = block_kernels.emulate_rms_norm(xs, f32(norm[0]), norm[1], narrow)
        if swiglu:
            xs = block_kernels.emulate_swiglu(xs, narrow)
        s = np.array(w.product(mx.array(xs)).astype(mx.float32))
        out = narrow(s) if residual is None else block_kernels.with_residual(s, f32(residual), narrow)
        return mx.array(out).astype(x.dtype)

    def pair(kind, x, a, b, norm=None):
        calls.append("pair" + ("+norm" if norm else ""))
        xs = f32(x) if norm is None else block_kernels.emulate_rms_norm(f32(x), f32(norm[0]), norm[1], narrow_to(x.dtype))
        both = [np.array(w.product(mx.array(xs)).astype(mx.float32)) for w in (a, b)]
        return mx.array(narrow_to(x.dtype)(np.concatenate(both, axis=1))).astype(x.dtype)

    monkeypatch.setattr(block_kernels, "product", kernel)
    monkeypatch.setattr(block_kernels, "pair_product", pair)
    monkeypatch.setattr(block_kernels, "rms_norm", norm)
    monkeypatch.setattr(block_kernels, "swiglu", swiglu)


def _logits_fused_and_apart(path, dtype, calls: list):
    """A 4-token prompt's logits with the fused forms and with the ops apart (as the backend runs them
    when the forms are off), each with the Counter of its launches, the backend set up as on a GPU."""
    import mlxinfer

    def logits(fused: bool):
        eng = mlxinfer.load(path, backend="mlx", device="cpu", dtype=dtype)
        b = eng.backend
        b.weight_dtype, b.block_kind, b.norm_kind, b.swiglu_kind = b.dtype, "cuda", "cuda", "cuda"  # (as on a GPU)
        b.fused_forms = b.pair_launch = fused
        calls.clear()
        return eng.logits([1, 5, 9, 2]), collections.Counter(calls)

    return logits(True), logits(False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_norms_swiglu_and_residuals_join_the_products_bit_for_bit(synthetic, monkeypatch, dtype, arch):
    """Where the block kernels multiply a pass's rows (here a 4-token prompt's), each layer's attention
    and FFN norms are one launch with the products after them (`rms_norm_linear_group`, `swiglu_ffn`:
    the kernels' NORM form), its FFN's SwiGLU one launch with the down product (`swiglu_ffn`: SWIGLU),
    and its attention output and FFN down products take their residual in the same launch (`linear_add`,
    `swiglu_ffn`: ADD); the logits are the bits of the ops apart, as the backend runs them when the
    fused forms are off (the norm kernel, the products, the swiglu kernel, the graph's Add). Stand-in
    kernels (`_stand_in_kernels`), so what is compared is the backend's wiring and MLX's Add against the
    kernels' rounding rule."""
    calls = []
    _stand_in_kernels(monkeypatch, calls)
    (fused, fused_calls), (plain, plain_calls) = _logits_fused_and_apart(
        synthetic(arch=arch, n_layers=2, qtype="Q8_0"), dtype, calls)
    layers = 2
    assert fused_calls == {"product+norm": 2 * layers, "product+add": layers, "product+swiglu+add": layers,
                           "norm": 1, "product": 1}  # (the output norm, before the head's product)
    assert plain_calls == {"norm": 2 * layers + 1, "product": 4 * layers + 1, "swiglu": layers}
    assert np.array_equal(np.asarray(fused).view(np.uint32), np.asarray(plain).view(np.uint32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pair", [True, False])
def test_a_mixed_type_group_takes_the_norm_form_a_run_each(synthetic, monkeypatch, dtype, pair):
    """A Q4_K_M file's layer whose V is Q6_K (layer 1 of 2, as llama.cpp's quantizer assigns it) holds
    its Q, K, V as two runs (Q and K in Q4_K, V in Q6_K): for decode rows both runs are one pair launch
    in the NORM form (`pair_product`), or without it (its self-check failed) each run is one NORM-form
    launch (the norm inside each), not a norm and three products, and the logits are the bits of the
    ops apart. (Stand-in kernels, as above.)"""
    from mlxinfer.backends.mlx_weights import WeightRuns

    calls = []
    _stand_in_kernels(monkeypatch, calls)
    path = synthetic(arch="qwen3", n_layers=2, qtype="Q4_K_M", hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                     head_dim=64, random_blocks=True)
    if not pair:
        monkeypatch.setattr(block_kernels, "pair_applies", lambda kind, x, a, b: False)
    (fused, fused_calls), (plain, plain_calls) = _logits_fused_and_apart(path, dtype, calls)
    import mlxinfer

    layers = mlxinfer.load(path, backend="mlx", device="cpu").model.w.layers
    assert not isinstance(layers[0].attn_qkv, WeightRuns) and [r.sizes for r in layers[1].attn_qkv.runs] == [(256, 128), (128,)]
    # layer 0: Q/K/V and gate/up one NORM launch each; layer 1: Q/K with V (or Q/K, V) and gate/up
    assert fused_calls == {"product+add": 2, "product+swiglu+add": 2, "norm": 1, "product": 1,
                           **({"product+norm": 3, "pair+norm": 1} if pair else {"product+norm": 5})}
    assert plain_calls == {"norm": 5, "product": 10, "swiglu": 2}
    assert np.array_equal(np.asarray(fused).view(np.uint32), np.asarray(plain).view(np.uint32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 1024), (9, 1312), (3, 4096), (2, 40), (5, 1000)])
def test_the_norm_kernel_run_on_the_host_gives_its_published_order(host_kernels, rows, cols, dtype):
    """blocks.cu's `rms_norm` (a warp a row; its values are what the NORM form multiplies) run on the host
    as `block_kernels.rms_norm` launches it: bit for bit `emulate_rms_norm` (the sum of squares in the dot
    order, 1/sqrt correctly rounded, (x * inv) * w), over rows of any length and rows past a block's 8,
    and within float32's rounding of the textbook formula."""
    rng = np.random.default_rng(rows + cols)
    narrow = lambda a: np.array(mx.array(a).astype(dtype).astype(mx.float32))  # noqa: E731
    xd = mx.array(rng.standard_normal((rows, cols), dtype=np.float32) * 3).astype(dtype)
    nw = mx.array(rng.uniform(0.5, 2.0, cols).astype(np.float32)).astype(dtype)
    x, w = np.array(xd.astype(mx.float32)), np.array(nw.astype(mx.float32))
    got = host_kernels.rms_norm(xd, nw, 1e-6)
    want = block_kernels.emulate_rms_norm(x, w, 1e-6, narrow)
    same = got.view(np.uint32) == want.view(np.uint32)
    assert same.all(), f"{int((~same).sum())} of {same.size} differ"
    exact = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * w
    unit = 2.0 ** -23 if dtype == mx.float32 else 2.0 ** -8
    assert np.all(np.abs(got - exact) <= (8 * 2.0 ** -23 * np.sqrt(cols) + unit) * np.abs(exact) + 1e-30)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("rows,f", [(1, 3072), (9, 1000), (3, 37)])
def test_the_swiglu_kernel_run_on_the_host_gives_its_published_order(host_kernels, rows, f, dtype):
    """blocks.cu's `swiglu` (a thread a value; what the SWIGLU form multiplies) run on the host as
    `block_kernels.swiglu` launches it: bit for bit `emulate_swiglu` (its own exp, silu rounded to the
    dtype, then the product with up), gates over the exponential's range and past its clamp (+-0, +-20,
    +-88, +-1e4), rows past a block's threads; and within the dtype's rounding of float64's
    g * sigmoid(g) * u, where the values are normal."""
    rng = np.random.default_rng(rows * f)
    narrow = lambda a: np.array(mx.array(a).astype(dtype).astype(mx.float32))  # noqa: E731
    x = rng.standard_normal((rows, 2 * f), dtype=np.float32) * 6
    x[0, :10] = [0.0, -0.0, 19.9, 20.1, -19.9, -20.1, 87.9, -88.1, 1e4, -1e4]
    xd = mx.array(x).astype(dtype)
    x = np.array(xd.astype(mx.float32))
    got = host_kernels.swiglu(xd)
    want = block_kernels.emulate_swiglu(x, narrow)
    same = got.view(np.uint32) == want.view(np.uint32)
    assert same.all(), f"{int((~same).sum())} of {same.size} differ"
    g, u = x[:, :f].astype(np.float64), x[:, f:].astype(np.float64)
    with np.errstate(over="ignore"):
        silu = g / (1 + np.exp(-g))
    exact = silu * u
    unit = 2.0 ** -23 if dtype == mx.float32 else 2.0 ** -8 if dtype == mx.bfloat16 else 2.0 ** -11
    tiny = np.finfo(np.float16 if dtype == mx.float16 else np.float32).tiny  # (bfloat16: float32's exponents)
    # where silu and the result are the dtype's normal numbers (float16's range: 6.1e-5 to 65,504)
    # (and past the clamp at g < -88 silu is g / (1 + e^88), below 1e-36 in magnitude: not g e^g)
    normal = (np.abs(silu) >= tiny) & (np.abs(exact) >= tiny) & np.isfinite(narrow(exact)) & (g >= -88)
    # silu: the exp within 2 float32 units, the division and the rounding to the dtype; then the product
    assert np.all(np.abs(got - exact)[normal] <= ((2 * unit + 6 * 2.0 ** -23) * np.abs(exact))[normal])


def test_the_exponential_is_within_two_float32_units_and_rounds_as_published():
    """`emulate_exp` (blocks.cu's mlxi_exp, which the host-compiled kernel matches bit for bit above)
    over its whole range [-20, 88], and at the ends of each reduction step: within 2 float32 units of
    e^t (a lost term of the polynomial or a wrong ln 2 split is thousands)."""
    t = np.concatenate([np.linspace(-20, 88, 400_001, dtype=np.float32),
                        ((np.arange(-29, 128) + 0.5) * np.log(2)).astype(np.float32)])
    t = t[(t >= -20) & (t <= 88)]
    ref = np.exp(t.astype(np.float64))
    got = block_kernels.emulate_exp(t)
    assert np.all(np.abs(got - ref) <= 2 * np.spacing(ref.astype(np.float32)))


def test_every_block_kernel_failing_turns_the_formed_kernels_off_for_loaded_weights_too(monkeypatch, tmp_path, capsys):
    """Every block kernel failing its self-check turns the block kernels off, and with them the norm,
    SwiGLU and formed kernels: a weight loaded before the check loses its `former` (`_formed_off`), one
    loaded after never gets one. (Stand-in verdicts on MLX's CPU: the backend told it is on a GPU.)"""
    from mlxinfer.backends import kernel_checks
    from mlxinfer.backends import mlx as mlx_mod

    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_checks, "_VERDICTS", {})
    monkeypatch.setattr(mlx_mod, "self_check_cases", lambda: [])
    monkeypatch.setattr(mlx_mod, "_check_products", lambda b: None)
    monkeypatch.setattr(mlx_mod, "_check_block_products", lambda b, kernel=None, fused=False: f"the {kernel} kernel differs")
    b = MLXBackend(device="cpu")
    b.device, b.block_kind, b.norm_kind, b.swiglu_kind, b.formed_kind = "gpu", "cuda", "cuda", "cuda", "cuda"
    raw = quants.random_blocks(np.random.default_rng(3), Q.Q4_K, 2, 256)
    early = b._to_device(Q.Q4_K, quants.split(raw, Q.Q4_K, 2, 256), (2, 256))
    assert early.former == "cuda"
    assert b.check_kernels() is None
    assert b.block_kind is b.norm_kind is b.swiglu_kind is b.formed_kind is None and b.block_fallback
    assert early.former is None
    assert b._to_device(Q.Q4_K, quants.split(raw, Q.Q4_K, 2, 256), (2, 256)).former is None
    assert "a block kernel failed its self-check" in capsys.readouterr().err


@pytest.mark.parametrize("failing", [None, "norm", "fused", "swiglu", "pair", "formed"])
def test_a_failing_norm_swiglu_kernel_or_fused_form_turns_only_itself_off(monkeypatch, tmp_path, capsys, failing):
    """The rms_norm and swiglu kernels, the block kernels' fused forms (ADD, NORM, SWIGLU) and the pair
    launch and the formed kernels each have a self-check verdict of their own (`verify_rms_norm`,
    `verify_swiglu`, `verify_fused_forms`, `verify_pair_launch`, `verify_formed_kernels`). The pair
    launch failing turns it off alone (a group's two runs a NORM launch each again); the formed kernels
    failing, they alone (a weight loaded then, or already loaded, has no `former`). The norm
    kernel failing turns it off and with it the NORM form's use (norms back on mx.fast.rms_norm, each
    apart from its product); the swiglu kernel failing turns it off and with it the SWIGLU form's use
    (MLX's silu and product, then the down product and the residual as `Backend`'s defaults); the fused
    forms failing turn them off (each norm, SwiGLU and residual add its own launch, the kernels kept);
    each says so in one line on stderr and leaves the block kernels' products on; passing, everything
    stays. (Stand-in verdicts on MLX's CPU: the backend told it is on a GPU.)"""
    from mlxinfer.backend import Backend
    from mlxinfer.backends import kernel_checks
    from mlxinfer.backends import mlx as mlx_mod

    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_checks, "_VERDICTS", {})
    monkeypatch.setattr(mlx_mod, "self_check_cases", lambda: [])
    monkeypatch.setattr(mlx_mod, "_check_products", lambda b: None)
    monkeypatch.setattr(mlx_mod, "_check_block_products", lambda b, kernel=None, fused=False: None)
    problems = {"norm": "the rms_norm kernel differs from its published order in 2 of 1024 values (1 rows of 1024, float32)",
                "fused": "the Q8_0 block kernel (of normed rows) differs from its published order in 1 of 42 values",
                "swiglu": "the swiglu kernel differs from its published order in 3 of 6000 values (1 rows of 3000, float32)",
                "pair": "the Q4_K+Q6_K pair launch differs from its products' published order in 1 of 33 values (1 rows, float32)",
                "formed": "the q6_k_values kernel's Q6_K values differ from the graph's in 1 of 51200 values (40 rows of 1280, float32)"}
    runs = []
    for name in ("norm", "fused", "swiglu", "pair", "formed"):
        verify = {"norm": "verify_rms_norm", "fused": "verify_fused_forms", "swiglu": "verify_swiglu",
                  "pair": "verify_pair_launch", "formed": "verify_formed_kernels"}[name]
        monkeypatch.setattr(mlx_mod, verify, lambda b, name=name: runs.append(name) or (problems[name] if failing == name else None))
    b = MLXBackend(device="cpu")
    b.device, b.block_kind, b.norm_kind, b.swiglu_kind, b.fused_forms = "gpu", "cuda", "cuda", "cuda", True
    b.pair_launch, b.formed_kind = True, "cuda"
    rng = np.random.default_rng(3)
    raw = quants.random_blocks(rng, Q.Q6_K, 2, 256)
    early = b._to_device(Q.Q6_K, quants.split(raw, Q.Q6_K, 2, 256), (2, 256))  # (loaded before the check)
    assert early.former == "cuda"
    # (the pair launch runs only in the fused forms' NORM path: not checked where they failed)
    assert b.check_kernels() is None and runs == ["fused", *(["pair"] if failing != "fused" else []), "formed", "norm", "swiglu"]
    err = capsys.readouterr().err.strip().splitlines()
    assert b.block_kind == "cuda" and b.norm_kind == (None if failing == "norm" else "cuda")
    assert b.swiglu_kind == (None if failing == "swiglu" else "cuda")
    assert b.fused_forms == (failing != "fused") and b.pair_launch == (failing != "pair")
    assert b.formed_kind == (None if failing == "formed" else "cuda")
    assert b._to_device(Q.Q6_K, quants.split(raw, Q.Q6_K, 2, 256), (2, 256)).former == (None if failing == "formed" else "cuda")
    assert early.former == (None if failing == "formed" else "cuda")  # (a weight loaded before: unset too)
    want = {None: [], "norm": [f"mlxinfer: warning: the rms_norm kernel failed its self-check ({problems['norm']}); norms use "
                               "mx.fast.rms_norm, each apart from the product after it"],
            "fused": [f"mlxinfer: warning: the block kernels' fused forms failed their self-check ({problems['fused']}); "
                      "each norm and residual add is a launch of its own"],
            "swiglu": [f"mlxinfer: warning: the swiglu kernel failed its self-check ({problems['swiglu']}); SwiGLU uses "
                       "MLX's own ops, apart from the down product"],
            "pair": [f"mlxinfer: warning: the pair launch failed its self-check ({problems['pair']}); a weight group's "
                     "runs of two types take a launch each"],
            "formed": [f"mlxinfer: warning: the formed kernels failed their self-check ({problems['formed']}); a prompt's "
                       "products form their scales and values by MLX's compiled ops"]}[failing]
    assert err == want
    if failing:
        assert problems[failing] in b.kernel_report()[0] and not b.kernel_report()[1]
    launched, used = [], []
    monkeypatch.setattr(block_kernels, "rms_norm", lambda *a: launched.append(a) or a[1])
    b.rms_norm(mx.ones((1, 64)), mx.ones((64,)), 1e-6)
    assert len(launched) == (0 if failing == "norm" else 1)
    monkeypatch.setattr(Backend, "linear_add", lambda *a: used.append("add"))
    monkeypatch.setattr(MLXBackend, "_block_product", lambda self, x, w, groups=None: True)

    def product(kind, x, w, per_warp=None, residual=None, norm=None, swiglu=False):
        used.append("kernel" + ("+norm" if norm else "") + ("+swiglu" if swiglu else "") + ("+add" if residual is not None else ""))
        return mx.zeros((x.shape[0], 16))

    monkeypatch.setattr(block_kernels, "product", product)
    monkeypatch.setattr(block_kernels, "swiglu", lambda kind, x: used.append("swiglu") or x[:, :8])
    from mlxinfer.backends.mlx_weights import WeightGroup

    b.linear_add(mx.ones((1, 64)), object(), mx.ones((1, 16)))
    assert used == ["add" if failing == "fused" else "kernel+add"]
    used.clear()
    b.rms_norm_linear_group(mx.ones((1, 64)), mx.ones((64,)), 1e-6, WeightGroup(object(), (8, 8)))
    assert used == ["kernel" + ("+norm" if failing in (None, "swiglu", "pair", "formed") else "")]
    used.clear()
    from mlxinfer.backends.mlx_weights import WeightRuns

    monkeypatch.setattr(block_kernels, "pair_applies", lambda kind, x, a, c: True)
    monkeypatch.setattr(block_kernels, "pair_product", lambda kind, x, a, c, norm=None: used.append("pair") or mx.zeros((1, 32)))
    b.rms_norm_linear_group(mx.ones((1, 64)), mx.ones((64,)), 1e-6, WeightRuns((WeightGroup(object(), (8, 8)),) * 2))
    assert used == {None: ["pair"], "swiglu": ["pair"], "formed": ["pair"],
                    "pair": ["kernel+norm", "kernel+norm"]}.get(failing, ["kernel", "kernel"])
    used.clear()
    down = types.SimpleNamespace(shape=(16, 8))  # (a down weight small enough for the SWIGLU form)
    b.swiglu_ffn(mx.ones((1, 64)), mx.ones((64,)), 1e-6, WeightGroup(object(), (8, 8)), down)
    assert used == {None: ["kernel+norm", "kernel+swiglu+add"], "norm": ["kernel", "kernel+swiglu+add"],
                    "fused": ["kernel", "swiglu", "add"], "swiglu": ["kernel+norm", "kernel+add"],
                    "pair": ["kernel+norm", "kernel+swiglu+add"], "formed": ["kernel+norm", "kernel+swiglu+add"]}[failing]


@pytest.mark.parametrize("kernel", ["graph", "cuda"])
def test_a_forced_attention_kernel_still_checks_the_block_kernels(monkeypatch, tmp_path, capsys, kernel):
    """--kernel forces attention's kernels (or MLX's graph) without their self-check, as asked; the
    block kernels, their fused forms, the pair launch, the formed kernels and the norm and swiglu kernels
    still get theirs before any runs (a
    failing one turned off, in one line). (MLX made to report a CUDA GPU; stand-in verdicts.)"""
    from mlxinfer.backends import kernel_checks
    from mlxinfer.backends import mlx as mlx_mod

    monkeypatch.setenv("MLXINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_checks, "_VERDICTS", {})
    monkeypatch.setattr(mx, "device_info", lambda device=None: {"compute_capability_major": 9})
    monkeypatch.setattr(mlx_mod, "gpu_kind", lambda: "cuda")
    monkeypatch.setattr(MLXBackend, "activate", lambda self: None)
    runs = []
    monkeypatch.setattr(mlx_mod, "verify_block_kernels", lambda b, name=None: runs.append("blocks") or None)
    monkeypatch.setattr(mlx_mod, "verify_fused_forms", lambda b: runs.append("fused") or None)
    monkeypatch.setattr(mlx_mod, "verify_pair_launch", lambda b: runs.append("pair") or None)
    monkeypatch.setattr(mlx_mod, "verify_formed_kernels", lambda b: runs.append("formed") or None)
    monkeypatch.setattr(mlx_mod, "verify_rms_norm", lambda b: runs.append("norm") or None)
    monkeypatch.setattr(mlx_mod, "verify_swiglu", lambda b: runs.append("swiglu") or "the swiglu kernel differs")
    monkeypatch.setattr(mlx_mod, "verify_gpu_kernels", lambda b: runs.append("attention") or None)
    b = MLXBackend(device="gpu", kernel=kernel, verify=mlx_mod.verify_gpu_kernels)
    assert "attention" not in runs and runs[-5:] == ["fused", "pair", "formed", "norm", "swiglu"]
    assert runs.count("blocks") == len(block_kernels.kernel_names())
    assert b.block_kind == "cuda" and b.swiglu_kind is None and b.swiglu_fallback == "the swiglu kernel differs"
    assert "the swiglu kernel failed its self-check" in capsys.readouterr().err


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_norms_swiglu_and_residuals_join_the_products_bit_for_bit(synthetic, monkeypatch, dtype):
    """On the GPU's own kernels: a Q8_0 Qwen3's logits for a 4-token prompt (block kernel rows) and a
    decode step with the norms, SwiGLU and the residual adds inside the products' launches equal, bit for
    bit, those with each op apart (the fused forms off: the rms_norm kernel, the products, the swiglu
    kernel, MLX's Add), and those with SwiGLU apart from the down product as a large one takes it."""
    import mlxinfer

    path = synthetic(arch="qwen3", n_layers=2, qtype="Q8_0", hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                     head_dim=64)

    forms, real = [], block_kernels.product

    def product(kind, x, w, per_warp=None, residual=None, norm=None, swiglu=False):
        forms.append((residual is not None, norm is not None, swiglu))
        return real(kind, x, w, per_warp, residual, norm, swiglu)

    monkeypatch.setattr(block_kernels, "product", product)

    def run(fused):
        eng = mlxinfer.load(path, backend="mlx", device="gpu", dtype=dtype)
        assert eng.backend.norm_kind and eng.backend.block_kind and eng.backend.swiglu_kind and eng.backend.fused_forms
        eng.backend.fused_forms = fused
        forms.clear()
        out = eng.logits([1, 5, 9, 2]), eng.generate([1, 5, 9, 2], max_tokens=4).token_ids
        return out, set(forms)

    fused, fused_forms = run(True)
    assert fused_forms >= {(True, False, False), (False, True, False), (True, False, True)}  # every form ran
    apart, apart_forms = run(False)
    assert apart_forms == {(False, False, False)}
    assert np.array_equal(np.asarray(fused[0]).view(np.uint32), np.asarray(apart[0]).view(np.uint32))
    assert fused[1] == apart[1]
    monkeypatch.setattr(block_kernels, "SWIGLU_FUSED_MAX_VALUES", 0)  # a large down weight's way: SwiGLU apart
    large, large_forms = run(True)
    assert (True, False, True) not in large_forms and (False, True, False) in large_forms
    assert np.array_equal(np.asarray(large[0]).view(np.uint32), np.asarray(apart[0]).view(np.uint32))
    assert large[1] == apart[1]


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_mixed_type_groups_join_the_products_bit_for_bit(synthetic, monkeypatch, dtype):
    """On the GPU's own kernels: a Q4_K_M Qwen3 (random blocks; layer 1's V in Q6_K, its Q/K/V two runs)
    gives the same logits and greedy tokens with the pair launch (both runs, NORM form, one launch), with
    the fused forms a launch a run, and with the ops apart."""
    import mlxinfer
    from mlxinfer.backends.mlx_weights import WeightRuns

    path = synthetic(arch="qwen3", n_layers=2, qtype="Q4_K_M", hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                     head_dim=64, random_blocks=True)

    normed, real, real_pair = set(), block_kernels.product, block_kernels.pair_product

    def product(kind, x, w, per_warp=None, residual=None, norm=None, swiglu=False):
        if norm is not None:
            normed.add(w.qtype.name)
        return real(kind, x, w, per_warp, residual, norm, swiglu)

    def pair_product(kind, x, a, b, norm=None):
        normed.add(f"{a.qtype.name}+{b.qtype.name}")
        return real_pair(kind, x, a, b, norm)

    def run(fused, pair):
        eng = mlxinfer.load(path, backend="mlx", device="gpu", dtype=dtype)
        assert isinstance(eng.model.w.layers[1].attn_qkv, WeightRuns) and eng.backend.fused_forms
        assert eng.backend.pair_launch, eng.backend.pair_fallback
        eng.backend.fused_forms, eng.backend.pair_launch = fused, pair
        normed.clear()
        return eng.logits([1, 5, 9, 2]), eng.generate([1, 5, 9, 2], max_tokens=4).token_ids

    monkeypatch.setattr(block_kernels, "product", product)
    monkeypatch.setattr(block_kernels, "pair_product", pair_product)
    paired = run(True, True)
    assert normed == {"Q4_K", "Q4_K+Q6_K"}  # layer 0's Q/K/V and both layers' gate/up; layer 1's pair
    fused = run(True, False)
    assert normed == {"Q4_K", "Q6_K"}  # each run's NORM form ran (the Q6_K V's too)
    apart = run(False, False)
    assert not normed
    for got in (paired, fused):
        assert np.array_equal(np.asarray(got[0]).view(np.uint32), np.asarray(apart[0]).view(np.uint32))
        assert got[1] == apart[1]


def test_bad_launches_are_one_line_errors():
    """A product of more rows than a launch takes (or none), a norm of no rows or of a 1-D x, a norm
    weight of another length, an x whose columns are not the weight's (or, for the SWIGLU form, twice
    them), SWIGLU with NORM, and a SwiGLU of an odd width or no rows are one-line ValueErrors before
    anything is launched."""
    _, parts = _fields(np.random.default_rng(0), 8, 256, False, Q.Q8_0)
    w = to_device(Q.Q8_0, parts, (8, 256))
    for rows in (0, block_kernels.MAX_ROWS + 1):
        with pytest.raises(ValueError, match=f"1..{block_kernels.MAX_ROWS} rows of x, got {rows}"):
            block_kernels.product("cuda", mx.zeros((rows, 256)), w)
    with pytest.raises(ValueError, match="norm's weight must be"):
        block_kernels.product("cuda", mx.zeros((1, 256)), w, norm=(mx.zeros((128,)), 1e-6))
    for x in (mx.zeros((0, 64)), mx.zeros((64,))):
        with pytest.raises(ValueError, match="rms_norm takes"):
            block_kernels.rms_norm("cuda", x, mx.zeros((64,)), 1e-6)
    with pytest.raises(ValueError, match=r"x must be \[rows, 512\] for a product by \[8, 256\] of its SwiGLU"):
        block_kernels.product("cuda", mx.zeros((1, 256)), w, swiglu=True)
    with pytest.raises(ValueError, match=r"x must be \[rows, 256\] for a product by \[8, 256\], got \[1, 512\]"):
        block_kernels.product("cuda", mx.zeros((1, 512)), w)
    with pytest.raises(ValueError, match="SWIGLU and NORM forms of a product do not combine"):
        block_kernels.product("cuda", mx.zeros((1, 512)), w, norm=(mx.zeros((256,)), 1e-6), swiglu=True)
    for x in (mx.zeros((1, 63)), mx.zeros((0, 64)), mx.zeros((64,))):
        with pytest.raises(ValueError, match="swiglu takes"):
            block_kernels.swiglu("cuda", x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", ["swiglu", "rms_norm"])
def test_the_swiglu_and_norm_self_checks_are_bit_for_bit(monkeypatch, dtype, kernel):
    """`verify_swiglu` and `verify_rms_norm` pass a kernel that writes its emulation's bits and name one
    that is a unit in the last place off in one value, with the rows, size and dtype. (Stand-in kernels
    on MLX's CPU.)"""
    from mlxinfer.backends.mlx import verify_rms_norm, verify_swiglu

    off = {"by": 0}
    f32 = lambda a: np.array(a.astype(mx.float32))  # noqa: E731

    def finish(out, dtype_):
        out.view(np.uint32)[0, 100] += off["by"] << (16 if dtype == "bfloat16" else 0)
        return mx.array(out).astype(dtype_)

    def swiglu(kind, x):
        narrow = lambda a: np.array(mx.array(a).astype(x.dtype).astype(mx.float32))  # noqa: E731
        return finish(block_kernels.emulate_swiglu(f32(x), narrow), x.dtype)

    def rms_norm(kind, x, w, eps):
        narrow = lambda a: np.array(mx.array(a).astype(x.dtype).astype(mx.float32))  # noqa: E731
        return finish(block_kernels.emulate_rms_norm(f32(x), f32(w), eps, narrow), x.dtype)

    monkeypatch.setattr(block_kernels, kernel, swiglu if kernel == "swiglu" else rms_norm)
    b = MLXBackend(device="cpu", dtype=dtype)
    b.swiglu_kind = b.norm_kind = "cuda"
    verify = verify_swiglu if kernel == "swiglu" else verify_rms_norm
    assert verify(b) is None
    off["by"] = 1
    size = "1 of 3000 values (1 rows of 3000" if kernel == "swiglu" else "1 of 1024 values (1 rows of 1024"
    assert verify(b) == f"the {kernel} kernel differs from its published order in {size}, {dtype})"


def test_a_pair_launch_is_what_mlx_custom_kernels_take(monkeypatch):
    """`pair_product`'s arguments (against a recorder): x, the norm's weight (x itself, unread, without
    NORM), the first run's affine fields then the Q6_K run's as `kernel_fields` makes them, dims [Na, K,
    1, eps bits, forms, Nb], the first type's template constants, a block for every 8 rows of each run (a
    run's last block its own), one [M, Na + Nb] output in x's dtype. A pair it does not take (the second
    not Q6_K, the first not Q4_K / Q5_K, rows of other lengths, a product wide enough for more rows a
    warp, more rows of x than a launch takes) is a one-line ValueError."""
    calls = []

    def launch(**kw):
        calls.append(kw)
        return [mx.zeros(kw["output_shapes"][0], dtype=kw["output_dtypes"][0])]

    monkeypatch.setattr(block_kernels, "_kernel", lambda kind, name, blocks=1: calls.append((name, blocks)) or launch)
    rng = np.random.default_rng(4)
    a = to_device(Q.Q5_K, _fields(rng, 20, 512, False, Q.Q5_K)[1], (20, 512))
    b = to_device(Q.Q6_K, _fields(rng, 9, 512, False, Q.Q6_K)[1], (9, 512))
    x = mx.zeros((2, 512), dtype=mx.bfloat16)
    nw = mx.ones((512,), dtype=mx.bfloat16)
    out = block_kernels.pair_product("cuda", x, a, b, norm=(nw, 1e-6))
    (name, blocks), kw = calls
    assert name == block_kernels.PAIR and blocks == 2 and out.shape == (2, 29) and out.dtype == mx.bfloat16
    ins = kw["inputs"]
    assert len(ins) == len(block_kernels.INPUTS[name]) and ins[0] is x and ins[1] is nw
    fields = [*block_kernels.kernel_fields(a), *block_kernels.kernel_fields(b)]
    assert all(np.array_equal(np.array(f), np.array(g)) and f.dtype == g.dtype for f, g in zip(ins[2:-1], fields, strict=True))
    assert ins[-1].tolist() == [20, 512, 1, int(block_kernels.f32_bits(1e-6)), 2, 9]
    assert kw["template"] == [("T", mx.bfloat16), ("M", 2), *block_kernels.KERNELS[Q.Q5_K][1]]
    assert kw["grid"][0] * kw["grid"][1] == 32 * block_kernels.WARPS * (3 + 2) and kw["output_shapes"] == [(2, 29)]
    calls.clear()
    block_kernels.pair_product("cuda", x, a, b)
    assert calls[1]["inputs"][1] is x and calls[1]["inputs"][-1].tolist()[3:5] == [0, 0]
    q8 = to_device(Q.Q8_0, _fields(rng, 20, 512, False, Q.Q8_0)[1], (20, 512))
    short = to_device(Q.Q6_K, _fields(rng, 9, 256, False, Q.Q6_K)[1], (9, 256))
    wide = types.SimpleNamespace(qtype=Q.Q4_K, shape=(16384, 512), float_scales=False)
    for x_, first, second in ((x, a, a), (x, q8, b), (x, a, short), (x, wide, b), (mx.zeros((9, 512)), a, b),
                              (mx.zeros((1, 1024)), a, b), (mx.zeros((1, 256)), a, b), (mx.zeros((0, 512)), a, b),
                              (x, mx.zeros((20, 512)), b)):
        with pytest.raises(ValueError, match="^no pair launch multiplies x .* the second Q6_K, one row a warp") as e:
            block_kernels.pair_product("cuda", x_, first, second)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_pair_self_check_is_bit_for_bit(monkeypatch, dtype):
    """`verify_pair_launch` passes a pair launch that writes its two products' emulated bits side by side
    and names one that is a unit in the last place off in one value of the second run, or that writes the
    runs in the other order, with the types, the rows and the dtype. (Stand-in kernels on MLX's CPU.)"""
    from mlxinfer.backends.mlx import verify_pair_launch

    bug = {"kind": None, "seen": []}
    f32 = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
    real, made = block_kernels.terms, {}

    def terms_seen(raw, qtype, rows, cols):  # each run's weight as the check expects its kernel to multiply it
        made[qtype, rows] = real(raw, qtype, rows, cols)
        return made[qtype, rows]

    monkeypatch.setattr(block_kernels, "terms", terms_seen)

    def pair(kind, x, a, b, norm=None):
        narrow = lambda v: np.array(mx.array(v).astype(x.dtype).astype(mx.float32))  # noqa: E731
        xs = f32(x) if norm is None else block_kernels.emulate_rms_norm(f32(x), f32(norm[0]), norm[1], narrow)
        runs = [narrow(block_kernels.emulate(xs, made[w.qtype, w.shape[0]], w.qtype)) for w in (a, b)]
        if bug["kind"] == "swapped":
            runs = runs[::-1]
        out = np.concatenate(runs, axis=1)
        bug["seen"].append((x.shape[0], norm is not None))
        if bug["kind"] == (x.shape[0], norm is not None):  # one ulp off in one value of that launch only
            out.view(np.uint32)[0, -1] += 1 << (16 if dtype == "bfloat16" else 0)
        return mx.array(out).astype(x.dtype)

    monkeypatch.setattr(block_kernels, "pair_product", pair)
    b = MLXBackend(device="cpu", dtype=dtype)
    b.block_kind = "cuda"
    assert verify_pair_launch(b) is None
    launches = sorted(set(bug["seen"]))
    assert launches == [(1, False), (1, True), (block_kernels.MAX_ROWS, False), (block_kernels.MAX_ROWS, True)]
    for rows, normed in launches:
        bug["kind"] = (rows, normed)
        assert verify_pair_launch(b) == (f"the Q4_K+Q6_K pair launch{' (of normed rows)' if normed else ''} differs "
                                         f"from its products' published order in 1 of {33 * rows} values ({rows} rows, {dtype})")
    bug["kind"] = "swapped"
    assert verify_pair_launch(b).startswith(f"the Q4_K+Q6_K pair launch differs from its products' published order in ")


def test_a_warp_takes_fewer_rows_of_a_narrow_product(monkeypatch):
    """A product's launch keeps at least MIN_BLOCKS_A_LAUNCH blocks where it can: 4 rows a warp from 16,353
    output rows (the 8B shape's gate|up and every head), 2 from 8,177, 1 for narrower ones (the 8B shape's
    QKV, attention output and down products, and the 0.6B shape's but its head); Metal's simdgroups always
    one."""
    assert [block_kernels.default_per_warp("cuda", n) for n in (512, 1024, 4096, 6144, 8192, 16000, 16384, 24576, 151936)] == \
        [1, 1, 1, 1, 2, 2, 4, 4, 4]
    for n in (8192, 16384, 24576):
        r = block_kernels.default_per_warp("cuda", n)
        assert -(-n // (r * block_kernels.WARPS)) >= block_kernels.MIN_BLOCKS_A_LAUNCH
    assert {block_kernels.default_per_warp("metal", n) for n in (1024, 151936)} == {1}
    seen = []
    x, w = mx.zeros((1, 256)), to_device(Q.Q8_0, quants.split(quants.random_blocks(np.random.default_rng(0), Q.Q8_0, 8192, 256),
                                                              Q.Q8_0, 8192, 256), (8192, 256))
    monkeypatch.setattr(block_kernels, "_kernel", lambda kind, name, blocks=1: lambda **kw: seen.append(kw) or [mx.zeros((1, 8192))])
    block_kernels.product("cuda", x, w)
    assert np.array(seen[0]["inputs"][-1])[2] == 2 and seen[0]["grid"][0] * seen[0]["grid"][1] == 8192 // 2 // 8 * 256


def _cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, stack frame bytes: spilled registers) of a one-kernel cubin, from its ELF's
    .nv.info section: EIATTR_REGCOUNT (0x2f) and EIATTR_FRAME_SIZE (0x11) entries, each [symbol, value]."""
    import struct

    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    size, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * size) for i in range(count)]
    strings = headers[names][4]
    info = next(cubin[h[4]:h[4] + h[5]] for h in headers
                if cubin[strings + h[0]:cubin.index(b"\0", strings + h[0])] == b".nv.info")
    regs, frame, i = 0, None, 0
    while i + 4 <= len(info):
        fmt, attr, n = info[i], info[i + 1], struct.unpack_from("<H", info, i + 2)[0]
        if fmt == 0x04:  # (EIFMT_SVAL: n bytes follow)
            if attr == 0x2F:
                regs = max(regs, struct.unpack_from("<I", info, i + 8)[0])
            elif attr == 0x11:
                frame = max(frame or 0, struct.unpack_from("<I", info, i + 8)[0])
            i += 4 + n
        else:
            i += 4
    assert frame is not None, "the cubin's .nv.info has no EIATTR_FRAME_SIZE entry"
    return regs, frame


def test_the_decode_forms_fit_their_launch_bounds():
    """The forms `min_blocks` bounds compile (NVRTC for sm_90, as MLX's JIT compiles them: the source
    `cuda_jit` names) within their registers: one row of x of the kernels in FEW_REGISTERS for 3 blocks of
    256 threads an SM (at most 80 a thread; float32 and bfloat16 x), of Q6_K's (TWO_BLOCKS) and MAX_ROWS
    rows for 2 (128), spilling at
    most a few values set once (a stack frame of at most 16 bytes at one row, 32 at MAX_ROWS; IQ4's 16 are
    its codebook); a kernel without a bound keeps the compiler's choice, more than 80 (without
    `__launch_bounds__`, the bounded forms would too: 96 at one row)."""
    from mlxinfer import cuda_jit

    lib, include = cuda_jit.find_nvrtc(), cuda_jit.find_include()
    if lib is None or include is None:
        pytest.skip("needs NVRTC and the CUDA headers (pip install 'nvidia-cuda-nvrtc>=13' 'nvidia-cuda-runtime>=13')")
    rng = np.random.default_rng(0)

    def resources(qtype, rows, dtype=mx.bfloat16):
        w = to_device(qtype, quants.split(quants.random_blocks(rng, qtype, 8, 256), qtype, 8, 256), (8, 256), dtype=dtype)
        with cuda_jit.collecting() as jobs:
            block_kernels.product("cuda", mx.zeros((rows, 256), dtype=dtype), w)
        (_, kernel, source), = jobs
        regs, frame = _cubin_resources(cuda_jit.compile_cubin(lib, source, f"mlx::core::cu::{kernel}", "sm_90a", include)[0])
        assert regs > 0, kernel
        return regs, frame

    assert {block_kernels.KERNELS[t][0] for t in (Q.Q4_K, Q.Q8_0, Q.IQ4_XS)} == block_kernels.FEW_REGISTERS
    assert block_kernels.TWO_BLOCKS == {"q6_k_matvec"}
    for qtype in (Q.Q4_K, Q.Q8_0, Q.Q6_K, Q.IQ4_XS):
        name = block_kernels.KERNELS[qtype][0]
        one = 3 if name in block_kernels.FEW_REGISTERS else 2
        assert block_kernels.min_blocks(name, 1) == one and block_kernels.min_blocks(name, block_kernels.MAX_ROWS) == 2
        for rows, dtype, most, spilled in ((1, mx.float32, 65536 // (256 * one) // 8 * 8, 16),
                                           (1, mx.bfloat16, 65536 // (256 * one) // 8 * 8, 16),
                                           (block_kernels.MAX_ROWS, mx.bfloat16, 128, 32)):
            regs, frame = resources(qtype, rows, dtype)
            assert regs <= most and frame <= spilled, f"{qtype.name}, {rows} rows, {dtype}: {regs} registers, {frame} bytes"
    assert block_kernels.min_blocks("q3_k_matvec", 1) == 1 and resources(Q.Q3_K, 1)[0] > 80
    # the pair launch (one row a warp) as the affine kernel's: 3 blocks at one row of x, 2 at MAX_ROWS
    for first in block_kernels.PAIR_FIRST:
        for rows, dtype, most in ((1, mx.float32, 80), (1, mx.bfloat16, 80), (block_kernels.MAX_ROWS, mx.bfloat16, 128)):
            assert block_kernels.min_blocks(block_kernels.PAIR, rows) == (3 if rows == 1 else 2)
            w = lambda t: to_device(t, quants.split(quants.random_blocks(rng, t, 8, 256), t, 8, 256), (8, 256), dtype=dtype)  # noqa: E731
            with cuda_jit.collecting() as jobs:
                block_kernels.pair_product("cuda", mx.zeros((rows, 256), dtype=dtype), w(first), w(Q.Q6_K))
            (_, kernel, source), = jobs
            regs, frame = _cubin_resources(cuda_jit.compile_cubin(lib, source, f"mlx::core::cu::{kernel}", "sm_90a", include)[0])
            assert 0 < regs <= most and frame <= 16, f"pair {first.name}, {rows} rows, {dtype}: {regs} registers, {frame} bytes"
    # no bound at all, not one of 1 block an SM, which lets NVRTC take up to 255 (Q3_K's 8 rows: 218)
    assert resources(Q.Q3_K, block_kernels.MAX_ROWS)[0] <= 176


@pytest.mark.parametrize("limit,fused", [(float("inf"), True), (512 * 256, True), (512 * 256 - 1, False)])
def test_a_down_product_takes_swiglu_inside_it_up_to_a_size(monkeypatch, limit, fused):
    """A decode row's FFN on the block kernels: SwiGLU inside the down product's launch (the SWIGLU form,
    with ADD) where the down weight has at most `block_kernels.SWIGLU_FUSED_MAX_VALUES` weights,
    else the `swiglu` kernel, then the down product with ADD: one launch more, the same bits (each form's
    bits: the GPU self-checks and test_gpu_norms_swiglu_and_residuals_join_the_products_bit_for_bit).
    (Stand-in kernels on MLX's CPU, the backend told it is on a GPU: the launches made, in order.)"""
    from mlxinfer.backends.mlx_weights import WeightGroup

    launched = []
    monkeypatch.setattr(block_kernels, "SWIGLU_FUSED_MAX_VALUES", limit)
    monkeypatch.setattr(block_kernels, "product", lambda kind, x, w, per_warp=None, residual=None, norm=None, swiglu=False:
                        launched.append(("product", norm is not None, residual is not None, swiglu))
                        or mx.zeros((x.shape[0], w.shape[0]), x.dtype))
    monkeypatch.setattr(block_kernels, "swiglu", lambda kind, x: launched.append(("swiglu",))
                        or mx.zeros((x.shape[0], x.shape[1] // 2), x.dtype))
    b = MLXBackend(device="cpu")
    b.device, b.block_kind, b.norm_kind, b.swiglu_kind, b.fused_forms = "gpu", "cuda", "cuda", "cuda", True
    b.weight_dtype = b.dtype
    rng = np.random.default_rng(5)

    def weight(n, k):
        raw = quants.random_blocks(rng, Q.Q8_0, n, k)
        return to_device(Q.Q8_0, quants.split(raw, Q.Q8_0, n, k), (n, k))

    gate_up = WeightGroup(weight(1024, 256), (512, 512))
    x = mx.array(rng.standard_normal((1, 256)).astype(np.float32))
    b.swiglu_ffn(x, mx.ones((256,)), 1e-6, gate_up, weight(256, 512))
    down = [("product", False, True, True)] if fused else [("swiglu",), ("product", False, True, False)]
    assert launched == [("product", True, False, False)] + down
