"""`cuda_jit`: our CUDA kernels compiled into MLX's own kernel cache, under the names MLX looks for.

No GPU here: what can be checked is checked on this CPU. The hash MLX names a module with is libstdc++'s
(checked against g++'s), the source is the one MLX 0.32's build_kernel generates (its parameters and
constants, read from MLX's custom_kernel.cpp), the files land where MLX's read_cached_ptx reads them,
NVRTC compiles the sources for an H200 (sm_90a) where the nvidia-cuda-nvrtc wheel is installed, and the
self-check's collecting pass finds every form the check then launches. That MLX then loads them is
seen on a GPU only (docs/performance.md)."""

import os
import shutil
import subprocess
import threading

import numpy as np
import pytest

import mlx.core as mx
from mlxinfer import block_kernels, cuda_jit, kernels
from mlxinfer.backends import mlx as mlx_backend
from mlxinfer.backends.mlx import MLXBackend, case_applies, self_check_cases


@pytest.fixture(autouse=True)
def _fresh_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mlx-cache"))  # (headers as files land there)
    device = mx.default_device()  # (a CPU backend made here makes the CPU MLX's default: not for later tests)
    kernels._kernel.cache_clear()
    block_kernels._kernel.cache_clear()
    yield
    kernels._kernel.cache_clear()
    block_kernels._kernel.cache_clear()
    mx.set_default_device(device)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (libstdc++'s std::hash)")
def test_std_hash_is_libstdcpps(tmp_path):
    src = tmp_path / "h.cpp"
    src.write_text('#include <iostream>\n#include <string>\n#include <functional>\nint main() { std::string l;\n'
                   '  while (std::getline(std::cin, l)) { std::string s;\n'
                   '    for (size_t i = 0; i < l.size(); i += 2) s.push_back((char)std::stoi(l.substr(i, 2), nullptr, 16));\n'
                   '    std::cout << std::hex << std::hash<std::string>{}(s) << "\\n"; } }\n')
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "h"), str(src)], check=True)
    rng = np.random.default_rng(0)
    cases = [b"x", b"abcdefg", b"abcdefgh", b"abcdefghi"] + [rng.bytes(n) for n in (15, 16, 17, 1000, 4099)]
    out = subprocess.run([str(tmp_path / "h")], input="".join(c.hex() + "\n" for c in cases).encode(),
                         capture_output=True, check=True).stdout.decode().split()
    assert [int(o, 16) for o in out] == [cuda_jit.std_hash(c) for c in cases]


def _scores_launch():
    q, keys, i32 = mx.zeros((3, 512), mx.bfloat16), mx.zeros((2, 70, 256), mx.bfloat16), mx.zeros((3,), mx.int32)
    template = [("H", 4), ("KV", 2), ("D", 128), ("CAUSAL", True), ("WINDOW", 0), ("SCALE_BITS", 7),
                ("SOFTCAP_BITS", 0), ("SOFTCAP_INV_BITS", 0), ("QT", mx.bfloat16), ("KVT", mx.bfloat16)]
    return kernels._kernel("cuda", "attn_scores"), [q, keys, i32, i32, i32], template


