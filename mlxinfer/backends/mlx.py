"""MLX backend: every primitive is an MLX graph builder (lazy `mx.array`s); the graph of a forward
pass is evaluated at the token boundary (`to_numpy`, `sync`; `start` queues it without waiting).

Runs where MLX runs: Metal on a Mac, CUDA where MLX's CUDA build is installed, the CPU otherwise.

Weights stay as compact as the file (`backends/mlx_weights.py`, `mlxinfer.quants`): Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q4_K and Q5_K repacked exactly into MLX's affine group-32 format; Q6_K, Q3_K, Q2_K, IQ4_NL,
IQ4_XS as the file's blocks and F16/BF16 in 16 bits, dequantized in the graph at each use; F32 stored
[in, out] so the matmul reads it without a transpose. Never `mx.load` (it mis-decodes Q4_K).

Attention arithmetic. On the CPU, attention's products and softmax are MLX's own (`mx.matmul`,
`mx.softmax`): MLX's CPU matmul computes each row of a product independently, so the per-head reference
and a batched override agree bit for bit. On a GPU they are mlxinfer's kernels (`mlxinfer.kernels`,
one published summation order), because MLX's GPU products change order with the number of rows.

Dtypes (`dtype=`, `--dtype`): activations in float32, bfloat16 or float16 (norms, RoPE and elementwise
ops in that dtype, as mlx-lm runs them; the residual stream too). On a GPU the weight products run in
it too (float weights, affine scales and dequantized blocks cast to it; MLX's GPU products accumulate
in float32). On MLX's CPU they run in float32 from the widened activations, their outputs rounded to
the dtype (`weight_dtype`): MLX's CPU quantized_matmul accumulates in its input type, so a bfloat16
product of 1,536 terms there came out ~8% off its largest output (summed in float32 from the same
bfloat16 inputs: ~0.4%), and ~10x slower. Attention reads q, K and V in their dtypes and computes in
float32 (each value widened exactly: the same products and sums as in float32), on the CPU through the
widened operands, on a GPU in the kernels themselves (templated on the input type); its result is
rounded to the dtype once, where the per-head reference rounds it. Softmax is always float32; logits leave the backend as float32
(`to_numpy`, `sample_tokens`). The KV cache stores `kv_dtype` (default: the dtype; q8_0 in
`backends/mlx_kv.py`). Default dtype: float32 on the CPU (no faster in 16 bits there),
`backend.GPU_DEFAULT_DTYPES` on a GPU (bfloat16 on CUDA, float32 on Metal).

Fused attention, chosen by platform (overridable with `kernel=`):
  - "graph": each sequence's heads in one batched graph (the CPU's override);
  - "cuda":  one `mx.fast.cuda_kernel` launch for the whole batch (metal_kernels/attention.cu);
  - "metal": its `mx.fast.metal_kernel` twin (metal_kernels/attention.metal), never run on hardware by
    this project.
Either is used by default only after a self-check on the device (`verify_gpu_kernels`; its verdict is
remembered per machine and code, `kernel_checks`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import weakref
from dataclasses import dataclass, replace

# MLX's CUDA backend runs float32 cuBLAS matmuls in TF32 unless told otherwise: ~3e-3 error on logits,
# outside our 1e-3 agreement with the CPU reference. Read once by MLX at its first matmul; a user who
# wants TF32 sets MLX_ENABLE_TF32=1 before importing mlxinfer.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import sys  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from .. import block_kernels, collectives, cuda_jit, kernels, quants  # noqa: E402
from ..backend import GELU_COEF_A, GPU_DEFAULT_DTYPES, KV_DTYPES, MOE_MIN_WEIGHT_SUM, SQRT_2_OVER_PI, AttentionSpec, Backend, softcap_inverse  # noqa: E402
from ..batch import Batch  # noqa: E402
from ..errors import GGUFError, RequestError  # noqa: E402
from ..kv_cache import KV_CACHES, PagedLayer  # noqa: E402
from ..sampling import MLXRandom  # noqa: E402
from . import kernel_checks  # noqa: E402
from .cpu import checked_threads, default_threads  # noqa: E402
from .mlx_kv import dequantize_q8_0, packed_width, quantize_q8_0, value_bytes  # noqa: E402
from .mlx_weights import GROUP, BlockWeight, ExpertStack, PackedWeight, QuantizedWeight, WeightGroup, WeightRuns, dense_product, to_device  # noqa: E402,F401

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}  # backend.DTYPES' MLX types
KEPT = (*quants.AFFINE_BITS, *quants.BLOCK_TYPES, *quants.HALF_TYPES)  # every type but F32 stays as compact
SPLIT_MIN_ROWS = 256  # quantized products are cut over the CPU threads in parts of at least this many rows
# On CUDA, an affine-quantized product of at least this many rows of x (long prompts' chunks) dequantizes
# the weight, then multiplies (`dense_product`: MLX's matmul, on the tensor cores in 16 bits). MLX's
# quantized_matmul dequantizes each tile of the weight inside its product, once for every tile of rows;
# the dense form dequantizes the whole weight once, whatever the rows. Measured on an H100 (the 0.6B
# shape's products, bfloat16): the dense form took 0.4-0.6x quantized_matmul's time at 2,048 rows,
# 0.62-1.42x at 1,024 (mostly below 1), 0.95-1.44x at 512 and up to 3.3x below.
# bench/probes/dense_products.py times both; docs/performance.md has the figures. (float32's passes are
# 512 rows, the protocol's chunk: there only a batch of 1,024 sequences or a larger --prefill-chunk reaches it.)
DENSE_MIN_ROWS = 1024
# ... and from the block kernels' last row on (a prompt's products of MAX_ROWS + 1 rows or more), a weight
# of fewer than 8 bits a value and at least DENSE_VALUES_MIN values that the affine_values kernel forms
# (`QuantizedWeight.former`) is dequantized by it in one launch, then multiplied: MLX's quantized_matmul
# at a 17-token prompt read a Qwen3-8B shape's 4-bit products more slowly than its 8-bit ones (its
# 4,096-output products 150-440 us each: a grid of 32 blocks on 132 SMs), and the 8B Q4_K_M file reached
# its first token later than the Q8_0 file; dequantized first, sooner (H100: docs/performance.md, "An 8B
# prompt pass by kernel"). An 8-bit weight gained nothing so (its first token 42.3 against 41.5 ms), and
# output heads (more than block_kernels.WIDE rows) stay on quantized_matmul, which reads them faster
# than they are formed.
DENSE_VALUES_MIN = 1 << 24
# On a GPU, a sequence's attention products with at least this many query rows (prefill chunks) are, in
# 16-bit dtypes on CUDA, the tensor-core order's (`self.mma`: kernels.mma_*, one launch a chunk in the
# fused override), else MLX's own GEMMs a head at a time, in the per-head reference and in the fused
# override alike; fewer rows (decode, short prompts) take mlxinfer's published-order kernels.
PREFILL_ROWS = 128
# ... and where a chunk's products would be MLX's GEMMs (neither the tensor-core order nor MLX's fused
# attention takes it: float32 chunks; 16-bit ones where neither applies), only from this size of a
# head's product (rows x keys x head size multiply-adds, the same for its scores and its context, so
# the reference's `matmul` and the override read it alike); smaller chunks keep the published-order
# kernels, whose few launches cover every head and sequence of the pass where MLX's GEMMs take two calls
# a head and a chunk. Measured on an H100 (Qwen3-0.6B's shape, head size 128: docs/performance.md,
# "prompt passes a few layers at a time; float32 chunks on the kernels up to a size"): the kernels
# sooner, or within a few ms, below 2^27 (chunks of 128 rows; 512 rows over up to 2,047 keys; 1,023
# over 1,023), MLX's GEMMs sooner from there (512 rows over 2,048 to 4,095 keys: 1.6-1.9x; 2,047 over
# 2,047: ~3x).
PREFILL_GEMM_MIN = 1 << 27


def gemm_sized(rows: int, macs: int) -> bool:
    """Whether a product of `rows` query rows and `macs` multiply-adds (attention's, float32) is MLX's
    GEMM rather than the published-order kernel's: PREFILL_ROWS rows and PREFILL_GEMM_MIN or more."""
    return rows >= PREFILL_ROWS and macs >= PREFILL_GEMM_MIN


def gemm_keys(rows: int, head_dim: int) -> int:
    """Keys enough for a chunk of `rows` rows (PREFILL_ROWS or more) to take MLX's GEMMs (`gemm_sized`),
    and at least 300 (past the softmax's 256 threads): the self-check's long-chunk cases."""
    return max(300, -(-PREFILL_GEMM_MIN // (rows * head_dim)))
# A long chunk's steps go over all heads at once (`_heads_together`) where its heads' float32 scores take
# at most this many bytes (each step's output holds as many), else a head at a time as the reference:
# the launches saved matter in short chunks; over long ones the products dominate, and stacking heads
# there raised the peak memory by far more than the stack (docs/performance.md, "float32 prefill chunks
# of several prompts"). Since PREFILL_GEMM_MIN sends the short chunks it was made for to the kernels, a
# chunk on MLX's GEMMs has rows x keys >= PREFILL_GEMM_MIN / head size, so its heads' scores fit this
# bound only where there are at most head size / 16 heads (Qwen3-0.6B's 16 heads of 128: never).
HEADS_TOGETHER_MAX_BYTES = 64 << 20
# Prompt tokens per prefill pass where 16-bit chunks take the tensor-core order: a chunk's launch reads
# every cached key once, so fewer, longer chunks read the prompt's keys fewer times (mlx-lm's prefill step
# is 2,048 too); docs/performance.md has the figures that chose it. Elsewhere the protocol's 512.
MMA_PREFILL_CHUNK = 2048
# 16-bit prefill chunks on a GPU take MLX's own fused attention (`mx.fast.scaled_dot_product_attention`:
# cuDNN's flash attention on CUDA, MLX's full-attention kernel on Metal) where it applies: the head sizes
# its kernel takes there (MLX's rules: cuDNN multiples of 8 up to 128; Metal's list), no soft-cap (it has
# none). A head at a time in the per-head reference, every head in one call in the fused override: the
# same bits where the self-check (`verify_sdpa`) finds them so.
SDPA_HEAD_DIMS = {"cuda": frozenset(range(8, 129, 8)), "metal": frozenset((64, 72, 80, 96, 128, 192, 256))}
# Consecutive prompts of a pass whose chunks have one length over as many keys (a batch's prompts of one
# length), no window, take one such call together in the fused override (`_sdpa_groups`: a call a prompt
# and a layer was 448 launches of a 16-prompt pass, each with its copies); their keys and values are
# stacked for it, copies of at most this many bytes of keys (as many of values) in all a layer's call:
# a pass's buffers may all live until it has run, so a pass stacks at most layers x twice this (sixteen
# 128-token prompts of Qwen3-0.6B: 4 MiB of keys a layer). The same bits a prompt where its own
# self-check (`verify_sdpa_batch`) finds them so; off alone where it does not.
SDPA_BATCH_MAX_BYTES = 8 << 20
_CPU_STREAMS: list = []  # shared by every MLX backend; thread-local: each thread that uses one gets its own


def _cpu_streams(n: int) -> list:
    """n of the shared CPU streams (made on first need). MLX's plain streams work only in the thread
    that made them, and the server generates in a worker thread: these are thread-local streams."""
    while len(_CPU_STREAMS) < n:
        _CPU_STREAMS.append(mx.new_thread_local_stream(mx.cpu))
    return _CPU_STREAMS[:n]


def gpu_kind() -> str | None:
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return None


SELF_CHECK_HEAD_DIMS = (64, 80, 128, 256)  # every architecture's here (SmolLM2 64, Qwen3 128), both sides
# of the Metal kernel's 128-wide context pass (MLXI_PART_D) and a width that is not a power of two


@dataclass(frozen=True)
class CheckCase:
    """One self-check case: a batch of sequences, each (cached keys S, query rows T; T rows are this
    pass's), written into a cache of kind `kv` as the engine writes it."""

    label: str
    spec: AttentionSpec
    seqs: tuple[tuple[int, int], ...]
    kv: str = "prealloc"

    def __str__(self):
        return f"head_dim {self.spec.head_dim}, {self.label}, {self.kv} cache"


def self_check_cases(head_dims=SELF_CHECK_HEAD_DIMS) -> list[CheckCase]:
    """Every plan the GPU kernels run, at each head size: one decode row over 1, 7 (operands of fewer
    than 8 elements, which MLX passes to a Metal kernel as `constant`) and 300 keys (past the softmax's
    256 threads), several decode rows, prefill chunks of 3 and of 9 rows (8+), a sliding window, soft-caps
    (Gemma 2's 50 and a cap of 2, which bends scores of ~3), few rows
    over more than 1,024 keys (the graph override on Metal) and 64 rows over as many (the fused kernel
    again), a chunk of PREFILL_ROWS rows or more windowed and soft-capped over few keys (the kernels in
    float32) and over enough for MLX's GEMMs (`gemm_keys`), and each cache kind (prealloc, paged, basic)
    for decode rows, a chunk, and a chunk of PREFILL_ROWS rows or more over enough keys for MLX's GEMMs
    beside a decode row (the kernel's)."""
    cases = []
    rows = PREFILL_ROWS + 2
    for d in head_dims:
        gqa, win = AttentionSpec.standard(4, 2, d), AttentionSpec.standard(4, 2, d, window=16)
        capped = [replace(win, softcap=50.0), replace(gqa, softcap=2.0)]
        keys = gemm_keys(rows, d)
        cases += [CheckCase("one decode row over 1 key", gqa, ((1, 1),)),
                  CheckCase("one decode row over 7 keys", AttentionSpec.standard(1, 1, d), ((7, 1),)),
                  CheckCase("one decode row over 300 keys", gqa, ((300, 1),)),
                  CheckCase("3 rows of a chunk over 70 keys", gqa, ((70, 3),)),
                  CheckCase("9 rows of a chunk over 300 keys, window 16", win, ((300, 9),)),
                  CheckCase("9 rows of a chunk over 300 keys, window 16, soft-cap 50", capped[0], ((300, 9),)),
                  CheckCase("a decode row over 300 keys and a 3-row chunk over 70, soft-cap 2", capped[1],
                            ((300, 1), (70, 3))),
                  CheckCase("one decode row over 1,100 keys", gqa, ((1100, 1),)),
                  CheckCase("64 rows of a chunk over 1,100 keys", gqa, ((1100, 64),)),
                  CheckCase(f"a {rows}-row chunk over 300 keys, window 16, soft-cap 50", capped[0], ((300, rows),)),
                  CheckCase(f"a {rows}-row chunk over 1,100 keys (float32: the kernels)", gqa, ((1100, rows),)),
                  CheckCase(f"a {rows}-row chunk over {keys:,} keys (float32: MLX's GEMMs), window 16, soft-cap 50",
                            capped[0], ((keys, rows),))]
        for kv in KV_CACHES:
            cases += [CheckCase("3 decode rows over 70, 257 and 5 keys", gqa, ((70, 1), (257, 1), (5, 1)), kv),
                      CheckCase("a 9-row chunk over 40 keys and a decode row over 129", gqa, ((40, 9), (129, 1)), kv),
                      CheckCase(f"a {rows}-row chunk over {keys:,} keys (float32: MLX's GEMMs) beside a decode row over 70",
                                gqa, ((keys, rows), (70, 1)), kv)]
    return cases


def model_check_cases(spec: AttentionSpec) -> list[CheckCase]:
    """The plans a model's attention launches, in the model's own shape: on CUDA its head counts, head
    size, scale, window and soft-cap are template arguments, so each model runs kernels of its own
    compile, which `self_check_cases` (4 and 2 heads) never launched. One decode row over 7 keys, over
    300 and over more than ONE_ROW_LONG_FORM_ABOVE (the long-context form); 3 and 8 decode rows (a
    batch); a 9-row chunk; a chunk of ROWS_MIN rows or more (the kernels by rows); a chunk of
    PREFILL_ROWS rows or more beside a decode row, over few keys (16-bit: the long-chunk path; float32:
    the kernels) and over enough for MLX's GEMMs (float32's long-chunk path: `gemm_keys`); two such
    chunks of one length over as many keys (16-bit: one call of MLX's fused attention over both,
    `sdpa_batch`)."""
    long = kernels.ONE_ROW_LONG_FORM_ABOVE + 100
    rows = kernels.ROWS_MIN + 6
    chunk = PREFILL_ROWS + 2
    keys = gemm_keys(chunk, spec.head_dim)
    return [CheckCase("one decode row over 7 keys", spec, ((7, 1),)),
            CheckCase("one decode row over 300 keys", spec, ((300, 1),)),
            CheckCase(f"one decode row over {long:,} keys", spec, ((long, 1),)),
            CheckCase("3 decode rows over 70, 257 and 5 keys", spec, ((70, 1), (257, 1), (5, 1))),
            CheckCase("8 decode rows over 300 keys", spec, ((300, 1),) * 8),
            CheckCase("9 rows of a chunk over 300 keys", spec, ((300, 9),)),
            CheckCase(f"{rows} rows of a chunk over {rows} keys (by rows)", spec, ((rows, rows),)),
            CheckCase(f"a {chunk}-row chunk over 300 keys beside a decode row over 70", spec, ((300, chunk), (70, 1))),
            CheckCase(f"a {chunk}-row chunk over {keys:,} keys beside a decode row over 70", spec, ((keys, chunk), (70, 1))),
            CheckCase(f"two {chunk}-row chunks over 300 keys each", spec, ((300, chunk),) * 2)]


def case_applies(backend: "MLXBackend", case: CheckCase) -> bool:
    """Whether the backend's cache can hold the case: a q8_0 cache holds rows of whole blocks of 32 values
    only, and the basic cache stores what the pass computed (it refuses another --kv-dtype)."""
    if backend.kv_dtype == "q8_0" and case.spec.n_kv_heads * case.spec.head_dim % 32:
        return False
    return case.kv != "basic" or backend.kv_dtype == backend.dtype_name


def check_case_inputs(backend: "MLXBackend", case: CheckCase, seed: int = 7):
    """(q, cache layer view, batch) of a case on `backend`, random values of magnitude ~3 (softmax rows
    spread, so that another summation order shows): each sequence's earlier rows written by a first
    pass, this pass's rows by the pass itself."""
    rng = np.random.default_rng(seed)
    spec, width = case.spec, case.spec.n_kv_heads * case.spec.head_dim
    cache = KV_CACHES[case.kv](backend, 1, width)
    slots = [cache.alloc() for _ in case.seqs]
    kv = [(rng.standard_normal((2, s, width), dtype=np.float32) * 3) for s, _ in case.seqs]
    starts = [s - t for s, t in case.seqs]
    early = [i for i, st in enumerate(starts) if st > 0]
    if early:
        pre = Batch(backend, [slots[i] for i in early], [0] * len(early), [starts[i] for i in early])
        cache.reserve(pre)
        cache.update(backend, 0, backend.from_numpy(np.concatenate([kv[i][0, :starts[i]] for i in early])),
                     backend.from_numpy(np.concatenate([kv[i][1, :starts[i]] for i in early])), pre)
    batch = Batch(backend, slots, starts, [t for _, t in case.seqs])
    cache.reserve(batch)
    view = cache.update(backend, 0, backend.from_numpy(np.concatenate([x[0, st:] for x, st in zip(kv, starts)])),
                        backend.from_numpy(np.concatenate([x[1, st:] for x, st in zip(kv, starts)])), batch)
    q = rng.standard_normal((batch.n_rows, spec.n_heads * spec.head_dim), dtype=np.float32)
    return backend.activation(backend.from_numpy(q)), view, batch


def _check_products(backend: "MLXBackend") -> str | None:
    """The matmul and softmax kernels against numpy's product and MLX's softmax (to 1e-5), on a product of
    full operands and on one of operands of fewer than 8 elements; the tanh kernel against MLX's tanh (to
    2e-7: both are tanhf, of two builds)."""
    rng = np.random.default_rng(7)
    for m, k, n in ((3, 128, 70), (1, 3, 2)):
        a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32) * 3
        prod = np.array(backend.matmul(mx.array(a), mx.array(b)))
        soft = np.array(backend.softmax_rows(mx.array(prod)))
        if not np.allclose(prod, a @ b, rtol=1e-5, atol=1e-4):
            return f"matmul kernel differs from the reference product by {np.max(np.abs(prod - a @ b)):.3g} ([{m}, {k}] x [{k}, {n}])"
        want = np.array(mx.softmax(mx.array(prod), axis=-1, precise=True))
        if not np.allclose(soft, want, rtol=1e-5, atol=1e-6):
            return f"softmax kernel differs from MLX's softmax by {np.max(np.abs(soft - want)):.3g} (rows of {n})"
    x = mx.array(np.linspace(-12, 12, 1001, dtype=np.float32))
    got, want = np.array(backend.tanh(x)), np.array(mx.tanh(x))
    if not np.allclose(got, want, rtol=2e-7, atol=1e-7):
        return f"tanh kernel differs from MLX's tanh by {np.max(np.abs(got - want)):.3g}"
    return None


def _differs(what: str, got: np.ndarray, want: np.ndarray, case) -> str | None:
    """A self-check's comparison: None where the float32 results `got` are `want`'s bits, else one line,
    `what` (the failure's subject and verb), how many values differ, and the case."""
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))  # (a NaN's sign and payload: the platform's)
    if same.all():
        return None
    return f"{what} in {int((~same).sum())} of {same.size} values ({case})"


