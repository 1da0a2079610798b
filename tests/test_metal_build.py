"""The Metal kernels as MLX would build them, checked here without Apple hardware: every launch the MLX
backend makes on Metal, for every self-check plan (which are the plans it runs), recorded with its
operands and launch configuration; the source MLX 0.32 would compile for it (`kernels.metal_kernel_source`:
our header, the [[kernel]] signature MLX generates, each operand `constant` below 8 elements, the body)
parsed by clang against tests/metal_stub.h (no error-severity diagnostic allowed) and measured against
Apple's limits: threadgroup memory <= 32 KB, threads a threadgroup <= 1,024 and the kernel's own count."""

from dataclasses import dataclass

import numpy as np
import pytest

import mlx.core as mx
from mlxinfer import kernels
from mlxinfer.backends.mlx import MLXBackend, case_applies, check_case_inputs, self_check_cases

from . import metal_clang

needs_clang = pytest.mark.skipif(not metal_clang.available(), reason="needs libclang (pip install libclang: the test extra)")


@dataclass(frozen=True)
class Launch:
    name: str
    inputs: tuple  # (dtype name, elements) of each input
    outputs: tuple  # dtype name of each output
    grid: tuple
    threadgroup: tuple
    template: tuple = ()  # int template arguments (qk_norm_rope's)


def record_launches(monkeypatch, cases, types=(("float32", None),)) -> set[Launch]:
    """Every Metal kernel launch the MLX backend makes for the cases (fused override and per-head
    reference) in each of `types` ((--dtype, --kv-dtype): q in the one, K and V in the other, its default
    the dtype), each kernel answered with zeros of its output shapes (nothing runs)."""
    launches = set()

    def kernel(kind, name):
        assert kind == "metal"

        def launch(inputs, grid, threadgroup, output_shapes, output_dtypes, template=None):
            assert template is None or all(isinstance(v, int) for _, v in template), template  # MLX's int arguments
            ins = tuple((str(x.dtype).rsplit(".", 1)[-1], x.size) for x in inputs)
            outs = tuple(str(d).rsplit(".", 1)[-1] for d in output_dtypes)
            launches.add(Launch(name, ins, outs, tuple(grid), tuple(threadgroup), tuple(template or ())))
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

        return launch

    monkeypatch.setattr(kernels, "_kernel", kernel)
    for dtype, kv_dtype in types:
        b = MLXBackend(device="cpu", dtype=dtype, kv_dtype=kv_dtype)
        b.gpu_kernels = b.kernel = "metal"  # as on a Mac whose self-check passed
        for case in filter(lambda c: case_applies(b, c), cases):
            q, view, batch = check_case_inputs(b, case)
            mx.eval(b.fused_attention_override(q, view, batch, case.spec), b.per_head_attention(q, view, batch, case.spec))
        if kv_dtype is None:  # Qwen3's norms and RoPE: a decode row (positions `constant`) and a prefill chunk
            for rows, heads, kv, dim in ((1, 16, 8, 128), (9, 8, 2, 64), (2, 4, 2, 256)):
                q, k = mx.zeros((rows, heads * dim), dtype=b.dtype), mx.zeros((rows, kv * dim), dtype=b.dtype)
                w = mx.ones((dim,), dtype=b.dtype)
                mx.eval(*b.qk_norm_rope(q, k, w, w, mx.arange(rows), heads, kv, dim, 1e-6, 1e6, False))
    return launches


def _variants(launches) -> dict[tuple, str]:
    """{(name, inputs): source} of each distinct generated kernel (MLX compiles one per address-space
    pattern), and for each kernel its all-`device` and all-`constant` forms too."""
    out = {}
    templates = {}
    for la in launches:
        out[(la.name, la.inputs, la.outputs)] = kernels.metal_kernel_source(la.name, la.inputs, la.outputs,
                                                                            la.template)
        templates[la.name] = la.template
    for name in kernels.kernel_source("metal")[1]:
        inputs, _ = kernels._INPUTS[name]
        for size in (1, 1 << 20):
            ins = tuple(("int32" if n in ("dims", "row_slot", "row_pos", "row_len") else "float32", size) for n in inputs)
            out[(name, ins, None)] = kernels.metal_kernel_source(name, ins, template=templates.get(name))
    return out


@pytest.fixture(scope="module")
def launches():
    mp = pytest.MonkeyPatch()
    try:
        yield record_launches(mp, self_check_cases(), (("float32", None), ("bfloat16", None), ("float16", None),
                                                       ("float32", "q8_0"), ("bfloat16", "q8_0")))
    finally:
        mp.undo()


