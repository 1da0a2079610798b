"""mlxinfer's published GPU summation order: its numpy emulation is checked here on any machine; on a
CUDA (or Metal) GPU the kernels are checked against the emulation bit for bit."""

import os

import re
from dataclasses import replace

import numpy as np
import pytest

from mlxinfer import kernels
from mlxinfer.backend import AttentionSpec, softcap_inverse
from mlxinfer.backends import make_backend
from mlxinfer.batch import Batch

GPU = None
try:
    from mlxinfer.backends.mlx import gpu_kind

    GPU = gpu_kind()
except ImportError:
    pass
needs_gpu = pytest.mark.skipif(GPU is None, reason="needs an MLX GPU (Metal or CUDA); this machine has none")


def test_kernel_sources_hold_every_kernel():
    split = {"attn_scores", "attn_softmax_context", "attn_short", "attn_softmax", "attn_context", "attn_context_rows",
             "attn_scores_rows"}
    assert set(kernels.QK_NORM_ROPE_KINDS) == {"cuda", "metal"}
    for kind in ("cuda", "metal"):
        header, bodies = kernels.kernel_source(kind)
        mma = {"mma_matmul", "mma_softmax", "mma_attention"} if kind in kernels.MMA_KINDS else set()
        assert set(bodies) == ({"matmul", "softmax", "fused_attention", "tanh", "qk_norm_rope"}
                               | (split if kind in kernels.SPLIT_KINDS else set()) | mma)
        assert "mlxi_dot" in header and "mlxi_softmax" in header


def test_kernel_arguments_stay_out_of_mlxs_small_host_pool():
    """A kernel's int32 arguments are at least `batch.MIN_INDEX_ENTRIES` entries (MLX keeps arrays of up
    to 8 bytes in host memory the GPU reads across the bus), zero-padded after the values: the attention
    kernels' `kernel_args` and the block kernels' norm and SwiGLU launches, which use it too."""
    import mlx.core as mx

    from mlxinfer import block_kernels
    from mlxinfer.batch import MIN_INDEX_ENTRIES

    assert kernels.kernel_args(7).tolist() == [7] + [0] * (MIN_INDEX_ENTRIES - 1)
    assert kernels.kernel_args(1, 2, 3, 4, 5, 6).tolist() == [1, 2, 3, 4, 5, 6]
    seen = []

    def record(kind, name):
        def launch(**kw):
            seen.append(kw["inputs"][-1])
            return [mx.zeros(kw["output_shapes"][0], kw["output_dtypes"][0])]
        return launch

    real = block_kernels._kernel
    block_kernels._kernel = record
    try:
        block_kernels.swiglu("cuda", mx.zeros((3, 64)))
        block_kernels.rms_norm("cuda", mx.zeros((3, 64)), mx.zeros((64,)), 1e-6)
    finally:
        block_kernels._kernel = real
    assert [d.tolist()[:2] for d in seen] == [[3, 32], [3, 64]] and all(d.size >= MIN_INDEX_ENTRIES for d in seen)


def test_cuda_kernels_go_to_mlx_without_comments_and_with_only_the_header_they_use():
    """MLX hashes a CUDA custom kernel's whole source on every launch, so each kernel is handed its body
    and the header definitions it reaches (transitively), no comments; the defines always. Metal's go as
    written. (That the cut sources compile: test_cuda_sources_compile_with_nvrtc.)"""
    full_header, bodies = kernels.kernel_source("cuda")
    for name in bodies:
        header, body = kernels.kernel_parts("cuda", name)
        assert "//" not in header + body and "\n\n" not in header + body
        assert header.startswith("#define MLXI_THREADS 256\n#define MLXI_WARPS 8\n")
        assert kernels.strip_comments(bodies[name]) == body
    header, _ = kernels.kernel_parts("cuda", "qk_norm_rope")  # the conversions and mlxi_warp_total alone
    assert set(re.findall(r"mlxi_\w+(?=\()", header)) == {"mlxi_f", "mlxi_in", "mlxi_put", "mlxi_warp_total"}
    header, _ = kernels.kernel_parts("cuda", "attn_softmax_context")  # a chain: mlxi_block_total -> warp_total
    used = set(re.findall(r"mlxi_\w+(?=\()", header))
    assert {"mlxi_block_total", "mlxi_warp_total", "mlxi_block_max"} <= used and "mlxi_context_tile" not in used
    assert kernels.kernel_parts("metal", "fused_attention") == (kernels.kernel_source("metal")[0],
                                                               kernels.kernel_source("metal")[1]["fused_attention"])
    assert kernels.strip_comments("a;  // x\n\n  // y\n#pragma unroll\nb; // z\n") == "a;\n#pragma unroll\nb;\n"


