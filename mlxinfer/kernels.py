"""mlxinfer's own GPU kernels for the MLX backend, from `metal_kernels/attention.cu` (CUDA, through
`mx.fast.cuda_kernel`) and `metal_kernels/attention.metal` (Metal, through `mx.fast.metal_kernel`).
Besides attention's, both have `qk_norm_rope` (Qwen3's per-head norms and RoPE of queries and keys, one
launch; at the end of this file). Each CUDA kernel goes to MLX as `kernel_parts` cuts it.

Three kernels share one published summation order (written out at the top of each source file):
`matmul` (every activation x activation product on a GPU: attention's scores and context), `softmax`
(every softmax of scores on a GPU) and `fused_attention` (a whole batch's attention in one launch:
decode rows and prefill chunks alike, each row reading its own sequence's cache slot up to its own
length; its blocks stride over the (row, head) work items, so its score scratch is sized by the grid).
On CUDA the fused attention has a second launch plan for few rows, the split kernels
(`split_attention`, chosen by `uses_split`): the same arithmetic, spread over the GPU one key, then
one partial-sum chain at a time: `attn_scores`, then for decode `attn_softmax_context` (each block
recomputes its heads' softmax max and total in the softmax kernel's order: one launch fewer, which
saves more host time than the recomputation costs on the GPU while few rows read short caches; over
caches of up to SHORT_MAX_KEYS keys both in one launch, `attn_short`: `uses_short`) or, for many rows
over longer caches, `attn_softmax` and `attn_context` (the choice: `uses_two_launches`).
A pass where a sequence brings many rows (a prefill chunk: `uses_rows`) takes the kernels by rows
instead, `attn_scores_rows` (32 rows x 32 keys of one sequence a block, in shared memory) and, in the
three-launch form, `attn_context_rows` (a thread walks all 32 chains of two rows): each thread sums the
32 lane partials of the published order itself, in the butterfly's tree order.
The attention kernels read q, K and V in the types they are handed (float32, bfloat16, float16: the
MLX backend's --dtype and --kv-dtype; K and V also as a q8_0 cache's packed int8 rows, each value d * q
formed in float32) and widen each value exactly before any arithmetic; the matmul
and softmax kernels take float32 (the backend widens their operands in the graph), so both paths
compute on the same float32 values. An attention's result is written in q's type (the activations'),
rounded to nearest even once, as MLX's astype rounds: the reference rounds its float32 context there
too (`Backend.per_head_attention`, step 8), so a 16-bit pass needs no conversion of its own before the
output projection. On CUDA the input types and the result's are template arguments (`input_types`,
`result_type`): MLX names a CUDA kernel by its template arguments only, so each type gets its own
compiled kernel (the scores and softmax kernels, whose outputs are float32, one whatever the result's
type).
Soft-capping (Gemma 2) is in the kernels' scores (`mlxi_score`: the reference's scale, then scale,
tanh, scale), its tanh `mlxi_tanh`, which the `tanh` kernel also gives the MLX backend's tanh primitive
on a GPU, so the reference caps its scores with the same function.
Because the per-head reference and the fused kernels are built from the same device functions, they
agree bit for bit on any number of query rows, which MLX's own products cannot promise (on CUDA a
product of more than one row goes to cuBLASLt, whose order is unpublished).

`published_dot` and `published_softmax_total` emulate the order in numpy float32, so the algorithm is
checked on any machine and the kernels are checked against it on a GPU.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

import numpy as np

from . import cuda_jit
from .batch import MIN_INDEX_ENTRIES
from .backend import softcap_inverse

SOURCES = {"metal": "attention.metal", "cuda": "attention.cu"}
THREADS = 256  # threads per block (8 warps / simdgroups of 32)
MAX_BLOCKS = 1024  # fused attention: blocks in flight (each keeps one row of scores in scratch)
MAX_HEAD_DIM = 256  # the fused kernel's shared memory holds 32 partial sums per head dimension


def source_parts(file: str) -> tuple[str, dict[str, str]]:
    """(header, {kernel name: body}) of a kernel source file of metal_kernels/ (`split_parts`)."""
    return split_parts(resources.files("metal_kernels").joinpath(file).read_text(encoding="utf-8"))


def split_parts(text: str) -> tuple[str, dict[str, str]]:
    """(header, {kernel name: body}) of a kernel source's text, split at its //@@ markers."""
    _, rest = text.split("//@@HEADER\n", 1)
    header, *bodies = rest.split("//@@BODY ")
    return header, {b.split("\n", 1)[0].strip(): b.split("\n", 1)[1] for b in bodies}


def kernel_source(kind: str) -> tuple[str, dict[str, str]]:
    """(header, {kernel name: body}) of the attention kernels' source for `kind`."""
    return source_parts(SOURCES[kind])


