"""The Metal kernels through clang here (libclang from PyPI; no Apple compiler runs on Linux): each
generated kernel, the whole source MLX would compile (`kernels.metal_kernel_source`), parsed against
tests/metal_stub.h, which stands in for Metal's types, address spaces and built-ins. Two departures from
Metal's language, both in how the text is read, not in what it says: clang's C++14 is the dialect (Metal's
is C++14 with extensions), a `threadgroup` array declared in a kernel body is read as `static`
(clang refuses an address space on an automatic variable; Metal's threadgroup arrays live as long as the
threadgroup, which is what `static` says), and a template kernel's explicit instantiation (MLX's
`template [[host_name("...")]] [[kernel]] decltype(f<...>) f<...>;`) is read without its two attribute
lists (C++ allows none there; what is instantiated, and with which arguments, is unchanged). Not collected by pytest (not a test_*.py file)."""

from __future__ import annotations

import re
from pathlib import Path

STUB = Path(__file__).with_name("metal_stub.h")
TG_BYTES = 32768  # threadgroup memory of a threadgroup on Apple silicon (Metal feature set tables)
TG_THREADS = 1024  # threads of a threadgroup


def available() -> bool:
    try:
        import clang.cindex  # noqa: F401
    except ImportError:
        return False
    return True


def parse(source: str, name: str = "kernel.metal"):
    """The translation unit of `source` (a generated kernel) after the stub header, as clang parses it."""
    import clang.cindex as ci

    text = re.sub(r"(?m)^(\s*)threadgroup\b", r"\1static threadgroup", source)
    text = re.sub(r'(?m)^template \[\[host_name\("\w+"\)\]\] \[\[kernel\]\] ', "template ", text)
    args = ["-x", "c++", "-std=c++14", "-fsyntax-only", "-include", str(STUB), "-I", "/mlxinfer-metal-stub"]
    return ci.Index.create().parse(name, args=args, unsaved_files=[
        (name, text), ("/mlxinfer-metal-stub/metal_simdgroup", "#pragma once\n")])


def errors(tu) -> list[str]:
    """Diagnostics of error severity (or worse), each 'line:col: message'."""
    return [f"{d.location.line}:{d.location.column}: {d.spelling}" for d in tu.diagnostics if d.severity >= 3]


def threadgroup_arrays(tu) -> dict[str, int]:
    """{name: bytes} of every variable in the threadgroup address space the kernel declares."""
    import clang.cindex as ci

    out = {}
    for c in tu.cursor.walk_preorder():
        if c.kind == ci.CursorKind.VAR_DECL and re.search(r"\bthreadgroup\b|address_space\(3\)", c.type.spelling):
            out[c.spelling] = c.type.get_size()
    return out