def test_qk_norm_rope_kernel_serves_rotate_half_heads_of_whole_lane_pairs():
    """The qk_norm_rope kernel keeps each rotated pair (d, d + head_dim/2) in one lane (d = lane + 32i): head
    dims that are multiples of 64 up to MAX_HEAD_DIM, rotate-half only; the rest take mx.fast's path."""
    assert all(kernels.qk_norm_rope_fits(d, False) for d in (64, 128, 192, 256))
    assert not any(kernels.qk_norm_rope_fits(d, False) for d in (32, 80, 96, 160, 320))
    assert not kernels.qk_norm_rope_fits(128, True)


def test_the_kernels_by_rows_join_partials_in_the_butterflys_order():
    """attn_scores_rows and attn_context_rows add the 32 lane partials (chain totals) in one thread:
    lanes taken in mlxi_chain_at's order (read from the CUDA source), each joining a stack of pending
    sums (lvl[b] + x at each 1 bit of k, x waits at the lowest 0 bit). That must give the butterfly's
    bits (lane 0 of s += shfl_xor(s, off), off = 16..1) for any partials, so the GPU can check the
    kernels bit for bit against the others; on any machine, this checks the order itself."""
    import re
    from importlib import resources

    src = resources.files("metal_kernels").joinpath("attention.cu").read_text(encoding="utf-8")
    expr = re.search(r"mlxi_chain_at\(int k\) \{\s*return (.*?);", src, re.S).group(1)
    order = [eval(expr, {}, {"k": k}) for k in range(32)]  # noqa: S307 (our own source's expression)
    assert sorted(order) == list(range(32))
    rng = np.random.default_rng(3)
    mags = np.float32(10.0) ** rng.uniform(-6, 6, (4000, 32)).astype(np.float32)
    parts = (mags * rng.choice([-1, 1], (4000, 32))).astype(np.float32)
    parts[rng.random((4000, 32)) < 0.05] = 0.0
    parts[rng.random((4000, 32)) < 0.02] = -0.0
    lvl = [None] * 5
    for k in range(32):
        x = parts[:, order[k]]
        for b in range(5):
            if (k >> b) & 1:
                x = (lvl[b] + x).astype(np.float32)
            else:
                lvl[b] = x
                break
    want = kernels._butterfly(parts, (16, 8, 4, 2, 1))
    assert np.array_equal(x.view(np.uint32), want.view(np.uint32))
    # the order is visible: lanes in plain order give other bits on some of these
    seq = parts[:, 0]
    for lane in range(1, 32):
        seq = (seq + parts[:, lane]).astype(np.float32)
    assert not np.array_equal(seq.view(np.uint32), want.view(np.uint32))


def test_published_dot_is_a_dot_product_in_its_own_order():
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((5, 200)) * 10).astype(np.float32)
    b = (rng.standard_normal((7, 200)) * 10).astype(np.float32)
    got = kernels.published_dot(a, b)
    np.testing.assert_allclose(got, a.astype(np.float64) @ b.T.astype(np.float64), rtol=1e-5, atol=1e-3)
    # a sequential float32 sum rounds differently on some of these outputs: the order is visible
    seq = np.zeros((5, 7), np.float32)
    for k in range(200):
        seq = (seq + a[:, None, k] * b[None, :, k]).astype(np.float32)
    assert not np.array_equal(got, seq)
    # the lane-strided order: a change in lane 3's terms only moves lane 3's partial
    assert kernels.published_dot(np.ones((1, 33), np.float32), np.ones((1, 33), np.float32))[0, 0] == 33


def test_published_softmax_total_order():
    e = np.random.default_rng(1).random(5000).astype(np.float32)
    total = kernels.published_softmax_total(e)
    assert abs(float(total) - float(e.astype(np.float64).sum())) < 1e-3
    assert total != np.float32(np.cumsum(e, dtype=np.float32)[-1])  # not a sequential sum