def test_every_metal_kernel_is_launched_by_the_self_check_plans(launches):
    """The recording reaches every Metal kernel; the products and the softmax also with float operands of
    fewer than 8 elements (`constant`: a decode row over 1 or 7 keys), the fused kernel with row arrays
    of fewer (`constant`) and of more (`device`)."""
    assert {la.name for la in launches} == set(kernels.kernel_source("metal")[1])

    def sizes(name, kinds):
        return {s for la in launches if la.name == name for (d, s) in la.inputs if d in kinds}

    assert min(sizes("matmul", {"float32"})) < kernels.METAL_CONSTANT_BELOW
    assert min(sizes("softmax", {"float32"})) < kernels.METAL_CONSTANT_BELOW
    rows = sizes("fused_attention", {"int32"}) - {7}  # (dims: 7 values, always constant)
    assert min(rows) < kernels.METAL_CONSTANT_BELOW <= max(rows)
    # the fused kernel reads q, K and V in each dtype (--dtype), K and V also a q8_0 cache's int8 rows
    # (--kv-dtype); the products and softmax take float32
    assert {la.inputs[0][0] for la in launches if la.name == "fused_attention"} == {"float32", "bfloat16", "float16"}
    assert {la.inputs[1][0] for la in launches if la.name == "fused_attention"} == {"float32", "bfloat16", "float16", "int8"}
    assert {d for la in launches if la.name in ("matmul", "softmax") for d, _ in la.inputs[:2]} <= {"float32", "int32"}
    # the fused kernel writes its result in q's dtype (the activations'), its scores' scratch in float32
    assert all(la.outputs == (la.inputs[0][0], "float32") for la in launches if la.name == "fused_attention")
    assert {la.outputs[0] for la in launches if la.name == "fused_attention"} == {"float32", "bfloat16", "float16"}
    # qk_norm_rope reads and writes the activations' type (q, k and their weights), its positions
    # `constant` for a decode row and `device` for a chunk, its shape as template arguments
    qk = [la for la in launches if la.name == "qk_norm_rope"]
    assert {la.inputs[0][0] for la in qk} == {"float32", "bfloat16", "float16"}
    assert all(len({d for d, _ in la.inputs[:4]} | set(la.outputs)) == 1 for la in qk)
    assert min(la.inputs[4][1] for la in qk) < kernels.METAL_CONSTANT_BELOW <= max(la.inputs[4][1] for la in qk)
    assert {dict(la.template)["D"] for la in qk} == {64, 128, 256}


def test_metal_launches_fit_apples_threads(launches):
    """Each launch: a threadgroup of exactly the kernel's MLXI_THREADS (its loops and its 8-simdgroup
    reductions assume that many), within Apple's 1,024; a grid within 32 bits a dimension."""
    header, _ = kernels.kernel_source("metal")
    assert f"#define MLXI_THREADS {kernels.THREADS}\n" in header and kernels.THREADS % 32 == 0
    for la in launches:
        assert la.threadgroup == (kernels.THREADS, 1, 1), la
        assert np.prod(la.threadgroup) <= metal_clang.TG_THREADS
        assert all(0 < g < 1 << 32 for g in la.grid), la
        assert la.grid[0] % la.threadgroup[0] == 0, la  # whole threadgroups: every reduction sees all its threads


@needs_clang
def test_metal_kernels_compile_with_clang_and_fit_apples_threadgroup_memory(launches):
    """Each generated kernel parses without an error against the Metal stand-in (an undeclared name, a
    `constant` pointer where `device` is declared, a wrong argument count: all errors), and the
    threadgroup arrays it declares (clang's sizes) fit the 32,768 bytes of an Apple GPU threadgroup."""
    import clang.cindex as ci

    memory = {}
    for (name, inputs, _), source in _variants(launches).items():
        tu = metal_clang.parse(source)
        errs = metal_clang.errors(tu)
        assert not errs, f"{name} {inputs}:\n" + "\n".join(errs[:5])
        arrays = metal_clang.threadgroup_arrays(tu)
        memory[name] = sum(arrays.values())
        assert memory[name] <= metal_clang.TG_BYTES, f"{name}: {arrays} = {memory[name]} bytes of threadgroup memory"
        for c in tu.cursor.walk_preorder():  # floats are divided only by precise::divide (the contract's)
            if c.kind == ci.CursorKind.BINARY_OPERATOR and c.location.file and c.location.file.name == "kernel.metal":
                toks = [t.spelling for t in c.get_tokens()]
                if "/" in toks and c.type.spelling.endswith("float"):
                    pytest.fail(f"{name}: a float divided by '/' at line {c.location.line}: {' '.join(toks)}")
    assert memory == {"matmul": 0, "softmax": 32, "fused_attention": 32 + 4 * 32 * 128, "tanh": 0, "qk_norm_rope": 0}, memory


@needs_clang
@pytest.mark.parametrize("bug", ["undeclared", "constant_to_device"])
def test_the_clang_check_bites(bug):
    """The check sees what a Metal compiler would refuse: a name nobody declares, and a `constant`
    operand handed to a `device` parameter."""
    ins = (("float32", 3), ("float32", 3), ("int32", 5))
    source = kernels.metal_kernel_source("matmul", ins)
    if bug == "undeclared":
        source = source.replace("if (lane == 0) out[w] = s;", "if (lane == 0) out[w] = s + bias;")
        want = "undeclared identifier 'bias'"
    else:
        source = source.replace("template <typename A, typename B>\ninline float mlxi_dot(A a, long sa, B b,",
                                "inline float mlxi_dot(device const float* a, long sa, device const float* b,")
        want = "no matching function for call to 'mlxi_dot'"
    assert not metal_clang.errors(metal_clang.parse(kernels.metal_kernel_source("matmul", ins)))
    errs = metal_clang.errors(metal_clang.parse(source))
    assert any(want in e for e in errs), errs