def _check_block_products(backend: "MLXBackend", kernel: str | None = None, fused: bool = False,
                          swiglu: bool = False) -> str | None:
    """The block kernels (`block_kernels`) against their numpy emulation, bit for bit, on random blocks
    with edge values of every type they take, for 1 and MAX_ROWS rows, each output row count a warp
    takes (42 rows: a last warp of 4 with 2 left), rows of 1,280 values (1,312 for the 32-value types:
    at MAX_ROWS rows of x a full tile of x, then a partial one; at one row, whose tile is 8,192 columns,
    one partial tile), with x in the products' dtype (`weight_dtype`: a 16-bit x
    is widened exactly, the float32 sum rounded once to that dtype at the end; none on the CPU: nothing
    to check). `kernel`: only the types of that kernel (`block_kernels.KERNELS`), else every type.
    `fused`: instead, with the most rows a warp, the ADD form (a residual plus the product:
    `block_kernels.with_residual`) and the NORM form (the product of the rows `emulate_rms_norm` norms) of
    each type the backend keeps on its kernel (`block_types`); `swiglu`: so, the SWIGLU form with ADD (a
    residual plus the product of `emulate_swiglu`'s values of [gate | up]), part of the swiglu kernel's
    verdict (`verify_swiglu`), as both compute SwiGLU's values by one function."""
    if backend.block_kind is None:
        return None
    rng = np.random.default_rng(7)
    dtype = backend.weight_dtype
    narrow = lambda a: np.array(mx.array(a).astype(dtype).astype(mx.float32))  # noqa: E731 (MLX's rounding)
    fma16 = dtype != mx.float32  # (a 16-bit x: the kernels' fma, `block_kernels.emulate`)
    per_warp = (1, 2, 4) if backend.block_kind == "cuda" else (1,)
    forms = ([(per_warp[-1], f) for f in ("add", "norm")] if fused else [(per_warp[-1], "glu")] if swiglu
             else [(r, "") for r in per_warp])
    for qtype in block_kernels.types_of(kernel):
        if (fused or swiglu) and qtype not in backend.block_types:
            continue
        k = 1280 if block_kernels.row_multiple(qtype) == 256 else 1312
        raw = quants.random_blocks(rng, qtype, 42, k, edges=True)
        w = to_device(qtype, quants.split(raw, qtype, 42, k), (42, k))
        values = block_kernels.terms(raw, qtype, 42, k)
        for m in (1, block_kernels.MAX_ROWS):
            x = narrow(rng.standard_normal((m, k), dtype=np.float32))
            sums = block_kernels.emulate(x, values, qtype, fma16)
            want = narrow(sums)
            # a residual of the sums' size, so that the additions round, and finite in every dtype
            res = narrow(rng.standard_normal(want.shape, dtype=np.float32) * np.minimum(np.abs(want), 1000.0))
            nw = narrow(rng.uniform(0.25, 4.0, k).astype(np.float32))
            gu = narrow(rng.standard_normal((m, 2 * k), dtype=np.float32) * 3.0) if swiglu else None  # [gate | up]
            for r, form in forms:
                out = block_kernels.product(backend.block_kind, mx.array(gu if form == "glu" else x).astype(dtype), w, r,
                                            mx.array(res).astype(dtype) if form in ("add", "glu") else None,
                                            (mx.array(nw).astype(dtype), 1e-5) if form == "norm" else None,
                                            swiglu=form == "glu")
                got = np.array(out.astype(mx.float32))
                if form == "norm":
                    expected = narrow(block_kernels.emulate(block_kernels.emulate_rms_norm(x, nw, 1e-5, narrow),
                                                            values, qtype, fma16))
                elif form == "glu":
                    expected = block_kernels.with_residual(
                        block_kernels.emulate(block_kernels.emulate_swiglu(gu, narrow), values, qtype, fma16), res, narrow)
                else:
                    expected = block_kernels.with_residual(sums, res, narrow) if form == "add" else want
                what = {"": "", "add": " (adding a residual)", "norm": " (of normed rows)",
                        "glu": " (of SwiGLU's values, adding a residual)"}[form]
                problem = _differs(f"the {qtype.name} block kernel{what} differs from its published order", got, expected,
                                   f"{m} rows, {r} a warp, {backend.dtype_name}")
                if problem:
                    return problem
    return None


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def verify_gpu_kernels(backend: "MLXBackend") -> str | None:
    """Run the GPU kernels on the device on every plan they run (`self_check_cases`): the fused override
    against the per-head reference, bit for bit (and, where the kernel has them, each launch plan on the
    same inputs; for decode rows also under mx.compile), and the matmul/softmax kernels against the
    reference product and MLX's softmax.
    Returns None when all agree, else one line naming the first failure and its case. (The block
    kernels have a check and a verdict of their own, `verify_block_kernels`: neither needs the other.)"""
    cases = [case for case in self_check_cases() if case_applies(backend, case)]
    _prebuild(backend, [lambda: _check_products(backend), lambda: backend.softmax_rows(mx.zeros((3, 70))),
                        lambda: backend.tanh(mx.zeros((8,)))] + [lambda c=c: _check_case(backend, c) for c in cases])
    try:
        problem = _check_products(backend)
    except Exception as e:  # a kernel that fails to compile or launch
        return f"{_one_line(e)} (the matmul and softmax kernels)"
    if problem:
        return problem
    return _first_problem(backend, cases)


def mma_check_cases(head_dims=SELF_CHECK_HEAD_DIMS) -> list[CheckCase]:
    """The tensor-core prefill path's cases at each head size: chunks of PREFILL_ROWS rows or more (row
    counts that are not whole tiles of 16, over key counts that are not whole steps of 16), with GQA, a
    window and a soft-cap, beside a decode row, in each cache kind."""
    rows = PREFILL_ROWS + 2
    cases = []
    for d in head_dims:
        gqa = AttentionSpec.standard(4, 2, d)
        win = replace(AttentionSpec.standard(4, 2, d, window=40), softcap=50.0)
        cases += [CheckCase(f"a {rows}-row chunk over {rows} keys", gqa, ((rows, rows),)),
                  CheckCase(f"a {rows}-row chunk over 300 keys, window 40, soft-cap 50", win, ((300, rows),))]
        cases += [CheckCase(f"a {rows}-row chunk over 300 keys beside a decode row over 70", gqa,
                            ((300, rows), (70, 1)), kv) for kv in KV_CACHES]
    return cases


def verify_mma(backend: "MLXBackend") -> str | None:
    """The tensor-core prefill kernels on the device (`mma_check_cases`): the fused override against the
    per-head reference, bit for bit. None, or one line naming the first failure. (MLX's fused attention
    is off meanwhile, so that every case runs these kernels.)"""
    cases = [case for case in mma_check_cases() if case_applies(backend, case)]
    sdpa, backend.sdpa = backend.sdpa, False
    try:
        _prebuild(backend, [lambda c=c: _check_case(backend, c) for c in cases])
        return _first_problem(backend, cases)
    finally:
        backend.sdpa = sdpa


QK_CHECK_SHAPES = ((1, 16, 8, 128), (5, 8, 2, 128), (3, 9, 3, 64), (4, 6, 2, 256))  # rows, heads, KV heads, head_dim


def verify_qk_norm_rope(backend: "MLXBackend", shapes=QK_CHECK_SHAPES) -> str | None:
    """The qk_norm_rope kernel on the device (Metal's: written for it, never run where it was written)
    against mx.fast's kernels on the same inputs (`_norm_rope`), in the backend's dtype: rows at
    positions up to 40,000, a head whose mean square epsilon dominates and an all-zero head; within
    a few float32 ulps in float32 and `kernels.rope16_bound` in 16 bits (the kernel's sum of squares is
    in another order than mx.fast's, so not bit for bit: tests/test_mlx_backend.py measures it), and each
    row's values the same when it is launched alone. None, or the first problem in one line (a kernel
    that fails to build or launch too)."""
    try:
        return _qk_norm_rope_problem(backend, shapes)
    except Exception as e:  # a kernel that fails to compile or launch
        return f"{_one_line(e)} (the qk_norm_rope kernel)"


def qk_check_inputs(rng, rows: int, heads: int, kv: int, dim: int) -> tuple:
    """float32 q [rows, heads*dim], k [rows, kv*dim], weights wq, wk [dim] and int32 positions [rows] for
    checking qk_norm_rope: values ~3, weights ~1, distinct positions up to 40,000 (theta = 40,000 radians
    in the first pair); where there are 3 rows or more, a query head of row 2 of mean square ~1e-7
    (epsilon 1e-6 dominates it) and an all-zero key head in the last row. (numpy arrays.)"""
    x = rng.standard_normal((rows, (heads + kv) * dim)).astype(np.float32) * 3
    if rows >= 3:
        x[2, dim:2 * dim] *= 1e-4
        x[-1, heads * dim:(heads + 1) * dim] = 0.0
    wq, wk = ((1 + 0.1 * rng.standard_normal(dim)).astype(np.float32) for _ in range(2))
    pos = rng.choice(40000, rows, replace=False).astype(np.int32)
    return np.ascontiguousarray(x[:, :heads * dim]), np.ascontiguousarray(x[:, heads * dim:]), wq, wk, pos