def test_emulation_follows_the_published_order_step_by_step():
    """The order written out in the kernels' header, one float32 addition at a time: lane l sums the
    products k = l, l+32, ...; lanes combine by the xor butterfly 16, 8, 4, 2, 1 (softmax: 256 thread
    partials, a butterfly in each warp of 32, then over the 8 warp totals 4, 2, 1). Pins the emulation
    (and so the kernels checked against it) to that order, not merely to a correct sum; the inputs are
    chosen so that the other butterfly orders give other bits."""

    def butterfly(lanes, offsets):
        lanes = np.asarray(lanes, np.float32)
        for off in offsets:
            lanes = np.array([np.float32(lanes[i] + lanes[i ^ off]) for i in range(len(lanes))], np.float32)
        return lanes[0]

    rng = np.random.default_rng(5)
    a = (rng.standard_normal((3, 300)) * 10).astype(np.float32)
    b = (rng.standard_normal((4, 300)) * 10).astype(np.float32)
    got = kernels.published_dot(a, b)
    reversed_order = []
    for i in range(3):
        for j in range(4):
            lanes = np.zeros(32, np.float32)
            for k in range(300):
                lanes[k % 32] = np.float32(lanes[k % 32] + np.float32(a[i, k] * b[j, k]))
            assert got[i, j] == butterfly(lanes, (16, 8, 4, 2, 1)), (i, j)
            reversed_order.append(got[i, j] != butterfly(lanes, (1, 2, 4, 8, 16)))
    assert any(reversed_order)
    k = np.arange(3000)  # warp w's threads hold values ~10^(w-3): the warp totals differ in magnitude
    e = (np.random.default_rng(0).random(3000) * 10.0 ** ((k % 256) // 32 - 3)).astype(np.float32)
    threads = np.zeros(256, np.float32)
    for i in range(e.size):
        threads[i % 256] = np.float32(threads[i % 256] + e[i])
    warps = [butterfly(threads[w * 32:(w + 1) * 32], (16, 8, 4, 2, 1)) for w in range(8)]
    total = kernels.published_softmax_total(e)
    assert total == butterfly(warps, (4, 2, 1)) != butterfly(warps, (1, 2, 4))
    assert total != butterfly([butterfly(threads[w * 32:(w + 1) * 32], (1, 2, 4, 8, 16)) for w in range(8)], (4, 2, 1))


@needs_gpu
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 37, 128), (5, 300, 64), (17, 33, 48), (3, 4100, 128), (64, 64, 4097),
                                   (2, 300000, 32)])  # the last one needs the kernel's 2-D grid
def test_gpu_matmul_kernel_follows_the_published_order(m, n, k):
    import mlx.core as mx

    rng = np.random.default_rng(m * n + k)
    a = (rng.standard_normal((m, k)) * 7).astype(np.float32)
    bt = (rng.standard_normal((n, k)) * 7).astype(np.float32)
    got = np.array(kernels.matmul(GPU, mx.array(a)[None], mx.array(bt)[None])[0])
    assert np.array_equal(got.view(np.uint32), kernels.published_dot(a, bt).view(np.uint32))


@needs_gpu
@pytest.mark.parametrize("n", [1, 7, 255, 256, 257, 1000, 4097, 9000])
def test_gpu_softmax_kernel(n):
    import mlx.core as mx

    x = (np.random.default_rng(n).standard_normal((3, n)) * 5).astype(np.float32)
    got = np.array(kernels.softmax(GPU, mx.array(x)))
    e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(1, keepdims=True), rtol=2e-6, atol=1e-9)
    assert np.all(np.isfinite(got))


def test_launch_plan_rule():
    """Which passes take the split kernels (`kernels.uses_split`): decode of up to 64 sequences of 16 heads
    over any cache, prefill chunks while their scratch fits; never on Metal (no split kernels there); and
    which of the split plan's forms."""
    from mlxinfer.backend import AttentionSpec

    spec = AttentionSpec.standard(16, 8, 128)
    assert kernels.uses_split("cuda", 1, spec, 40960)
    assert kernels.uses_split("cuda", 64, spec, 40960) and not kernels.uses_split("cuda", 65, spec, 40960)
    assert kernels.uses_split("cuda", 511, spec, 768) and kernels.uses_split("cuda", 512, spec, 4096)
    assert not kernels.uses_split("cuda", 512, spec, 4097)
    assert not kernels.uses_split("metal", 1, spec, 512)
    # the split plan's form: two launches for one row over any cache, or while rows x capacity <= 2^14
    assert kernels.uses_two_launches(1, 40960) and kernels.uses_two_launches(8, 2048)
    assert not kernels.uses_two_launches(8, 2049) and not kernels.uses_two_launches(2, 8193)
    assert not kernels.uses_two_launches(511, 768)  # prefill chunks: three launches
    # ... and the two-launch form in one (attn_short) for up to 8 rows over up to 256 keys (a preallocated
    # store's first step), where the group's scores fit a block's 32 KiB (32 heads a KV head)
    assert kernels.uses_short(1, spec, 1) and kernels.uses_short(8, spec, 256)
    assert not kernels.uses_short(9, spec, 256) and not kernels.uses_short(1, spec, 257)
    assert kernels.uses_short(1, AttentionSpec.standard(256, 8, 128), 256)
    assert not kernels.uses_short(1, AttentionSpec.standard(264, 8, 128), 256)


INT_INPUTS = {"row_slot", "row_pos", "row_len", "dims", "tiles"}
SPLIT_TEMPLATE = {"H": 16, "KV": 8, "D": 128, "CAUSAL": "true", "WINDOW": 0, "SCALE_BITS": 1035273459, "SOFTCAP_BITS": 0,
                  "SOFTCAP_INV_BITS": 0}