_INPUTS = {
    "matmul": (["a", "bt", "dims"], ["out"]),
    "softmax": (["x", "dims"], ["out"]),
    "fused_attention": (["q", "k", "v", "row_slot", "row_pos", "row_len", "scales", "dims"], ["out", "p"]),
    "tanh": (["x", "dims"], ["out"]),
    "attn_scores": (["q", "k", "row_slot", "row_pos", "row_len"], ["p"]),
    "attn_softmax_context": (["x", "v", "row_slot", "row_len"], ["out"]),
    "attn_short": (["q", "k", "v", "row_slot", "row_pos", "row_len"], ["out"]),
    "attn_softmax": (["x", "row_len"], ["out"]),
    "attn_context": (["p", "v", "row_slot", "row_len"], ["out"]),
    "attn_context_rows": (["p", "v", "row_slot", "row_len"], ["out"]),
    "attn_scores_rows": (["q", "k", "row_slot", "row_pos", "row_len", "tiles"], ["p"]),
    "qk_norm_rope": (["q", "k", "wq", "wk", "row_pos"], ["qo", "ko"]),
    "mma_matmul": (["a", "bt", "dims"], ["out"]),
    "mma_softmax": (["x", "dims"], ["out"]),
    "mma_attention": (["q", "k", "v", "pos", "scales", "dims"], ["out"]),
}
MMA_KINDS = ("cuda",)  # the tensor-core order's kernels exist in these sources
MMA_WARPS = 4  # warps a block in the tensor-core kernels (attention.cu's mma_attention is written for 4)
SPLIT_KINDS = ("cuda",)  # the split attention kernels exist in these sources (Metal: one launch only)
SPLIT_MAX_ITEMS = 1024  # (row, head) work items up to which the split kernels run: their scratch is
# 2 x items x capacity floats, the same bound as the one-launch kernel's MAX_BLOCKS x capacity ...
SPLIT_MAX_SCRATCH = 1 << 25  # ... or, for more items, while items x capacity stays within this many
# floats (128 MiB a buffer: a 512-row prefill chunk of 16 heads over a cache of up to 4,096 rows). MLX
# keeps a pass's scratch until the whole chunk is evaluated: up to 28 layers x 2 buffers = 7 GiB for
# Qwen3-0.6B, the price of a prefill about a quarter shorter than the one-launch kernel's at 2,047
# tokens on an H200 (peak memory there 9.4 against 4.0 GB; mlx-lm's own at 8,191 tokens is 22 GB)


def strip_comments(text: str) -> str:
    """The source without its // comments and blank lines (the kernels have no /* */ comments and no
    string literals)."""
    lines = (line.split("//", 1)[0].rstrip() for line in text.split("\n"))
    return "\n".join(line for line in lines if line.strip()) + "\n"


def _header_units(header: str) -> list[tuple[str | None, str]]:
    """A comment-free header cut into (name, text) units: each #define line (name None: always kept) and
    each top-level definition (a function or a struct), from its first line at column 0 to its closing
    brace at column 0."""
    units, current = [], []
    for line in header.split("\n"):
        if not line:
            continue
        if not current and line.startswith("#"):
            units.append((None, line))
            continue
        current.append(line)
        if line in ("}", "};"):
            text = "\n".join(current)
            m = re.search(r"\bstruct\s+(mlxi_\w+)", text) or re.search(r"\b(mlxi_\w+)\s*[({]", text)
            units.append((m.group(1), text))  # (a struct's own name, not a base's)
            current = []
    if current:
        raise ValueError(f"kernel header: a definition without its closing brace at column 0: {current[0]!r}")
    return units


@lru_cache(maxsize=None)
def kernel_parts(kind: str, name: str) -> tuple[str, str]:
    """(header, body) of one kernel as handed to MLX. For CUDA, without comments, and the header holding
    only the definitions the body reaches: MLX's CUDA custom kernel hashes its whole source on every
    launch (CustomKernel::eval_gpu, to name its module), ~2 us per launch for our ~16 KB (std::hash
    measured at 0.13 us per KB on this project's x86 VM) and a decode token launches 3 of ours a layer;
    here 0.9-7 KB. Metal's sources go as written (their header is ~2 KB, all of it used by the fused
    kernel)."""
    header, bodies = kernel_source(kind)
    if kind != "cuda":
        return header, bodies[name]
    return pruned(header, bodies[name])


def pruned(header: str, body: str) -> tuple[str, str]:
    """(header, body) without comments, the header holding only its #defines and the definitions the
    body reaches (by the `mlxi_` names it and they use): what a CUDA kernel hands MLX (`kernel_parts`)."""
    body = strip_comments(body)
    units = _header_units(strip_comments(header))
    defined: dict[str, str] = {}  # each name's text, all its overloads'
    for n, text in units:
        if n:
            defined[n] = defined.get(n, "") + text
    needed, todo = set(), set(re.findall(r"\bmlxi_\w+", body))
    while todo:
        n = todo.pop()
        if n in defined and n not in needed:
            needed.add(n)
            todo |= set(re.findall(r"\bmlxi_\w+", defined[n]))
    return "\n".join(text for n, text in units if n is None or n in needed) + "\n", body


@lru_cache(maxsize=None)
def _kernel(kind: str, name: str):
    import mlx.core as mx

    header, body = kernel_parts(kind, name)
    inputs, outputs = _INPUTS[name]
    if kind == "cuda":  # compiled into MLX's kernel cache once per machine (`cuda_jit`)
        return cuda_jit.Kernel(f"mlxinfer_{name}_{kind}", inputs, outputs, body, header)
    return mx.fast.metal_kernel(name=f"mlxinfer_{name}_{kind}", input_names=inputs, output_names=outputs,
                                source=body, header=header, ensure_row_contiguous=True)


METAL_CONSTANT_BELOW = 8  # MLX's metal_kernel passes an input of fewer elements in `constant` memory
METAL_ATTRIBUTES = {  # the thread attributes MLX 0.32's metal_kernel declares when the body names one
    "dispatch_quadgroups_per_threadgroup": "uint", "dispatch_simdgroups_per_threadgroup": "uint",
    "dispatch_threads_per_threadgroup": "uint3", "grid_origin": "uint3", "grid_size": "uint3",
    "quadgroup_index_in_threadgroup": "uint", "quadgroups_per_threadgroup": "uint",
    "simdgroup_index_in_threadgroup": "uint", "simdgroups_per_threadgroup": "uint",
    "thread_execution_width": "uint", "thread_index_in_quadgroup": "uint", "thread_index_in_simdgroup": "uint",
    "thread_index_in_threadgroup": "uint", "thread_position_in_grid": "uint3",
    "thread_position_in_threadgroup": "uint3", "threadgroup_position_in_grid": "uint3",
    "threadgroups_per_grid": "uint3", "threads_per_grid": "uint3", "threads_per_simdgroup": "uint",
    "threads_per_threadgroup": "uint3"}