def _qk_norm_rope_problem(backend: "MLXBackend", shapes) -> str | None:
    rng = np.random.default_rng(11)
    dt, u = backend.dtype, kernels.QK_NORM_ROPE_UNIT.get(backend.dtype_name)
    for rows, heads, kv, dim in shapes:
        q, k, wq, wk, pos = qk_check_inputs(rng, rows, heads, kv, dim)
        q, k, wq, wk, pos = (mx.array(a) for a in (q, k, wq, wk, pos))
        q, k, wq, wk = (a.astype(dt) for a in (q, k, wq, wk))
        got = kernels.qk_norm_rope(backend.gpu_kernels, q, k, wq, wk, pos, heads, kv, dim, 1e-6, 1e6)
        alone = kernels.qk_norm_rope(backend.gpu_kernels, q[-1:], k[-1:], wq, wk, pos[-1:], heads, kv, dim, 1e-6, 1e6)
        for name, g, one, a, w, n in (("queries", got[0], alone[0], q, wq, heads), ("keys", got[1], alone[1], k, wk, kv)):
            want = np.array(backend._norm_rope(a, w, pos, n, dim, 1e-6, 1e6, False, None).astype(mx.float32))
            g = np.array(g.astype(mx.float32))
            bound = 2e-6 + 2e-6 * np.abs(want) if u is None else kernels.rope16_bound(want, dim, u)
            if not np.all(np.abs(g - want) <= bound):  # (NaN fails too)
                worst = "NaN" if np.isnan(g).any() else f"up to {np.max(np.abs(g - want)):.3g}"
                return f"{name} of {rows} rows x {n} heads of {dim}: {worst} from mx.fast's (bound {bound.max():.3g})"
            if not np.array_equal(g[-1:], np.array(one.astype(mx.float32))):
                return f"{name} of {rows} rows x {n} heads of {dim}: the last row alone gives other values"
    return None


def sdpa_check_cases(head_dims=(64, 80, 128)) -> list[CheckCase]:
    """MLX's fused attention on 16-bit prefill chunks (`MLXBackend.sdpa`): chunks of PREFILL_ROWS rows or
    more with GQA, from the cache's start ("causal") and from mid-cache, with a window (an additive mask),
    two in one pass (each put in its place), in each cache kind; head sizes it takes (a multiple of 8 up to 128, 80 not a
    power of two; `verify_sdpa` adds 256 on Metal)."""
    rows = PREFILL_ROWS + 2
    cases = []
    for d in head_dims:
        gqa = AttentionSpec.standard(4, 2, d)
        cases += [CheckCase(f"a {rows}-row chunk over {rows} keys", gqa, ((rows, rows),)),
                  CheckCase(f"a {rows}-row chunk over 300 keys, window 40", AttentionSpec.standard(4, 2, d, window=40),
                            ((300, rows),))]
        cases += [CheckCase(f"a {rows}-row chunk over 300 keys beside a {rows + 10}-row chunk over 200", gqa,
                            ((300, rows), (200, rows + 10)), kv) for kv in KV_CACHES]
    return cases


def _check_long_case(backend: "MLXBackend", case: CheckCase,
                     what: str = "one call over every head differs from a call a head") -> str | None:
    """One case of chunks that all take MLX's fused attention: the override against the reference, bit
    for bit (none of our kernels runs: a failure is that path's alone). None, or one line."""
    try:
        q, view, batch = check_case_inputs(backend, case)
        got = backend.to_numpy(backend.fused_attention_override(q, view, batch, case.spec))
        ref = backend.to_numpy(backend.per_head_attention(q, view, batch, case.spec))
    except Exception as e:  # a shape MLX's kernel refuses (force_fused)
        return f"{_one_line(e)} ({case})"
    return _differs(what, got, ref, case)


CUDNN_WHEELS = (("mlx-cuda-13", "nvidia-cudnn-cu13"), ("mlx-cuda-12", "nvidia-cudnn-cu12"))  # MLX's CUDA build, its cuDNN


def cudnn_version(kind: str) -> str:
    """On CUDA, " cudnn X" with the version of the cuDNN wheel MLX's CUDA build requires ("?" where none
    is found; where MLX's build is not found either, the first cuDNN wheel of CUDNN_WHEELS installed):
    MLX's fused attention is cuDNN's kernel there, so its self-check's verdict is kept per cuDNN release.
    Looked up by name, not by listing every installed distribution."""
    if kind != "cuda":
        return ""
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    builds = [cudnn for mlx_build, cudnn in CUDNN_WHEELS if version(mlx_build)]
    for name in builds or [cudnn for _, cudnn in CUDNN_WHEELS]:
        found = version(name)
        if found:
            return f" cudnn {found}"
    return " cudnn ?"


def verify_sdpa(backend: "MLXBackend") -> str | None:
    """MLX's fused attention on 16-bit prefill chunks, on the device (`sdpa_check_cases`): the fused
    override's one call over every head against the per-head reference's call a head, bit for bit. None,
    or one line naming the first failure (an exception too: a shape MLX's kernel refuses)."""
    dims = [d for d in (64, 80, 128, 256) if d in SDPA_HEAD_DIMS.get(backend.gpu_kernels, ())]
    cases = [case for case in sdpa_check_cases(dims) if case_applies(backend, case)]
    # and one pass of real size (the kernel may pick its method by shape): Qwen3-0.6B's heads, a
    # 2,048-row chunk over 4,096 keys
    cases.append(CheckCase("a 2048-row chunk over 4096 keys", AttentionSpec.standard(16, 8, 128), ((4096, 2048),)))
    batched, backend.sdpa_batch = backend.sdpa_batch, False  # (a call a prompt here: `verify_sdpa_batch`'s apart)
    try:
        return next(filter(None, (_check_long_case(backend, case) for case in cases)), None)
    finally:
        backend.sdpa_batch = batched


def sdpa_batch_check_cases(head_dims=(64, 80, 128)) -> list[CheckCase]:
    """Prompts of one length in one call of MLX's fused attention (`_sdpa_groups`): two and three chunks of
    PREFILL_ROWS rows or more from the cache's start (three with four query heads a KV head), beside a
    chunk of another length, two over as many cached keys each (mid-cache) in each cache kind. Every chunk
    takes MLX's kernel (none of ours runs: `_check_long_case`)."""
    rows = PREFILL_ROWS + 2
    cases = []
    for d in head_dims:
        gqa = AttentionSpec.standard(4, 2, d)
        cases += [CheckCase(f"two {rows}-row chunks from the start", gqa, ((rows, rows),) * 2),
                  CheckCase(f"three {rows}-row chunks from the start beside one over 300 keys", AttentionSpec.standard(8, 2, d),
                            ((rows, rows),) * 3 + ((300, rows),))]
        cases += [CheckCase(f"two {rows}-row chunks over 300 keys each", gqa, ((300, rows),) * 2, kv) for kv in KV_CACHES]
    return cases


# verify_sdpa_batch's passes of real size (the kernel may pick its method by shape), Qwen3-0.6B's heads and
# 4:1 GQA; each stacks at most SDPA_BATCH_MAX_BYTES of keys (the two 2,048-row chunks: exactly that)
SDPA_BATCH_SIZED = [CheckCase("sixteen 128-row chunks from the start", AttentionSpec.standard(16, 8, 128), ((128, 128),) * 16),
                    CheckCase("four 512-row chunks from the start", AttentionSpec.standard(32, 8, 128), ((512, 512),) * 4),
                    CheckCase("two 2048-row chunks from the start", AttentionSpec.standard(16, 8, 128), ((2048, 2048),) * 2)]


def verify_sdpa_batch(backend: "MLXBackend") -> str | None:
    """Prompts of one length in one call of MLX's fused attention, on the device (`sdpa_batch_check_cases`,
    and a pass of real size: sixteen 128-token prompts of Qwen3-0.6B's heads): the fused override against
    the per-head reference's call a head and a prompt, bit for bit. None, or one line."""
    dims = [d for d in (64, 80, 128, 256) if d in SDPA_HEAD_DIMS.get(backend.gpu_kernels, ())]
    cases = [case for case in sdpa_batch_check_cases(dims) if case_applies(backend, case)]
    cases += SDPA_BATCH_SIZED
    what = "one call over several prompts differs from a call a prompt"
    return next(filter(None, (_check_long_case(backend, case, what) for case in cases)), None)


def _first_problem(backend: "MLXBackend", cases) -> str | None:
    """The first of the cases' failures (`_check_case`), or None."""
    return next(filter(None, (_check_case(backend, case) for case in cases)), None)


def _prebuild(backend: "MLXBackend", parts) -> None:
    """On CUDA, compile every kernel form that `parts` launch at once, on every core, into MLX's kernel
    cache (`cuda_jit`: each part runs with every launch recording its form and returning zeros, its
    result and any failure ignored); the check then loads them instead of compiling one at a time."""
    if "cuda" not in (backend.kernel, backend.block_kind) or cuda_jit.builder() is None:
        return
    with cuda_jit.collecting() as jobs:
        for part in parts:
            with contextlib.suppress(Exception):
                part()
    cuda_jit.build(jobs)


@contextlib.contextmanager
def attention_results(backend: "MLXBackend", dtype):
    """Attention's results in `dtype` meanwhile (`attention_dtype`), in the fused paths and the per-head
    reference alike. The checks compare them in float32 (every bit of the published order's result, not
    only what survives its rounding to a 16-bit dtype) and in the dtype a model runs."""
    was, backend.attention_dtype = backend.attention_dtype, dtype
    try:
        yield
    finally:
        backend.attention_dtype = was


def _check_case(backend: "MLXBackend", case: CheckCase) -> str | None:
    """One self-check case: None, or one line naming how the kernels differ from the reference. Every
    launch plan with attention's result in float32, then in the dtype (`attention_results`; on CUDA
    every form a model launches is then compiled too)."""
    try:
        q, view, batch = check_case_inputs(backend, case)
        spec = case.spec
        bits = backend.to_numpy  # (16-bit results widened to float32: exact, so equal bits stay equal)
        runs = []
        for result in dict.fromkeys([mx.float32, backend.dtype]):
            with attention_results(backend, result):
                plans = {"": bits(backend.fused_attention_override(q, view, batch, spec))}
                if backend.kernel in kernels.SPLIT_KINDS and view.store is not None:  # every launch plan
                    args = (backend.kernel, q, *view.store, batch.row_slots, batch.positions, batch.row_lens, spec)
                    plans[" (one launch)"] = bits(kernels.fused_attention(*args, split=False, out_dtype=result))
                    for two, form in ((True, "two"), (False, "three")):
                        plans[f" (split, {form} launches)"] = bits(kernels.split_attention(
                            *args, two_launches=two, short=False, out_dtype=result))
                    if kernels.short_fits(spec, view.store[0].shape[1]):
                        plans[" (split, two launches in one)"] = bits(kernels.split_attention(
                            *args, two_launches=True, short=True, out_dtype=result))
                    plans[" (split, three launches, context by rows)"] = bits(kernels.split_attention(
                        *args, two_launches=False, seq_rows=batch.rows, by_rows=True, out_dtype=result))
                if all(t == 1 for _, t in case.seqs):  # decode rows, as the compiled decode step launches them
                    compiled = mx.compile(lambda x: backend.fused_attention_override(x, view, batch, spec))
                    plans[" (compiled)"] = bits(compiled(q))
                ref = bits(backend.per_head_attention(q, view, batch, spec))
            runs.append(("" if result == mx.float32 else f" in {backend.dtype_name}", plans, ref))
    except Exception as e:  # a kernel that fails to compile or launch
        return f"{_one_line(e)} ({case})"
    # the launch plans run every row through a kernel, but a long chunk (`_long_chunk`) is another path
    # (MLX's GEMMs, its fused attention or the tensor-core order) in the reference and in the override:
    # the plans answer for the others
    kernel_rows = np.zeros(ref.shape[0], dtype=bool)
    for b, (r0, r1) in enumerate(batch.rows):
        kernel_rows[r0:r1] = not backend._long_chunk(spec, batch, b)
    for result, plans, ref in runs:
        for plan, got in plans.items():
            rows = slice(None) if plan in ("", " (compiled)") else kernel_rows
            problem = _differs(f"fused attention kernel{plan}{result} differs from the per-head reference", got[rows],
                               ref[rows], case)
            if problem:
                return problem
    return None


def verify_block_kernels(backend: "MLXBackend", kernel: str | None = None) -> str | None:
    """A block kernel's self-check (`_check_block_products` over its types; None: every kernel's): None,
    or one line naming the failure."""
    if backend.block_kind == "cuda" and cuda_jit.builder() is not None:  # every row count a decode batch launches
        rng = np.random.default_rng(7)
        weights = [to_device(t, quants.split(quants.random_blocks(rng, t, 8, 256), t, 8, 256), (8, 256))
                   for t in block_kernels.types_of(kernel)]
        zeros = lambda *shape: mx.zeros(shape, backend.weight_dtype)  # noqa: E731
        # (a product's ADD and NORM forms are the same compiled kernels: nothing more to build for them)
        _prebuild(backend, [lambda w=w, m=m: block_kernels.product("cuda", zeros(m, 256), w)
                            for w in weights for m in range(1, block_kernels.MAX_ROWS + 1)]
                  + [lambda: block_kernels.rms_norm("cuda", zeros(2, 256), zeros(256), 1e-6),
                     lambda: block_kernels.swiglu("cuda", zeros(2, 512))])
    try:
        return _check_block_products(backend, kernel)
    except Exception as e:  # a kernel that fails to compile or launch
        return f"{_one_line(e)} (the block kernels)"


def verify_fused_forms(backend: "MLXBackend") -> str | None:
    """The block kernels' ADD and NORM forms (`_check_block_products(fused=True)`), a verdict apart from
    each kernel's own: failing, only they are turned off (and with them SWIGLU, which comes with ADD).
    None, or one line naming the failure."""
    try:
        return _check_block_products(backend, fused=True)
    except Exception as e:  # a form that fails to compile or launch
        return f"{_one_line(e)} (the block kernels' fused forms)"