TEMPLATED = {"attn_scores", "attn_softmax_context", "attn_short", "attn_context", "attn_context_rows", "attn_scores_rows", "qk_norm_rope"}  # the kernels kernels.split_attention passes `template` to
STUB = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
struct Shape { int v[8]; __device__ long operator[](int i) const { return v[i]; } };
#define INFINITY __int_as_float(0x7f800000)
typedef signed char int8_t;  // (MLX's device/utils.cuh brings libcu++'s)
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
"""
CUDA_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half", "int8": "int8_t"}  # MLX's dtype_to_cuda_type
ATTENTION_INPUTS = {"q": "QT", "k": "KVT", "v": "KVT"}  # read in the activations' / the KV cache's dtype


def _cuda_include():
    """A directory with cuda_bf16.h and cuda_fp16.h (MLX's JIT includes them before our header): the CUDA
    runtime wheel's or a CUDA toolkit's, or None."""
    import glob

    try:
        import nvidia

        roots = [os.path.join(r, "cuda_runtime", "include") for r in nvidia.__path__]
    except ImportError:
        roots = []
    for root in roots + sorted(glob.glob("/usr/local/cuda*/include")):
        if os.path.exists(os.path.join(root, "cuda_bf16.h")):
            return root
    return None


def _nvrtc():
    """libnvrtc through ctypes (the nvidia-cuda-nvrtc wheel, Linux x86-64: `cuda_jit.find_nvrtc`), or None."""
    from mlxinfer import cuda_jit

    return cuda_jit.find_nvrtc()


def _cuda_kernel_source(name: str, body: str, header: str, extra: tuple = (), types=("float32", "float32")) -> str:
    """The source MLX's cuda_kernel compiles for a body: our header, then a __global__ function with
    each input (and its `_shape` where the body uses it), each output, the template constants (and
    `extra` ones: (name, value) pairs). types: the dtypes of q and of k, v (kernels.input_types)."""
    inputs, outputs = kernels._INPUTS[name]
    ctypes_ = {"QT": CUDA_TYPES[types[0]], "KVT": CUDA_TYPES[types[1]]}
    params = []
    for i in inputs:
        kind = "int" if i in INT_INPUTS else "float"
        if name == "qk_norm_rope" and i not in INT_INPUTS:  # (q, k, their weights and outputs: one type)
            kind = ctypes_["QT"]
        elif i in ATTENTION_INPUTS:
            kind = ctypes_[ATTENTION_INPUTS[i]]
        params.append(f"const {kind}* {i}")
        if f"{i}_shape" in body:
            params.append(f"const __grid_constant__ Shape {i}_shape")
    params += [f"{ctypes_['QT'] if name == 'qk_norm_rope' else 'float'}* {o}" for o in outputs]
    consts = "".join(f"  constexpr {'bool' if v == 'true' else 'int'} {k} = {v};\n" for k, v in SPLIT_TEMPLATE.items()
                     if name in TEMPLATED) + "".join(f"  constexpr int {k} = {v};\n" for k, v in extra)
    if {"q", "k", "v"} & set(inputs) and name != "qk_norm_rope":
        consts += "".join(f"  using {t} = {c};\n" for t, c in ctypes_.items())
    return f"{STUB}{header}\n__global__ void k_{name}({', '.join(params)}) {{\n{consts}{body}\n}}\n"


def _nvrtc_and_headers():
    """(libnvrtc, the include folder of cuda_bf16.h and cuda_fp16.h), or skip the test saying what is missing."""
    lib = _nvrtc()
    if lib is None:
        pytest.skip("needs NVRTC (pip install 'nvidia-cuda-nvrtc>=13'; Linux x86-64)")
    include = _cuda_include()
    if include is None:
        pytest.skip("needs cuda_bf16.h and cuda_fp16.h (pip install 'nvidia-cuda-runtime>=13', or a CUDA toolkit)")
    return lib, include


def _nvrtc_compile(lib, name: str, source: str, opts) -> tuple[int, str]:
    """Compile one kernel source with NVRTC: (its result code, its log)."""
    import ctypes

    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None) == 0
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


def test_cuda_sources_compile_with_nvrtc(monkeypatch):
    """Every CUDA kernel body compiles (NVRTC, sm_90, no GPU needed), as MLX's cuda_kernel would build it:
    a typo in metal_kernels/attention.cu fails here, on any Linux x86-64 machine, not first on a GPU."""
    lib, include = _nvrtc_and_headers()
    _, names = kernels.kernel_source("cuda")
    parts = {name: kernels.kernel_parts("cuda", name) for name in names}  # what MLX is handed: no comments, ...
    bodies = {name: body for name, (_, body) in parts.items()}  # ... each header cut to what its body reaches
    opts = [b"--gpu-architecture=compute_90", b"-default-device", b"--std=c++17", f"-I{include}".encode()]
    mma = {"mma_matmul", "mma_softmax", "mma_attention"}  # (built below, as the tensor-core GPU's code)
    builds = [(name, body, ()) for name, body in bodies.items()
              if name not in {"attn_softmax_context", "attn_short", "attn_context_rows", "qk_norm_rope"} | mma]
    forms = [(("NHB", nhb), ("UR", ur)) for nhb in (1, 2) for ur in (1, 2, 4, 8)]
    assert tuple(kernels.CONTEXT_ROWS_FORM) in forms
    builds += [("attn_context_rows", bodies["attn_context_rows"], f) for f in forms]
    unrollings = {tuple(kernels.split_unroll(rows, cap)) for rows in range(1, 1025) for cap in (1, 1 << 20)}  # all used
    builds += [("attn_softmax_context", bodies["attn_softmax_context"], u) for u in sorted(unrollings)]
    builds += [("attn_softmax_context", bodies["attn_softmax_context"], form) for form in kernels.ONE_ROW_FORMS]
    short = (("SK", kernels.SHORT_MAX_KEYS),)
    builds += [("attn_short", bodies["attn_short"], tuple(kernels.split_unroll(rows, cap)) + short)  # the forms it takes
               for rows, cap in sorted({(min(r, 2), c) for r in range(1, kernels.SHORT_MAX_ROWS + 1)
                                        for c in (1, kernels.SHORT_MAX_KEYS)})]
    builds += [("qk_norm_rope", bodies["qk_norm_rope"], (("EPS_BITS", kernels.f32_bits(1e-6)), ("LOG2_BASE_BITS", bits)))
               for bits in (kernels.f32_bits(19.93), 1 << 30)]
    assert {n for n, _, _ in builds} | mma == set(bodies)
    for name, body, extra in builds:
        rc, log = _nvrtc_compile(lib, name, _cuda_kernel_source(name, body, parts[name][0], extra), opts)
        assert rc == 0, f"{name}: {log}"
    for t in ("bfloat16", "float16"):  # qk_norm_rope in each --dtype: q, k, weights and outputs of that type
        src = _cuda_kernel_source("qk_norm_rope", bodies["qk_norm_rope"], parts["qk_norm_rope"][0], builds[-1][2], (t, t))
        rc, log = _nvrtc_compile(lib, "qk_norm_rope", src, opts)
        assert rc == 0, f"qk_norm_rope {t}: {log}"
    # the attention kernels read q, K and V in bfloat16 and float16 too (--dtype, --kv-dtype), and K and V
    # from a q8_0 cache's int8 rows: each kernel's form in use, with both 16-bit types, q in bfloat16 over
    # a float32 cache, and q in float32 and bfloat16 over a q8_0 cache
    forms = {"attn_context_rows": tuple(kernels.CONTEXT_ROWS_FORM), "attn_softmax_context": kernels.ONE_ROW_FORM,
             "attn_short": kernels.ONE_ROW_FORM + short}
    for name in sorted(set(bodies) - {"matmul", "softmax", "attn_softmax", "qk_norm_rope"} - mma):
        for types in (("bfloat16", "bfloat16"), ("float16", "float16"), ("bfloat16", "float32"), ("float32", "int8"),
                      ("bfloat16", "int8")):
            src = _cuda_kernel_source(name, bodies[name], parts[name][0], tuple(forms.get(name, ())), types)
            rc, log = _nvrtc_compile(lib, name, src, opts)
            assert rc == 0, f"{name} {types}: {log}"
    # the score kernels with a soft-cap (Gemma 2's 50; its bits as kernels.split_attention passes them)
    monkeypatch.setitem(SPLIT_TEMPLATE, "SOFTCAP_BITS", kernels.f32_bits(50.0))
    monkeypatch.setitem(SPLIT_TEMPLATE, "SOFTCAP_INV_BITS", kernels.f32_bits(softcap_inverse(50.0)))
    for name in ("attn_scores", "attn_scores_rows", "attn_short"):
        src = _cuda_kernel_source(name, bodies[name], parts[name][0], tuple(forms.get(name, ())))
        rc, log = _nvrtc_compile(lib, name, src, opts)
        assert rc == 0, f"{name}, soft-capped: {log}"


MMA_TYPES = {"a": "float", "bt": "uint16_t", "x": "float", "q": "uint16_t", "k": "uint16_t", "v": "uint16_t", "pos": "int",
             "scales": "float", "dims": "int"}  # the tensor-core kernels' inputs (kernels.mma_*: 16-bit bits)


def test_tensor_core_kernels_build_for_sm_90():
    """The tensor-core kernels compiled by NVRTC to sm_90 machine code, not only to PTX, so that ptxas reads
    their inline mma.sync instructions (a wrong operand count or type fails here), for both 16-bit types
    and every head size the path takes up to 256 (each a register array of its own size)."""
    lib, include = _nvrtc_and_headers()
    opts = [b"--gpu-architecture=sm_90", b"-default-device", b"--std=c++17", f"-I{include}".encode()]
    for name in ("mma_matmul", "mma_softmax", "mma_attention"):
        header, body = kernels.kernel_parts("cuda", name)
        inputs, outputs = kernels._INPUTS[name]
        params = ", ".join([f"const {MMA_TYPES[i]}* {i}" for i in inputs] + [f"float* {o}" for o in outputs])
        for bf in ("true", "false"):
            for d in ((16, 64, 80, 128, 256) if name == "mma_attention" else (0,)):
                consts = f"  constexpr bool BF = {bf};\n" + (f"  constexpr int D = {d};\n" if d else "")
                src = f"{STUB}{header}\n__global__ void k_{name}({params}) {{\n{consts}{body}\n}}\n"
                rc, log = _nvrtc_compile(lib, name, src, opts)
                assert rc == 0, f"{name} BF={bf} D={d}: {log}"


HOST_STUBS = {  # what the kernels' K/V reader and scores need of CUDA and of Metal, for this CPU's C++ compiler
    "cuda": """#include <cmath>
#include <cstdint>
#include <cstring>
#define __device__
#define __forceinline__ inline
struct __half { unsigned short x; };
struct __nv_bfloat16 { unsigned short x; };
inline __half __ushort_as_half(unsigned short x) { return {x}; }
inline float __half2float(__half h) { _Float16 f; std::memcpy(&f, &h.x, 2); return (float)f; }
inline float __bfloat162float(__nv_bfloat16 b) { uint32_t u = (uint32_t)b.x << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float __fmul_rn(float a, float b) { return a * b; }
""",
    "metal": """#include <cmath>
#include <cstdint>
#include <cstring>
#define device
typedef _Float16 float16_t;
typedef unsigned short ushort;
template <typename T, typename U> T as_type(U x) { static_assert(sizeof(T) == sizeof(U), ""); T t; std::memcpy(&t, &x, sizeof t); return t; }
namespace metal { namespace precise { inline float tanh(float x) { return ::tanhf(x); } } }
"""}


def _host_library(kind: str, names, code: str, tmp_path):
    """The header definitions `names` of the `kind` kernel source, as they stand there, and `code` (extern
    "C" functions calling them), compiled for this CPU with g++ (HOST_STUBS standing in for the GPU's
    intrinsics; no contraction into fma), loaded through ctypes; skips without a C++ compiler."""
    import ctypes
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler (g++) for this CPU")
    header, _ = kernels.kernel_source(kind)
    units = [text for name, text in kernels._header_units(kernels.strip_comments(header)) if name in names]
    src = HOST_STUBS[kind] + "\n".join(units) + "\n" + code
    path = tmp_path / f"{kind}.so"
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-x", "c++", "-",
                            "-o", str(path)], input=src, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return ctypes.CDLL(str(path)), len(units)


@pytest.mark.parametrize("kind", ["cuda", "metal"])
def test_the_kernels_read_a_q8_0_cache_as_the_graph_does(kind, tmp_path):
    """A q8_0 cache's packed rows (values q as int8, then each block's float16 scale d) read by the
    kernels' own reader, `mlxi_kv` as it stands in the header of attention.cu / attention.metal, compiled
    for this CPU (g++; stand-ins for CUDA's and Metal's half-float intrinsics): every value of every row
    is d * q with the bits of `dequantize_q8_0`'s, which the per-head reference and the graph override
    read. Blocks of magnitudes 1e-6 to 1e4 (float16 scales from subnormal to large), negative values,
    all-zero blocks, rows of 5 blocks. (On a GPU the kernels' attention over such caches is checked
    against the reference: tests/test_mlx_backend.py, the self-check.)"""
    import ctypes

    import mlx.core as mx
    from mlxinfer.backends.mlx_kv import dequantize_q8_0, packed_width, quantize_q8_0

    lib, units = _host_library(kind, ("mlxi_f", "mlxi_kv"), """
extern "C" void read_store(const int8_t* s, long rows, long w, float* out) {
  for (long r = 0; r < rows; ++r)
    for (long c = 0; c < w; ++c) out[r * w + c] = mlxi_kv(s, r, c, w);
}
""", tmp_path)
    assert units == (5 if kind == "cuda" else 2), "the reader's definitions in the header"
    rng = np.random.default_rng(11)
    rows, w = 7, 160
    mags = 10.0 ** rng.uniform(-6, 4, (rows, w // 32, 1))
    x = (rng.standard_normal((rows, w // 32, 32)) * mags).astype(np.float32).reshape(rows, w)
    x[2, 32:64] = 0.0  # an all-zero block: d = 0, q = 0
    packed = np.array(quantize_q8_0(mx.array(x)))
    assert packed.dtype == np.int8 and packed.shape == (rows, packed_width(w)) and (packed[:, :w] < 0).any()
    store = np.concatenate([packed.reshape(-1), np.zeros(64, np.int8)])  # (room past the last row)
    out = np.zeros((rows, w), np.float32)
    lib.read_store(store.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(rows), ctypes.c_long(w),
                   out.ctypes.data_as(ctypes.c_void_p))
    want = np.array(dequantize_q8_0(mx.array(packed)))
    same = out.view(np.uint32) == want.view(np.uint32)
    assert same.all(), f"{int((~same).sum())} of {same.size} values differ, first at {np.argwhere(~same)[0]}"


@pytest.mark.parametrize("kind", ["cuda", "metal"])
def test_the_kernels_score_and_soft_cap_in_the_reference_order(kind, tmp_path):
    """The kernels' scores (`mlxi_score`, as it stands in the header of attention.cu / attention.metal,
    compiled for this CPU) against the per-head reference's steps 4 on the same dot products: scale(dot,
    scale), then with a soft-cap scale(tanh(scale(s, 1/cap)), cap), each product rounded to float32, 1/cap
    softcap_inverse's; tanh here is this CPU's tanhf on both sides (on a GPU the reference takes the
    kernels' own: kernels.tanh). Caps of 0 (none), 0.5, 2, 50 (Gemma 2's) and 60 over dot products of
    magnitudes 1e-3 to 1e4; the cap taken before the scale, or tanh of s * cap, give other bits."""
    import ctypes
    import ctypes.util

    lib, _ = _host_library(kind, ("mlxi_tanh", "mlxi_score"), """