def test_the_source_and_module_name_are_mlxs():
    """As MLX 0.32's build_kernel writes them: its header, each input typed by its dtype with its Shape
    where the body names `<input>_shape`, the outputs, each template argument as a constant of its kind
    (bool as true/false, a dtype as its CUDA type), the body; named custom_kernel_<name> and the
    template's suffix (_t for true, a dtype's type string), then the hash of that source in hex."""
    k, inputs, template = _scores_launch()
    module, kernel, source = k.job(inputs, template, [mx.float32])
    assert kernel == "custom_kernel_mlxinfer_attn_scores_cuda_4_2_128_t_0_7_0_0_bfloat16_t_bfloat16_t"
    assert module == f"{kernel}_{cuda_jit.std_hash(source.encode()):x}"
    assert source.startswith(cuda_jit.DEFAULT_HEADER + k.header + "namespace mlx::core::cu {\n\nnamespace cg")
    params = source.split(f"__global__ void {kernel}(\n", 1)[1].split(") {\n", 1)[0]
    assert params.split(",\n") == [
        "    const __nv_bfloat16* q", "    const __grid_constant__ Shape q_shape", "    const __nv_bfloat16* k",
        "    const __grid_constant__ Shape k_shape", "    const int32_t* row_slot", "    const int32_t* row_pos",
        "    const int32_t* row_len", "    float* p"]
    assert ("  constexpr bool CAUSAL = true;\n" in source and "  constexpr int SCALE_BITS = 7;\n" in source
            and "  using KVT = __nv_bfloat16;\n" in source)
    assert source.endswith(k.body + "\n}\n\n} // namespace mlx::core::cu\n")
    # a scalar input has no Shape parameter; a different template argument is a different module
    other = k.job([mx.array(1.0, mx.bfloat16)] + inputs[1:], template, [mx.float32])
    assert "Shape q_shape" not in other[2] and "Shape k_shape" in other[2] and other[0] != module


def test_modules_are_written_where_mlx_reads_them(tmp_path, monkeypatch, capsys):
    """<cache>/<module>.ptx (the cubin) and .txt ('mlx::core::cu::<kernel>' TAB its lowered name), names of
    more than 245 characters cut into directories as MLX's get_ptx_path cuts them; a module on disk is
    not built again; a compile that fails writes nothing and says so in one line."""
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "t"))
    assert cuda_jit.ptx_cache_dir("0.32.4") == tmp_path / "t" / "mlx" / "0.32.4" / "ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "c"))
    assert cuda_jit.ptx_cache_dir("0.32.4") == tmp_path / "c"
    compiled = []

    def fake_compile(lib, source, name, arch, include):
        compiled.append(name)
        if "broken" in source:
            raise RuntimeError("mlxinfer.cu(3): error: identifier \"oops\" is undefined")
        return b"\x7fELF" + source.encode()[:8], "_Z3low"

    monkeypatch.setattr(cuda_jit, "compile_cubin", fake_compile)
    b = cuda_jit.Builder("sm_90a", object(), tmp_path, tmp_path / "c", workers=1)
    long = "custom_kernel_" + "x" * 300 + "_1f"
    assert b.build([("m_1", "k1", "src one"), (long, "k2", "src two")]) == 2
    assert (tmp_path / "c" / "m_1.ptx").read_bytes() == b"\x7fELFsrc one"
    assert (tmp_path / "c" / "m_1.txt").read_text() == "mlx::core::cu::k1\t_Z3low\n"
    assert (tmp_path / "c" / long[:245] / (long[245:] + ".ptx")).exists()
    assert b.build([("m_1", "k1", "src one")]) == 0 and len(compiled) == 2
    assert cuda_jit.Builder("sm_90a", object(), tmp_path, tmp_path / "c").build([("m_1", "k1", "x")]) == 0
    assert b.build([("m_2", "k3", "broken"), ("m_3", "k4", "broken")]) == 0
    assert not (tmp_path / "c" / "m_2.ptx").exists() and not (tmp_path / "c" / "m_2.txt").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot prebuild the CUDA kernel" in err[0] and "oops" in err[0]


def _affine_job(k):
    """(module, kernel, source) of a 4-bit affine block kernel's launch on two rows of float16 x."""
    return k.job([mx.zeros((2, 512), mx.float16), mx.zeros((2, 40), mx.float16), mx.zeros((512,), mx.float16),
                  mx.zeros((40, 64), mx.uint32), mx.zeros((40, 16), mx.uint16), mx.zeros((40, 16), mx.uint16),
                  mx.zeros((5,), mx.int32)],
                 [("T", mx.float16), ("M", 2), ("BITS", 4), ("SCALES", 1), ("ZERO", 0)], [mx.float16])