_METAL_TYPES = {"float32": "float", "int32": "int32_t", "bfloat16": "bfloat16_t", "float16": "float16_t", "int8": "int8_t"}


def metal_kernel_source(name: str, inputs, outputs=None, template=None) -> str:
    """The source MLX 0.32's `mx.fast.metal_kernel` compiles for kernel `name` launched on `inputs`
    ([(dtype name, size)], one per input) with outputs of dtypes `outputs` (dtype names; default all
    float32) and int template arguments `template` ([(name, value)]), after MLX's own header: our header,
    then the [[kernel]] signature its `write_signature` (mlx/backend/common/metal_kernel.cpp) generates,
    each input `constant` below METAL_CONSTANT_BELOW elements and `device` otherwise, followed by its
    shape, strides and ndim where the body names them, then the body, and for a template its explicit
    instantiation. What the checks here compile and measure (tests/test_metal_*.py), since no Metal
    compiler runs here."""
    header, body = kernel_parts("metal", name)
    names, out_names = _INPUTS[name]
    outputs = list(outputs or ["float32"] * len(out_names))
    params = []
    for n, (dtype, size) in zip(names, inputs, strict=True):
        params.append(f"  const {'constant' if size < METAL_CONSTANT_BELOW else 'device'} {_METAL_TYPES[dtype]}* {n} "
                      f"[[buffer({len(params)})]]")
        for info, ctype in (("shape", "int*"), ("strides", "int64_t*"), ("ndim", "int&")):
            if f"{n}_{info}" in body:
                params.append(f"  const constant {ctype} {n}_{info} [[buffer({len(params)})]]")
    params += [f"  device {_METAL_TYPES[d]}* {o} [[buffer({len(params) + i})]]"
               for i, (o, d) in enumerate(zip(out_names, outputs, strict=True))]
    params += [f"  {t} {a} [[{a}]]" for a, t in METAL_ATTRIBUTES.items() if a in body]
    args = "<" + ", ".join(str(int(v)) for _, v in template) + ">" if template else ""
    kernel = f"custom_kernel_mlxinfer_{name}_metal"
    if template:
        kernel += "_" + args.replace("<", "_").replace(">", "_").replace(", ", "_")[:-1]
    kernel += "".join(f"_{_METAL_TYPES[d]}{'c' if size < METAL_CONSTANT_BELOW else ''}" for d, size in inputs)
    kernel += "".join(f"_{_METAL_TYPES[d]}" for d in outputs)
    declared = "template <" + ", ".join(f"int {n}" for n, _ in template) + ">\n" if template else ""
    instance = (f'\ntemplate [[host_name("{kernel}")]] [[kernel]] decltype({kernel}{args}) {kernel}{args};\n'
                if template else "")
    return (f"{header}{declared}[[kernel]] void {kernel}(\n" + ",\n".join(params) + ") {\n" + body + "\n}\n"
            + instance)


def kernel_args(*values):
    """A kernel's int32 arguments as its `dims` input (here and in block_kernels), zero-padded to
    `batch.MIN_INDEX_ENTRIES` (an array of up to two would sit in MLX's small host-memory pool, which the
    GPU reads across the bus)."""
    import mlx.core as mx

    return mx.array(list(values) + [0] * (MIN_INDEX_ENTRIES - len(values)), dtype=mx.int32)