extern "C" void scores(const float* dot, long n, float sc, float cap, float inv, float* out) {
  for (long i = 0; i < n; ++i) out[i] = mlxi_score(dot[i], sc, cap, inv);
}
""", tmp_path)
    tanhf = ctypes.CDLL(ctypes.util.find_library("m")).tanhf
    tanhf.restype, tanhf.argtypes = ctypes.c_float, [ctypes.c_float]
    rng = np.random.default_rng(4)
    dot = (rng.standard_normal(3000) * 10.0 ** rng.uniform(-3, 4, 3000)).astype(np.float32)
    sc = np.float32(AttentionSpec.standard(1, 1, 128).scale)
    f = ctypes.c_float
    for cap in (0.0, 0.5, 2.0, 50.0, 60.0):
        inv = np.float32(softcap_inverse(cap)) if cap else np.float32(0)
        out = np.zeros_like(dot)
        lib.scores(dot.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(dot.size), f(sc), f(cap), f(inv),
                   out.ctypes.data_as(ctypes.c_void_p))
        s = (dot * sc).astype(np.float32)  # 4. scale after the product
        if cap:  # soft-capping: scale(tanh(scale(s, 1/cap)), cap)
            t = np.array([tanhf(float(v)) for v in (s * inv).astype(np.float32)], np.float32)
            s = (t * np.float32(cap)).astype(np.float32)
        same = out.view(np.uint32) == s.view(np.uint32)
        assert same.all(), f"cap {cap}: {int((~same).sum())} of {same.size} scores differ, first at {np.argmax(~same)}"


@pytest.mark.parametrize("heads", [(16, 8, 128), (32, 8, 128), (32, 4, 128), (14, 2, 64), (8, 8, 256), (9, 3, 64)])
def test_one_row_forms_keep_their_values_in_registers(heads, monkeypatch):
    """One row's attn_softmax_context forms hold up to 2 x 32 values and their scores per thread in
    flight (kernels.ONE_ROW_FORM, ONE_ROW_LONG_FORM): at the shapes of the models here (Qwen3 0.6B to
    14B, SmolLM2, a 256-wide head) ptxas fits them in registers, no spills to local memory, which would
    undo the point (NVRTC to sm_90 with ptxas' report; no GPU needed)."""
    lib = _nvrtc()
    if lib is None:
        pytest.skip("needs NVRTC (pip install 'nvidia-cuda-nvrtc>=13'; Linux x86-64)")
    h, kv, d = heads
    monkeypatch.setitem(SPLIT_TEMPLATE, "H", h)
    monkeypatch.setitem(SPLIT_TEMPLATE, "KV", kv)
    monkeypatch.setitem(SPLIT_TEMPLATE, "D", d)
    include = _cuda_include()
    if include is None:
        pytest.skip("needs cuda_bf16.h and cuda_fp16.h (pip install 'nvidia-cuda-runtime>=13', or a CUDA toolkit)")
    header, body = kernels.kernel_parts("cuda", "attn_softmax_context")
    opts = [b"--gpu-architecture=sm_90", b"-default-device", b"--std=c++17", b"--ptxas-options=-v", f"-I{include}".encode()]
    for form in (kernels.ONE_ROW_FORM, kernels.ONE_ROW_LONG_FORM):
        src = _cuda_kernel_source("attn_softmax_context", body, header, tuple(form))
        rc, log = _nvrtc_compile(lib, "attn_softmax_context", src, opts)
        assert rc == 0, log
        assert "0 bytes spill stores, 0 bytes spill loads" in log, (form, log[-400:])


def _recorded_launches(monkeypatch) -> list:
    """[(kernel name, its inputs, its template as a dict)] of every kernel launched from here on, each
    answered with zeros of its output shapes (nothing runs)."""
    import mlx.core as mx

    seen = []

    def kernel(kind, name):
        def launch(inputs, grid, threadgroup, output_shapes, output_dtypes, template=None):
            seen.append((name, inputs, dict(template or [])))
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]
        return launch

    monkeypatch.setattr(kernels, "_kernel", kernel)
    return seen