def test_nvrtc_compiles_the_sources_for_an_h200(tmp_path):
    """A launch's source, as MLX generates it, compiles with MLX's NVRTC options for sm_90a against our
    stand-in for MLX's device header: a cubin, and the lowered name MLX's module lookup is told; built
    by two worker processes, each module lands in the cache whole."""
    lib, include = cuda_jit.find_nvrtc(), cuda_jit.find_include()
    if lib is None or include is None:
        pytest.skip("needs NVRTC 13 and the CUDA headers (pip install 'nvidia-cuda-nvrtc>=13'; a CUDA toolkit)")
    k, inputs, template = _scores_launch()
    launches = [k.job(inputs, template, [mx.float32]), _affine_job(block_kernels._kernel("cuda", "affine_matvec"))]
    assert f'#include "{cuda_jit.header_dir()}/mlxi_' in launches[1][2]  # (a block kernel's header: a file)
    assert cuda_jit.Builder("sm_90a", lib, include, tmp_path, workers=2).build(launches) == 2
    for module, kernel, _ in launches:
        name, lowered = (tmp_path / f"{module}.txt").read_text().rstrip("\n").split("\t")
        assert (tmp_path / f"{module}.ptx").read_bytes()[:4] == b"\x7fELF"
        assert name == f"mlx::core::cu::{kernel}" and kernel in lowered and lowered.startswith("_Z")


def test_a_worker_imports_mlx_from_the_path_it_is_handed(tmp_path):
    """A compile worker runs isolated (`python -I`: no PYTHONPATH, which is where MLX was on the lent
    H200, 2026-12-04: 'No module named mlx' for every form, MLX compiling each itself). It is handed this
    process's sys.path: run here without site-packages at all (-S), it still finds MLX there and builds."""
    import json
    import subprocess
    import sys

    lib, include = cuda_jit.find_nvrtc(), cuda_jit.find_include()
    if lib is None or include is None:
        pytest.skip("needs NVRTC 13 and the CUDA headers (pip install 'nvidia-cuda-nvrtc>=13'; a CUDA toolkit)")
    k, inputs, template = _scores_launch()
    module, kernel, source = k.job(inputs, template, [mx.float32])
    b = cuda_jit.Builder("sm_90a", lib, include, tmp_path, workers=2)
    job = [b.lib_path, source, kernel, b.arch, str(b.include), str(b.cache), module, b.stamp]
    run = lambda path: subprocess.run([sys.executable, "-I", "-S", cuda_jit.__file__], capture_output=True,  # noqa: E731
                                      input=json.dumps({"path": path, "jobs": [job]}).encode(), timeout=300)
    assert json.loads(run(sys.path).stdout) == [None]
    assert (tmp_path / f"{module}.ptx").exists()
    missing = json.loads(run([]).stdout)  # (without it: MLX's include path cannot be found)
    assert missing[0][0] == "compile" and "mlx" in missing[0][1]


class _Recorder:
    """A Builder that records the modules asked for (compiling nothing)."""

    def __init__(self):
        self.asked = []

    def build(self, jobs):
        self.asked += [m for m, _, _ in jobs]
        return 0


def _forced_cuda(monkeypatch):
    """An MLX CPU backend told the CUDA kernels are selected, MLX's CUDA kernels replaced by zeros."""
    rec = _Recorder()
    monkeypatch.setattr(cuda_jit, "builder", lambda: rec)
    monkeypatch.setattr(cuda_jit, "build", lambda jobs: rec.build(jobs))

    def fake_kernel(**kw):
        return lambda **launch: [mx.zeros(s, d) for s, d in zip(launch["output_shapes"], launch["output_dtypes"])]

    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_kernel)
    b = MLXBackend(device="cpu", dtype="bfloat16")
    b.gpu_kernels = b.kernel = b.block_kind = "cuda"
    b.weight_dtype = b.dtype
    return b, rec


