"""Our CUDA kernels compiled once per machine, many at once, into MLX's own kernel cache.

MLX's `mx.fast.cuda_kernel` compiles each form of a kernel (its template arguments and input types) with
NVRTC when a graph first launches it, one at a time, and keeps the result in that process only: it
never writes a custom kernel to its disk cache, though it reads that cache for every module it builds
(mlx/backend/cuda/jit_module.cpp, MLX 0.32: `read_cached_ptx` before compiling, `write_cached_ptx` only
for its own kernels). Our attention and block kernels come in dozens of forms (head sizes, GQA shapes,
dtypes, unrollings, row counts), so the GPU self-check spent minutes compiling before the first token
and every process paid again for the forms it launched.

This module writes what MLX would have compiled into the cache MLX reads, under the name MLX looks for:
for a launch it rebuilds the source MLX generates (`mlx_source`, a copy of MLX 0.32's `build_kernel`),
names the module as MLX does (the kernel's name and template arguments, then libstdc++'s std::hash of
that source: `std_hash`), and compiles the same source with NVRTC for the device (MLX's options; MLX's
own device header replaced by `UTILS_STUB`, which declares what our kernels use of it: the fp16/bf16
types, fixed-width integers, `Shape` as MLX passes it). MLX then loads the cubin from disk instead of
compiling. Where anything here does not match (another MLX, no NVRTC, a name MLX does not look for, a
cache it cannot write), MLX compiles the kernel itself, as before, only slower. Either compile's bits
are what the self-check vouches for: its verdict is keyed by this file's digest and by `identity()`
(the builder's stamp: the stand-in header, NVRTC's options and version, the GPU's architecture), and a
module whose stamp file differs from this builder's is compiled again.

`collecting()` lets the self-check find every form it will launch without launching any (each launch
returns zeros and records its form), so that `build` compiles them all at once on every core.
Hand-written because no library does this; it is the project's own build step for its own kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

SUPPORTED_MLX = ("0.32.",)  # MLX versions whose build_kernel `mlx_source` copies (read from 0.32's sources)
ANNOUNCE_FROM = 8  # a build of at least this many forms says so first (one line: it takes seconds to a minute)
MAX_NDIM = 10  # MLX's Shape: cuda::std::array<int32_t, MAX_NDIM>, passed by value
CUDA_TYPES = {"bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
              "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
              "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}  # dtype_to_cuda_type
TYPE_STRINGS = {"float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t", "bool": "bool",
                "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t", "uint8": "uint8_t",
                "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t"}  # get_type_string
DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
UTILS_NAME = "mlx/backend/cuda/device/utils.cuh"
UTILS_STUB = """#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
namespace mlx::core::cu {
struct Shape { int32_t v[%d]; __device__ const int32_t& operator[](int i) const { return v[i]; } };
struct Strides { int64_t v[%d]; __device__ const int64_t& operator[](int i) const { return v[i]; } };
}
""" % (MAX_NDIM, MAX_NDIM)

_MASK = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995


def std_hash(data: bytes) -> int:
    """libstdc++'s std::hash<std::string> on a 64-bit machine (`_Hash_bytes`, seed 0xc70f6907), which
    MLX's CUDA backend puts in a custom kernel's module name."""

    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    h = (0xC70F6907 ^ (n * _MUL)) & _MASK
    whole = n & ~7
    for i in range(0, whole, 8):
        word = int.from_bytes(data[i:i + 8], "little")
        h = ((h ^ ((shift_mix((word * _MUL) & _MASK) * _MUL) & _MASK)) * _MUL) & _MASK
    if n & 7:
        h = ((h ^ int.from_bytes(data[whole:], "little")) * _MUL) & _MASK
    h = (shift_mix(h) * _MUL) & _MASK
    return shift_mix(h)


def dtype_name(dtype) -> str:
    """An MLX dtype's name ("bfloat16" of mx.bfloat16)."""
    return str(dtype).rsplit(".", 1)[-1]


def template_suffix(template) -> str:
    """MLX's `template_arguments_hash`: what follows a kernel's name in its compiled name."""
    out = []
    for _, v in template:
        if isinstance(v, bool):
            out.append("_t" if v else "_f")
        elif isinstance(v, int):
            out.append(f"_{v}")
        else:
            out.append("_" + TYPE_STRINGS[dtype_name(v)])
    return "".join(out)