def test_soft_capped_passes_reach_the_kernels_with_their_cap(monkeypatch):
    """Soft-capping (Gemma 2) is in the kernels: the split plans carry the cap's and its float32 inverse's
    bits as template arguments (0 without one: another compiled kernel), the one-launch kernel both
    beside its scale; the MLX backend sends such passes to the kernels (and may compile their decode
    step), and on a GPU its tanh primitive is the kernels' own (kernels.tanh)."""
    import mlx.core as mx

    seen = _recorded_launches(monkeypatch)
    q = mx.zeros((3, 4 * 64))
    k = v = mx.zeros((2, 40, 2 * 64))
    rows = [mx.array([0, 1, 1], dtype=mx.int32), mx.array([5, 0, 1], dtype=mx.int32), mx.array([6, 2, 2], dtype=mx.int32)]
    plain = AttentionSpec.standard(4, 2, 64)
    for spec in (plain, replace(plain, softcap=50.0)):
        cap, inv = (50.0, softcap_inverse(50.0)) if spec.softcap else (0.0, 0.0)
        seen.clear()
        kernels.fused_attention("cuda", q, k, v, *rows, spec, split=False)
        for two, by_rows, short in ((True, False, False), (False, True, False), (True, False, True)):
            kernels.split_attention("cuda", q, k, v, *rows, spec, two_launches=two, by_rows=by_rows, seq_rows=[(0, 1), (1, 3)],
                                    short=short)
        (fused,) = [inputs for name, inputs, _ in seen if name == "fused_attention"]
        assert np.array(fused[6]).tolist() == [np.float32(spec.scale), np.float32(cap), np.float32(inv)]
        scores = [t for name, _, t in seen if name in ("attn_scores", "attn_scores_rows", "attn_short")]
        assert len(scores) == 3 and all((t["SOFTCAP_BITS"], t["SOFTCAP_INV_BITS"]) == (kernels.f32_bits(cap), kernels.f32_bits(inv))
                                        for t in scores)
    assert inv == float(np.float32(1) / np.float32(50)) != 0.02
    mlx = make_backend("mlx", device="cpu")
    mlx.kernel = "cuda"  # pretend: the dispatch rule only
    spec = replace(plain, softcap=50.0)
    assert not mlx._pass_needs_graph(Batch(mlx, [0], [5], [1]), spec) and mlx.compiles_pass(Batch(mlx, [0], [5], [1]), spec)
    mlx.gpu_kernels = "cuda"
    seen.clear()
    mlx.tanh(mx.zeros((3, 5)))
    assert [name for name, _, _ in seen] == ["tanh"]
    mlx.tanh(mx.zeros((3, 5), dtype=mx.bfloat16))  # (16-bit values: MLX's own)
    assert len(seen) == 1