def test_the_self_checks_prebuild_finds_every_form_they_launch(monkeypatch):
    """The collecting pass asks for every module that the attention check's cases and the block check
    then launch (recorded as each form's first launch asks for it), at every head size, and for the
    block kernels at every row count a decode batch launches, not only the two checked."""
    b, rec = _forced_cuda(monkeypatch)
    assert mlx_backend.verify_gpu_kernels(b) is not None  # (zeros are not a product: the check fails)
    collected = set(rec.asked)
    rec.asked.clear()
    kernels._kernel.cache_clear()  # as in a new process: every form's first launch asks again
    for case in self_check_cases():
        if case_applies(b, case):
            mlx_backend._check_case(b, case)
    launched = set(rec.asked)
    assert launched and launched <= collected
    names = {m.split("_cuda_")[0].removeprefix("custom_kernel_mlxinfer_") for m in collected}
    assert names >= {"matmul", "softmax", "tanh", "fused_attention", "attn_scores", "attn_scores_rows",
                     "attn_softmax", "attn_softmax_context", "attn_short", "attn_context", "attn_context_rows"}
    assert {d for d in mlx_backend.SELF_CHECK_HEAD_DIMS if any(f"scores_cuda_4_2_{d}_" in m for m in collected)} \
        == set(mlx_backend.SELF_CHECK_HEAD_DIMS)
    rec.asked.clear()
    mlx_backend.verify_block_kernels(b)
    rows = {int(m.split("bfloat16_t_")[1].split("_")[0]) for m in rec.asked if "matvec" in m}
    assert rows == set(range(1, block_kernels.MAX_ROWS + 1))
    assert {m.split("_cuda_")[0] for m in rec.asked} == {
        f"custom_kernel_mlxinfer_{n}" for n, _ in block_kernels.KERNELS.values()} | {
        "custom_kernel_mlxinfer_rms_norm", "custom_kernel_mlxinfer_swiglu"}
    # one kernel per type and row count: its ADD, NORM and SWIGLU forms are chosen at launch, nothing more to build
    assert len({m for m in rec.asked if "matvec" in m}) == len(set(block_kernels.KERNELS.values())) * block_kernels.MAX_ROWS


def test_each_launch_asks_once_per_form(monkeypatch):
    """Outside a collecting pass a form's first launch in a process asks for its module (built before
    MLX looks for it), later launches of that form do not; another form asks again."""
    b, rec = _forced_cuda(monkeypatch)
    k, inputs, template = _scores_launch()
    launch = dict(inputs=inputs, template=template, grid=(256, 1, 1), threadgroup=(256, 1, 1),
                  output_shapes=[(3, 4, 70)], output_dtypes=[mx.float32])
    k(**launch)
    k(**launch)
    assert len(rec.asked) == 1
    k(**dict(launch, template=template[:-1] + [("KVT", mx.float32)]))
    assert len(rec.asked) == 2 and rec.asked[0] != rec.asked[1]


def test_a_models_check_builds_and_launches_its_own_shapes(monkeypatch):
    """`check_model` with Qwen3-0.6B's spec (16 and 8 heads of 128) collects and launches that shape's
    forms, not the self-check's 4 and 2 heads: the scores kernel, the kernels by rows, and the one-row
    softmax-context in its short- and long-context forms and its several-rows form, as the dispatch
    picks them, with the result in the model's dtype (OT: what the model launches; the check runs each in
    float32 too); every form launched was collected first."""
    from mlxinfer.backend import AttentionSpec

    b, rec = _forced_cuda(monkeypatch)
    b.checked = "cuda"  # (as after the self-check)
    spec = AttentionSpec.standard(16, 8, 128)
    collected = []
    real = mlx_backend._prebuild

    def prebuild(backend, parts):
        real(backend, parts)
        collected.extend(rec.asked)
        rec.asked.clear()

    monkeypatch.setattr(mlx_backend, "_prebuild", prebuild)
    b.check_model([spec, spec])  # (every kernel gives zeros, the reference's too: each case runs to its end)
    assert collected and set(rec.asked) <= set(collected)
    shape = cuda_jit.template_suffix([("H", 16), ("KV", 8), ("D", 128), ("CAUSAL", True), ("WINDOW", 0),
                                      ("SCALE_BITS", kernels.f32_bits(spec.scale)), ("SOFTCAP_BITS", 0),
                                      ("SOFTCAP_INV_BITS", 0), ("QT", mx.bfloat16), ("KVT", mx.bfloat16)])
    result = [("OT", mx.bfloat16)]
    for name, form in [("attn_scores", []), ("attn_scores_rows", []), ("attn_context_rows", [*kernels.CONTEXT_ROWS_FORM, *result]),
                       ("attn_softmax_context", [*kernels.ONE_ROW_FORM, *result]),
                       ("attn_softmax_context", [*kernels.ONE_ROW_LONG_FORM, *result]),
                       ("attn_softmax_context", [*kernels.split_unroll(8, 300), *result]),
                       ("attn_short", [*kernels.ONE_ROW_FORM, ("SK", kernels.SHORT_MAX_KEYS), *result])]:
        kernel = f"custom_kernel_mlxinfer_{name}_cuda{shape}{cuda_jit.template_suffix(form)}_"
        assert any(m.startswith(kernel) for m in collected), kernel
    assert not any("_cuda_4_2_" in m for m in collected)