def matmul(kind: str, a, bt, group: int = 1):
    """out[b, i, j] = dot(a[b, i, :], bt[b // group, j, :]) in the published order: a [B, M, K],
    bt [B // group, N, K] (the right-hand operand stored transposed) -> [B, M, N] float32."""
    import mlx.core as mx

    nb, m, k = a.shape
    n = bt.shape[1]
    blocks = -(-nb * m * n // 8)  # 8 warps per block, one output per warp
    (out,) = _kernel(kind, "matmul")(
        inputs=[a, bt, kernel_args(nb, m, n, k, group)], grid=launch_grid(blocks),
        threadgroup=(THREADS, 1, 1), output_shapes=[(nb, m, n)], output_dtypes=[mx.float32])
    return out


def softmax(kind: str, x):
    """Softmax of each row of x [R, n] in the published order."""
    import mlx.core as mx

    r, n = x.shape
    (out,) = _kernel(kind, "softmax")(
        inputs=[x, kernel_args(r, n)], grid=(r * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(r, n)], output_dtypes=[mx.float32])
    return out


def launch_grid(blocks: int, threads: int = THREADS, columns: int = 65535) -> tuple[int, int, int]:
    """A launch of `blocks` blocks of `threads` threads as a 2-D grid, rows of at most `columns` blocks (a
    grid's first dimension holds 65,535; tests pass fewer to make small launches take several rows): the
    attention kernels' and block_kernels'."""
    cols = min(blocks, columns)
    return (cols * threads, -(-blocks // cols), 1)


# -- the tensor-core order (attention.cu, "The tensor-core order"): 16-bit dtypes, prefill chunks ----
def _bits16(a):
    """A bfloat16 / float16 array as its 16-bit patterns (what the tensor-core kernels read)."""
    import mlx.core as mx

    return mx.view(a, mx.uint16)


def mma_matmul(kind: str, a, bt, group: int = 1):
    """out[b, i, j] = mma_dot(a[b, i, :], bt[b // group, j, :]): a float32 [B, M, K] (each value rounded to
    bt's 16-bit type as the kernel reads it), bt bfloat16 or float16 [B // group, N, K] -> [B, M, N]
    float32, in k-steps of 16 on the tensor cores."""
    import mlx.core as mx

    nb, m, k = a.shape
    n = bt.shape[1]
    warps = nb * -(-m // 16) * -(-n // 8)
    (out,) = _kernel(kind, "mma_matmul")(
        inputs=[a.astype(mx.float32), _bits16(bt), kernel_args(nb, m, n, k, group)],
        template=[("BF", bt.dtype == mx.bfloat16)], grid=launch_grid(-(-warps // MMA_WARPS), 32 * MMA_WARPS),
        threadgroup=(32 * MMA_WARPS, 1, 1), output_shapes=[(nb, m, n)], output_dtypes=[mx.float32])
    return out


def mma_softmax(kind: str, x):
    """Softmax of each row of float32 x [R, n] in the tensor-core path's order (four chains a row)."""
    import mlx.core as mx

    r, n = x.shape
    (out,) = _kernel(kind, "mma_softmax")(
        inputs=[x, kernel_args(r, n)], grid=launch_grid(-(-4 * r // THREADS)), threadgroup=(THREADS, 1, 1),
        output_shapes=[(r, n)], output_dtypes=[mx.float32])
    return out


def mma_supported() -> bool:
    """Whether this CUDA GPU has the m16n8k16 bfloat16 / float16 instruction (compute capability 8.0 or
    more: Ampere, Ada, Hopper, Blackwell); False where MLX cannot say."""
    import mlx.core as mx

    try:
        return int(mx.device_info(mx.gpu)["compute_capability_major"]) >= 8
    except Exception:
        return False


def mma_fits(spec) -> bool:
    """Whether `mma_attention` takes this head size (whole k-steps of 16, registers for up to 256)."""
    return spec.head_dim % 16 == 0 and spec.head_dim <= MAX_HEAD_DIM


def mma_attention(kind: str, q, keys, values, positions, spec, out_dtype=None):
    """One sequence's prefill chunk, every head, in the tensor-core order: q [T, H*D] and the sequence's
    keys, values [S, KV*D], all bfloat16 or all float16; positions int32 [T] -> [T, H*D] in `out_dtype`
    (default q's dtype), the
    bits of the per-head reference's steps 3-7 on the MLX backend for 16-bit chunks of PREFILL_ROWS rows
    or more (mma_matmul, scale, soft-cap, mask, mma_softmax, mma_matmul)."""
    import mlx.core as mx

    out_dtype = out_dtype or q.dtype
    t, s = q.shape[0], keys.shape[0]
    blocks = -(-t // (16 * MMA_WARPS)) * spec.n_heads  # a block: one head, 64 rows
    dims = kernel_args(t, s, spec.n_heads, spec.n_kv_heads, int(spec.causal), int(spec.window or 0))
    scales = mx.array([spec.scale, *softcap_values(spec)], dtype=mx.float32)
    (out,) = _kernel(kind, "mma_attention")(
        inputs=[_bits16(q), _bits16(keys), _bits16(values), positions, scales, dims],
        template=[("BF", q.dtype == mx.bfloat16), ("D", spec.head_dim), *result_type(kind, out_dtype)],
        grid=launch_grid(blocks, 32 * MMA_WARPS), threadgroup=(32 * MMA_WARPS, 1, 1),
        output_shapes=[(t, spec.n_heads * spec.head_dim)], output_dtypes=[out_dtype])
    return out


TWO_LAUNCH_ROWS = 1  # the split plan's two-launch form for up to this many rows, or ...
TWO_LAUNCH_MAX_KEYS = 1 << 14  # ... while rows x capacity <= this. The two-launch form recomputes
# the softmax in its context pass, GPU time that grows with rows x keys, to save one launch: ~16-21 us
# of host time, and decode is host-bound. On an H200's device clock one row takes about as long either
# way (within ~30%, either side, from 512 to 32,768 keys), eight rows 13-23% longer in two launches.


ROWS_MIN = 64  # a pass takes the kernels by rows (`attn_scores_rows`; in the three-launch form also
ROWS_MAX_KEYS_PER_ROW = 64  # `attn_context_rows`) when one of its sequences brings at least ROWS_MIN
# rows (a prefill chunk) and the capacity is at most ROWS_MAX_KEYS_PER_ROW times that many: every row
# of such a pass, decode rows beside the chunk included, then runs by rows (a decode row alone: a thread
# walks all of its keys), so a few rows over a long cache keep the kernels by key, which spread every
# key and chain over the GPU. By rows, a 511-row chunk's attention takes about 0.4x its time by key on
# an H200. That is known for chunks of 511 and 2,047 rows over caches of their own length only: hence a
# bound of 64 rows, until shorter chunks over longer caches are measured.


CONTEXT_ROWS_FORM = [("NHB", 1), ("UR", 4)]  # attn_context_rows: heads a thread takes at once (1 or 2),
# keys of a chain unrolled (loads in flight); the arithmetic and its order are the same for any. Of
# 2x2, 2x4, 1x4 and 1x8 (NHB x UR), 1x4 makes the fastest attention of a 511- and of a 2,047-row chunk on
# an H200, a fifth or more faster than two heads a thread (146 registers, one block an SM; one head: 96).


def split_unroll(rows: int, capacity: int) -> list[tuple[str, int]]:
    """`attn_softmax_context`'s form: SU scores per head in flight in its softmax pass, KU values in its
    context loop, PF (prefetch the next KU values and scores) and WS (whole steps without key checks
    first; see the kernel). One row has 128 blocks for 132 SMs, each waiting on memory, so it keeps
    more loads in flight (faster on an H200 at 2,048 and at 32,768 keys); with 8 rows that form is
    slower (more registers, fewer blocks at once), so several rows keep (1, 8) without PF and WS. One
    row: `ONE_ROW_FORM` over caches of up to ONE_ROW_LONG_FORM_ABOVE keys, else
    `ONE_ROW_LONG_FORM`. The arithmetic and its order are the same in every form."""
    if rows > 1:
        return [("SU", 1), ("KU", 8), ("PF", 0), ("WS", 0)]
    return list(ONE_ROW_FORM if capacity <= ONE_ROW_LONG_FORM_ABOVE else ONE_ROW_LONG_FORM)


ONE_ROW_FORM = (("SU", 8), ("KU", 32), ("PF", 0), ("WS", 1))  # one row, caches of up to ...
ONE_ROW_LONG_FORM_ABOVE = 4096  # ... this many keys; above it:
ONE_ROW_LONG_FORM = (("SU", 8), ("KU", 32), ("PF", 1), ("WS", 1))
ONE_ROW_FORMS = tuple((("SU", 8), ("KU", ku), ("PF", pf), ("WS", ws)) for ku, pf, ws in  # every form
                      ((32, 0, 0), (32, 1, 0), (32, 0, 1), (32, 1, 1), (64, 0, 1), (16, 1, 1)))  # the
# one-row kernel has; tests/test_mlx_backend.py checks each bit for bit on a GPU, tests/test_kernels.py
# compiles each. Most of a 32-key step's instructions are index arithmetic and key checks, which WS
# removes: a fifth to a quarter off one row's attention from 2,048 keys on an H200. PF pays only beside
# WS over long caches (over a third off at 32,768 keys; alone, nothing), hence ONE_ROW_LONG_FORM. With
# this rule one row is at least as fast as mx.fast.scaled_dot_product_attention there at every context
# from 512 to 32,768 keys.


SHORT_MAX_ROWS = 8  # the two-launch form's work in one launch (`attn_short`) for up to this many rows over
SHORT_MAX_KEYS = 256  # a cache of up to this many keys, where a block's shared memory holds its group's
SHORT_MAX_BYTES = 32 << 10  # scores (G heads x SHORT_MAX_KEYS floats, at most this many bytes). Each of
# the head size / 8 blocks of a (row, KV head) computes its scores itself, a chain of key loads a warp
# that grows with the keys: up to ~80 keys its device time is within a microsecond of the two launches',
# over 256 up to twice theirs, over 1,024 five times. A 0.6B decode step is bound by its launches and
# gains a tenth; an 8B one is bound by the device, hence a preallocated store's first step (256 keys)
# and no more (docs/performance.md has the figures).


def short_fits(spec, capacity: int) -> bool:
    """Whether `attn_short`'s shared scores hold a cache of `capacity` keys for `spec`'s groups."""
    return 0 < capacity <= SHORT_MAX_KEYS and spec.n_heads // spec.n_kv_heads * SHORT_MAX_KEYS * 4 <= SHORT_MAX_BYTES


def uses_short(rows: int, spec, capacity: int) -> bool:
    """Whether the split plan's two-launch form runs as one launch (`attn_short`)."""
    return rows <= SHORT_MAX_ROWS and short_fits(spec, capacity)


def uses_two_launches(rows: int, capacity: int) -> bool:
    """Whether the split plan computes softmax and context in one launch (`attn_softmax_context`)."""
    return rows <= TWO_LAUNCH_ROWS or rows * capacity <= TWO_LAUNCH_MAX_KEYS


def uses_split(kind: str, rows: int, spec, capacity: int = 0) -> bool:
    """Whether `fused_attention` takes the split kernels for a pass of `rows` query rows over a cache
    of `capacity` rows."""
    items = rows * spec.n_heads
    return kind in SPLIT_KINDS and (items <= SPLIT_MAX_ITEMS or items * capacity <= SPLIT_MAX_SCRATCH)


def uses_rows(seq_rows, capacity: int) -> bool:
    """Whether a split pass takes the kernels by rows (see ROWS_MIN); seq_rows: each sequence's (first,
    end) rows, None for a compiled decode step (never by rows)."""
    if seq_rows is None:
        return False
    longest = max(r1 - r0 for r0, r1 in seq_rows)
    return longest >= ROWS_MIN and capacity <= ROWS_MAX_KEYS_PER_ROW * longest


@lru_cache(maxsize=256)
def _checked_rows(seq_rows: tuple, n: int) -> tuple:
    """seq_rows as given, once checked to cut the pass's n rows into consecutive runs (cached: every
    layer of a pass hands the same)."""
    if seq_rows[0][0] != 0 or seq_rows[-1][1] != n or any(r1 <= r0 for r0, r1 in seq_rows) or any(
            a[1] != b[0] for a, b in zip(seq_rows, seq_rows[1:])):
        raise ValueError(f"seq_rows must cut the pass's {n} rows into consecutive runs, got {seq_rows[:4]}...")
    return seq_rows


@lru_cache(maxsize=256)
def _score_tiles(seq_rows: tuple):
    """attn_scores_rows' tiles: each sequence's rows cut into runs of at most 32 (first row, rows), as
    one int32 array (cached: every layer of a pass asks for the same)."""
    import mlx.core as mx

    tiles = [(t0, min(32, r1 - t0)) for r0, r1 in seq_rows for t0 in range(r0, r1, 32)]
    return mx.array(np.array(tiles, dtype=np.int32).reshape(-1))


def input_types(kind: str, q, keys) -> list:
    """The template arguments that name a CUDA attention kernel's input types (MLX's CUDA kernel cache
    is keyed by name and template arguments, not by the inputs' dtypes; KVT int8: a q8_0 cache's packed
    rows); Metal's names carry them."""
    return [("QT", q.dtype), ("KVT", keys.dtype)] if kind == "cuda" else []


def result_type(kind: str, out_dtype) -> list:
    """The template argument that names the type a CUDA kernel writes an attention's result in (OT), for
    the kernels that write it; Metal's names carry it."""
    return [("OT", out_dtype)] if kind == "cuda" else []


def softcap_values(spec) -> tuple[float, float]:
    """(cap, its float32 inverse) of a soft-capped spec, (0, 0) without one: what the kernels' mlxi_score
    takes (a cap of 0 is none)."""
    return (float(np.float32(spec.softcap)), softcap_inverse(spec.softcap)) if spec.softcap else (0.0, 0.0)


def tanh(kind: str, x):
    """tanh of float32 x (any shape) elementwise, by mlxi_tanh: the function the attention kernels cap
    their scores with (the MLX backend's tanh on a GPU, so that the reference caps with it too)."""
    import mlx.core as mx

    n = x.size
    (out,) = _kernel(kind, "tanh")(inputs=[mx.reshape(x, (-1,)), kernel_args(n)], grid=launch_grid(-(-n // THREADS)),
                                   threadgroup=(THREADS, 1, 1), output_shapes=[(n,)], output_dtypes=[mx.float32])
    return mx.reshape(out, x.shape)


def fused_attention(kind: str, q, keys, values, row_slot, row_pos, row_len, spec, split: bool | None = None,
                    seq_rows=None, out_dtype=None):
    """A batch's attention: q [N, H*D]; keys and values [slots, capacity, KV*D]; per row its cache slot,
    position and its sequence's length (int32 arrays). -> [N, H*D] in `out_dtype` (default: q's dtype;
    float32 keeps every bit of the published order's result, what the checks compare).

    Two launch plans compute the same bits. Few rows (decode) and short prefill chunks (`uses_split`, or
    split=True) take the split kernels: scores with one warp per key, then the softmax and the context
    with one thread per partial-sum chain of the published order (in one launch, or the softmax with
    one block per row and head first: `uses_two_launches`); every key is spread over the GPU. Long
    prefill chunks over long caches take the one-launch kernel, one block per (row, head) work item,
    whose scratch is bounded by its grid. `seq_rows`: each sequence's rows of the pass, (first, end)
    host ints (None: one row each, as in a compiled decode step): a split pass where a sequence brings
    at least ROWS_MIN rows over a cache of at most ROWS_MAX_KEYS_PER_ROW keys a row of it runs all its
    rows by rows (`uses_rows`: `attn_scores_rows`, `attn_context_rows`)."""
    import mlx.core as mx

    if split if split is not None else uses_split(kind, q.shape[0], spec, keys.shape[1]):
        return split_attention(kind, q, keys, values, row_slot, row_pos, row_len, spec, seq_rows=seq_rows,
                               out_dtype=out_dtype)
    out_dtype = out_dtype or q.dtype
    n = q.shape[0]
    cap = keys.shape[1]
    dims = kernel_args(cap, spec.n_heads, spec.n_kv_heads, spec.head_dim, int(spec.causal), int(spec.window or 0), n)
    blocks = min(n * spec.n_heads, MAX_BLOCKS)
    types = input_types(kind, q, keys) + result_type(kind, out_dtype)
    scales = mx.array([spec.scale, *softcap_values(spec)], dtype=mx.float32)
    out, _ = _kernel(kind, "fused_attention")(
        inputs=[q, keys, values, row_slot, row_pos, row_len, scales, dims],
        grid=(blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1), **({"template": types} if types else {}),
        output_shapes=[(n, spec.n_heads * spec.head_dim), (blocks, cap)], output_dtypes=[out_dtype, mx.float32])
    return out


def split_attention(kind, q, keys, values, row_slot, row_pos, row_len, spec, steps: int = 3,
                     two_launches: bool | None = None, seq_rows=None, by_rows: bool | None = None, out_dtype=None,
                     short: bool | None = None):
    """The split plan: scores, then softmax and context in one launch (`two_launches`, by default
    `uses_two_launches`) or two; the two-launch form over a short cache in one launch (`short`, by
    default `uses_short`: `attn_short`). `steps=1` stops after the scores and returns them, `steps=2` after the
    three-launch form's softmax (bench/probes/decode_attention.py and prefill_attention.py time the steps),
    both float32, `steps=3` runs the whole plan (its result in `out_dtype`, default q's dtype). `seq_rows` as fused_attention's; `by_rows` forces the kernels by rows
    (True) or the others (False). The attention's shape is compiled into the kernels."""
    import mlx.core as mx

    if steps not in (1, 2, 3):
        raise ValueError(f"steps must be 1 (scores), 2 (and softmax) or 3 (the whole plan), got {steps}")
    n, cap = q.shape[0], keys.shape[1]
    out_dtype = out_dtype or q.dtype
    softcap, softcap_inv = softcap_values(spec)
    template = [("H", spec.n_heads), ("KV", spec.n_kv_heads), ("D", spec.head_dim), ("CAUSAL", bool(spec.causal)),
                ("WINDOW", int(spec.window or 0)), ("SCALE_BITS", f32_bits(spec.scale)), ("SOFTCAP_BITS", f32_bits(softcap)),
                ("SOFTCAP_INV_BITS", f32_bits(softcap_inv)), *input_types(kind, q, keys)]
    result = result_type(kind, out_dtype)  # (the context kernels': the scores and softmax are float32)
    shape = [(n, spec.n_heads, cap)]
    if two_launches is None:
        two_launches = uses_two_launches(n, cap)
    if seq_rows is not None:  # None: one row a sequence (a decode step), nothing to check
        seq_rows = _checked_rows(tuple((int(r0), int(r1)) for r0, r1 in seq_rows), n)
    if by_rows is None:
        by_rows = uses_rows(seq_rows, cap)
    if short is None:
        short = uses_short(n, spec, cap)
    context = dict(grid=launch_grid(n * spec.n_kv_heads * -(-spec.head_dim // 8)), threadgroup=(THREADS, 1, 1),
                   output_shapes=[(n, spec.n_heads * spec.head_dim)], output_dtypes=[out_dtype])
    if short and two_launches and steps == 3 and not by_rows:
        if not short_fits(spec, cap):
            raise ValueError(f"attn_short's shared scores hold {SHORT_MAX_KEYS} keys of at most "
                             f"{SHORT_MAX_BYTES // (4 * SHORT_MAX_KEYS)} heads, not {cap} keys of a group of "
                             f"{spec.n_heads // spec.n_kv_heads}")
        (out,) = _kernel(kind, "attn_short")(inputs=[q, keys, values, row_slot, row_pos, row_len],
                                             template=template + split_unroll(n, cap) + [("SK", SHORT_MAX_KEYS)] + result,
                                             **context)
        return out
    if by_rows and spec.head_dim <= 128:  # tiles of up to 32 rows of one sequence x 32 keys
        tiles = _score_tiles(tuple((r, r + 1) for r in range(n)) if seq_rows is None else seq_rows)
        (out,) = _kernel(kind, "attn_scores_rows")(
            inputs=[q, keys, row_slot, row_pos, row_len, tiles],
            template=template, grid=launch_grid(tiles.size // 2 * spec.n_kv_heads * -(-cap // 32)),
            threadgroup=(THREADS, 1, 1), output_shapes=shape, output_dtypes=[mx.float32])
    else:
        (out,) = _kernel(kind, "attn_scores")(
            inputs=[q, keys, row_slot, row_pos, row_len], template=template,
            grid=launch_grid(n * spec.n_kv_heads * -(-cap // 64)), threadgroup=(THREADS, 1, 1),
            output_shapes=shape, output_dtypes=[mx.float32])
    if steps == 1:
        return out
    if two_launches and steps == 3:
        (out,) = _kernel(kind, "attn_softmax_context")(inputs=[out, values, row_slot, row_len],
                                                       template=template + split_unroll(n, cap) + result, **context)
        return out
    (out,) = _kernel(kind, "attn_softmax")(  # one block per (row, head)
        inputs=[out, row_len], grid=(n * spec.n_heads * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=shape, output_dtypes=[mx.float32])
    if steps == 2:
        return out
    if by_rows:  # a warp per (two rows, KV head, 128 head dimensions)
        warps = -(-n // 2) * spec.n_kv_heads * -(-spec.head_dim // 128)
        context["grid"] = launch_grid(-(-warps // (THREADS // 32)))
        (out,) = _kernel(kind, "attn_context_rows")(inputs=[out, values, row_slot, row_len],
                                                    template=template + CONTEXT_ROWS_FORM + result, **context)
        return out
    (out,) = _kernel(kind, "attn_context")(inputs=[out, values, row_slot, row_len], template=template + result,
                                           **context)
    return out


# -- the published order in numpy (float32, bit-exact for the sums) ---------------------------------
LANES = 32  # dot products: lane l sums the terms l, l + LANES, ... (one warp / simdgroup)
DOT_BUTTERFLY = (16, 8, 4, 2, 1)  # then the lanes' partials, s += shuffle_xor(s, off) for these offsets
WARP_TOTALS_BUTTERFLY = (4, 2, 1)  # softmax: THREADS thread-strided partials, DOT_BUTTERFLY in each warp,
# then the 8 warp totals by these offsets. tests/test_metal_order.py reads all of this (and the exp,
# division and tanh the kernels use: EXACT_MATH) from metal_kernels/attention.metal and fails where they
# differ. (precise::tanh is not correctly rounded, but it is MLX's, and the reference takes the kernels'.)
EXACT_MATH = ("metal::precise::exp", "metal::precise::divide", "metal::precise::tanh")
def _butterfly(partials: np.ndarray, offsets) -> np.ndarray:
    """Combine partial sums on the last axis as the kernels' xor butterfly does; returns lane 0's."""
    p = partials.astype(np.float32)
    lanes = np.arange(p.shape[-1])
    for off in offsets:
        p = (p + p[..., lanes ^ off]).astype(np.float32)
    return p[..., 0]


def published_dot(a: np.ndarray, bt: np.ndarray) -> np.ndarray:
    """[M, K] x [N, K] -> [M, N], each dot product in the kernels' order: 32 lane-strided partial
    sums of rounded products, then the butterfly 16, 8, 4, 2, 1."""
    a, bt = np.asarray(a, np.float32), np.asarray(bt, np.float32)
    m, k = a.shape
    n = bt.shape[0]
    partial = np.zeros((m, n, LANES), dtype=np.float32)
    for i in range(0, k, LANES):
        w = min(LANES, k - i)
        prod = (a[:, None, i:i + w] * bt[None, :, i:i + w]).astype(np.float32)
        partial[:, :, :w] = (partial[:, :, :w] + prod).astype(np.float32)
    return _butterfly(partial, DOT_BUTTERFLY)


def published_softmax_total(e: np.ndarray) -> np.float32:
    """The softmax kernel's sum of the already-exponentiated values e [n]: 256 thread-strided partial
    sums, a butterfly within each warp of 32, then over the 8 warp totals."""
    e = np.asarray(e, np.float32)
    partial = np.zeros(THREADS, dtype=np.float32)
    for i in range(0, e.size, THREADS):
        w = min(THREADS, e.size - i)
        partial[:w] = (partial[:w] + e[i:i + w]).astype(np.float32)
    warp_totals = _butterfly(partial.reshape(THREADS // LANES, LANES), DOT_BUTTERFLY)
    return _butterfly(warp_totals[None, :], WARP_TOTALS_BUTTERFLY)[0]


# -- Qwen3's per-head RMSNorm and RoPE of queries and keys, one launch -----------------------------------
QK_NORM_ROPE_KINDS = ("cuda", "metal")  # the sources that have it (Metal's checked at first use: backends.mlx)


def rope16_bound(out: np.ndarray, head_dim: int, u: float) -> np.ndarray:
    """How far a 16-bit qk_norm_rope output may be from another computation of it with the same roundings
    (mx.fast's: the normalized value and its product by the weight rounded to the type, the rotation in
    float32 rounded once), [rows, heads*head_dim] like `out`. The float32 parts (sum of squares, 1/sqrt,
    sin/cos: ~2.5e-6 of outputs up to ~10) can move a value across a rounding boundary: one unit in the
    type's last place, at most 2u of the value (u = 2^-8 bfloat16, 2^-11 float16), at the normalized
    value (then times the weight, ~1 here) and again at its product by the weight: 4u of each of the
    pair (x1, x2) the rotation takes, so 4u (|x1| + |x2|) of the output, and 2u |out| at its own
    rounding; |x1| + |x2| <= sqrt(2) times the rotated pair's length. Where x1 cos - x2 sin nearly
    cancels, that is many units of the output's last place."""
    pairs = out.reshape(out.shape[0], -1, 2, head_dim // 2)
    length = np.sqrt((pairs.astype(np.float64) ** 2).sum(axis=2, keepdims=True))
    pair = np.broadcast_to(length, pairs.shape).reshape(out.shape)
    return 4 * u * np.sqrt(2) * pair + 2 * u * np.abs(out) + 2.5e-6


QK_NORM_ROPE_UNIT = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}  # u of `rope16_bound`; float32: 2e-6 rel + abs


def qk_norm_rope_fits(head_dim: int, traditional: bool) -> bool:
    """Whether the qk_norm_rope kernel serves this shape: rotate-half RoPE, head_dim a multiple of 64 (each
    rotated pair in one lane) up to MAX_HEAD_DIM."""
    return not traditional and head_dim % 64 == 0 and head_dim <= MAX_HEAD_DIM


def qk_norm_rope_types_fit(q, k, wq, wk) -> bool:
    """Whether the qk_norm_rope kernel takes these arrays' types: q, k and their weights of one float
    type (the kernel reads and writes that type)."""
    import mlx.core as mx

    return len({q.dtype, k.dtype, wq.dtype, wk.dtype}) == 1 and q.dtype in (mx.float32, mx.bfloat16, mx.float16)


def f32_bits(x: float) -> int:
    """The bits of float32(x) as a signed int32: how a float reaches a kernel as a template constant or
    in an int32 input (here and in block_kernels)."""
    return int(np.array(x, dtype=np.float32).view(np.int32))


@lru_cache(maxsize=None)
def _log2f(x: float) -> float:
    """C's log2f of float32 x: what MLX's rope kernels take of their float base (std::log2(float)); a
    last-bit difference would move theta by ~4e-4 radians at position 40,000. Correctly rounded from
    float64 where no C library answers."""
    import ctypes
    import ctypes.util

    try:
        f = ctypes.CDLL(ctypes.util.find_library("m") or None).log2f
    except (OSError, AttributeError):
        return float(np.float32(np.log2(np.float64(np.float32(x)))))
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return float(f(float(np.float32(x))))


def qk_norm_rope(kind: str, q, k, wq, wk, row_pos, n_heads: int, n_kv_heads: int, head_dim: int, eps: float,
                 base: float):
    """(q, k) after each head's RMSNorm (weights wq, wk [head_dim]) and rotate-half RoPE at each row's
    position, in one launch of `kind`'s kernel (QK_NORM_ROPE_KINDS): q [N, n_heads*head_dim], k [N, n_kv_heads*head_dim] (a decode row's slices of
    the Q/K/V product are contiguous; other slices are copied by MLX first), q, k and the weights of one
    type (float32, bfloat16 or float16: the activations'), the outputs of that type too. On each device
    the operations and roundings of MLX's own rms_norm and rope kernels there but for the sum of squares'
    order (metal_kernels/attention.cu, attention.metal), so not their bits: tests/test_mlx_backend.py
    bounds the difference on CUDA, `backends.mlx.verify_qk_norm_rope` at first use on Metal."""
    import mlx.core as mx

    if not qk_norm_rope_fits(head_dim, False):
        raise ValueError(f"qk_norm_rope: head_dim {head_dim} is not a multiple of 64 up to {MAX_HEAD_DIM}")
    if not qk_norm_rope_types_fit(q, k, wq, wk):
        raise ValueError(f"qk_norm_rope: q, k and their weights must be of one float type, not "
                         f"{q.dtype}, {k.dtype}, {wq.dtype}, {wk.dtype}")
    n = q.shape[0]
    log2_base = _log2f(base)
    template = [("H", n_heads), ("KV", n_kv_heads), ("D", head_dim), ("EPS_BITS", f32_bits(eps)),
                ("LOG2_BASE_BITS", f32_bits(log2_base))]
    qo, ko = _kernel(kind, "qk_norm_rope")(
        inputs=[q, k, wq, wk, row_pos], template=template, grid=launch_grid(-(-n * (n_heads + n_kv_heads) // 8)),
        threadgroup=(THREADS, 1, 1), output_shapes=[q.shape, k.shape], output_dtypes=[q.dtype, k.dtype])
    return qo, ko