def _constant(name: str, v) -> str:
    if isinstance(v, bool):
        return f"  constexpr bool {name} = {'true' if v else 'false'};\n"
    if isinstance(v, int):
        return f"  constexpr int {name} = {v};\n"
    return f"  using {name} = {CUDA_TYPES[dtype_name(v)]};\n"


def mlx_source(func: str, header: str, body: str, input_names, inputs, output_names, output_dtypes,
               template) -> str:
    """The source MLX 0.32's `build_kernel` generates for a launch: `inputs` as (dtype name, ndim) per
    input; an input's `_shape` (`_strides`, `_ndim`) parameter is there where the body names it and the
    input is not a scalar, as MLX decides it."""
    s = [DEFAULT_HEADER, header, "namespace mlx::core::cu {\n\n", "namespace cg = cooperative_groups;\n\n",
         f"__global__ void {func}(\n"]
    for name, (dtype, ndim) in zip(input_names, inputs, strict=True):
        s.append(f"    const {CUDA_TYPES[dtype]}* {name},\n")
        if ndim > 0:
            for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if name + suffix in body:
                    s.append(f"    const __grid_constant__ {kind} {name}{suffix},\n")
    for i, (name, dtype) in enumerate(zip(output_names, output_dtypes, strict=True)):
        s.append(f"    {CUDA_TYPES[dtype]}* {name}" + (",\n" if i < len(output_names) - 1 else ") {\n"))
    if template:
        s += [_constant(n, v) for n, v in template] + ["\n"]
    s += [body, "\n}\n\n} // namespace mlx::core::cu\n"]
    return "".join(s)


# -- where MLX looks, and NVRTC ---------------------------------------------------------------------
def ptx_cache_dir(version: str) -> Path:
    """MLX's `ptx_cache_dir`: $MLX_PTX_CACHE_DIR, else <temp>/mlx/<version>/ptx (std::filesystem's
    temp_directory_path: $TMPDIR, $TMP, $TEMP, $TEMPDIR, else /tmp)."""
    if os.environ.get("MLX_PTX_CACHE_DIR"):
        return Path(os.environ["MLX_PTX_CACHE_DIR"]).absolute()
    tmp = next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if os.environ.get(v)), "/tmp")
    return Path(tmp) / "mlx" / version / "ptx"


def ptx_path(cache: Path, module: str) -> Path:
    """MLX's `get_ptx_path`: names longer than 245 characters are cut into directories."""
    limit, parts = 245, []
    while len(module) > limit:
        parts.append(module[:limit])
        module = module[limit:]
    return cache.joinpath(*parts, module + ".ptx")


def _loaded_nvrtc() -> list[str]:
    """The libnvrtc MLX has loaded, from this process's maps (Linux), then the nvidia wheels' beside MLX."""
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if "/libnvrtc.so" in path and path not in found:
                found.append(path)
    return found


def _nvidia_roots() -> list[Path]:
    import mlx

    roots = [Path(p).parent / "nvidia" for p in mlx.__path__]
    with contextlib.suppress(ImportError):
        import nvidia

        roots += [Path(p) for p in nvidia.__path__]
    return [r for r in dict.fromkeys(roots) if r.is_dir()]


def find_nvrtc():
    """libnvrtc through ctypes: the one MLX loaded, else an nvidia wheel's beside MLX (or None). Its
    builtins library is loaded first from the same directory, where NVRTC looks for it by name."""
    wheels = [p for r in _nvidia_roots() for p in sorted(glob.glob(str(r / "*" / "lib" / "libnvrtc.so*")))
              if ".alt." not in p]
    for path in _loaded_nvrtc() + wheels:
        try:
            return load_nvrtc(path)
        except OSError:
            continue
    return None


def load_nvrtc(path: str):
    for builtins in sorted(Path(path).parent.glob("libnvrtc-builtins.so*")):
        with contextlib.suppress(OSError):
            ctypes.CDLL(str(builtins))
    return ctypes.CDLL(path)


