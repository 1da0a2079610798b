"""CPU reference backend: numpy float32, deterministic. The oracle other backends are checked against.

Weights are dequantized to float32 once at load (with `gguf`'s dequantisation); a weight handle is the
transposed view `W.T` of the [out, in] array, so `x @ W.T` runs as one BLAS sgemm with no copy.

Batch invariance: OpenBLAS computes a one-row product with gemv and a several-row product with gemm,
whose float orders differ, so `linear` multiplies each sequence's rows on their own (`groups`): a
sequence's floats are those it would get alone, whatever else shares the pass. The price is that a
batch of decode rows makes one gemv per sequence instead of one gemm for all (the MLX backend, whose
products are row-invariant, batches them).

Thread invariance: OpenBLAS's threaded gemm sums a long product differently from its one-thread gemm
(measured: attention weights x values, [512 x S] x [S x 64], for S = 909, 1,306, 4,085, ...), so the
activation x activation products (`matmul`, and the fused override's) always run on one BLAS thread,
and the override spreads a sequence's heads over the backend's own threads instead: the same
one-thread BLAS calls per head, whatever the thread count. Weight products (`linear`) keep the BLAS
threads (every shape tried gave the same bits on 1 and 2).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from threadpoolctl import ThreadpoolController, threadpool_limits

from ..backend import GELU_COEF_A, MOE_MIN_WEIGHT_SUM, SQRT_2_OVER_PI, Backend, softcap_inverse
from ..errors import GGUFError, RequestError


TILE_ELEMENTS = 1 << 19  # rows of scores processed together: ~2 MB of float32
PARALLEL_PRODUCT_MACS = 1 << 20  # heads whose products are at least this large run on the backend's threads


def default_threads(ranks: int = 1) -> int:
    """Threads when the user names none (the cpu backend's BLAS threads; MLX's CPU streams): the cores
    not already busy (load average over the last minute), and at most the machine's share of one of
    `ranks` processes of a tensor-parallel run, which share its cores. OpenBLAS threads spin while they
    wait, so one thread per core that another process is using makes every product wait for a
    descheduled thread: on this project's 2-core machine, with another process busy, decode fell from
    31 to 1.4-2.6 tok/s with 2 threads and held 20.5 with 1."""
    cores = os.cpu_count() or 1
    try:
        busy = int(os.getloadavg()[0] + 0.5)
    except OSError:
        busy = 0
    return max(1, min(cores // max(1, ranks), cores - busy))


def checked_threads(threads) -> int:
    """A thread count the user asked for: a positive integer, at most 4 per core (more only waits on
    itself, and MLX's CPU device makes a stream per thread)."""
    limit = 4 * (os.cpu_count() or 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= limit:
        raise RequestError(f"threads must be an integer from 1 to {limit} (4 per core here), got {threads!r}")
    return threads


def set_blas_threads(threads: int | None, ranks: int = 1) -> int:
    """Limit numpy's BLAS to `threads` (None: `default_threads(ranks)`), with threadpoolctl; returns it."""
    threads = checked_threads(default_threads(ranks) if threads is None else threads)
    threadpool_limits(limits=threads, user_api="blas")
    return threads


_CONTROLLER = None


def one_blas_thread():
    """A context in which numpy's BLAS runs on one thread (threadpoolctl; the controller is made once)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=1, user_api="blas")


def _softmax_last_axis(x: np.ndarray, in_place: bool = False) -> np.ndarray:
    """The one softmax both attention paths use, so its float order is shared by construction:
    max, exp(x - max), sum, divide, each a numpy ufunc over the last axis (in place on x when the
    caller owns it: the same ufuncs, no large temporary)."""
    m = np.max(x, axis=-1, keepdims=True)
    e = np.subtract(x, m, out=x) if in_place else x - m
    np.exp(e, out=e)
    e /= np.sum(e, axis=-1, keepdims=True)
    return e


def _mask_biases(positions: np.ndarray, s: int, causal: bool, window: int | None) -> list:
    """[(first column, bias [T, n])]: 0 where key j is seen from the query at positions[i], -inf where
    it is hidden, over the only columns that can be hidden: past the first query's position (causal)
    and before the last query's window (sliding window). Built once per sequence and pass."""
    out = []
    if causal:
        lo = int(positions.min()) + 1
        if lo < s:
            hidden = np.arange(lo, s)[None, :] > positions[:, None]
            out.append((lo, np.where(hidden, np.float32(-np.inf), np.float32(0.0))))
    if window:
        hi = min(s, int(positions.max()) - window + 1)
        if hi > 0:
            hidden = np.arange(hi)[None, :] <= positions[:, None] - window
            out.append((0, np.where(hidden, np.float32(-np.inf), np.float32(0.0))))
    return out


def _add_biases(scores: np.ndarray, biases: list, q0: int = 0, q1: int | None = None) -> np.ndarray:
    """scores [..., T', S] += the biases' query rows q0..q1 (in place): x + 0 is x (a -0 score becomes
    +0, which softmax treats alike) and x + -inf is -inf, and every path adds the same biases over
    the same columns, so the bits agree however the rows are blocked."""
    for c0, bias in biases:
        scores[..., c0:c0 + bias.shape[1]] += bias[q0:q1]
    return scores


class CPUBackend(Backend):
    name = "cpu"
    device = "cpu"

    def __init__(self, attention: str = "fused", threads: int | None = None, ranks: int = 1):
        super().__init__(attention)
        self._dequantized: dict[str, np.ndarray] = {}
        self._rope_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._local = threading.local()  # each thread's score buffer (`_scratch`)
        self._pool = None  # threads for the heads of long prefill chunks (made on first use)
        self._bias_key, self._bias = None, []
        self.threads = set_blas_threads(threads, ranks)  # ranks: processes sharing this machine's cores

    def describe(self) -> str:
        return f"cpu ({self.threads} BLAS thread{'s' if self.threads != 1 else ''})"

    # -- data in and out ----------------------------------------------------------------------
    def from_numpy(self, a):
        return np.ascontiguousarray(a, dtype=np.float32)

    def to_numpy(self, x):
        return np.asarray(x)

    def index_array(self, values):
        return np.asarray(values, dtype=np.int32)

    def concat_index_arrays(self, parts):
        return np.concatenate([np.asarray(p, dtype=np.int32).reshape(-1) for p in parts])

    def _dequant(self, gguf, name):
        w = self._dequantized.get(name)
        if w is None:
            w = np.ascontiguousarray(gguf.dequantize(name), dtype=np.float32)
            self._dequantized[name] = w
        return w

    def load_weight(self, gguf, name):
        w = self._dequant(gguf, name)
        if w.ndim != 2:
            raise GGUFError(f"{gguf.path}: tensor {name!r} should be a matrix, found shape {w.shape}")
        return w.T

    def load_embedding(self, gguf, name):
        return self._dequant(gguf, name)

    def load_vector(self, gguf, name):
        return self._dequant(gguf, name).reshape(1, -1)

    def new_store(self, slots, capacity, width):
        return np.zeros((slots, capacity, width), dtype=np.float32)

    def resize_store(self, store, slots, capacity):
        out = np.zeros((slots, capacity, store.shape[2]), dtype=np.float32)
        s, c = min(slots, store.shape[0]), min(capacity, store.shape[1])
        out[:s, :c] = store[:s, :c]
        return out

    # -- primitives ---------------------------------------------------------------------------
    def linear(self, x, w, groups=None):
        if groups is None or len(groups) == 1:
            return np.matmul(x, w)
        return np.concatenate([np.matmul(x[r0:r1], w) for r0, r1 in groups])

    def matmul(self, a, b):
        with one_blas_thread():  # the same bits on any thread count (module docstring)
            return np.matmul(a, b)

    def transpose_2d(self, x):
        return x.T

    def softmax_rows(self, x):
        return _softmax_last_axis(x)

    def sum_squares_rows(self, x):
        return np.sum(x * x, axis=1, keepdims=True)

    def add_scalar(self, x, s):
        return x + np.float32(s)

    def rsqrt(self, x):
        return np.float32(1.0) / np.sqrt(x)

    def mul_rows(self, x, col):
        return x * col

    def hadamard(self, a, b):
        return a * b

    def add(self, a, b):
        return a + b

    def scale(self, x, s):
        return x * np.float32(s)

    def silu(self, x):
        t = np.negative(x)  # x / (1 + exp(-x)), in one temporary (a prefill chunk's is [T, 1536])
        np.exp(t, out=t)
        np.add(t, np.float32(1.0), out=t)
        return np.divide(x, t, out=t)

    def gelu(self, x):
        inner = np.float32(SQRT_2_OVER_PI) * x * (np.float32(1.0) + np.float32(GELU_COEF_A) * x * x)
        return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))

    def tanh(self, x):
        return np.tanh(x)

    def load_experts(self, gguf, name):
        return np.ascontiguousarray(gguf.dequantize(name), dtype=np.float32)

    def moe_mlp(self, x, logits, experts, k, groups=None):
        probs = self.softmax_rows(logits)
        ids = np.argsort(-probs, axis=1, kind="stable")[:, :k]
        w = np.take_along_axis(probs, ids, axis=1)
        w = w / np.maximum(w.sum(axis=1, dtype=np.float64, keepdims=True).astype(np.float32),
                           np.float32(MOE_MIN_WEIGHT_SUM))
        gate, up, down = experts
        y = np.empty((x.shape[0], k, down.shape[1]), dtype=np.float32)
        for r0, r1 in groups or [(0, x.shape[0])]:  # each sequence's rows apart, each expert's rows together
            for e in np.unique(ids[r0:r1]):
                rows, slots = np.nonzero(ids[r0:r1] == e)
                xe = x[r0 + rows]
                h = self.silu(xe @ gate[e].T) * (xe @ up[e].T)
                y[r0 + rows, slots] = h @ down[e].T
        out = y[:, 0] * w[:, :1]
        for j in range(1, k):
            out = out + y[:, j] * w[:, j:j + 1]
        return out

    def _rope_table(self, head_dim, base, n, factors):
        key = (head_dim, base, factors)
        cos, sin = self._rope_cache.get(key, (None, None))
        if cos is None or cos.shape[0] < n:
            n = max(n, 2 * (0 if cos is None else cos.shape[0]), 256)
            inv_freq = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
            if factors is not None:
                inv_freq = inv_freq / np.asarray(factors, dtype=np.float64)
            ang = np.arange(n, dtype=np.float64)[:, None] * inv_freq[None, :]
            cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
            self._rope_cache[key] = (cos, sin)
        return cos, sin

    def rope(self, x, positions, n_heads, head_dim, base, traditional, factors=None):
        t = x.shape[0]
        cos, sin = self._rope_table(head_dim, base, int(positions.max()) + 1, factors)
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]
        xh = x.reshape(t, n_heads, head_dim)
        half = head_dim // 2
        if traditional:
            x1, x2 = xh[..., 0::2], xh[..., 1::2]
        else:
            x1, x2 = xh[..., :half], xh[..., half:]
        out = np.empty_like(xh)
        if traditional:
            out[..., 0::2] = x1 * c - x2 * s
            out[..., 1::2] = x2 * c + x1 * s
        else:
            out[..., :half] = x1 * c - x2 * s
            out[..., half:] = x2 * c + x1 * s
        return out.reshape(t, n_heads * head_dim)

    def reshape(self, x, rows, cols):
        return x.reshape(rows, cols)

    def copy_2d_from(self, x, row, rows, col, cols):
        return np.ascontiguousarray(x[row : row + rows, col : col + cols])

    def copy_2d_into(self, dst, src, row, col):
        dst[row : row + src.shape[0], col : col + src.shape[1]] = src
        return dst

    def zeros(self, rows, cols):
        return np.zeros((rows, cols), dtype=np.float32)

    def concat_dim0(self, a, b):
        return np.concatenate([a, b], axis=0)

    def gather_rows(self, table, ids):
        return table[np.asarray(ids, dtype=np.int64)]

    def mask_scores(self, scores, positions, causal, window):
        return _add_biases(scores.copy(), self._biases(positions, scores.shape[-1], causal, window))

    def _biases(self, positions, s, causal, window) -> list:
        """`_mask_biases`, kept for the last (positions, S): every layer and head of a pass asks for
        the same ones."""
        key = (positions.tobytes(), s, causal, window)
        if self._bias_key != key:
            self._bias_key, self._bias = key, _mask_biases(positions, s, causal, window)
        return self._bias

    def sample_tokens(self, logits, sampler):
        return sampler.sample_numpy(np.asarray(logits, dtype=np.float32))

    # -- fused attention override -------------------------------------------------------------
    def _threads(self):
        """The backend's own worker threads (made on first use): the heads of long prefill chunks."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads)
        return self._pool

    def _scratch(self, *shape) -> np.ndarray:
        """A reused float32 buffer of `shape`, the calling thread's own (a view of one growing
        allocation): a long prompt's score blocks are tens of MB, and a fresh allocation of that size
        costs more in page faults than the product that fills it."""
        n = int(np.prod(shape))
        buf = getattr(self._local, "scores", None)
        if buf is None or buf.size < n:
            buf = self._local.scores = np.empty(n, dtype=np.float32)
        return buf[:n].reshape(shape)

    @staticmethod
    def _scores_to_probabilities(scores, scale, biases, cap=None) -> np.ndarray:
        """scores [heads, T, S] -> attention weights, in place: scale, soft-cap (`cap`), mask (biases: the pass's, query
        row i of every head = row i), softmax. Every step works row by row, so the rows are processed
        in tiles of ~2 MB (all steps of a tile while it sits in a core's cache, instead of five passes
        over tens of MB): the same operations on the same values, so the same bits, whichever tile
        holds a row."""
        g, t, s = scores.shape
        rows = scores.reshape(g * t, s)
        tile = max(1, TILE_ELEMENTS // s)
        for a in range(0, g * t, tile):
            b = min(a + tile, g * t)
            block = rows[a:b]
            block *= np.float32(scale)
            if cap:  # the reference's scale, tanh, scale
                block *= np.float32(softcap_inverse(cap))
                np.tanh(block, out=block)
                block *= np.float32(cap)
            if biases:  # rows are (head, query row) pairs: query row = row % t
                for h in range(a // t, (b - 1) // t + 1):
                    r0, r1 = max(a, h * t), min(b, (h + 1) * t)
                    _add_biases(rows[r0:r1], biases, r0 - h * t, r1 - h * t)
            _softmax_last_axis(block, in_place=True)
        return scores

    def fused_attention_override(self, q, kv, batch, spec):
        """Per sequence, its heads' products and softmax with no per-head tensors; byte-identical to
        `per_head_attention`: each KV head's K and V are contiguous [S, D] blocks (as the reference's
        copies are), query head h reads KV head h // group, the score product reads K through a
        transposed view (as `transpose_2d` does), each product is the one-thread BLAS call the
        reference makes, and the softmax runs the same ufuncs in place, row by row, in a reused buffer.
        A pass whose per-head products are at least PARALLEL_PRODUCT_MACS (long prefill chunks; decode
        beyond 2^20 / head_dim keys) runs one task per head on the backend's threads: the head's score
        product, softmax and context product back to back, its [T, S] scores in its thread's own buffer
        (presumably why it is faster: one head's block, not all heads' tens of MB, moves between them;
        36.5 / 35.9 vs 38.4 s to the first token of 8,000 tokens on this project's 2-core VM, one
        sitting, bench/results/cpu-prefill-v1-vs-v2-1756.txt); smaller passes run all heads as one
        task, their softmax as one block."""
        kvh, d, group, heads = spec.n_kv_heads, spec.head_dim, spec.group, spec.n_heads
        out = np.empty((q.shape[0], heads * d), dtype=np.float32)
        for b, (r0, r1) in enumerate(batch.rows):
            t = r1 - r0
            k, v = kv.sequence(self, b)
            s = k.shape[0]
            qh = np.ascontiguousarray(q[r0:r1].reshape(t, heads, d).transpose(1, 0, 2))  # [H, T, D]
            kh = [np.ascontiguousarray(k[:, j * d:(j + 1) * d]) for j in range(kvh)]  # [S, D] each
            vh = [np.ascontiguousarray(v[:, j * d:(j + 1) * d]) for j in range(kvh)]
            masked = t > 1 or spec.window
            positions = batch.positions_of(self, b) if masked else None
            biases = self._biases(positions, s, spec.causal, spec.window) if masked else []
            ctx = np.empty((heads, t, d), dtype=np.float32)

            def task(h0, h1):  # heads h0 .. h1 - 1
                scores = self._scratch(h1 - h0, t, s)
                for h in range(h0, h1):
                    np.matmul(qh[h], kh[h // group].T, out=scores[h - h0])
                attn = self._scores_to_probabilities(scores, spec.scale, biases, spec.softcap)
                for h in range(h0, h1):
                    np.matmul(attn[h - h0], vh[h // group], out=ctx[h])

            with one_blas_thread():  # the reference's one-thread calls, whatever the thread count
                if self.threads < 2 or heads < 2 or t * d * s < PARALLEL_PRODUCT_MACS:
                    task(0, heads)
                else:
                    list(self._threads().map(lambda h: task(h, h + 1), range(heads)))
            out[r0:r1] = ctx.transpose(1, 0, 2).reshape(t, heads * d)
        return out
