"""The Backend protocol: the primitive ops every model is written against.

A backend owns its tensor type (numpy arrays for `cpu`, lazy `mx.array`s for `mlx`) and implements the
primitives below. Models never touch tensors directly: every step of the forward pass is a call on the
backend, so a tracing wrapper (`mlxinfer.tracing`) sees and counts each one.

A forward pass advances a *batch* of sequences at once (`mlxinfer.batch.Batch`). Activations are packed:
2-D `[N, cols]` float32 tensors whose N rows are the rows of every sequence in the pass, sequence after
sequence (a prefill chunk gives several rows, a decode step one). Positions, slots and lengths reach the
backend as integer arrays made by `index_array`. Weight matrices are opaque handles made by
`load_weight`; `linear(x, w)` treats them as the logical `[in, out]` matrix.

`fused_attention` is the composite op with a contract: `per_head_attention` below is its definition, built
from the primitives; its op order is what every override must reproduce bit for bit. The other composite
ops (`rms_norm`, `qk_norm_rope`, `linear_group`, `linear_add`, `rms_norm_linear_group`, `swiglu_ffn`) have defaults built from the primitives too, which the
tracing backend runs; a backend's overrides of them fuse kernels or drop reshapes.
"""

from __future__ import annotations

import math
import resource
import sys
from dataclasses import dataclass

import numpy as np

from . import collectives
from .errors import RequestError
from .sampling import NumpyRandom

# The protocol's op names, in one place: the tracing backend wraps exactly these.
PRIMITIVE_OPS = (
    "linear",
    "matmul",
    "transpose_2d",
    "softmax_rows",
    "sum_squares_rows",
    "add_scalar",
    "rsqrt",
    "mul_rows",
    "hadamard",
    "add",
    "scale",
    "silu",
    "gelu",
    "tanh",
    "moe_mlp",
    "rope",
    "reshape",
    "copy_2d_from",
    "copy_2d_into",
    "zeros",
    "concat_dim0",
    "gather_rows",
    "scatter_rows",
    "read_rows",
    "mask_scores",
    "sample_tokens",
    "all_sum",
    "all_gather_cols",
)
OPS = PRIMITIVE_OPS + ("fused_attention",)
ATTENTION_PATHS = ("fused", "per-head")
DTYPES = ("float32", "bfloat16", "float16")  # the MLX backend's activations (--dtype); the cpu backend: float32
KV_DTYPES = (*DTYPES, "q8_0")  # what the MLX backend's KV cache stores (--kv-dtype)
# the dtype MLX runs on a GPU when none is asked for, by GPU kind (on its CPU: float32). CUDA: bfloat16,
# which reached the first token 2.1-12.8x sooner than float32 from 511 prompt tokens (later after 17),
# decoded faster after 2,047 (not after 17) and took less memory (an H100: docs/performance.md).
# Metal: float32, as nothing has been measured on Apple hardware.
GPU_DEFAULT_DTYPES = {"cuda": "bfloat16", "metal": "float32"}
MOE_MIN_WEIGHT_SUM = 6.103515625e-5  # llama.cpp clamps the chosen experts' weight sum to float16's smallest normal
# GELU's tanh approximation, ggml's constants (ggml-cpu/vec.h)
GELU_COEF_A, SQRT_2_OVER_PI = 0.044715, 0.79788456080286535587989211986876


def softcap_inverse(cap: float) -> float:
    """1/cap rounded once to float32: soft-capping scales by it, takes tanh, scales by cap."""
    return float(np.float32(1.0) / np.float32(cap))


def attention_scale(head_dim: int) -> float:
    """1/sqrt(head_dim), rounded once to float32: every attention path multiplies by this value."""
    return float(np.float32(1.0 / math.sqrt(head_dim)))