def find_include() -> Path | None:
    """The CUDA headers MLX compiles against: nvidia/cu13 (or cuda_runtime)/include beside MLX, then
    $CUDA_HOME, $CUDA_PATH, /usr/local/cuda."""
    dirs = [r / d / "include" for r in _nvidia_roots() for d in ("cu13", "cuda_runtime")]
    dirs += [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    dirs.append(Path("/usr/local/cuda/include"))
    return next((d for d in dirs if (d / "cooperative_groups.h").exists() and (d / "cuda_bf16.h").exists()), None)


def include_path(cuda: Path) -> list[Path]:
    """MLX's include path for NVRTC: its bundled headers and CCCL (libcu++, which cooperative_groups.h
    needs), then the CUDA headers (and their CCCL, where MLX bundles none)."""
    import mlx

    dirs = [d for p in mlx.__path__ for d in (Path(p) / "include", Path(p) / "include" / "cccl")]
    return [d for d in dirs + [cuda / "cccl", cuda] if d.is_dir()]


def nvrtc_options(arch: str, include: Path) -> list[str]:
    """MLX's NVRTC options (jit_module.cpp's `compile`)."""
    return ["--device-as-default-execution-space", f"--gpu-architecture={arch}",
            *(f"--include-path={d}" for d in include_path(include))]


def stamp(lib, arch: str, include: Path) -> str:
    """What decides a cubin besides its source: the stand-in header, NVRTC's options and version, the
    architecture. Kept beside each module (<module>.mlxinfer) and in the self-check's key."""
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    with contextlib.suppress(Exception):
        lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    parts = [UTILS_STUB, *nvrtc_options(arch, include), f"nvrtc {major.value}.{minor.value}", arch]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def compile_cubin(lib, source: str, name_expr: str, arch: str, include: Path) -> tuple[bytes, str]:
    """(cubin, lowered name of `name_expr`) of a source, as MLX's JIT compiles it; raises RuntimeError
    with NVRTC's log on failure."""
    prog = ctypes.c_void_p()
    headers = (ctypes.c_char_p * 1)(UTILS_STUB.encode())
    names = (ctypes.c_char_p * 1)(UTILS_NAME.encode())
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"mlxinfer.cu", 1, headers, names):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        if lib.nvrtcAddNameExpression(prog, name_expr.encode()):
            raise RuntimeError("nvrtcAddNameExpression failed")
        opts = [o.encode() for o in nvrtc_options(arch, include)]
        if lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)):
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            lines = [line for line in log.value.decode(errors="replace").splitlines() if "error" in line]
            raise RuntimeError(lines[0].strip() if lines else "NVRTC failed")
        lowered = ctypes.c_char_p()
        if lib.nvrtcGetLoweredName(prog, name_expr.encode(), ctypes.byref(lowered)) or not lowered.value:
            raise RuntimeError(f"NVRTC has no lowered name for {name_expr}")
        size = ctypes.c_size_t()
        if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) or not size.value:
            raise RuntimeError("NVRTC made no cubin")
        cubin = ctypes.create_string_buffer(size.value)
        if lib.nvrtcGetCUBIN(prog, cubin):
            raise RuntimeError("nvrtcGetCUBIN failed")
        return cubin.raw, lowered.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