@pytest.mark.parametrize("dtype,kv_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
                                            ("bfloat16", "float32")])
def test_cuda_attention_kernels_are_named_by_their_input_types(monkeypatch, dtype, kv_dtype):
    """MLX's CUDA custom kernel names (and caches) a compiled kernel by its name and template arguments, not
    by its inputs' dtypes: every attention launch on CUDA carries q's and K/V's dtypes as template arguments
    (QT, KVT), so a bfloat16 pass never runs the float32 build; the kernels that write the result carry its
    type too (OT, q's by default), the scores and softmax kernels (float32 outputs) none, so one build of
    them serves every result type. Every launch plan, recorded (nothing runs)."""
    import mlx.core as mx

    seen = _recorded_launches(monkeypatch)
    spec = AttentionSpec.standard(4, 2, 64)
    q = mx.zeros((3, 4 * 64), dtype=getattr(mx, dtype))
    k = v = mx.zeros((2, 40, 2 * 64), dtype=getattr(mx, kv_dtype))
    rows = [mx.array([0, 1, 1], dtype=mx.int32), mx.array([5, 0, 1], dtype=mx.int32), mx.array([6, 2, 2], dtype=mx.int32)]
    kernels.fused_attention("cuda", q, k, v, *rows, spec, split=False)
    for two, by_rows, short in ((True, False, False), (False, False, False), (False, True, False), (True, False, True)):
        kernels.split_attention("cuda", q, k, v, *rows, spec, two_launches=two, by_rows=by_rows, seq_rows=[(0, 1), (1, 3)],
                                short=short)
    reading = {n for n, _, _ in seen} - {"attn_softmax"}  # (attn_softmax reads float32 scores only)
    assert reading == {"fused_attention", "attn_scores", "attn_softmax_context", "attn_short", "attn_context",
                       "attn_scores_rows", "attn_context_rows"}
    for name, _, template in seen:
        if name in reading:
            assert (template["QT"], template["KVT"]) == (getattr(mx, dtype), getattr(mx, kv_dtype)), name
        writing = name in ("fused_attention", "attn_softmax_context", "attn_short", "attn_context", "attn_context_rows")
        assert template.get("OT") == (getattr(mx, dtype) if writing else None), name