def verify_pair_launch(backend: "MLXBackend") -> str | None:
    """The pair launch (`block_kernels.pair_product`: a group's run of each type in PAIR_FIRST and its Q6_K
    run in one launch) against its two products' published orders side by side, bit for bit, on random
    blocks with edge values: runs of 20 and 13 rows (each last block with idle warps) of 1,280 values,
    1 and MAX_ROWS rows of x, alone and of normed rows (NORM), in the products' dtype; only types the
    backend keeps on their kernels. None, or one line naming the failure."""
    if backend.block_kind is None or Q.Q6_K not in backend.block_types:
        return None
    rng = np.random.default_rng(17)
    dtype = backend.weight_dtype
    narrow = lambda a: np.array(mx.array(a).astype(dtype).astype(mx.float32))  # noqa: E731 (MLX's rounding)
    fma16 = dtype != mx.float32  # (a 16-bit x: the kernels' fma, `block_kernels.emulate`)
    k = 1280
    try:
        firsts = [t for t in block_kernels.PAIR_FIRST if t in backend.block_types]
        runs = {}
        for qtype, rows in [(t, 20) for t in firsts] + [(Q.Q6_K, 13)]:
            raw = quants.random_blocks(rng, qtype, rows, k, edges=True)
            runs[qtype] = (to_device(qtype, quants.split(raw, qtype, rows, k), (rows, k)),
                           block_kernels.terms(raw, qtype, rows, k))
        b, vb = runs[Q.Q6_K]
        _prebuild(backend, [lambda a=runs[t][0], m=m: block_kernels.pair_product("cuda", mx.zeros((m, k), dtype), a, b)
                            for t in firsts for m in range(1, block_kernels.MAX_ROWS + 1)])
        for first in firsts:
            a, va = runs[first]
            for m in (1, block_kernels.MAX_ROWS):
                x = narrow(rng.standard_normal((m, k), dtype=np.float32))
                nw = narrow(rng.uniform(0.25, 4.0, k).astype(np.float32))
                for norm in (False, True):
                    xs = block_kernels.emulate_rms_norm(x, nw, 1e-5, narrow) if norm else x
                    want = np.concatenate([narrow(block_kernels.emulate(xs, va, first, fma16)),
                                           narrow(block_kernels.emulate(xs, vb, Q.Q6_K, fma16))], axis=1)
                    out = block_kernels.pair_product(backend.block_kind, mx.array(x).astype(dtype), a, b,
                                                     (mx.array(nw).astype(dtype), 1e-5) if norm else None)
                    problem = _differs(f"the {first.name}+Q6_K pair launch{' (of normed rows)' if norm else ''} differs "
                                       "from its products' published order", np.array(out.astype(mx.float32)), want,
                                       f"{m} rows, {backend.dtype_name}")
                    if problem:
                        return problem
    except Exception as e:  # a kernel that fails to compile or launch
        return f"{_one_line(e)} (the pair launch)"
    return None


def verify_formed_kernels(backend: "MLXBackend") -> str | None:
    """The formed kernels (`block_kernels.formed_scales`, `formed_values`: what a prompt's products
    multiply) against the graph's (`mlx_weights`' compiled formed_scales and formed_values), bit for bit,
    through the weights' own dispatch (`QuantizedWeight.affine`, `BlockWeight.dense`) with and without a
    `former`, on random blocks with edge values of every type they form, 40 rows of 1,280 values, whole and
    a row slice (a dense product's), in the products' dtype. None, or one line naming the failure."""
    rng = np.random.default_rng(19)
    rows, k = 40, 1280
    values = backend.uses_values()  # (an affine weight's values: checked only where products use them)
    types = {**block_kernels.FORMED, **(block_kernels.VALUES if values else {})}

    def formed(w):  # [(kernel, what, array)] of each form the weight's type has
        out = []
        if block_kernels.FORMED.get(w.qtype) == "affine_scales":
            scales, biases = w.affine()
            out += [("affine_scales", "scales", scales), ("affine_scales", "biases", biases)]
        if (values and w.qtype in block_kernels.VALUES) or w.qtype == Q.Q6_K:
            out.append((block_kernels.VALUES.get(w.qtype, "q6_k_values"), "values", w.dense()))
        return out

    try:
        weights = {}
        for qtype in types:
            raw = quants.random_blocks(rng, qtype, rows, k, edges=True)
            weights[qtype] = to_device(qtype, quants.split(raw, qtype, rows, k), (rows, k), dtype=backend.weight_dtype,
                                       compiled=True)
        _prebuild(backend, [lambda w=w: [a for _, _, a in formed(replace(w, former=backend.formed_kind))]
                            for w in weights.values()])
        for qtype, w in weights.items():
            for part, what in ((w, ""), (w.row_slice(7, 29), ", rows 7-28")):
                got, want = formed(replace(part, former=backend.formed_kind)), formed(part)
                for (name, of, g), (_, _, x) in zip(got, want):
                    problem = _differs(f"the {name} kernel's {qtype.name} {of} differ from the graph's",
                                       np.array(g.astype(mx.float32)), np.array(x.astype(mx.float32)),
                                       f"{rows} rows of {k}{what}, {backend.dtype_name}")
                    if problem:
                        return problem
    except Exception as e:  # a kernel that fails to compile or launch
        return f"{_one_line(e)} (the formed kernels)"
    return None


def verify_rms_norm(backend: "MLXBackend") -> str | None:
    """blocks.cu's `rms_norm` kernel against `block_kernels.emulate_rms_norm`, bit for bit, in the
    backend's dtype: rows of 1,024 and 1,312 values, 1 and 9 rows (a block's 8, then one more), large
    and small values. None, or one line naming the failure."""
    rng = np.random.default_rng(11)
    narrow = lambda a: np.array(mx.array(a).astype(backend.dtype).astype(mx.float32))  # noqa: E731
    try:
        for rows, k, scale in ((1, 1024, 1.0), (9, 1312, 300.0)):
            x = narrow(rng.standard_normal((rows, k), dtype=np.float32) * scale)
            w = narrow(rng.uniform(0.25, 4.0, k).astype(np.float32))
            got = np.array(block_kernels.rms_norm(backend.norm_kind, mx.array(x).astype(backend.dtype),
                                                  mx.array(w).astype(backend.dtype), 1e-6).astype(mx.float32))
            problem = _differs("the rms_norm kernel differs from its published order", got,
                               block_kernels.emulate_rms_norm(x, w, 1e-6, narrow), f"{rows} rows of {k}, {backend.dtype_name}")
            if problem:
                return problem
    except Exception as e:  # a kernel that fails to compile or launch
        return f"{_one_line(e)} (the rms_norm kernel)"
    return None


def verify_swiglu(backend: "MLXBackend") -> str | None:
    """blocks.cu's `swiglu` kernel against `block_kernels.emulate_swiglu`, bit for bit, in the backend's
    dtype: 1 and 9 rows of 3,000 + 3,000 values (gate | up), gates across the exponential's whole range
    and past both ends of its clamp, zeros and signed zeros; then the block kernels' SWIGLU form, which
    computes those values by the same function (`_check_block_products(swiglu=True)`), so that a wrong
    SwiGLU turns off SwiGLU alone (not the ADD and NORM forms). None, or one line naming the failure."""
    rng = np.random.default_rng(13)
    narrow = lambda a: np.array(mx.array(a).astype(backend.dtype).astype(mx.float32))  # noqa: E731
    try:
        for rows, scale in ((1, 4.0), (9, 40.0)):
            x = narrow(rng.standard_normal((rows, 6000), dtype=np.float32) * scale)
            x[0, :8] = [0.0, -0.0, 19.5, 20.5, -87.5, -88.5, -200.0, 300.0]
            got = np.array(block_kernels.swiglu(backend.swiglu_kind, mx.array(x).astype(backend.dtype)).astype(mx.float32))
            want = block_kernels.emulate_swiglu(x, narrow)
            problem = _differs("the swiglu kernel differs from its published order", got, want,
                               f"{rows} rows of 3000, {backend.dtype_name}")
            if problem:
                return problem
        return _check_block_products(backend, swiglu=True)
    except Exception as e:  # a kernel that fails to compile or launch
        return f"{_one_line(e)} (the swiglu kernel)"


def _split(g, name: str, rows: int, cols: int) -> tuple:
    """A kept type's tensor as `quants.split` cuts it ([rows, cols]), once the file's check passed (a
    block with an inf or NaN scale, or an F16/BF16 value that is one, is a one-line GGUFError naming the
    tensor: `check_finite`)."""
    g.check_finite(name)
    return quants.split(g.raw(name), g.tensor(name).ggml_type, rows, cols)