class Builder:
    """Writes kernels into MLX's cache: `job` names a launch's module, `build` compiles what is missing."""

    def __init__(self, arch: str, lib, include: Path, cache: Path, workers: int | None = None):
        self.arch, self.lib, self.include, self.cache = arch, lib, include, cache
        self.lib_path = getattr(lib, "_name", None)
        self.workers = workers or default_workers()
        self.stamp = stamp(lib, arch, include)
        self.done: set[str] = set()  # modules known to be on disk (this process)
        self.warned = False
        self.off = False  # set when the cache cannot be written: nothing more is compiled in vain

    def missing(self, module: str) -> bool:
        """Whether the module is not on disk as this builder would write it (its stamp file too)."""
        if module in self.done:
            return False
        path = ptx_path(self.cache, module)
        try:
            same = path.with_suffix(".mlxinfer").read_text() == self.stamp
        except (OSError, ValueError):
            same = False
        if same and path.exists() and path.with_suffix(".txt").exists():
            self.done.add(module)
            return False
        return True

    def _warn(self, kernel: str, error: str) -> None:
        if not self.warned:
            self.warned = True
            print(f"mlxinfer: warning: cannot prebuild the CUDA kernel {kernel} ({error}); MLX compiles it itself "
                  "at first launch", file=sys.stderr)

    def build(self, jobs) -> int:
        """Compile and write each (module, kernel name, source) not yet on disk, on every core; returns how
        many were compiled. A failure costs only speed (MLX compiles that one itself): one warning line;
        a cache that cannot be written stops the builder for this process.
        Several go to worker processes (this file run as an isolated script, `python -I`, given this
        process's sys.path after its own, as MLX may be on PYTHONPATH alone: nothing of
        the caller's program or environment is imported), as NVRTC compiles one program at a time in a
        process (two threads took 1.1x one thread's time for four kernels on this project's 2-core VM)."""
        if self.off:
            return 0
        todo = [(m, k, s) for m, k, s in dict((m, (m, k, s)) for m, k, s in jobs).values() if self.missing(m)]
        if not todo:
            return 0
        try:
            errors = self._compile(todo)
        except Exception as e:  # nothing here may stop a run: MLX compiles what is not built
            self._warn(todo[0][1], f"{type(e).__name__}: {e}")
            return 0
        for (m, k, _), error in zip(todo, errors):
            if error is None:
                self.done.add(m)
                continue
            stage, message = error
            self.off = self.off or stage == "write"
            self._warn(k, message)
        return errors.count(None)

    def _compile(self, todo) -> list:
        args = [(self.lib_path, s, k, self.arch, str(self.include), str(self.cache), m, self.stamp) for m, k, s in todo]
        workers = min(len(todo), self.workers)
        if len(todo) >= ANNOUNCE_FROM:
            print(f"mlxinfer: compiling {len(todo)} CUDA kernel forms on {workers} processes into MLX's kernel cache "
                  f"({self.cache}; once per machine for this MLX and these kernels)", file=sys.stderr, flush=True)
        if workers == 1:
            return [_compile_and_write(*a, lib=self.lib) for a in args]
        procs = []
        try:
            for n in range(workers):
                procs.append(subprocess.Popen([sys.executable, "-I", __file__], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
                procs[-1].stdin.write(json.dumps({"path": sys.path, "jobs": args[n::workers]}).encode())
                procs[-1].stdin.close()
        except OSError as e:  # a worker that cannot start (no processes left, no memory): none are built
            for p in procs:
                p.kill()
                p.wait()
            return [("start", f"a compile worker did not start: {e}")] * len(args)
        errors = [None] * len(args)
        for n, p in enumerate(procs):
            out = p.stdout.read()
            p.wait()
            try:
                errors[n::workers] = [e if e is None else tuple(e) for e in json.loads(out)]
            except (ValueError, TypeError):
                errors[n::workers] = [("worker", f"a compile worker exited with {p.returncode}")] * len(args[n::workers])
        return errors


def default_workers() -> int:
    """The cores this process may run on (its affinity, not the machine's), at most 32."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, 32))


def write_module(cache: Path, module: str, kernel: str, cubin: bytes, lowered: str, stamp: str) -> None:
    """A module as MLX's read_cached_ptx reads it: <module>.ptx (the cubin) and .txt (the kernel's name,
    a tab, its lowered name), each written whole (a temporary file, then renamed), the .ptx after the
    .txt; then our stamp file (<module>.mlxinfer: `stamp`), which MLX does not read."""
    path = ptx_path(cache, module)
    path.parent.mkdir(parents=True, exist_ok=True)
    for suffix, data in ((".txt", f"mlx::core::cu::{kernel}\t{lowered}\n".encode()), (".ptx", cubin),
                         (".mlxinfer", stamp.encode())):
        tmp = path.with_suffix(f"{suffix}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path.with_suffix(suffix))


_LIBS: dict = {}  # a worker's NVRTC, by path


def _compile_and_write(lib_path, source, kernel, arch, include, cache, module, stamp, lib=None):
    """One module compiled and written: None, or (stage, the error's line), stage "compile" or "write"."""
    try:
        if lib is None:
            if lib_path not in _LIBS:
                _LIBS[lib_path] = load_nvrtc(lib_path)
            lib = _LIBS[lib_path]
        cubin, lowered = compile_cubin(lib, source, f"mlx::core::cu::{kernel}", arch, Path(include))
    except Exception as e:
        return "compile", f"{type(e).__name__}: {e}"
    try:
        write_module(Path(cache), module, kernel, cubin, lowered, stamp)
    except OSError as e:
        return "write", f"{type(e).__name__}: {e}"
    return None


_BUILDER: Builder | None = None
_BUILDER_READY = False
_STATE = threading.local()  # .jobs: the jobs of this thread's `collecting()` block (other threads launch)


def builder() -> Builder | None:
    """This process's Builder, or None where kernels cannot be prebuilt (no CUDA device, an MLX whose
    source generation is not known here, no NVRTC or headers, MLXINFER_CUDA_PREBUILD=0)."""
    global _BUILDER, _BUILDER_READY
    if _BUILDER_READY:
        return _BUILDER
    _BUILDER_READY = True
    if os.environ.get("MLXINFER_CUDA_PREBUILD", "1") == "0":
        return None
    import mlx.core as mx

    if not (hasattr(mx, "cuda") and mx.cuda.is_available()) or not mx.__version__.startswith(SUPPORTED_MLX):
        return None
    try:
        info = mx.device_info(mx.gpu)
        major, minor = int(info["compute_capability_major"]), int(info["compute_capability_minor"])
    except Exception as e:
        print(f"mlxinfer: warning: cannot read the GPU's compute capability ({type(e).__name__}: {e}); MLX "
              "compiles our CUDA kernels itself, one at a time", file=sys.stderr)
        return None
    lib, include = find_nvrtc(), find_include()
    if lib is None or include is None:
        return None
    arch = f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    cache = ptx_cache_dir(mx.__version__)
    try:  # a cache MLX reads but we cannot write (another user's /tmp/mlx): every compile would be in vain
        cache.mkdir(parents=True, exist_ok=True)
        probe = cache / f".mlxinfer-write-check.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        print(f"mlxinfer: warning: cannot write MLX's kernel cache {cache} ({e.strerror}); MLX compiles our "
              "CUDA kernels itself, one at a time (set MLX_PTX_CACHE_DIR to a writable directory)", file=sys.stderr)
        return None
    _BUILDER = Builder(arch, lib, include, cache)
    return _BUILDER


def identity() -> str:
    """How our CUDA kernels get compiled here, for the self-check's key: the builder's stamp, or
    "mlx" where MLX compiles them itself."""
    b = builder()
    return f"prebuilt {b.stamp}" if b else "mlx"


@contextlib.contextmanager
def collecting():
    """Within the block every prebuilt kernel's launch records its module and returns zeros: run the
    code whose kernels are to be built, then `build` the jobs yielded."""
    outer = getattr(_STATE, "jobs", None)
    _STATE.jobs = jobs = []
    try:
        yield jobs
    finally:
        _STATE.jobs = outer


def is_collecting() -> bool:
    """Whether this thread is inside a `collecting()` block (launches record jobs and return zeros)."""
    return getattr(_STATE, "jobs", None) is not None


def build(jobs) -> int:
    b = builder()
    return b.build(jobs) if b else 0


# -- the header as a file ----------------------------------------------------------------------------
INCLUDE_FROM = 512  # a header of this many bytes or more reaches MLX as an #include of a file (None: never)
_SAFE_PATH = re.compile(r"[A-Za-z0-9_./+-]+")  # a path an #include "..." line takes as it is


def header_dir() -> Path:
    """Where headers handed to MLX as files live: beside the modules in MLX's kernel cache."""
    import mlx.core as mx

    return ptx_cache_dir(mx.__version__) / "mlxinfer-headers"


def write_header(path: Path, header: str) -> bool:
    """The header in the file at `path` (written whole, then renamed into place), unless it holds it
    already; False where it cannot be written."""
    data = header.encode()
    try:
        if path.is_file() and path.read_bytes() == data:
            return True
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except (OSError, ValueError):
        return False
    return True


def included(header: str) -> str:
    """What a kernel hands MLX as its header: for one of INCLUDE_FROM bytes or more, one #include line of a
    file holding it, named by its digest (so that a module's name, which hashes the source, still changes
    with the header); else the header itself. MLX's CUDA custom kernel hashes its whole source at every
    launch (`CustomKernel::eval_gpu` names its module with std::hash of it; 0.13 us a KB on this project's
    x86 VM): a block kernel's header is 9-12 KB, ~57 launches a decode token of Qwen3-0.6B. NVRTC (ours in
    `Builder`, or MLX's own compile) reads the file by its absolute path, which is thus part of every
    module's name: a kernel cache read under another path (another MLX_PTX_CACHE_DIR) is compiled again.
    Where the file cannot be written, or its path would need quoting, the header goes inline as before."""
    if INCLUDE_FROM is None or len(header.encode()) < INCLUDE_FROM:
        return header
    try:
        path = header_dir().absolute() / f"mlxi_{hashlib.sha256(header.encode()).hexdigest()[:24]}.cuh"
    except (OSError, ValueError):
        return header
    if not _SAFE_PATH.fullmatch(str(path)) or not write_header(path, header):
        return header
    return f'#include "{path}"\n'


class Kernel:
    """`mx.fast.cuda_kernel` with its forms prebuilt: called as MLX's kernel is. At each form's first
    launch in this process (its template, input dtypes and ranks) the module is built into MLX's cache
    if missing, before MLX looks for it. Its header reaches MLX as `included` makes it, decided at the
    first launch (its file made again at each new form's)."""

    def __init__(self, name: str, input_names, output_names, source: str, header: str):
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.body, self.source_header = source, header
        self._header = None  # what MLX is handed (`included`), at the first launch
        self.mlx = None  # MLX's kernel, made at the first launch (MLX without CUDA refuses to make one)
        self.seen: set = set()

    @property
    def header(self) -> str:
        if self._header is None:
            self._header = included(self.source_header)
        return self._header

    def _header_file_again(self) -> None:
        """The header's file written again, at the very path the source names, should the cache have been
        cleared since the first launch (NVRTC reads it at each compile)."""
        if self.header != self.source_header:
            write_header(Path(self.header.split('"')[1]), self.source_header)

    def job(self, inputs, template, output_dtypes) -> tuple[str, str, str]:
        """(module, kernel name, source) of a launch, as MLX names and generates it (its header's file
        made again for the compile)."""
        self._header_file_again()
        kernel = f"custom_kernel_{self.name}{template_suffix(template)}"
        ins = [(dtype_name(a.dtype), a.ndim) for a in inputs]
        source = mlx_source(kernel, self.header, self.body, self.input_names, ins, self.output_names,
                            [dtype_name(d) for d in output_dtypes], template)
        return f"{kernel}_{std_hash(source.encode()):x}", kernel, source

    def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes, template=()):
        import mlx.core as mx

        template = list(template)
        jobs = getattr(_STATE, "jobs", None)
        if jobs is not None:
            jobs.append(self.job(inputs, template, output_dtypes))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        form = (tuple(template), tuple([(a.dtype, a.ndim > 0) for a in inputs]), tuple(output_dtypes))  # ~1 us
        if form not in self.seen:
            self.seen.add(form)
            b = builder()
            if b is not None:
                b.build([self.job(inputs, template, output_dtypes)])
            else:  # (MLX compiles it itself)
                self._header_file_again()
        if self.mlx is None:
            self.mlx = mx.fast.cuda_kernel(name=self.name, input_names=self.input_names, output_names=self.output_names,
                                           source=self.body, header=self.header, ensure_row_contiguous=True)
        kw = {"template": template} if template else {}
        return self.mlx(inputs=inputs, grid=grid, threadgroup=threadgroup, output_shapes=output_shapes,
                        output_dtypes=output_dtypes, **kw)


if __name__ == "__main__":  # a compile worker (`Builder.build`): its path and jobs as JSON on stdin, their errors on stdout
    _payload = json.loads(sys.stdin.read())
    sys.path.extend(p for p in _payload["path"] if p not in sys.path)  # after the standard library's
    print(json.dumps([_compile_and_write(*job) for job in _payload["jobs"]]))