def _fake_compile(calls):
    def compile_cubin(lib, source, name, arch, include):
        calls.append(name)
        return b"\x7fELF" + source.encode()[:8], "_Z3low"
    return compile_cubin


def test_a_worker_that_cannot_start_costs_only_speed(tmp_path, monkeypatch, capsys):
    """No process left to start a compile worker (EAGAIN): nothing is built, one warning line, no raise."""
    def no_fork(*a, **k):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(cuda_jit.subprocess, "Popen", no_fork)
    b = cuda_jit.Builder("sm_90a", object(), tmp_path, tmp_path / "c", workers=2)
    assert b.build([("m_1", "k1", "a"), ("m_2", "k2", "b")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not start" in err[0]


def test_an_unexpected_failure_in_process_costs_only_speed(tmp_path, monkeypatch):
    """A form's first launch compiles in the caller's process: any exception there (here what a failed
    lowered-name lookup would raise) is one warning, never out of the user's forward pass."""
    def bad(lib, source, name, arch, include):
        return None.decode()

    monkeypatch.setattr(cuda_jit, "compile_cubin", bad)
    b = cuda_jit.Builder("sm_90a", object(), tmp_path, tmp_path / "c", workers=1)
    assert b.build([("m_1", "k1", "a")]) == 0


def test_an_unwritable_cache_stops_the_compiles(tmp_path, monkeypatch):
    """Once a module cannot be written, nothing more is compiled in vain in this process (MLX compiles)."""
    calls = []
    monkeypatch.setattr(cuda_jit, "compile_cubin", _fake_compile(calls))

    def read_only(*a):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cuda_jit, "write_module", read_only)
    b = cuda_jit.Builder("sm_90a", object(), tmp_path, tmp_path / "c", workers=1)
    for n in range(5):
        b.build([(f"m_{n}", f"k{n}", f"src {n}")])
    assert len(calls) == 1


def test_a_changed_stub_rebuilds_the_modules(tmp_path, monkeypatch):
    """A module on disk from another stand-in header (or NVRTC, options, architecture: its stamp file)
    is compiled again, not loaded; the same stamp is not."""
    calls = []
    monkeypatch.setattr(cuda_jit, "compile_cubin", _fake_compile(calls))
    new = lambda: cuda_jit.Builder("sm_90a", object(), tmp_path, tmp_path / "c", workers=1)  # noqa: E731
    new().build([("m_1", "k1", "s")])
    new().build([("m_1", "k1", "s")])
    assert len(calls) == 1
    monkeypatch.setattr(cuda_jit, "UTILS_STUB", cuda_jit.UTILS_STUB + "// fixed\n")
    new().build([("m_1", "k1", "s")])
    assert len(calls) == 2
    assert cuda_jit.Builder("sm_100a", object(), tmp_path, tmp_path / "c", workers=1).build(
        [("m_1", "k1", "s")]) == 1


def test_collecting_is_this_threads_only(monkeypatch):
    """While one thread collects (a second engine's check), another thread's launches run for real."""
    monkeypatch.setattr(cuda_jit, "builder", lambda: None)
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: (
        lambda **launch: [mx.ones(s, d) for s, d in zip(launch["output_shapes"], launch["output_dtypes"])]))
    k = cuda_jit.Kernel("k", ["x"], ["out"], "out[0] = x[0];", "")
    launch = dict(inputs=[mx.zeros((4,))], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(4,)],
                  output_dtypes=[mx.float32])
    got = []
    with cuda_jit.collecting() as jobs:
        def serve():
            with mx.stream(mx.new_stream(mx.cpu)):
                got.append(mx.array_equal(k(**launch)[0], mx.ones((4,))).item())

        t = threading.Thread(target=serve)
        t.start()
        t.join()
        assert not mx.array_equal(k(**launch)[0], mx.ones((4,))).item()  # this thread collects
    assert got == [True] and len(jobs) == 1