class MLXBackend(Backend):
    name = "mlx"
    lazy = True

    def __init__(self, attention: str = "fused", device: str | None = None, kernel: str | None = None,
                 verify=verify_gpu_kernels, per_sequence_linear: bool = False, threads: int | None = None,
                 ranks: int = 1, float_scales: bool = False, dtype: str | None = None, kv_dtype: str | None = None):
        super().__init__(attention)
        # affine weights' float32 scales formed once at load, not at each use (`mlx_weights.to_device`):
        # the same bits, more memory (1.17-1.33x the file's bytes instead of 1.00-1.03x). Off by
        # default: on a GPU decode rows go to the block kernels (`block_kernels`), which read the compact
        # fields in registers, and a prefill chunk forms them once a product for many rows; on MLX's CPU
        # the larger scales are read every product and decode is no faster.
        # MLX's GPU products are not row-invariant (README: batch invariance); this multiplies each
        # sequence's rows on their own, as the cpu backend does, at the price of batching.
        self.per_sequence_linear = per_sequence_linear
        gpu = gpu_kind()
        if device is None:
            device = "gpu" if gpu else "cpu"
        if device not in ("cpu", "gpu"):
            raise RequestError(f"unknown device {device!r} (choose cpu or gpu)")
        if device == "gpu" and gpu is None:
            raise RequestError("--device gpu: MLX has no GPU here (neither Metal nor CUDA is available)")
        if threads is not None and device == "gpu":
            raise RequestError("--threads sets the threads of the CPU's weight products; on a GPU MLX schedules its own")
        self.device = device
        dtype = dtype or (GPU_DEFAULT_DTYPES[gpu] if device == "gpu" else "float32")
        if dtype not in DTYPES:
            raise RequestError(f"unknown dtype {dtype!r} (choose {', '.join(DTYPES)})")
        kv_dtype = kv_dtype or dtype
        if kv_dtype not in KV_DTYPES:
            raise RequestError(f"unknown KV cache dtype {kv_dtype!r} (choose {', '.join(KV_DTYPES)})")
        self.dtype_name, self.dtype, self.kv_dtype = dtype, DTYPES[dtype], kv_dtype
        # attention's result: the dtype, rounded once where the reference rounds it (`zeros`); float32
        # while the checks compare the paths (`attention_results`), so that they see every bit of the order
        self.attention_dtype = self.dtype
        self.weight_dtype = self.dtype if device == "gpu" else mx.float32  # the weight products' (docstring)
        self.kv_value_bytes = value_bytes(kv_dtype)
        self.float_scales = float_scales
        self.mx_device = mx.gpu if device == "gpu" else mx.cpu
        self.activate()
        # MLX runs a CPU stream's work on one thread: quantized products of at least 2 x SPLIT_MIN_ROWS
        # output rows are cut by rows, and the graph attention by KV heads, into up to `threads` parts,
        # each on its own stream (bitwise the whole: every output is the same dot product of the same
        # row; every head the same BLAS calls). By default the free cores, at most cores // ranks (the
        # processes of a tensor-parallel run share them; `cpu.default_threads`).
        if device == "cpu":
            threads = checked_threads(default_threads(ranks) if threads is None else threads)
        self.threads = threads or 1
        self._streams = _cpu_streams(self.threads - 1)
        if kernel not in (None, "graph", "metal", "cuda"):
            raise RequestError(f"unknown fused attention kernel {kernel!r} (graph, metal or cuda)")
        if kernel in ("metal", "cuda") and (device != "gpu" or gpu != kernel):
            raise RequestError(f"the {kernel} attention kernel needs an MLX {kernel} GPU device")
        # On a GPU, attention's arithmetic runs on our kernels (`self.gpu_kernels`, "metal" or "cuda").
        self.gpu_kernels = gpu if device == "gpu" else None
        self.holds_pass_buffers = device == "gpu"  # (MLX frees a buffer once the command using it has run)
        self.kernel = kernel or (gpu if device == "gpu" else "graph")
        # the quantized products' block kernels ("metal", "cuda" or None): checked apart from attention
        self.block_kind = self.gpu_kernels
        self.block_types = frozenset(block_kernels.KERNELS)  # less those whose kernel failed its self-check
        # affine products of this many rows or more dequantized, then multiplied (DENSE_MIN_ROWS): CUDA
        # only (measured there; MLX's Metal quantized_matmul is not)
        self.dense_rows = DENSE_MIN_ROWS if self.gpu_kernels == "cuda" else None
        # a formed weight's products from this many rows on dequantized by the affine_values kernel first
        # (DENSE_VALUES_MIN): CUDA only, as dense_rows
        self.values_rows = block_kernels.MAX_ROWS + 1 if self.gpu_kernels == "cuda" else None
        # RMSNorm by blocks.cu's kernel where the block kernels run (`rms_norm`), whose values the NORM
        # form of a product multiplies (`rms_norm_linear_group`: a norm and the products after it, one
        # launch); None (mx.fast.rms_norm) elsewhere, or once its own self-check failed
        self.norm_kind = self.block_kind
        # the block kernels' ADD and NORM forms (`linear_add`, `rms_norm_linear_group`): a verdict of their
        # own, so that a failure turns off only them (each norm and residual add its own launch again)
        self.fused_forms = bool(self.block_kind)
        # a group's two runs of different types in one launch (`block_kernels.pair_product`, in
        # `rms_norm_linear_group`): a verdict of its own too (each run's own launch again, failing)
        self.pair_launch = bool(self.block_kind)
        # a prompt's products' scales and values formed by blocks.cu's kernels (`block_kernels.FORMED`), each
        # weight's `former`: a verdict of its own too (the graph's compiled kernels again, failing)
        self.formed_kind = self.block_kind
        self._formers: list = []  # weak references to the weights handed a former (`_to_device`)
        # SwiGLU by blocks.cu's kernel where the block kernels run (`swiglu_ffn`), whose values the SWIGLU
        # form of the down product multiplies; None (MLX's silu and product) elsewhere, or once its own
        # self-check failed
        self.swiglu_kind = self.block_kind
        self.norm_fallback = self.fused_fallback = self.swiglu_fallback = self.pair_fallback = None  # their self-checks' failures
        self.formed_fallback = None
        # 16-bit prefill chunks in the tensor-core order (attention.cu; `matmul`, `softmax_rows`,
        # `fused_attention_override`):
        # CUDA (compute capability 8.0+), with q and the cache of one 16-bit type; off again if its own
        # self-check fails
        self.mma = bool(self.gpu_kernels in kernels.MMA_KINDS and dtype != "float32" and kv_dtype == dtype
                        and kernels.mma_supported())
        self.mma_fallback = None  # that check's failure, once one failed
        # ... unless MLX's own fused attention takes them (`_sdpa_takes`, SDPA_HEAD_DIMS): on the same
        # CUDA GPUs, and on Metal, in the same dtypes; off again if its self-check (`verify_sdpa`) fails
        self.sdpa = self.mma or bool(self.gpu_kernels == "metal" and dtype != "float32" and kv_dtype == dtype)
        if self.gpu_kernels == "cuda" and os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1") == "0":
            self.sdpa = False  # MLX told not to use cuDNN's attention: its kernel would refuse every chunk
        self.sdpa_fallback = None
        self.sdpa_batch, self.sdpa_batch_fallback = self.sdpa, None  # prompts of one length in one call
        self.qk_fallback = None  # the qk_norm_rope kernel's check failure, once one failed (`verify_qk_norm_rope`)
        self.model_long_chunks = None  # whether either takes the model's chunks (`check_model`)
        self.fallback = None  # the self-check's failure, once one failed
        self.block_fallback = None  # the block kernels' self-check failures, once one failed
        self.checked = None  # the kernel the self-check ran on, once it ran
        self.checked_here = False  # whether it ran in this process (not a remembered verdict)
        self._cache: dict[str, object] = {}
        if device == "gpu" and kernel is None and verify is not None:
            self.check_kernels(verify)
        elif device == "gpu" and verify is verify_gpu_kernels:
            self.check_blocks()  # (--kernel forces attention's kernels unchecked, not the block kernels)

    def check_kernels(self, verify=verify_gpu_kernels, fresh: bool = False) -> str | None:
        """Never run an unverified kernel silently: run `verify` (on the device; the default check's
        verdict is remembered per machine, code and dtypes: `kernel_checks`, unless `fresh`); on a
        mismatch use MLX's own ops instead, with fused attention running the per-head reference itself
        (see `fused_attention_override`), say so in one line on stderr, and return it."""
        self.checked = self.kernel
        ran = []

        def run():
            ran.append(True)
            return verify(self)

        kept = verify is verify_gpu_kernels and self.device == "gpu"  # (tests force kernels on the CPU: not kept)
        if kept and self.sdpa:  # first, so that a failing 16-bit prefill path turns off only itself
            key = f"{self.kernel} sdpa prefill{cudnn_version(self.kernel)}"
            problem = kernel_checks.verdict(key, self.dtype_name, self.kv_dtype, lambda: verify_sdpa(self), fresh=fresh)
            if problem:
                self._sdpa_off(problem)
        if kept and self.sdpa and self.sdpa_batch:
            key = f"{self.kernel} sdpa batched prefill{cudnn_version(self.kernel)}"
            problem = kernel_checks.verdict(key, self.dtype_name, self.kv_dtype, lambda: verify_sdpa_batch(self), fresh=fresh)
            if problem:
                self._sdpa_batch_off(problem)
        if kept and self.mma:
            mma = kernel_checks.verdict(f"{self.kernel} tensor-core prefill", self.dtype_name, self.kv_dtype,
                                        lambda: verify_mma(self), fresh=fresh)
            if mma:
                self.mma, self.mma_fallback = False, mma
                print(f"mlxinfer: warning: the tensor-core prefill kernels failed their self-check ({mma}); "
                      "16-bit prefill chunks use MLX's own products", file=sys.stderr)
        if kept and self.gpu_kernels == "metal":  # never run on hardware where it was written: checked here
            qk = kernel_checks.verdict("metal qk_norm_rope", self.dtype_name, "-", lambda: verify_qk_norm_rope(self),
                                       fresh=fresh)
            self.qk_fallback = qk  # (a fresh check that passes clears an earlier failure)
            if qk:
                print(f"mlxinfer: warning: the qk_norm_rope kernel failed its check ({qk}); Qwen3's norms and RoPE "
                      "use mx.fast's kernels", file=sys.stderr)
        if kept:
            problem = kernel_checks.verdict(self.kernel, self.dtype_name, self.kv_dtype, run, fresh=fresh)
        else:
            problem = run()
        self.checked_here = bool(ran)  # run in this process, not a remembered verdict
        if problem:
            self._attention_falls_back(problem)
        if kept:
            self.check_blocks(fresh)
        return problem

    def _formed_off(self) -> None:
        """The formed kernels off: for weights loaded from now on, and for those already loaded (a later
        fresh check, `kernel_report`, may fail after a model is loaded)."""
        self.formed_kind = None
        for ref in self._formers:
            if (w := ref()) is not None:
                w.former = None
        self._formers = []

    def check_blocks(self, fresh: bool = False) -> None:
        """The block kernels' verdicts (`check_kernels` runs them after attention's; on their own where
        --kernel forces the attention kernels): each block kernel's, then the fused forms', the pair
        launch's (where the fused forms passed: it runs only in their NORM path), the norm kernel's and
        the swiglu kernel's, each failure turning off only what it checked, in one line on stderr."""
        if self.block_kind:  # each block kernel's verdict, of its own (they read no KV cache)
            failed = {}
            for name in block_kernels.kernel_names():
                blocks = kernel_checks.verdict(f"{self.block_kind} blocks {name}", self.dtype_name, "-",
                                               lambda name=name: verify_block_kernels(self, name), fresh=fresh)
                if blocks:
                    failed[name] = blocks
            if failed:
                self.block_types = self.block_types - {t for n in failed for t in block_kernels.types_of(n)}
                self.block_fallback = "; ".join(failed.values())
                if not self.block_types:
                    self.block_kind = self.norm_kind = self.swiglu_kind = None
                    self._formed_off()
                print(f"mlxinfer: warning: a block kernel failed its self-check ({self.block_fallback}); "
                      f"{self.block_off} products use MLX's own ops", file=sys.stderr)
            fused = self.fused_forms and self.block_kind and kernel_checks.verdict(
                f"{self.block_kind} blocks fused forms", self.dtype_name, "-", lambda: verify_fused_forms(self), fresh=fresh)
            if fused:
                self.fused_forms, self.fused_fallback = False, fused
                print(f"mlxinfer: warning: the block kernels' fused forms failed their self-check ({fused}); each "
                      "norm and residual add is a launch of its own", file=sys.stderr)
            pair = self.pair_launch and self.fused_forms and self.block_kind and kernel_checks.verdict(
                f"{self.block_kind} blocks pair launch", self.dtype_name, "-", lambda: verify_pair_launch(self), fresh=fresh)
            if pair:
                self.pair_launch, self.pair_fallback = False, pair
                print(f"mlxinfer: warning: the pair launch failed its self-check ({pair}); a weight group's runs "
                      "of two types take a launch each", file=sys.stderr)
            formed = self.formed_kind and kernel_checks.verdict(
                f"{self.formed_kind} blocks formed scales and values{' compiled' * block_kernels.FORMED_COMPILED}",
                self.dtype_name, "-",
                lambda: verify_formed_kernels(self), fresh=fresh)
            if formed:
                self.formed_fallback = formed
                self._formed_off()
                print(f"mlxinfer: warning: the formed kernels failed their self-check ({formed}); a prompt's "
                      "products form their scales and values by MLX's compiled ops", file=sys.stderr)
            norm = self.norm_kind and kernel_checks.verdict(f"{self.norm_kind} blocks rms_norm", self.dtype_name, "-",
                                                            lambda: verify_rms_norm(self), fresh=fresh)
            if norm:
                self.norm_kind, self.norm_fallback = None, norm
                print(f"mlxinfer: warning: the rms_norm kernel failed its self-check ({norm}); norms use "
                      "mx.fast.rms_norm, each apart from the product after it", file=sys.stderr)
            glu = self.swiglu_kind and kernel_checks.verdict(f"{self.swiglu_kind} blocks swiglu", self.dtype_name, "-",
                                                             lambda: verify_swiglu(self), fresh=fresh)
            if glu:
                self.swiglu_kind, self.swiglu_fallback = None, glu
                print(f"mlxinfer: warning: the swiglu kernel failed its self-check ({glu}); SwiGLU uses MLX's "
                      "own ops, apart from the down product", file=sys.stderr)

    def _sdpa_batch_off(self, problem: str) -> None:
        self.sdpa_batch, self.sdpa_batch_fallback = False, problem
        print(f"mlxinfer: warning: MLX's fused attention over several prompts in one call failed its "
              f"self-check ({problem}); each prompt takes a call of its own", file=sys.stderr)

    def _sdpa_off(self, problem: str) -> None:
        self.sdpa, self.sdpa_fallback = False, problem
        instead = "the tensor-core kernels" if self.mma else "MLX's products a head at a time"
        print(f"mlxinfer: warning: MLX's fused attention failed its self-check on 16-bit prefill chunks ({problem}); "
              f"they take {instead}", file=sys.stderr)

    def _attention_falls_back(self, problem: str) -> None:
        self.fallback = problem
        self.gpu_kernels, self.kernel, self.mma, self.sdpa = None, "graph", False, False
        print(f"mlxinfer: warning: the attention kernels failed their self-check ({problem}); using "
              "MLX's own ops and per-head attention (pass --kernel to force the kernels)", file=sys.stderr)

    def check_model(self, specs) -> str | None:
        """The attention kernels checked in a model's own shapes (`model_check_cases` for each distinct
        spec, bit for bit as `verify_gpu_kernels` checks its cases; on CUDA their forms compiled at once
        first), before the model's first pass; the verdict remembered per spec as the self-check's is.
        A failure falls back as the self-check's does. Nothing to do without GPU kernels, or when they
        are forced (--kernel: unchecked, as asked)."""
        specs = list(dict.fromkeys(specs))
        # whether a 16-bit path takes this model's chunks at all (Metal: not a soft-capped model's)
        self.model_long_chunks = any((self.mma and kernels.mma_fits(spec)) or self._sdpa_takes(spec, PREFILL_ROWS)
                                     for spec in specs)
        if not self.gpu_kernels or self.checked is None:
            return None
        for spec in specs:
            cases = [c for c in model_check_cases(spec) if case_applies(self, c)]

            def run(cases=cases):
                _prebuild(self, [lambda c=c: _check_case(self, c) for c in cases])
                return _first_problem(self, cases)

            def verdict(run=run, spec=spec):
                shape = (f"{self.kernel} model {spec.n_heads}x{spec.n_kv_heads}x{spec.head_dim} scale {spec.scale!r} "
                         f"window {spec.window} softcap {spec.softcap} causal {spec.causal} sdpa {self.sdpa}"
                         f"{' batched' if self.sdpa and self.sdpa_batch else ''}"
                         f"{cudnn_version(self.kernel) if self.sdpa else ''}")
                return (kernel_checks.verdict(shape, self.dtype_name, self.kv_dtype, run) if self.device == "gpu"
                        else run())  # (tests force kernels on the CPU: not kept)

            problem = verdict()
            if problem and self.sdpa and self.sdpa_batch and not spec.window and self._sdpa_takes(spec, PREFILL_ROWS):
                # two equal chunks may take one call over both prompts: that alone off, checked again
                self._sdpa_batch_off(f"{problem}, in the model's shape")
                problem = verdict()
            if problem and self.sdpa and self._sdpa_takes(spec, PREFILL_ROWS):
                # its chunk may be MLX's fused attention's, at a head size `verify_sdpa` did not ask:
                # that path off alone, and the model's shape checked again without it
                self._sdpa_off(f"{problem}, in the model's shape")
                problem = verdict()
            if problem:
                self._attention_falls_back(f"{problem}, in the model's shape")
                return self.fallback
        return None

    @property
    def block_off(self) -> str:
        """The types whose block kernel failed its self-check (their products on MLX's own ops)."""
        return ", ".join(t.name for t in block_kernels.KERNELS if t not in self.block_types)

    def kernel_report(self) -> tuple[str, bool]:
        """(one line, passed) on the GPU kernels of this device: the self-check's verdict over its
        cases (run now if it has not run), for `mlxinfer inspect --kernels`."""
        if self.device != "gpu":
            return "kernels: none on the CPU (MLX's own ops, graph attention): nothing to check", True
        if not (self.fallback or self.checked_here):  # asked for: run now unless it just ran here
            self.check_kernels(fresh=True)
        kind = self.checked
        cases = self_check_cases()
        what = (f"{len(cases)} cases: head dims {', '.join(map(str, SELF_CHECK_HEAD_DIMS))}; decode rows, chunks, "
                f"a window, soft-caps, contexts of 1 to 1,100 keys; {', '.join(KV_CACHES)} caches")
        if self.block_fallback:
            blocks = f"; block kernels: self-check FAILED ({self.block_fallback}), {self.block_off} products on MLX's own ops"
        else:
            blocks = "; block kernels: self-check passed, bit for bit their published order"
        if self.mma_fallback:
            blocks += (f"; tensor-core prefill: self-check FAILED ({self.mma_fallback}), 16-bit chunks on MLX's "
                       "own products")
        elif self.mma:
            blocks += "; tensor-core prefill: self-check passed, fused bit for bit the per-head reference"
        if self.sdpa_fallback:
            blocks += f"; MLX's fused attention on 16-bit prefill chunks: self-check FAILED ({self.sdpa_fallback})"
        elif self.sdpa:
            blocks += ("; MLX's fused attention on 16-bit prefill chunks: self-check passed, one call over every "
                       "head bit for bit a call a head")
            if self.sdpa_batch_fallback:
                blocks += f"; one call over several prompts: self-check FAILED ({self.sdpa_batch_fallback}), a call a prompt"
            elif self.sdpa_batch:
                blocks += "; one call over several prompts: self-check passed, bit for bit a call a prompt"
        if self.fused_fallback:
            blocks += f"; the block kernels' fused forms: self-check FAILED ({self.fused_fallback}), norms and adds apart"
        if self.pair_fallback:
            blocks += f"; pair launch: self-check FAILED ({self.pair_fallback}), a launch a run"
        if self.formed_fallback:
            blocks += f"; formed scales and values: self-check FAILED ({self.formed_fallback}), MLX's compiled ops"
        if self.norm_fallback:
            blocks += f"; rms_norm: self-check FAILED ({self.norm_fallback}), mx.fast.rms_norm"
        if self.swiglu_fallback:
            blocks += f"; swiglu: self-check FAILED ({self.swiglu_fallback}), MLX's silu and product"
        if self.qk_fallback:
            blocks += f"; qk_norm_rope: check FAILED ({self.qk_fallback}), mx.fast's kernels"
        elif self.gpu_kernels == "metal":
            blocks += "; qk_norm_rope: check passed, within its bound of mx.fast's kernels"
        if self.fallback:
            return (f"kernels: {kind}: self-check FAILED ({self.fallback}); mlxinfer uses MLX's own ops and "
                    f"per-head attention ({what}){blocks}"), False
        return (f"kernels: {kind}: self-check passed, fused attention bit for bit the per-head reference ({what})"
                f"{blocks}"), (self.block_fallback is None and self.mma_fallback is None and self.sdpa_fallback is None
                               and self.sdpa_batch_fallback is None and self.qk_fallback is None
                               and self.fused_fallback is None and self.norm_fallback is None
                               and self.swiglu_fallback is None and self.pair_fallback is None
                               and self.formed_fallback is None)

    @property
    def rows_independent(self) -> bool:
        """On the CPU device (tests/test_prefix.py); a GPU's products are not measured: assumed not."""
        return self.device == "cpu"

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per prefill pass unless told: MMA_PREFILL_CHUNK where 16-bit chunks take the
        tensor-core order or MLX's fused attention (and the model's, once `check_model` saw it, do), else
        the protocol's."""
        long = (self.mma or self.sdpa) and self.model_long_chunks is not False
        return MMA_PREFILL_CHUNK if long else Backend.prefill_chunk

    def describe(self) -> str:
        types = self.dtype_name + ("" if self.kv_dtype == self.dtype_name else f", {self.kv_dtype} KV cache")
        if self.device == "cpu":
            return f"mlx (cpu, {types}, graph attention, {self.threads} thread{'s' if self.threads != 1 else ''})"
        ops = f"{self.gpu_kernels} kernels" if self.gpu_kernels else "MLX ops"
        if self.block_fallback:
            ops += f" ({self.block_off} products on MLX's: their block kernel failed its self-check)"
        elif self.block_kind and not self.gpu_kernels:
            ops += f" ({self.block_kind} block kernels)"
        if self.norm_fallback:  # (every norm's bits depend on it: the engine's identity names it)
            ops += " (RMSNorm on mx.fast's kernel: ours failed its self-check)"
        if self.swiglu_fallback:  # (every FFN's bits depend on it)
            ops += " (SwiGLU on MLX's ops: our kernel failed its self-check)"
        if self.fused_fallback:
            ops += " (norms and residual adds apart from the products: their forms failed the self-check)"
        if self.sdpa:  # (a chunk's bits depend on these: the engine's identity names them)
            ops += ", MLX's fused attention on 16-bit prefill chunks"
        elif self.sdpa_fallback:
            ops += " (MLX's fused attention failed its self-check on prefill chunks)"
        if self.sdpa and self.sdpa_batch_fallback:
            ops += " (a call a prompt: the batched one failed its self-check)"
        if self.mma:
            ops += ", tensor-core prefill"
        elif self.mma_fallback:
            ops += " (tensor-core prefill failed its self-check)"
        if self.dense_rows:  # (a batch's and a chunk's bits depend on it)
            small = (f" (of 2^{DENSE_VALUES_MIN.bit_length() - 1}+ values under 8 bits: {self.values_rows}+)"
                     if self.values_rows and self.formed_kind else "")
            ops += f", affine products of {self.dense_rows}+ rows{small} dequantized first"
        rows = ", each sequence's rows multiplied alone" if self.per_sequence_linear else ""
        attention = "per-head (the kernels failed their self-check)" if self.fallback else self.kernel
        return f"mlx (gpu, {types}, {attention} attention, {ops}{rows})"

    def label(self) -> str:
        return f"MLX/{self.device.upper()}"

    def activate(self):
        """Make this backend's device MLX's default. Called where graphs start (inputs, embedding
        lookups), so that two MLX backends on different devices can live in one process."""
        if mx.default_device() != self.mx_device:
            mx.set_default_device(self.mx_device)

    # -- data in and out ----------------------------------------------------------------------
    def from_numpy(self, a):
        self.activate()
        return mx.array(np.asarray(a, dtype=np.float32))

    def activation(self, x):
        return x.astype(self.dtype)

    def to_numpy(self, x):
        if x.dtype in (mx.bfloat16, mx.float16):  # (logits, activations: numpy has no bfloat16)
            x = x.astype(mx.float32)
        return np.array(x, copy=True)

    def index_array(self, values):
        self.activate()
        return mx.array(np.asarray(values, dtype=np.int32).reshape(-1))

    def concat_index_arrays(self, parts):
        return mx.concatenate([mx.reshape(p, (-1,)) for p in parts])

    def start(self, *xs):
        mx.async_eval(*xs)

    def sync(self, *xs):
        mx.eval(*xs)

    def done_marker(self, *xs):
        # one element made on the host that depends on xs (Depends launches nothing: it shares that
        # element's buffer), detached from them once evaluated, so that it keeps no store from being
        # written in place
        return mx.depends(mx.array([0], dtype=mx.int32), list(xs))

    def new_random(self, seed: int):
        return MLXRandom(seed)

    def peak_memory_mb(self) -> float:
        return mx.get_peak_memory() / (1024 * 1024)

    def _to_device(self, qtype, arrays, shape):
        """A weight on this backend (`mlx_weights.to_device`): in the products' dtype, its affine scales
        formed once at load (`float_scales`) or at each use, by one compiled kernel on a GPU. Where the
        block kernels may multiply it, their inputs are made here too (views of its fields, no copy), so
        a decode step replays no view of them (four a layer)."""
        w = to_device(qtype, arrays, shape, self.float_scales, self.weight_dtype, compiled=self.device == "gpu")
        if self.block_kind and qtype in block_kernels.KERNELS and not getattr(w, "float_scales", False):
            w.kernel_fields = block_kernels.kernel_fields(w)
            mx.eval(*w.kernel_fields)
            if self.formed_kind and (qtype in block_kernels.FORMED or (qtype in block_kernels.VALUES and self.uses_values())):
                w.former = self.formed_kind  # a prompt's products: its scales or values by one kernel
                self._formers.append(weakref.ref(w))  # (unset if a later check fails: `_formed_off`)
        return w

    @staticmethod
    def _read(g, name, transposed: bool):
        """A 2-D weight in host memory: (type, arrays, (out, in)), the arrays `quants.split` makes
        (the type kept as compact as the file), or (None, (matrix,), ...) in float32 for F32, [out, in]
        or [in, out] when `transposed`. A type that is neither is refused by `g.dequantize`."""
        t = g.tensor(name)
        if len(t.shape) != 2:
            raise GGUFError(f"{g.path}: tensor {name!r} should be a matrix, found shape {list(t.shape)}")
        rows, cols = t.shape
        if t.ggml_type in KEPT:
            return t.ggml_type, _split(g, name, rows, cols), (rows, cols)
        m = g.dequantize(name)
        return None, (np.ascontiguousarray(m.T if transposed else m, dtype=np.float32),), (rows, cols)

    def _matrix(self, g, name, transposed: bool):
        """A 2-D weight: a QuantizedWeight or BlockWeight (one copy serves both the embedding and a
        tied output head), or a float32 array, [out, in] for row gathers or [in, out] (`transposed`)
        for matmuls, since `x @ W` is ~2.5x faster than `x @ W.T` on MLX's CPU. Cached per layout."""
        key = (name, transposed and g.tensor(name).ggml_type not in KEPT)
        if key not in self._cache:
            self._cache[key] = self._to_device(*self._read(g, name, transposed))
        return self._cache[key]

    def load_weight(self, g, name):
        return self._matrix(g, name, transposed=True)

    def load_weight_group(self, g, names):
        """The matrices stacked into one (one product for Q, K and V, one for gate and up: two and one
        fewer launches a layer) where they share a layout: all of one kept type, or all float32; where
        they do not, each run of consecutive matrices of one layout stacked (`WeightRuns`: a Q4_K_M
        file's Q and K in one product, its Q6_K V in another). Packed rows are stacked as they are, so
        each output column is the same dot product of the same row as the separate product's. Stacked
        in host memory: the parts never reach the device."""
        parts = [self._read(g, n, transposed=True) for n in names]
        runs = [list(run) for _, run in itertools.groupby(parts, key=lambda p: p[0])]
        groups = tuple(self._stacked(run) for run in runs)
        return groups[0] if len(groups) == 1 else WeightRuns(groups)

    def _stacked(self, parts) -> WeightGroup:
        """Matrices of one layout (`_read`'s (qtype, arrays, shape) each) as one `WeightGroup`."""
        qtype = parts[0][0]
        axis = 1 if qtype is None else 0  # float [in, out] side by side; packed [out, ...] rows stacked
        sizes = tuple(shape[0] for _, _, shape in parts)
        stacked = [np.concatenate([arrays[i] for _, arrays, _ in parts], axis=axis) for i in range(len(parts[0][1]))]
        return WeightGroup(self._to_device(qtype, stacked, (sum(sizes), parts[0][2][1])), sizes)

    def load_embedding(self, g, name):
        return self._matrix(g, name, transposed=False)

    def load_vector(self, g, name):
        # evaluated here: left lazy, the cast would be a launch of every first pass (113 in a 0.6B Qwen3's)
        v = mx.array(np.ascontiguousarray(g.dequantize(name), dtype=np.float32).reshape(-1)).astype(self.dtype)
        mx.eval(v)
        return v

    # -- the KV cache's stores, in kv_dtype (q8_0: packed int8 rows, `backends/mlx_kv.py`) -----------
    def new_store(self, slots, capacity, width):
        self.activate()
        if self.kv_dtype == "q8_0":
            if width % 32:
                raise RequestError(f"--kv-dtype q8_0 quantizes KV rows in blocks of 32 values; this model's rows "
                                   f"hold {width} (KV heads x head_dim): choose another --kv-dtype")
            return mx.zeros((slots, capacity, packed_width(width)), dtype=mx.int8)
        return mx.zeros((slots, capacity, width), dtype=DTYPES[self.kv_dtype])

    def resize_store(self, store, slots, capacity):
        out = mx.zeros((slots, capacity, store.shape[2]), dtype=store.dtype)
        s, c = min(slots, store.shape[0]), min(capacity, store.shape[1])
        out[:s, :c] = store[:s, :c]
        return out

    def scatter_rows(self, store, slots, positions, x):
        store[slots, positions] = quantize_q8_0(x) if store.dtype == mx.int8 else x.astype(store.dtype)
        return store

    def read_rows(self, store, slot, length):
        rows = store[slot, :length]
        return dequantize_q8_0(rows) if store.dtype == mx.int8 else rows

    # -- primitives ---------------------------------------------------------------------------
    def linear(self, x, w, groups=None):
        # in the activations' dtype (a no-op for attention's output, already in it), the product in
        # `weight_dtype` (float32 on MLX's CPU: see the module docstring), its output in the dtype
        return self._linear(x.astype(self.dtype).astype(self.weight_dtype), w, groups).astype(self.dtype)

    def linear_add(self, x, w, residual, groups=None):
        # decode rows of a block type on a GPU: the product and the residual in one launch (the kernels'
        # ADD form rounds the product to the dtype, then the sum, as `linear` then `add` do: the same
        # bits, one launch a layer fewer for each of the attention's and the FFN's output products)
        if (self.fused_forms and self.weight_dtype == self.dtype and residual.dtype == self.dtype
                and self._block_product(x, w, groups)):
            return block_kernels.product(self.block_kind, x.astype(self.dtype), w, residual=residual)
        return super().linear_add(x, w, residual, groups)

    def _block_product(self, x, w, groups=None) -> bool:
        """Whether `_linear` multiplies x by w in a block kernel (`block_kernels`)."""
        return (not (self.per_sequence_linear and groups is not None and len(groups) > 1) and bool(self.block_kind)
                and isinstance(w, PackedWeight) and w.qtype in self.block_types and block_kernels.applies(w, x))

    def _linear(self, x, w, groups=None):
        # MLX's CPU products compute each row on its own (batch-invariant as they are); on a GPU they
        # do not (README: batch invariance), unless `per_sequence_linear`.
        if self.per_sequence_linear and groups is not None and len(groups) > 1:
            return mx.concatenate([self._linear(x[r0:r1], w) for r0, r1 in groups])
        if self._block_product(x, w):
            return block_kernels.product(self.block_kind, x, w)  # decode rows: the fields read in registers
        if isinstance(w, QuantizedWeight) and (
                (self.dense_rows and x.size >= self.dense_rows * x.shape[-1]) or self._values_product(x, w)):
            return dense_product(w, x)  # many rows: the weight dequantized, then one product (DENSE_MIN_ROWS)
        if isinstance(w, PackedWeight):
            if self._streams and w.shape[0] >= 2 * SPLIT_MIN_ROWS:
                return self._split_quantized_matmul(x, w)
            return w.product(x)
        return mx.matmul(x, w)

    def uses_values(self) -> bool:
        """Whether products here multiply an affine weight's dequantized values (`dense_rows`,
        `values_rows`: CUDA), so that its `former` forms them (the affine_values kernel) and the formed
        self-check checks that kernel; elsewhere (Metal) its twin is neither checked nor used."""
        return bool(self.dense_rows or self.values_rows)

    def _values_product(self, x, w) -> bool:
        """Whether a product of x's rows by affine weight w dequantizes it by its kernel first
        (`values_rows`, DENSE_VALUES_MIN): a weight of fewer than 8 bits a value that the kernel forms,
        neither an output head nor small."""
        return bool(self.values_rows and w.former and not w.float_scales and w.bits < 8
                    and x.size >= self.values_rows * x.shape[-1]
                    and w.shape[0] <= block_kernels.WIDE and w.shape[0] * w.shape[1] >= DENSE_VALUES_MIN)

    def _cpu_parts(self, n: int, min_size: int = 1):
        """[((start, end), stream context)]: n items cut into up to `threads` nearly equal parts of at
        least min_size, the first on the current stream, each other on its own CPU stream (MLX gives a
        stream its own thread)."""
        k = max(1, min(n // min_size, self.threads))
        cuts = np.linspace(0, n, k + 1).astype(int)
        streams = [contextlib.nullcontext()] + [mx.stream(st) for st in self._streams[:k - 1]]
        return [((int(cuts[i]), int(cuts[i + 1])), streams[i]) for i in range(k)]

    def _split_quantized_matmul(self, x, w):
        """x @ w.T with w's output rows cut over the CPU threads (`_cpu_parts`), then side by side (a
        BlockWeight's rows are dequantized on their part's thread too)."""
        parts = []
        for (a, b), stream in self._cpu_parts(w.shape[0], SPLIT_MIN_ROWS):
            with stream:
                parts.append(w.row_slice(a, b).product(x))
        return mx.concatenate(parts, axis=-1)

    def linear_group(self, x, ws, groups=None):
        if isinstance(ws, WeightRuns):
            return tuple(y for run in ws.runs for y in self.linear_group(x, run, groups))
        if not isinstance(ws, WeightGroup):
            return super().linear_group(x, ws, groups)
        return self._group_columns(self.linear(x, ws.merged, groups), ws.sizes)

    @staticmethod
    def _group_columns(y, sizes):
        """Each matrix's columns (`sizes` of them, in order) of a product by a group's merged matrix: views
        (one decode row's part is contiguous), all of them by one Split primitive (a slice each was a view
        primitive each, the host's work at every layer of every pass: two a layer more for Q, K and V)."""
        if y.shape[1] != sum(sizes):  # (a split gives the last matrix whatever columns are left)
            raise ValueError(f"a group's product has {y.shape[1]} columns, its matrices {sum(sizes)}")
        if len(sizes) == 1:
            return (y,)
        return tuple(mx.split(y, list(itertools.accumulate(sizes[:-1])), axis=1))

    def matmul(self, a, b):
        # attention's products, in float32 whatever the dtype (operands widened exactly; the kernels
        # widen what they read the same way). On a GPU, products of fewer than PREFILL_ROWS rows (decode
        # rows, short chunks) or fewer than PREFILL_GEMM_MIN multiply-adds are our kernel's (one
        # published order, so the fused kernels can match them); larger ones MLX's own (cuBLAS, Metal
        # GEMM), which the fused override then runs the same way (`fused_attention_override`). 16-bit
        # chunks (`self.mma`) take the tensor-core order instead: b's values are the dtype's (keys,
        # values), a's are rounded to it in the kernel (queries: exact; attention weights: to nearest even)
        if self.mma and a.shape[0] >= PREFILL_ROWS:
            bt = mx.contiguous(mx.transpose(b)).astype(self.dtype)
            return mx.squeeze(kernels.mma_matmul(self.gpu_kernels, a.astype(mx.float32)[None], bt[None]), 0)
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        if self.gpu_kernels and not gemm_sized(a.shape[0], a.shape[0] * a.shape[1] * b.shape[1]):
            return mx.squeeze(kernels.matmul(self.gpu_kernels, a[None], mx.contiguous(mx.transpose(b))[None]), 0)
        return mx.matmul(a, b)

    def transpose_2d(self, x):
        # widened before the transpose: the product then sees the float32 view the graph path passes
        return mx.transpose(x.astype(mx.float32))

    def softmax_rows(self, x):
        # attention's: a 16-bit chunk's scores in the tensor-core path's order (`matmul`)
        if self.mma and x.shape[0] >= PREFILL_ROWS:
            return kernels.mma_softmax(self.gpu_kernels, x.astype(mx.float32))
        return self._softmax(x)

    def _softmax(self, x):
        x = x.astype(mx.float32)
        if self.gpu_kernels:
            return kernels.softmax(self.gpu_kernels, x)
        return mx.softmax(x, axis=-1, precise=True)

    def sum_squares_rows(self, x):
        return mx.sum(x * x, axis=1, keepdims=True)

    def add_scalar(self, x, s):
        return x + s

    def rsqrt(self, x):
        return mx.rsqrt(x)

    def mul_rows(self, x, col):
        return x * col

    def hadamard(self, a, b):
        return a * b

    def add(self, a, b):
        return a + b

    def scale(self, x, s):
        return x * s

    def silu(self, x):
        return x * mx.sigmoid(x)

    def gelu(self, x):
        inner = SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)
        return 0.5 * x * (1.0 + mx.tanh(inner))

    def tanh(self, x):
        # on a GPU float32 (attention's soft-capping, the logits') through our kernel: the tanh the fused
        # kernels cap scores with (kernels.tanh; MLX's own may be another toolkit's tanhf)
        if self.gpu_kernels and x.dtype == mx.float32:
            return kernels.tanh(self.gpu_kernels, x)
        return mx.tanh(x)

    def load_experts(self, gguf, name):
        """An ExpertStack: a kept type's stack as [experts * out, in] rows of that type (quantized experts
        stay quantized: Qwen3-30B-A3B's would take ~120 GB in float32), F32 as float32 [experts, in, out]."""
        t = gguf.tensor(name)
        if len(t.shape) != 3:
            raise GGUFError(f"{gguf.path}: tensor {name!r} should be an [experts, out, in] stack, found shape {list(t.shape)}")
        e, out, n_in = t.shape
        if t.ggml_type in KEPT:
            arrays = _split(gguf, name, e * out, n_in)
            return ExpertStack((e, out, n_in), weight=self._to_device(t.ggml_type, arrays, (e * out, n_in)))
        dense = mx.array(np.ascontiguousarray(np.swapaxes(gguf.dequantize(name), 1, 2), dtype=np.float32))
        dense = dense.astype(self.weight_dtype)
        return ExpertStack((e, out, n_in), dense=dense)

    def moe_mlp(self, x, logits, experts, k, groups=None):
        probs = self._softmax(logits)  # (the router's: one order for any number of rows)
        ids = mx.argsort(-probs, axis=-1)[:, :k]
        w = mx.take_along_axis(probs, ids, axis=-1)
        w = w / mx.maximum(mx.sum(w, axis=-1, keepdims=True), MOE_MIN_WEIGHT_SUM)
        gate, up, down = experts
        xe = mx.expand_dims(x.astype(self.weight_dtype), (-2, -3))  # [N, 1, 1, in]: one row against its k experts
        h = self.silu(gate.products(xe, ids)) * up.products(xe, ids)
        y = down.products(h, ids)[:, :, 0]  # [N, k, hidden]
        out = y[:, 0] * w[:, :1]
        for j in range(1, k):
            out = out + y[:, j] * w[:, j:j + 1]
        return out.astype(self.dtype)  # (the router's weights are float32)

    def rms_norm(self, x, weight, eps):
        # Where the block kernels run, blocks.cu's (`norm_kind`): the values its products' NORM form
        # multiplies, so `rms_norm_linear_group` fused or not gives the same bits. Else one fused kernel
        # for the six primitives (on this CPU bitwise equal to them; tested); the weight is 1-D already
        # (`load_vector`): a reshape here was a graph node a call
        if self.norm_kind and x.ndim == 2 and x.dtype == weight.dtype:
            return block_kernels.rms_norm(self.norm_kind, x, weight, eps)
        return mx.fast.rms_norm(x, weight, eps)

    def rms_norm_linear_group(self, x, weight, eps, ws, groups=None):
        # a product a run of one layout (a WeightGroup is one run): each run's NORM form where every run
        # takes it (two runs a pair kernel takes, Q4_K then Q6_K: one launch for both), else the norm
        # once and the runs' products
        runs = ws.runs if isinstance(ws, WeightRuns) else (ws,) if isinstance(ws, WeightGroup) else None
        if runs is None or not self._norm_form(x, weight, [run.merged for run in runs], groups):
            return super().rms_norm_linear_group(x, weight, eps, ws, groups)
        if self.pair_launch and len(runs) == 2 and block_kernels.pair_applies(self.block_kind, x, runs[0].merged,
                                                                              runs[1].merged):
            y = block_kernels.pair_product(self.block_kind, x, runs[0].merged, runs[1].merged, norm=(weight, eps))
            return self._group_columns(y, runs[0].sizes + runs[1].sizes)
        return tuple(y for run in runs for y in self._group_columns(
            block_kernels.product(self.block_kind, x, run.merged, norm=(weight, eps)), run.sizes))

    def _norm_form(self, x, weight, ws, groups=None) -> bool:
        """Whether rms_norm(x) times each of the merged matrices ws is a block kernel's NORM form."""
        return bool(self.fused_forms and self.norm_kind and x.dtype == weight.dtype == self.dtype == self.weight_dtype
                    and all(self._block_product(x, w, groups) for w in ws))

    def _norm_product(self, x, weight, eps, w, groups=None):
        """rms_norm(x) @ w for a group's merged matrix w: for decode rows of a block type on a GPU in one
        launch (the kernels' NORM form multiplies the very values `rms_norm` writes), one launch a layer
        fewer for each of the attention's and the FFN's norms."""
        if self._norm_form(x, weight, [w], groups):
            return block_kernels.product(self.block_kind, x, w, norm=(weight, eps))
        return self.linear(self.rms_norm(x, weight, eps), w, groups)

    def swiglu_ffn(self, x, weight, eps, gate_up, down, groups=None):
        # Where the block kernels run (`swiglu_kind`): gate and up stay side by side (one merged product,
        # no column views) and SwiGLU is blocks.cu's `swiglu` kernel; for decode rows of a block type with
        # the fused forms, its values are what the down product's SWIGLU form multiplies, the residual
        # added in the same launch (ADD): norm + gate/up, then SwiGLU + down + add, two launches a layer,
        # where the down weight is small enough (`block_kernels.fuses_swiglu`; else the swiglu kernel first).
        # Elsewhere the composite's default (MLX's own silu and product, compiled into one kernel).
        if not (self.swiglu_kind and isinstance(gate_up, WeightGroup) and len(gate_up.sizes) == 2
                and gate_up.sizes[0] == gate_up.sizes[1] and x.dtype == self.dtype):
            return super().swiglu_ffn(x, weight, eps, gate_up, down, groups)
        gu = self._norm_product(x, weight, eps, gate_up.merged, groups)
        if (self.fused_forms and self.weight_dtype == self.dtype and self._block_product(gu, down, groups)
                and block_kernels.fuses_swiglu(down)):
            return block_kernels.product(self.block_kind, gu, down, residual=x, swiglu=True)
        return self.linear_add(block_kernels.swiglu(self.swiglu_kind, gu), down, x, groups)

    def qk_norm_rope(self, q, k, q_weight, k_weight, positions, n_heads, n_kv_heads, head_dim, eps, base,
                     traditional, factors=None):
        if self.gpu_kernels in kernels.QK_NORM_ROPE_KINDS and self.qk_fallback is None and factors is None \
                and kernels.qk_norm_rope_fits(head_dim, traditional) and kernels.qk_norm_rope_types_fit(q, k, q_weight, k_weight):
            # one launch for both, reading the heads in place: the step's 4 launches and 4 views a layer
            # become 1 (not bit for bit mx.fast's: see kernels.qk_norm_rope), in every --dtype
            return kernels.qk_norm_rope(self.gpu_kernels, q, k, q_weight, k_weight, positions, n_heads, n_kv_heads,
                                        head_dim, eps, base)
        return (self._norm_rope(q, q_weight, positions, n_heads, head_dim, eps, base, traditional, factors),
                self._norm_rope(k, k_weight, positions, n_kv_heads, head_dim, eps, base, traditional, factors))

    def _norm_rope(self, x, weight, positions, heads, head_dim, eps, base, traditional, factors):
        """The default's kernels on [N, heads, 1, head_dim] (rms_norm over the last axis), two reshapes
        instead of five (tested bitwise)."""
        def norm_rope(xh):
            return self._rope(mx.fast.rms_norm(xh, weight, eps), positions, head_dim, base, traditional, factors)

        return self._per_head(x, heads, head_dim, norm_rope)

    def rope(self, x, positions, n_heads, head_dim, base, traditional, factors=None):
        return self._per_head(x, n_heads, head_dim,
                              lambda xh: self._rope(xh, positions, head_dim, base, traditional, factors))

    @staticmethod
    def _per_head(x, n_heads, head_dim, fn):
        """fn of [N, heads*head_dim] rows seen as [N, heads, 1, head_dim]: each row its own batch entry
        (mx.fast.rope's array offset gives each batch entry its own position)."""
        n = x.shape[0]
        return mx.reshape(fn(mx.reshape(x, (n, n_heads, 1, head_dim))), (n, n_heads * head_dim))

    @staticmethod
    def _rope(xh, positions, head_dim, base, traditional, factors=None):
        if factors is None:
            return mx.fast.rope(xh, head_dim, traditional=traditional, base=base, scale=1.0, offset=positions)
        return mx.fast.rope(xh, head_dim, traditional=traditional, base=None, scale=1.0, offset=positions,
                            freqs=_rope_periods(head_dim, base, factors))

    def reshape(self, x, rows, cols):
        if x.dtype == mx.int8:  # a q8_0 store: `cols` values a row are its packed bytes
            return mx.reshape(x, (rows, -1))
        return mx.reshape(x, (rows, cols))

    def copy_2d_from(self, x, row, rows, col, cols):
        return mx.contiguous(x[row : row + rows, col : col + cols])

    def copy_2d_into(self, dst, src, row, col):
        dst[row : row + src.shape[0], col : col + src.shape[1]] = src
        return dst

    def zeros(self, rows, cols):
        return mx.zeros((rows, cols), dtype=self.attention_dtype)

    def concat_dim0(self, a, b):
        return mx.concatenate([a, b], axis=0)

    def gather_rows(self, table, ids):
        self.activate()
        if isinstance(table, PackedWeight):  # embedding rows
            return table.rows(ids).astype(self.dtype)
        if table.dtype == mx.int8:  # a q8_0 store's rows
            return dequantize_q8_0(table[ids])
        return table[ids]

    def mask_scores(self, scores, positions, causal, window):
        hidden = _hidden_keys(positions, scores.shape[-1], causal, window)
        return mx.where(hidden, mx.array(-np.inf, dtype=mx.float32), scores)

    def sample_tokens(self, logits, sampler):
        return sampler.sample_mlx(logits.astype(mx.float32))

    # -- fused attention ----------------------------------------------------------------------
    @property
    def compiles_decode(self) -> bool:
        """A decode pass is shape-stable (fixed batch and cache capacity, positions and lengths as
        arrays) where attention runs our GPU kernel, which reads each row's length from an array; the
        graph path slices the cache by host lengths and is never compiled. Not with per-sequence
        products either: compiled, their bits changed with the batch size on the H200."""
        return self.attention == "fused" and self.kernel in ("cuda", "metal") and not self.per_sequence_linear

    def compiles_pass(self, batch, spec):
        # the passes the override sends to the kernel (with `compiles_decode`, there is one): the graph
        # path slices the cache by host lengths
        return not self._pass_needs_graph(batch, spec)

    def compile_decode(self, forward):
        return mx.compile(forward)

    def all_sum(self, x, group):
        return collectives.all_sum(x, group)

    def all_gather_cols(self, x, group, cols):
        return collectives.all_gather_cols(x, group, cols)

    def fused_attention_override(self, q, kv, batch, spec):
        if self.fallback is not None:
            # The kernels failed their self-check: MLX's own GPU products then differ between the
            # reference's one-head products and a batched graph's (on Metal a one-batch product may take
            # split-K GEMM, a batched one never), so fused attention runs the reference itself: the same
            # products, the same bits, at the reference's speed
            return self.per_head_attention(q, kv, batch, spec)
        long = [b for b in range(len(batch.rows)) if self._long_chunk(spec, batch, b)] if self.gpu_kernels else []
        if not long:
            return self._fused(q, kv, batch, spec, range(len(batch.rows)))
        # Chunks of PREFILL_ROWS rows or more: in 16-bit dtypes on CUDA MLX's fused attention over every
        # head, or the tensor-core kernel, each the reference's bits in one call; else the reference's
        # products (MLX's GEMMs a head at a time, the same calls as `per_head_attention`, so the same
        # bits) with its other steps once over every head (`_heads_together`). The other sequences'
        # rows as usual, then put in their places.
        out = self.zeros(q.shape[0], spec.n_heads * spec.head_dim)
        for group in self._sdpa_groups(batch, spec, long):
            b, (r0, r1) = group[0], (batch.rows[group[0]][0], batch.rows[group[-1]][1])
            if len(group) > 1:
                ctx = self._sdpa_batch(q[r0:r1], kv, batch, spec, group)
            elif self._sdpa_takes(spec, r1 - r0):
                k, v = kv.sequence(self, b)
                ctx = self._sdpa(_head_major(q[r0:r1], spec.n_heads), _head_major(k, spec.n_kv_heads),
                                 _head_major(v, spec.n_kv_heads), spec, self._sdpa_mask(batch, b, k.shape[0], spec))
                ctx = _row_major(ctx).astype(self.attention_dtype)
            elif self.mma and kernels.mma_fits(spec):
                k, v = kv.sequence(self, b)
                ctx = kernels.mma_attention(self.gpu_kernels, q[r0:r1].astype(self.dtype), k.astype(self.dtype),
                                            v.astype(self.dtype), batch.positions_of(self, b), spec,
                                            out_dtype=self.attention_dtype)
            elif not self.mma and spec.n_heads * (r1 - r0) * batch.kv_lens[b] * 4 <= HEADS_TOGETHER_MAX_BYTES:
                ctx = self._heads_together(q[r0:r1], kv, batch, spec, b)
            else:  # (a long chunk over many keys; 16-bit, a head size the tensor-core kernel does not take)
                out = self.per_head_sequence(q, kv, batch, spec, b, out)
                continue
            if r0 == 0 and r1 == q.shape[0]:  # the whole pass
                return ctx
            out[r0:r1] = ctx
        rest = [b for b in range(len(batch.rows)) if b not in long]
        if rest:
            at = mx.array(np.concatenate([np.arange(*batch.rows[b]) for b in rest]).astype(np.int32))
            out[at] = self._fused(q, kv, batch, spec, rest, at)
        return out

    def _long_chunk(self, spec, batch, b: int) -> bool:
        """Whether sequence b's chunk takes the long-chunk paths below (else the kernels): PREFILL_ROWS
        rows or more, and where its products would be MLX's GEMMs (no tensor-core order, no MLX fused
        attention) a head's product of PREFILL_GEMM_MIN multiply-adds or more over its keys, as the
        reference's `matmul` decides."""
        r0, r1 = batch.rows[b]
        rows = r1 - r0
        if rows < PREFILL_ROWS:  # (first: a compiled decode step's batch has no kv_lens)
            return False
        return self.mma or self._sdpa_takes(spec, rows) or gemm_sized(rows, rows * batch.kv_lens[b] * spec.head_dim)

    def _sdpa_groups(self, batch, spec, seqs) -> list[list[int]]:
        """`seqs` (in batch order) as runs that one call of MLX's fused attention takes together
        (SDPA_BATCH_MAX_BYTES): consecutive sequences whose chunks it takes, of one length over as many
        keys, no window (so one bottom-right causal mask is each one's own), the keys all runs stack at most
        that many bytes; every other sequence a run of its own."""
        row_bytes = spec.n_kv_heads * spec.head_dim * self.dtype.size

        def joins(g, b):
            (a0, a1), (b0, b1), n = batch.rows[g[0]], batch.rows[b], batch.kv_lens[b]
            return (b == g[-1] + 1 and b1 - b0 == a1 - a0 and n == batch.kv_lens[g[0]] and self._sdpa_takes(spec, b1 - b0))

        groups, stacked = [], 0  # (the keys' bytes the groups of more than one stack so far)
        for b in seqs:
            g = groups[-1] if groups else None
            more = batch.kv_lens[b] * row_bytes * (2 if g and len(g) == 1 else 1)  # (a pair stacks its first too)
            if g and self.sdpa_batch and not spec.window and joins(g, b) and stacked + more <= SDPA_BATCH_MAX_BYTES:
                g.append(b)
                stacked += more
            else:
                groups.append([b])
        return groups

    def _sdpa_batch(self, q, kv, batch, spec, group):
        """One call of MLX's fused attention over the sequences `group` (`_sdpa_groups`): their rows q
        [B*T, H*D] seen as [B, H, T, D] (a view), their keys and values stacked [B, KV, S, D] (a copy); the
        context back as [B*T, H*D]."""
        n, t = len(group), q.shape[0] // len(group)
        keys, values = zip(*(kv.sequence(self, b) for b in group))
        mask = self._sdpa_mask(batch, group[0], keys[0].shape[0], spec)  # ("causal" or None: no window)
        ctx = self._sdpa(_head_major(mx.reshape(q, (n, t, -1)), spec.n_heads), _head_major(mx.stack(keys), spec.n_kv_heads),
                         _head_major(mx.stack(values), spec.n_kv_heads), spec, mask)
        return _row_major(ctx).astype(self.attention_dtype)

    def per_head_sequence(self, q, kv, batch, spec, b, out):
        # A 16-bit chunk that MLX's fused attention takes (`_sdpa_takes`): steps 3-7 of the reference are
        # one call of it a head (q_h, k_h, v_h as the default copies them, each [1, 1, rows, D]); the
        # fused override makes one call over every head. Other sequences: the default's steps.
        r0, r1 = batch.rows[b]
        if not self._sdpa_takes(spec, r1 - r0):
            return super().per_head_sequence(q, kv, batch, spec, b, out)
        d, t = spec.head_dim, r1 - r0
        k_b, v_b = kv.sequence(self, b)
        s = k_b.shape[0]
        mask = self._sdpa_mask(batch, b, s, spec)
        for h in range(spec.n_heads):
            kv_h = h // spec.group
            q_h = self.copy_2d_from(q, r0, t, h * d, d)
            k_h = self.copy_2d_from(k_b, 0, s, kv_h * d, d)
            v_h = self.copy_2d_from(v_b, 0, s, kv_h * d, d)
            ctx = self._sdpa(q_h[None, None], k_h[None, None], v_h[None, None], spec, mask)
            out = self.copy_2d_into(out, ctx[0, 0], r0, h * d)
        return out

    def _heads_together(self, q, kv, batch, spec, b):
        """Sequence b's chunk (its rows of q) as the per-head reference computes it where `matmul` is
        MLX's product (no tensor-core order): each head's two products the same MLX call on operands of
        the same layout as the reference's (fresh row-contiguous float32 blocks: [rows, D] by a
        transposed [keys, D], then [rows, keys] by [keys, D]; indexing by an integer copies one out), every
        other step once over all heads' [heads, rows, keys] scores: scaling, soft-capping and masking are
        elementwise and the softmax row by row, so each value is computed as in its own head's call. The
        same bits in about 5 launches a head (2 products, the query's and weights' copies, a key and a
        value copy a KV head) instead of about 13 (the reference's mask, scale and softmax a head too),
        which in a float32 pass of several chunks of 128 rows cost far more than the products."""
        t, d, h_all, kvh = q.shape[0], spec.head_dim, spec.n_heads, spec.n_kv_heads
        k, v = kv.sequence(self, b)
        s, f32 = k.shape[0], mx.float32
        qh = mx.transpose(mx.reshape(q.astype(f32), (t, h_all, d)), (1, 0, 2))  # [H, T, D] (a view)
        kh = mx.transpose(mx.reshape(k.astype(f32), (s, kvh, d)), (1, 0, 2))  # [KV, S, D]
        vh = mx.transpose(mx.reshape(v.astype(f32), (s, kvh, d)), (1, 0, 2))
        keys = [mx.transpose(kh[j]) for j in range(kvh)]
        scores = mx.stack([mx.matmul(qh[h], keys[h // spec.group]) for h in range(h_all)])
        scores = self._softcap(self.scale(scores, spec.scale), spec.softcap)
        if t > 1 or spec.window:
            scores = self.mask_scores(scores, batch.positions_of(self, b), spec.causal, spec.window)
        attn = mx.reshape(self._softmax(mx.reshape(scores, (h_all * t, s))), (h_all, t, s))
        values = [vh[j] for j in range(kvh)]
        ctx = mx.concatenate([mx.matmul(attn[h], values[h // spec.group]) for h in range(h_all)], axis=1)
        return ctx.astype(self.attention_dtype)

    def sequence_op(self, spec, rows: int) -> str | None:
        return "sdpa" if self._sdpa_takes(spec, rows) else None

    def _sdpa_takes(self, spec, rows: int) -> bool:
        """Whether a sequence's chunk of `rows` query rows takes MLX's fused attention (16-bit prefill
        chunks on a GPU: `self.sdpa`): PREFILL_ROWS rows or more, a head size its kernel takes on this GPU,
        no soft-cap."""
        return (self.sdpa and rows >= PREFILL_ROWS and not spec.softcap
                and spec.head_dim in SDPA_HEAD_DIMS.get(self.gpu_kernels, ()))

    def _sdpa(self, q, k, v, spec, mask):
        """`mx.fast.scaled_dot_product_attention` on [1, heads, rows, D] in the dtype; on a GPU only its
        fused kernel (`force_fused`: a shape it does not take raises, never MLX's composed fallback, whose
        products batch heads). MLX's CPU (tests) has only the fallback."""
        dt = self.dtype
        return mx.fast.scaled_dot_product_attention(q.astype(dt), k.astype(dt), v.astype(dt), scale=spec.scale,
                                                    mask=mask, force_fused=self.device == "gpu")

    def _sdpa_mask(self, batch, b: int, keys: int, spec):
        """Sequence b's mask as `mask_scores` draws it (key j hidden from position p when j > p, causal, or
        j <= p - window), for `_sdpa`: "causal" where that is MLX's bottom-right causal mask (no window,
        the chunk's last row at the last key), else additive (0 or -inf in the dtype) [rows, keys], or
        None."""
        if not spec.window and (not spec.causal or keys == batch.kv_lens[b]):
            return "causal" if spec.causal else None
        hidden = _hidden_keys(batch.positions_of(self, b), keys, spec.causal, spec.window)
        return mx.where(hidden, mx.array(-np.inf, dtype=self.dtype), mx.array(0, dtype=self.dtype))

    def _fused(self, q, kv, batch, spec, seqs, at=None):
        """The fused override for sequences `seqs` of the batch (all, or those whose rows `at` lists):
        their rows' attention, in that order."""
        sub = [batch.rows[b] for b in seqs]
        if self.kernel == "graph" or self._pass_needs_graph(batch, spec):
            return self._graph_attention(q, kv, batch, spec, seqs)
        q_all = q
        if at is not None:  # the rows of `seqs` alone, numbered from 0
            q = q[at]
            starts = np.cumsum([0] + [r1 - r0 for r0, r1 in sub])
            sub = [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]
        pick = (lambda a: a[at]) if at is not None else (lambda a: a)
        if kv.store is not None:  # the whole batch in one launch, reading the cache in place
            keys, values = kv.store
            return kernels.fused_attention(self.kernel, q, keys, values, pick(batch.row_slots), pick(batch.positions),
                                           pick(batch.row_lens), spec, seq_rows=sub, out_dtype=self.attention_dtype)
        if isinstance(kv, PagedLayer):  # the batch's rows gathered from the blocks, one launch
            rows, row_seq, s_max = kv.batch_rows(self)
            n, w = kv.keys.shape[0] * kv.keys.shape[1], kv.keys.shape[2]
            keys = kv.keys.reshape(n, w)[rows].reshape(len(batch), s_max, w)
            values = kv.values.reshape(n, w)[rows].reshape(len(batch), s_max, w)
            return kernels.fused_attention(self.kernel, q, keys, values, pick(row_seq), pick(batch.positions),
                                           pick(batch.row_lens), spec, seq_rows=sub, out_dtype=self.attention_dtype)
        outs = []  # a cache with no single store (basic): one launch per sequence, its K/V as slot 0
        for b in seqs:
            r0, r1 = batch.rows[b]
            k, v = kv.sequence(self, b)
            zeros = mx.zeros((r1 - r0,), dtype=mx.int32)
            row_len = mx.full((r1 - r0,), k.shape[0], dtype=mx.int32)
            outs.append(kernels.fused_attention(self.kernel, q_all[r0:r1], k[None], v[None], zeros,
                                                batch.positions_of(self, b), row_len, spec,
                                                seq_rows=[(0, r1 - r0)], out_dtype=self.attention_dtype))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)

    def _softcap(self, scores, cap):
        """The reference's soft-capping (scale, tanh, scale) where the spec asks for it."""
        return self.scale(self.tanh(self.scale(scores, softcap_inverse(cap))), cap) if cap else scores

    def _pass_needs_graph(self, batch, spec) -> bool:
        """Whether this pass's attention takes the graph override even with a GPU kernel: a head_dim past
        the kernel's limit, or (where the kernel has no split plan: Metal) few rows over long caches
        (never a traced batch's, whose lengths live only in its arrays). A q8_0 cache is read by the
        kernels in place (`mlxi_kv`), soft-capping computed in them (`mlxi_score`)."""
        if spec.head_dim > kernels.MAX_HEAD_DIM:
            return True
        if kernels.uses_split(self.kernel, batch.n_rows, spec):
            return False
        return self._few_long_rows(batch, spec)

    @staticmethod
    def _few_long_rows(batch, spec) -> bool:
        """A pass of few query rows over long caches (one sequence decoding at 8k: 16 work items for a
        GPU of 132 SMs) runs faster as the graph override than as the one-launch kernel, whose products
        spread every score over the GPU. Both paths compute the same bits; this only picks the faster
        one (on the H200 the graph path decoded ~4x faster at 8,192 tokens of context).
        Where the split kernels exist (CUDA) they take these passes instead."""
        longest = batch.max_kv_len
        return longest is not None and batch.n_rows * spec.n_heads < 256 and longest > 1024

    def _graph_attention(self, q, kv, batch, spec, seqs=None):
        """Each sequence's heads in one batched graph (of `seqs`, default all), byte-identical to the
        per-head reference on the same device: on the CPU each head's product is the same BLAS call the
        reference makes (MLX's CPU matmul loops one call per batch element) on the same contiguous [S, D]
        blocks; on a GPU the products and softmax are the same kernels, batched over heads (sequences of
        fewer than PREFILL_ROWS rows: `fused_attention_override` sends the others to the reference)."""
        kvh, d, group = spec.n_kv_heads, spec.head_dim, spec.group
        outs = []
        for b in (range(len(batch.rows)) if seqs is None else seqs):
            r0, r1 = batch.rows[b]
            t = r1 - r0
            k, v = kv.sequence(self, b)
            s = k.shape[0]
            f32 = mx.float32  # attention's arithmetic (as `matmul`): the operands widened exactly
            qh = mx.contiguous(mx.transpose(mx.reshape(q[r0:r1], (t, kvh, group, d)), (1, 2, 0, 3)))
            qh = qh.astype(f32)  # [KV, G, T, D]
            kh = mx.contiguous(mx.transpose(mx.reshape(k, (s, kvh, d)), (1, 0, 2))).astype(f32)  # [KV, S, D]
            if self.gpu_kernels:
                scores = kernels.matmul(self.gpu_kernels, mx.reshape(qh, (kvh * group, t, d)), kh, group)
                scores = self._softcap(scores * spec.scale, spec.softcap)
                if t > 1 or spec.window:
                    scores = self.mask_scores(scores, batch.positions_of(self, b), spec.causal, spec.window)
                attn = kernels.softmax(self.gpu_kernels, mx.reshape(scores, (-1, s)))
                vt = mx.contiguous(mx.transpose(mx.reshape(v, (s, kvh, d)), (1, 2, 0))).astype(f32)  # [KV, D, S]
                ctx = kernels.matmul(self.gpu_kernels, mx.reshape(attn, (kvh * group, t, s)), vt, group)
                ctx = mx.reshape(ctx, (kvh, group, t, d))
            else:  # the KV heads cut over the CPU threads, each part on its own stream
                vh = mx.contiguous(mx.transpose(mx.reshape(v, (s, kvh, d)), (1, 0, 2))).astype(f32)[:, None]
                parts = []
                for (h0, h1), stream in self._cpu_parts(kvh):
                    with stream:
                        scores = mx.matmul(qh[h0:h1], mx.swapaxes(kh[h0:h1, None], -1, -2)) * spec.scale  # [KV, G, T, S]
                        scores = self._softcap(scores, spec.softcap)
                        if t > 1 or spec.window:
                            scores = self.mask_scores(scores, batch.positions_of(self, b), spec.causal, spec.window)
                        parts.append(mx.matmul(self.softmax_rows(scores), vh[h0:h1]))  # [KV, G, T, D]
                ctx = parts[0] if len(parts) == 1 else mx.concatenate(parts)
            outs.append(mx.reshape(mx.transpose(ctx, (2, 0, 1, 3)), (t, spec.n_heads * d)).astype(self.attention_dtype))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)


def _hidden_keys(positions, keys: int, causal: bool, window):
    """[rows, keys] bool: key j hidden from the row at positions[i] (j > p when causal, j <= p - window
    with a window), the rule of `mask_scores`."""
    j, pos = mx.arange(keys)[None, :], positions[:, None]
    hidden = mx.zeros((positions.shape[0], keys), dtype=mx.bool_)
    if causal:
        hidden = mx.logical_or(hidden, j > pos)
    if window:
        hidden = mx.logical_or(hidden, j <= pos - window)
    return hidden


def _head_major(x, n: int):
    """[rows, n*D] -> [1, n, rows, D], or [B, rows, n*D] -> [B, n, rows, D] (`mx.fast.scaled_dot_product_attention`'s
    layout) as a view, no copy: its kernels read strided heads (MLX copies where one needs contiguous
    rows), so a chunk's keys and values are not copied out of the KV store, 128 MiB a layer at 32k tokens
    of Qwen3-0.6B in bfloat16."""
    y = mx.swapaxes(mx.reshape(x, (*x.shape[:-1], n, -1)), -3, -2)
    return y[None] if x.ndim == 2 else y


def _row_major(ctx):
    """MLX's fused attention's context [B, H, rows, D] back as rows [B*rows, H*D] (one copy; a swap, not
    `ctx[0]`: MLX indexes an array by an integer with a gather, a copy of the whole context)."""
    return mx.reshape(mx.swapaxes(ctx, 1, 2), (-1, ctx.shape[1] * ctx.shape[3]))


@functools.lru_cache(maxsize=None)
def _rope_periods(head_dim: int, base: float, factors: tuple) -> mx.array:
    """mx.fast.rope's `freqs` for frequencies divided by `factors`: it takes periods, base**(2j/d) (its
    angle is p / freqs[j]), so each period is multiplied by its pair's factor (computed in float64, once)."""
    periods = base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim) * np.asarray(factors, np.float64)
    return mx.array(periods.astype(np.float32))
