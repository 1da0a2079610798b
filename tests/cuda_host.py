"""metal_kernels/blocks.cu (and attention.cu's kernels, the tensor-core ones and the float32 attention
kernels: `HostKernel`) run on the host: each kernel body compiled by g++ against tests/cuda_host.h (the
CUDA subset it uses) and launched with the arguments `block_kernels.product` hands MLX, one fiber per
CUDA thread, so that CI, which has no GPU, runs the kernels' own indexing, tiles of x, barriers and warp
shuffles and compares their bits with the published order's numpy emulation. What it cannot show: the
GPU's compiler and memory system (alignment faults, races the host's scheduling happens to hide).

    lib = HostKernels(tmp_dir, forms)    # forms: [(kernel, constants, "float" | "__nv_bfloat16", M)]
    out = lib.product(x, w, per_warp)    # as block_kernels.product("cuda", x, w, per_warp)
    out = lib.product(x, w, per_warp, residual)  # the ADD form (the same kernel: dims' forms bits)
    out = lib.rms_norm(x, weight, eps)   # forms: ("rms_norm", (), t, 1)
    out = lib.swiglu(x)                  # forms: ("swiglu", (), t, 1)
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxinfer import block_kernels

HEADER = Path(__file__).with_name("cuda_host.h")
# each block kernel input's C type (the arrays `block_kernels.product` hands MLX)
C_TYPES = {"ql": "uint8_t", "qh": "uint8_t", "scales": "int8_t", "d_bits": "uint16_t", "s0": "uint16_t",
           "qs": "uint8_t", "sc_h": "uint16_t", "sc_l": "uint8_t", "hmask": "uint8_t", "sc3": "uint8_t",
           "sc2": "uint8_t", "dmin_bits": "uint16_t", "v": "uint16_t", "w": "uint32_t", "dims": "int"}
T_NAMES = {mx.float32: "float", mx.bfloat16: "__nv_bfloat16", mx.float16: "__half"}


def available() -> bool:
    return shutil.which("g++") is not None


def _form_id(name, consts, t, m) -> str:
    return f"{name}_{'_'.join(str(v) for _, v in consts)}_{t.strip('_')}_{m}"


def input_types(consts, x: str) -> dict:
    """Each input's C type for a launch of x's C type (res, the residual, and nw, the norm's weight, are
    of x's type too): s1 is the K-quants' uint8 sub-scales, else fp16 bits."""
    return dict(C_TYPES, x=x, res=x, nw=x, s1="uint8_t" if dict(consts).get("SCALES") == 2 else "uint16_t")


def source(forms) -> str:
    """One C++ file: the header, blocks.cu's header, and per form a function holding the kernel body with
    its constants (as MLX's cuda_kernel writes them) and an extern "C" launcher."""
    header, bodies = block_kernels.kernel_source("cuda")
    parts = [f'#include "{HEADER}"\n', header]
    for name, consts, t, m in forms:
        fid = _form_id(name, consts, t, m)
        types = input_types(consts, t)
        ins, outs = block_kernels.INPUTS[name], block_kernels.OUTPUTS.get(name, ["out"])
        params = ", ".join([f"const {types[i]}* {i}" for i in ins] + [f"{t}* {o}" for o in outs])
        extra = "".join(f"constexpr int {k} = {v};\n" for k, v in consts)
        args = ", ".join([f"(const {types[i]}*)a{n}" for n, i in enumerate(ins)] + [f"({t}*)o{n}" for n in range(len(outs))])
        void_params = ", ".join([f"const void* a{n}" for n in range(len(ins))] + [f"void* o{n}" for n in range(len(outs))])
        blocks = block_kernels.min_blocks(name, m)
        parts.append(f"#undef MLXI_MIN_BLOCKS\n#define MLXI_MIN_BLOCKS {blocks}\n"  # (as `_kernel` sets it per form)
                     f"namespace {fid} {{\nusing T = {t};\nconstexpr int M = {m};\n{extra}"
                     f"void body({params}) {{\n{bodies[name]}\n}}\n}}\n"
                     f'extern "C" void run_{fid}({void_params}, unsigned gx, unsigned gy, unsigned threads) {{\n'
                     f"  mlxh_launch(gx, gy, threads, [&] {{ {fid}::body({args}); }});\n}}\n")
    return "\n".join(parts)


class HostKernels:
    """The forms compiled into one shared library under `folder` (reused while its source is unchanged)."""

    def __init__(self, folder, forms):
        self.lib = _compile(folder, source(forms), "blocks_host")

    def product(self, x, w, per_warp=None, residual=None, norm=None, swiglu=False):
        """x @ w.T (plus `residual`: the ADD form; of x normed: the NORM form; of SwiGLU's values of x =
        [gate | up]: the SWIGLU form) by the host-compiled kernel, launched exactly as
        `block_kernels.product` launches it on CUDA (its inputs, template and grid recorded from a
        stand-in for MLX's kernel)."""
        return self._launch(lambda: block_kernels.product("cuda", x, w, per_warp, residual, norm, swiglu))

    def pair_product(self, x, a, b, norm=None):
        """`block_kernels.pair_product` by the host-compiled kernel (as `product`)."""
        return self._launch(lambda: block_kernels.pair_product("cuda", x, a, b, norm))

    def rms_norm(self, x, weight, eps):
        """`block_kernels.rms_norm` by the host-compiled kernel (as `product`)."""
        return self._launch(lambda: block_kernels.rms_norm("cuda", x, weight, eps))

    def swiglu(self, x):
        """`block_kernels.swiglu` by the host-compiled kernel (as `product`)."""
        return self._launch(lambda: block_kernels.swiglu("cuda", x))

    def formed_scales(self, w):
        """`block_kernels.formed_scales` by the host-compiled kernel: (scales, biases) as float32 values."""
        return self._launch(lambda: block_kernels.formed_scales("cuda", w), outputs=2)

    def formed_values(self, w):
        """`block_kernels.formed_values` by the host-compiled kernel, as float32 values."""
        return self._launch(lambda: block_kernels.formed_values("cuda", w))

    def affine_values(self, w):
        """`block_kernels.affine_values` by the host-compiled kernel, as float32 values."""
        return self._launch(lambda: block_kernels.affine_values("cuda", w))

    def _launch(self, call, outputs=None):
        """The launch `call` makes, run by the host-compiled kernel: its one output, or its first
        `outputs` outputs as a tuple, as float32 values."""
        seen = {}

        def record(kind, name, blocks=1):
            def launch(**kw):
                seen.update(kw, name=name)
                return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(kw["output_shapes"], kw["output_dtypes"])]
            return launch

        real, compiled = block_kernels._kernel, block_kernels.FORMED_COMPILED
        block_kernels._kernel, block_kernels.FORMED_COMPILED = record, False  # (a bare launch: its inputs read here)
        try:
            call()
        finally:
            block_kernels._kernel, block_kernels.FORMED_COMPILED = real, compiled
        template = dict(seen["template"])
        t, m = T_NAMES[template.pop("T")], template.pop("M", 1)  # (rms_norm, swiglu: no M)
        consts = tuple(template.items())
        arrays = [_before_a_wall(_host_array(a)) for a in seen["inputs"]]
        shapes, dtypes = seen["output_shapes"], seen["output_dtypes"]
        outs = [_guarded(shape, np.float32 if dtype == mx.float32 else np.uint16) for shape, dtype in zip(shapes, dtypes)]
        (gx, gy, _), (tx, _, _) = seen["grid"], seen["threadgroup"]
        fn = getattr(self.lib, f"run_{_form_id(seen['name'], consts, t, m)}")
        fn(*[a.ctypes.data_as(ctypes.c_void_p) for a in arrays], *[o.ctypes.data_as(ctypes.c_void_p) for o in outs],
           ctypes.c_uint(gx // tx), ctypes.c_uint(gy), ctypes.c_uint(tx))
        values = []
        for out, shape, dtype in zip(outs, shapes, dtypes):
            out = _unguarded(out, shape, seen["name"])
            values.append(out if dtype == mx.float32 else np.array(mx.view(mx.array(out), dtype).astype(mx.float32)))
        return values[0] if outputs is None else tuple(values[:outputs])


GUARD = 4096  # elements past each output a host kernel must leave as they were (a write past its end)


def _guarded(shape, dtype) -> np.ndarray:
    """A zeroed output of `shape` followed by GUARD elements of a pattern (0xA5 bytes), flat."""
    buf = np.zeros(int(np.prod(shape)) + GUARD, dtype)
    buf[-GUARD:].view(np.uint8)[:] = 0xA5
    return buf


def _unguarded(buf: np.ndarray, shape, name: str) -> np.ndarray:
    """The output in `buf`, after checking that the kernel wrote nothing past its end."""
    if not (buf[-GUARD:].view(np.uint8) == 0xA5).all():
        raise AssertionError(f"host kernel {name} wrote past the end of its {tuple(shape)} output")
    return buf[:-GUARD].reshape(shape)


def launch_on_host(folder, monkeypatch) -> list:
    """`kernels._kernel` replaced (through pytest's `monkeypatch`) by attention.cu's kernels compiled
    under `folder` and run on the host; returns the list of the names launched, in order (so that a
    test can say which path ran)."""
    from mlxinfer import kernels

    made, launched = {}, []

    def kernel(kind, name):
        assert kind == "cuda"
        made.setdefault(name, HostKernel(folder, name))
        return lambda **kw: launched.append(name) or made[name](**kw)

    monkeypatch.setattr(kernels, "_kernel", kernel)
    return launched


def cuda_path(dtype: str = "float32", attention: str = "fused"):
    """An MLX backend on the CPU made to take the CUDA path (its kernels: `launch_on_host`)."""
    from mlxinfer.backends.mlx import MLXBackend

    b = MLXBackend(attention=attention, device="cpu", dtype=dtype)
    b.gpu_kernels = b.kernel = "cuda"
    return b


def pretend_gpu(monkeypatch, gpu: str) -> str:
    """MLX made to report a GPU of kind `gpu` (`mlx.gpu_kind`; "cuda-sm75": a Turing GPU, compute
    capability 7, else 9) whose device is never activated: a backend constructed with `kernel=` the
    returned kind runs no kernel and no self-check (the block kernels' too: `check_blocks` stubbed). The
    kind ("cuda" for "cuda-sm75")."""
    from mlxinfer.backends import mlx as mlx_backend

    turing = gpu == "cuda-sm75"
    monkeypatch.setattr(mx, "device_info", lambda device=None: {"compute_capability_major": 7 if turing else 9})
    monkeypatch.setattr(mlx_backend, "gpu_kind", lambda: "cuda" if turing else gpu)
    monkeypatch.setattr(mlx_backend.MLXBackend, "activate", lambda self: None)
    monkeypatch.setattr(mlx_backend.MLXBackend, "check_blocks", lambda self, fresh=False: None)
    return "cuda" if turing else gpu


def _host_array(a) -> np.ndarray:
    """An MLX input as the contiguous numpy array a host kernel reads (16-bit floats as their bits)."""
    return np.ascontiguousarray(np.array(mx.view(a, mx.uint16) if a.dtype in (mx.bfloat16, mx.float16) else a))


PAGE = mmap.PAGESIZE
_LIBC = ctypes.CDLL(None, use_errno=True)


def _before_a_wall(a: np.ndarray) -> np.ndarray:
    """A copy of `a` ending at most 15 bytes before a page the process may not read (PROT_NONE; its start
    16-byte aligned, as the kernels' vector loads assume): a kernel reading past the end of an input (a
    row past the weight's last) stops the launch with SIGSEGV, where a plain array's next bytes would be
    read silently. (The array over the mapping keeps it alive.)"""
    size = -(-a.nbytes // PAGE) * PAGE
    region = mmap.mmap(-1, size + PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    if _LIBC.mprotect(ctypes.c_void_p(base + size), ctypes.c_size_t(PAGE), 0):  # PROT_NONE
        raise OSError(ctypes.get_errno(), "mprotect failed")
    start = (size - a.nbytes) // 16 * 16
    out = np.frombuffer(region, dtype=a.dtype, count=a.size, offset=start).reshape(a.shape)
    out[...] = a
    return out


def _compile(folder, text: str, stem: str, flags: tuple = ()):
    """The shared library g++ builds from `text` under `folder` (reused while the text and flags are
    unchanged); flags: more of g++'s (-DMLXH_UCONTEXT: cuda_host.h's portable fiber switch)."""
    digest = hashlib.sha256((text + " ".join(flags)).encode()).hexdigest()[:16]
    folder = Path(folder)
    lib = folder / f"{stem}_{digest}.so"
    if not lib.exists():
        src = folder / f"{stem}_{digest}.cpp"
        src.write_text(text)
        r = subprocess.run(["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC",
                            "-pthread", "-w", *flags, "-o", str(lib), str(src)], capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise RuntimeError(f"g++ failed:\n{r.stderr[-3000:]}")
    return ctypes.CDLL(str(lib))


HOST_TYPES = {mx.float32: "float", mx.int32: "int", mx.uint16: "uint16_t", mx.bfloat16: "__nv_bfloat16",
              mx.float16: "__half", mx.uint32: "uint32_t", mx.int8: "int8_t"}  # an MLX input's C type


class HostKernel:
    """One kernel of attention.cu (`kernels.kernel_parts("cuda", name)`: the body and the header units it
    uses), compiled by g++ for the forms asked and launched as `kernels` launches it on MLX: the wrapper
    (`kernels.mma_attention` & co.) runs with its `_kernel` replaced by this, so the inputs, template
    arguments and grid are the wrapper's own."""

    def __init__(self, folder, name: str):
        self.folder, self.name = folder, name
        self.libs: dict = {}

    def _shaped(self):
        """The inputs whose shapes the kernel reads (`x_shape[i]`, as MLX's cuda_kernel provides them)."""
        from mlxinfer import kernels

        header, body = kernels.kernel_parts("cuda", self.name)
        return [n for n in kernels._INPUTS[self.name][0] if re.search(rf"\b{n}_shape\b", header + body)]

    def _lib(self, inputs, template, out_dtypes):
        from mlxinfer import kernels

        key = (tuple((a.dtype, a.ndim) for a in inputs), tuple(template), tuple(out_dtypes))
        if key not in self.libs:
            header, body = kernels.kernel_parts("cuda", self.name)
            names, outs = kernels._INPUTS[self.name]
            params = [f"const {HOST_TYPES[a.dtype]}* {n}" for n, a in zip(names, inputs)]
            params += [f"{HOST_TYPES[d]}* {o}" for o, d in zip(outs, out_dtypes)]
            params += [f"const long* {n}_shape" for n in self._shaped()]
            consts = "".join(f"using {k} = {HOST_TYPES[v]};\n" if isinstance(v, mx.Dtype) else
                             f"constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {str(v).lower()};\n"
                             for k, v in template)
            casts = ", ".join(f"({p.rsplit(' ', 1)[0]})a[{i}]" for i, p in enumerate(params))
            text = (f'#include "{HEADER}"\n{header}\nnamespace form {{\n{consts}'
                    f"void body({', '.join(params)}) {{\n{body}\n}}\n}}\n"
                    f'extern "C" void run(void** a, unsigned gx, unsigned gy, unsigned threads) {{\n'
                    f"  mlxh_launch(gx, gy, threads, [&] {{ form::body({casts}); }});\n}}\n")
            self.libs[key] = _compile(self.folder, text, f"{self.name}_host")
        return self.libs[key]

    def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes, template=()):
        lib = self._lib(inputs, template, output_dtypes)
        from mlxinfer import kernels

        arrays = [_host_array(a) for a in inputs]
        if not set(output_dtypes) <= {mx.float32, mx.bfloat16, mx.float16, mx.uint16}:
            raise NotImplementedError(f"host kernel {self.name}: outputs of {output_dtypes} (float32 or 16 bits only)")
        outs = [_guarded(s, np.float32 if d == mx.float32 else np.uint16) for s, d in zip(output_shapes, output_dtypes)]
        names = kernels._INPUTS[self.name][0]
        shapes = [np.array(inputs[names.index(n)].shape, np.int64) for n in self._shaped()]
        ptrs = (ctypes.c_void_p * (len(arrays) + len(outs) + len(shapes)))(
            *[a.ctypes.data for a in arrays + outs + shapes])
        (gx, gy, _), (tx, _, _) = grid, threadgroup
        lib.run(ptrs, ctypes.c_uint(gx // tx), ctypes.c_uint(gy), ctypes.c_uint(tx))
        # (a 16-bit output's bits as its type: a bfloat16 or float16 output is that type, as on MLX)
        return [mx.view(mx.array(_unguarded(o, s, self.name)), d) for o, s, d in zip(outs, output_shapes, output_dtypes)]