def test_a_long_header_reaches_mlx_as_a_file(monkeypatch):
    """A header of INCLUDE_FROM bytes or more is handed to MLX as one #include line of a file holding it,
    in MLX's kernel cache, named by its digest: the source MLX hashes at every launch is a block kernel's
    ~12 KB less, and a header differing in one byte is another file and another module. A short header
    (the tanh kernel's), and every header with INCLUDE_FROM None, go inline, as MLX's source always had them."""
    k = block_kernels._kernel("cuda", "affine_matvec")
    module, _, source = _affine_job(k)
    line = next(x for x in source.splitlines() if x.startswith("#include") and "mlxi_" in x)
    path = line.split('"')[1]
    assert path.startswith(str(cuda_jit.header_dir().absolute()) + "/mlxi_")
    assert open(path).read() == k.source_header and len(k.source_header) >= cuda_jit.INCLUDE_FROM
    assert k.source_header not in source and len(source) < 2000
    with open(path, "w") as f:  # (a file of other contents under its name is written again)
        f.write("// cut short")
    assert cuda_jit.included(k.source_header) == k.header and open(path).read() == k.source_header
    other = cuda_jit.Kernel(k.name, k.input_names, k.output_names, k.body, k.source_header.replace("0.5f", "0.25f", 1))
    assert other.source_header != k.source_header
    assert _affine_job(other)[0] != module and other.header != k.header
    assert _affine_job(cuda_jit.Kernel(k.name, k.input_names, k.output_names, k.body, k.source_header))[0] == module
    short = kernels._kernel("cuda", "tanh")
    assert len(short.source_header) < cuda_jit.INCLUDE_FROM and short.header == short.source_header
    monkeypatch.setattr(cuda_jit, "INCLUDE_FROM", None)
    inline = cuda_jit.Kernel(k.name, k.input_names, k.output_names, k.body, k.source_header)
    assert inline.header == k.source_header and k.source_header in _affine_job(inline)[2]


@pytest.mark.parametrize("where", ["unwritable", "a space"])
def test_a_header_that_cannot_be_a_file_goes_inline(tmp_path, monkeypatch, where):
    """Where the header's file cannot be written (its directory under a file) or its path would need
    quoting in an #include line, the header goes inline: slower launches, the same kernel."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    monkeypatch.setattr(cuda_jit, "header_dir", lambda: blocker / "h" if where == "unwritable" else tmp_path / "a b")
    k = block_kernels._kernel("cuda", "affine_matvec")
    assert k.header == k.source_header and k.source_header in _affine_job(k)[2]


def test_a_headers_file_is_written_again_where_its_source_names_it(tmp_path, monkeypatch):
    """A header's file removed after its kernel's first launch (a cleared cache) is written again at the
    next form's job, at the path the kernel's source already names, though the cache's setting changed."""
    k = block_kernels._kernel("cuda", "affine_matvec")
    path = k.header.split('"')[1]
    os.remove(path)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert path in _affine_job(k)[2]
    assert open(path).read() == k.source_header and not (tmp_path / "elsewhere").exists()