@dataclass(frozen=True)
class AttentionSpec:
    """What an architecture asks of attention: head geometry, the score scale, causal masking and an
    optional sliding window (a query at position p sees keys at positions p - window + 1 .. p)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    causal: bool = True
    window: int | None = None
    softcap: float | None = None  # scores capped to softcap * tanh(score / softcap) before masking (Gemma 2)

    @classmethod
    def standard(cls, n_heads: int, n_kv_heads: int, head_dim: int, window: int | None = None):
        return cls(n_heads, n_kv_heads, head_dim, attention_scale(head_dim), True, window)

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads


class Backend:
    """Base class of all backends. Subclasses implement every primitive; a subclass may override
    `fused_attention_override` (it must then be byte-identical to `per_head_attention`).

    `attention` ("fused" or "per-head") is part of the backend's configuration, chosen at construction
    and reported by `describe()`; `fused_attention` dispatches on it."""

    name = "base"
    device = "cpu"
    kernel: str | None = None
    lazy = False  # ops build a graph evaluated later: the engine queues the next pass before reading
    compiles_decode = False  # decode passes may run as one compiled step (`compile_decode`)
    # the device keeps every buffer an evaluation allocates until the whole evaluation has run (MLX on a
    # GPU): the loop then starts a long pass a few layers at a time (`Loop._start`, PACE_LAYERS)
    holds_pass_buffers = False
    # a prefill row's bits do not depend on the other rows of its chunk (measured on MLX's CPU device; not
    # so on numpy/OpenBLAS, whose kernels change with a product's shape): a cached prefix may then end
    # anywhere, else only where a prefill chunk does (`Loop._reusable`)
    rows_independent = False

    dtype_name = "float32"  # the activations' dtype (MLX: --dtype)
    kv_dtype = "float32"  # what the KV cache stores (MLX: --kv-dtype)
    kv_value_bytes = 4.0  # bytes a KV cache value takes in the backend's stores
    prefill_chunk = 512  # prompt tokens per prefill pass unless the engine is told (`load(prefill_chunk=)`)

    def __init__(self, attention: str = "fused"):
        if attention not in ATTENTION_PATHS:
            raise RequestError(f"unknown attention path {attention!r} (choose from {', '.join(ATTENTION_PATHS)})")
        self.attention = attention

    def describe(self) -> str:
        """The backend's configuration in one line, e.g. "mlx (gpu, bfloat16, cuda attention, cuda kernels)"."""
        return self.name

    def label(self) -> str:
        """A short tag for traces: "CPU", "MLX/GPU"."""
        return self.name.upper()

    # -- data in and out (not ops of the forward pass; not traced) ---------------------------
    def from_numpy(self, a: np.ndarray):
        raise NotImplementedError

    def activation(self, x):
        """x (from `from_numpy`, float32) in the dtype the backend's activations have (MLX: --dtype)."""
        return x

    def to_numpy(self, x) -> np.ndarray:
        """float32 for any float tensor (MLX narrower dtypes widened)."""
        raise NotImplementedError

    def index_array(self, values) -> object:
        """An int32 array of the backend's kind holding `values` (token ids, positions, slots)."""
        raise NotImplementedError

    def concat_index_arrays(self, parts):
        """Concatenate int32 index arrays (token ids assembled for the next pass)."""
        raise NotImplementedError

    def load_weight(self, gguf, name: str):
        """A weight matrix stored in GGUF as [out, in] rows, as a handle `linear` reads as [in, out]."""
        raise NotImplementedError

    def load_weight_group(self, gguf, names):
        """Weight matrices that multiply the same activations (a layer's Q, K and V; gate and up), as
        one handle for `linear_group`; iterating it gives each matrix's `linear` handle in order.
        Default: the tuple of their `load_weight` handles."""
        return tuple(self.load_weight(gguf, n) for n in names)

    def load_embedding(self, gguf, name: str):
        """A [vocab, hidden] table for `gather_rows`."""
        raise NotImplementedError

    def load_vector(self, gguf, name: str):
        """A 1-D parameter (norm weights) as a row that `hadamard` broadcasts over [N, n] rows: [1, n]
        (numpy), or [n] where the backend's fused rms_norm takes it so (MLX: no reshape a call)."""
        raise NotImplementedError

    def new_store(self, slots: int, capacity: int, width: int):
        """A zeroed [slots, capacity, width] KV store (the preallocated cache's per-layer tensor)."""
        raise NotImplementedError

    def resize_store(self, store, slots: int, capacity: int):
        """A [slots, capacity, width] store holding `store`'s rows (grown or trimmed; the rest zero)."""
        raise NotImplementedError

    def compiles_pass(self, batch, spec) -> bool:
        """Whether this decode batch's attention would read only the batch's arrays (no host length),
        so that a compiled step traced with placeholder host values computes it."""
        return False

    def compile_decode(self, forward):
        """`forward` (a decode pass: arrays in, logits and the written cache stores out) compiled into
        one step. Backends that set `compiles_decode` implement it."""
        raise NotImplementedError

    def start(self, *xs) -> None:
        """Start computing `xs` without waiting (lazy backends queue them; eager ones have nothing to do)."""

    def sync(self, *xs) -> None:
        """Token boundary: make sure `xs` are computed (lazy backends evaluate here)."""

    def done_marker(self, *xs):
        """What waiting for `xs` can wait on instead of them: computed once they are, and holding none of
        them once computed (a lazy backend's arrays; eager ones computed them already: None)."""
        return None

    def new_random(self, seed: int):
        """A sequence's random state for `sample_tokens`, seeded."""
        return NumpyRandom(seed)

    def peak_memory_mb(self) -> float:
        """Peak memory so far: the process's peak resident set (backends with their own allocator
        report that allocator's peak)."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1024 * 1024 if sys.platform == "darwin" else 1024)

    # -- primitives ---------------------------------------------------------------------------
    def linear(self, x, w, groups=None):
        """[N, K] activations times a weight handle -> [N, out]. `groups` are the (start, stop) row
        ranges of the batch's sequences: a backend whose product rows depend on how many rows are
        multiplied together (numpy: one row goes to gemv, several to gemm) multiplies each group on
        its own, so that a sequence's floats never depend on the other sequences of the batch."""
        raise NotImplementedError

    def matmul(self, a, b):
        """[M, K] @ [K, N] -> [M, N] of two activations (attention's scores and context)."""
        raise NotImplementedError

    def transpose_2d(self, x):
        raise NotImplementedError

    def softmax_rows(self, x):
        """Softmax of each row: subtract the row max, exp, divide by the row sum."""
        raise NotImplementedError

    def sum_squares_rows(self, x):
        """[M, N] -> [M, 1], the sum of squares of each row."""
        raise NotImplementedError

    def add_scalar(self, x, s: float):
        raise NotImplementedError

    def rsqrt(self, x):
        raise NotImplementedError

    def mul_rows(self, x, col):
        """[M, N] * [M, 1]: scale each row by its own scalar."""
        raise NotImplementedError

    def hadamard(self, a, b):
        """Elementwise product; `b` may be a row ([1, N] or [N], `load_vector`) broadcast over the rows of `a`."""
        raise NotImplementedError

    def add(self, a, b):
        raise NotImplementedError

    def scale(self, x, s: float):
        raise NotImplementedError

    def silu(self, x):
        raise NotImplementedError

    def gelu(self, x):
        """GELU, tanh approximation (Gemma's gelu_pytorch_tanh), elementwise in float32, as ggml writes it:
        0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))."""
        raise NotImplementedError

    def tanh(self, x):
        """Elementwise tanh (soft-capping: cap * tanh(x / cap))."""
        raise NotImplementedError

    def load_experts(self, gguf, name: str):
        """A [experts, out, in] stack of expert matrices (Qwen3-MoE's and Mixtral's `*_exps`), as `moe_mlp`
        reads it (the cpu backend dequantizes to float32; MLX keeps the file's type)."""
        raise NotImplementedError

    def moe_mlp(self, x, logits, experts, k: int, groups=None):
        """Each row's mixture of experts, as llama.cpp's build_moe_ffn with softmax gating and normalized
        weights (Qwen3-MoE): p = softmax of the router's `logits` [N, E] (`softmax_rows`' order); the k
        experts of largest p, largest first (ties: the lower expert); weights w = those p / max(their
        sum, 2^-14), the sum accumulated in float64 as ggml's; with `experts` = (gate, up, down) stacks,
        y_j = down_e(silu(gate_e(x)) * up_e(x)) for the j-th chosen expert e, and the output
        y_0 w_0 + y_1 w_1 + ... added in that order. `groups` as `linear`'s: a backend whose products
        depend on how many rows are multiplied together keeps each sequence's rows apart."""
        raise NotImplementedError

    def rope(self, x, positions, n_heads: int, head_dim: int, base: float, traditional: bool, factors=None):
        """Rotary position embedding of [N, n_heads*head_dim] rows, row i at position positions[i]:
        pair j turns by positions[i] * base**(-2j/head_dim) / factors[j].
        `traditional=False` rotates halves (x[:d/2], x[d/2:]) as Qwen/NeoX; True rotates
        interleaved pairs (x[2i], x[2i+1]) as llama.cpp does on Llama GGUF files. `factors` (None, or
        head_dim/2 floats) divide each pair's frequency: llama.cpp's `freq_factors` (Llama 3's
        `rope_freqs.weight`) times the linear scaling factor, as ggml's rope computes the angle
        freq_scale * p * theta_scale**j / freq_factors[j]."""
        raise NotImplementedError

    def reshape(self, x, rows: int, cols: int):
        raise NotImplementedError

    def copy_2d_from(self, x, row: int, rows: int, col: int, cols: int):
        """A new [rows, cols] tensor holding x[row:row+rows, col:col+cols]."""
        raise NotImplementedError

    def copy_2d_into(self, dst, src, row: int, col: int):
        """Write src [r, c] into dst[row:row+r, col:col+c]; returns the updated dst."""
        raise NotImplementedError

    def zeros(self, rows: int, cols: int):
        """A [rows, cols] tensor of zeros in the activations' dtype."""
        raise NotImplementedError

    def concat_dim0(self, a, b):
        raise NotImplementedError

    def gather_rows(self, table, ids):
        """Rows `ids` (an index array) of a [V, C] table or activation."""
        raise NotImplementedError

    def scatter_rows(self, store, slots, positions, x):
        """store[slots[i], positions[i]] = x[i] for every row i of x (the KV cache write); returns the
        updated store (in place where the backend can). numpy and MLX arrays share the syntax."""
        store[slots, positions] = x
        return store

    def move_rows(self, store, slot: int, src: int, n: int):
        """store[slot, :n] = store[slot, src:src + n], the stored values as they are (a windowed KV
        store dropping its first src rows); returns the updated store."""
        if n > 0:
            store[slot, :n] = store[slot, src:src + n]
        return store

    def read_rows(self, store, slot: int, length: int):
        """The first `length` rows of one slot of a [slots, capacity, width] store, [length, width]
        (a view where the backend has views)."""
        return store[slot, :length]

    def mask_scores(self, scores, positions, causal: bool, window: int | None):
        """Set scores[i, j] = -inf where key position j is hidden from the query at positions[i]:
        j > positions[i] when causal, j <= positions[i] - window with a sliding window."""
        raise NotImplementedError

    def sample_tokens(self, logits, sampler):
        """Choose one token per row of [R, V] logits: `sampler` (mlxinfer.sampling.Sampler) holds each
        row's temperature, top-k, top-p, min-p and random state. Returns (token ids [R] int32,
        log-probabilities [R] float32 of the chosen tokens under the model's softmax)."""
        raise NotImplementedError

    # -- composite ops: defaults built from the primitives (the reference), overridable ----------
    def rms_norm(self, x, weight, eps: float):
        """x * rsqrt(mean(x^2) + eps) * weight, row by row: sum_squares_rows, scale by 1/n, add_scalar
        eps, rsqrt, mul_rows, hadamard with the weight row (`load_vector`). A backend may override it with a
        fused kernel (MLX: mx.fast.rms_norm); the tracing backend always runs this default."""
        n = x.shape[1]
        mean_sq = self.scale(self.sum_squares_rows(x), 1.0 / n)
        inv = self.rsqrt(self.add_scalar(mean_sq, eps))
        return self.hadamard(self.mul_rows(x, inv), weight)

    def qk_norm_rope(self, q, k, q_weight, k_weight, positions, n_heads: int, n_kv_heads: int, head_dim: int,
                     eps: float, base: float, traditional: bool, factors=None):
        """Qwen3's q_norm / k_norm then RoPE: RMSNorm of each head's slice of the queries [N, n_heads*head_dim]
        and keys [N, n_kv_heads*head_dim] (weights head_dim long), then `rope` -> (q, k). Default, for
        each: reshape to one row a head, rms_norm, reshape back, rope. A backend may override it with
        fewer graph nodes: MLX runs the same kernels with two reshapes instead of five, and on CUDA one
        kernel for both (`kernels.qk_norm_rope`)."""
        out = []
        for x, weight, heads in ((q, q_weight, n_heads), (k, k_weight, n_kv_heads)):
            n = x.shape[0]
            y = self.reshape(self.rms_norm(self.reshape(x, n * heads, head_dim), weight, eps), n, heads * head_dim)
            out.append(self.rope(y, positions, heads, head_dim, base, traditional, factors))
        return tuple(out)

    def rms_norm_linear_group(self, x, weight, eps: float, ws, groups=None):
        """`linear_group` of `rms_norm(x, weight, eps)`: a pre-norm block's norm and the products after it.
        Default: the two ops; a backend may do both in one launch where it keeps the bits (MLX on a GPU:
        the block kernels' NORM form multiplies the values its `rms_norm` kernel writes)."""
        return self.linear_group(self.rms_norm(x, weight, eps), ws, groups)

    def linear_add(self, x, w, residual, groups=None):
        """residual + x @ w: a layer's output projection and its residual connection. Default: `linear`,
        then `add`; a backend may do both in one launch where it keeps the bits (MLX on a GPU: the
        block kernels' ADD form, which rounds the product and then the sum as these two ops do)."""
        return self.add(residual, self.linear(x, w, groups))

    def swiglu_ffn(self, x, weight, eps: float, gate_up, down, groups=None):
        """x + down(silu(gate(h)) * up(h)) for h = rms_norm(x, weight, eps): a pre-norm SwiGLU FFN block on
        one rank (`gate_up` a `load_weight_group` of gate and up). Default: `rms_norm_linear_group`, silu,
        hadamard, `linear_add`; a backend may keep gate and up side by side and take the activation into
        the down product's launch where it keeps the bits (MLX on a GPU: the block kernels' SWIGLU form
        multiplies the values its `swiglu` kernel writes)."""
        gate, up = self.rms_norm_linear_group(x, weight, eps, gate_up, groups)
        return self.linear_add(self.hadamard(self.silu(gate), up), down, x, groups)

    def linear_group(self, x, ws, groups=None):
        """x times each matrix of a `load_weight_group` handle: a tuple of products, one per matrix.
        Default: one `linear` each (what the tracing backend counts); a backend may multiply once by
        the matrices side by side (MLX: one launch instead of three for Q, K and V)."""
        return tuple(self.linear(x, w, groups) for w in ws)

    # -- collectives (tensor parallelism, `mlxinfer.collectives`) ------------------------------
    def all_sum(self, x, group):
        """The elementwise sum of `x` over the ranks of `group` (an mx.distributed group), on every rank.
        Here through MLX arrays for any backend; the MLX backend keeps it in its graph."""
        return self.from_numpy(collectives.through_mlx(collectives.all_sum, self.to_numpy(x), group))

    def all_gather_cols(self, x, group, cols: int):
        """[R, C] on each rank -> [R, cols]: the ranks' columns side by side in rank order, the first
        `cols` kept (the output head's vocabulary shards; the last rank's padding is dropped)."""
        return self.from_numpy(collectives.through_mlx(collectives.all_gather_cols, self.to_numpy(x), group, cols))

    # -- the composite op ---------------------------------------------------------------------
    def check_model(self, specs) -> str | None:
        """Called once a model is built, with its layers' attention specs: a backend whose fused
        attention runs kernels compiled per shape checks them in that shape before use (the MLX backend
        on a GPU); None, or the one-line problem that made it fall back. Here nothing to check."""
        return None

    def fused_attention(self, q, kv, batch, spec: AttentionSpec):
        """Attention of the batch's query rows q [N, H*D] against each sequence's own cached keys and
        values (`kv`, a cache layer view), -> [N, H*D]. Runs the path chosen at construction, on the
        pass as the view's store addresses it (`kv.batch`: a windowed store's rows start at an origin)."""
        batch = kv.batch
        if self.attention == "per-head":
            return self.per_head_attention(q, kv, batch, spec)
        return self.fused_attention_override(q, kv, batch, spec)

    def fused_attention_override(self, q, kv, batch, spec: AttentionSpec):
        """The backend's fast path; backends without one run the contract itself."""
        return self.per_head_attention(q, kv, batch, spec)

    def per_head_attention(self, q, kv, batch, spec: AttentionSpec):
        """The contract of `fused_attention`, op for op. For each sequence b of the batch, in order
        (its query rows r0 .. r0+T-1 of q, at positions p_0 .. p_{T-1}; its S cached rows, keys and
        values at positions 0..S-1, this pass's rows already written), and for each query head h in
        0..H-1, in order:
          1. kv_h = h // (H // KV)                          (GQA: consecutive heads share a KV head)
          2. k_b, v_b = kv.sequence(self, b)                [S, KV*D]  (read_rows of the cache)
             q_h = copy_2d_from(q, r0, T, h*D, D)           [T, D]
             k_h = copy_2d_from(k_b, 0, S, kv_h*D, D)       [S, D]
             v_h = copy_2d_from(v_b, 0, S, kv_h*D, D)       [S, D]
          3. scores = matmul(q_h, transpose_2d(k_h))        [T, S], each score one dot product over D
                                                            in the backend's matmul order
          4. scores = scale(scores, spec.scale)             scale AFTER the matmul, float32 1/sqrt(D)
             if spec.softcap:                               soft-capping (Gemma 2), as llama.cpp:
                 scores = scale(tanh(scale(scores, 1/cap)), cap)   1/cap rounded to float32 once
          5. if T > 1 or spec.window:                       (a lone decode row sees every cached key
                 scores = mask_scores(scores, p, ...)        unless a window hides some)
          6. attn = softmax_rows(scores)                    max, exp(x - max), sum, divide
          7. ctx = matmul(attn, v_h)                        [T, D], one dot product over S per value
          8. out = copy_2d_into(out, ctx, r0, h*D)       out: `zeros`, in the activations' dtype, so a
                                                            narrower one rounds ctx to nearest even here
        An override may batch heads and sequences, skip copies and fuse steps, but every float it
        produces must be computed by the same operations on the same operands in the same summation
        order (all S keys of the row, masked ones included, in every reduction).
        Operands narrower than float32 (MLX's --dtype, --kv-dtype) are widened to float32 exactly first
        (a q8_0 cache: dequantized, d * q); steps 3-7 then run on the same float32 values in every path,
        and the result is in the activations' dtype (step 8's rounding, once, in every path).
        A backend may make steps 3-7 of some sequences one op a head whose bits it can vouch for in the
        override too: MLX's 16-bit prefill chunks on CUDA are one call of its fused attention a head
        (docs/attention-contract.md).
        """
        out = self.zeros(q.shape[0], spec.n_heads * spec.head_dim)
        for b in range(len(batch.rows)):
            out = self.per_head_sequence(q, kv, batch, spec, b, out)
        return out

    def sequence_op(self, spec: AttentionSpec, rows: int) -> str | None:
        """The one op this backend's `per_head_sequence` makes of each head's steps 3-7 for a sequence's
        chunk of `rows` query rows, or None where it runs the steps as written (the protocol's). A
        wrapper that counts ops (the tracer) hands such chunks to the backend whole, counted as that op,
        so that the bits stay the backend's reference."""
        return None

    def per_head_sequence(self, q, kv, batch, spec: AttentionSpec, b: int, out):
        """Steps 1-8 of `per_head_attention` for sequence b alone: its rows of `out` written, returned.
        (An override may run some sequences through this and others its own way, as MLX's GPU override
        does with prefill chunks; a backend whose own `per_head_sequence` makes a head's steps one op
        for some chunks names it in `sequence_op`.)"""
        h_all, d = spec.n_heads, spec.head_dim
        r0, r1 = batch.rows[b]
        t = r1 - r0
        k_b, v_b = kv.sequence(self, b)
        s = k_b.shape[0]
        for h in range(h_all):
            kv_h = h // spec.group
            q_h = self.copy_2d_from(q, r0, t, h * d, d)
            k_h = self.copy_2d_from(k_b, 0, s, kv_h * d, d)
            v_h = self.copy_2d_from(v_b, 0, s, kv_h * d, d)
            scores = self.matmul(q_h, self.transpose_2d(k_h))
            scores = self.scale(scores, spec.scale)
            if spec.softcap:
                scores = self.scale(self.tanh(self.scale(scores, softcap_inverse(spec.softcap))), spec.softcap)
            if t > 1 or spec.window:
                scores = self.mask_scores(scores, batch.positions_of(self, b), spec.causal, spec.window)
            attn = self.softmax_rows(scores)
            ctx = self.matmul(attn, v_h)
            out = self.copy_2d_into(out, ctx, r0, h * d)
        return out
