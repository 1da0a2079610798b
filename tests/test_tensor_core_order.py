"""The tensor-core order (metal_kernels/attention.cu, "The tensor-core order"; issue 30): the second
published summation order of 16-bit (bfloat16, float16) attention on prefill chunks of PREFILL_ROWS rows
or more. mma_dot: k-steps of 16 from k = 0 on the m16n8k16 instruction, the accumulator from +0, a k-step
whose 16 x 16 left operand (16 rows aligned at multiples of 16, zero-padded) is all zeros of either sign
skipped, the left operand rounded to the 16-bit type to nearest even as it is read; mma_softmax: four
chains, chain c the keys j with (j mod 8) // 2 == c, total (c0 + c1) + (c2 + c3); mma_attention: the
per-head reference's steps (mma_matmul, scale, soft-cap, mask, mma_softmax, mma_matmul) in one launch.

Here (no GPU): attention.cu's own bodies, compiled by g++ and run on the host (tests/cuda_host.py, a
fiber per CUDA thread), launched by the wrappers of mlxinfer/kernels.py themselves (their `_kernel`
replaced by `cuda_host.HostKernel`). The instruction is the host's stand-in (`mlxh_mma`: each step's
accumulator plus its 16 exact products summed in double, rounded once to float32), which is not the
GPU's rounding (unpublished, mostly toward zero): so these tests check the kernels' layouts, steps,
chains, skips and masks against numpy emulations of the order, bit for bit, and that the fused kernel
gives the per-head reference's bits, not the GPU's bits (bench/probes/mma_check.py runs on a GPU). And
the rule that sends a pass to these kernels: CUDA, q and cache of one 16-bit type, PREFILL_ROWS rows or
more, head sizes of whole k-steps up to 256."""

import ctypes
import functools

import mlx.core as mx
import numpy as np
import pytest

from mlxinfer import kernels
from mlxinfer.backend import AttentionSpec, Backend
from mlxinfer.backends.mlx import MMA_PREFILL_CHUNK, PREFILL_ROWS, CheckCase, MLXBackend, check_case_inputs, mma_check_cases
from mlxinfer.batch import Batch
from mlxinfer.engine import Engine
from mlxinfer.kv_cache import KV_CACHES

from . import cuda_host

DTYPES = ["bfloat16", "float16"]
U16 = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}  # unit roundoff (to nearest): 8- and 11-bit significands
ETA16 = {"bfloat16": 2.0 ** -134, "float16": 2.0 ** -25}  # half the smallest subnormal: the absolute error below
U32 = 2.0 ** -24


# -- the host kernels ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def host_dir(tmp_path_factory):
    """One folder for the module's g++ builds (each kernel form is built once, by its source's hash)."""
    if not cuda_host.available():
        pytest.skip("needs g++ (C++20) to run the CUDA kernels on the host")
    return tmp_path_factory.mktemp("mma_host")


@pytest.fixture
def launched(host_dir, monkeypatch):
    """`kernels._kernel` replaced by attention.cu's kernels run on the host; the names of the kernels
    launched, in order (so that a test can say which path ran)."""
    return cuda_host.launch_on_host(host_dir, monkeypatch)


def _mx16(x: np.ndarray, dtype: str):
    """float32 values as an MLX array of the 16-bit type (MLX's rounding; the tests then read the
    rounded values back, so which rounding made them does not matter)."""
    return mx.array(np.asarray(x, np.float32)).astype(getattr(mx, dtype))


def _widened(a) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def round16(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 x rounded to the 16-bit type to nearest even (ties included), as float64: numpy's
    float16 conversion, and bfloat16's by its bits (finite inputs)."""
    x = np.asarray(x, np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    u = x.view(np.uint32).astype(np.uint64)
    r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16) & 0xFFFFFFFF
    return r.astype(np.uint32).view(np.float32).astype(np.float64)


def _assert_same_bits(got: np.ndarray, want: np.ndarray, what: str):
    """Bit for bit, a NaN matching any NaN (the tests that feed infinities make some)."""
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{what}: {int((~same).sum())} of {same.size} values differ"


# -- 1. mma_dot -----------------------------------------------------------------------------------------
def emulate_mma_dot(a: np.ndarray, bt: np.ndarray, dtype: str, group: int = 1, skip: bool = True) -> np.ndarray:
    """mma_dot in numpy: out[b, i, j] over a float32 [B, M, K] (each value rounded to the 16-bit type as
    read) and bt [B // group, N, K] (the 16-bit type's values as float32). Per k-step of 16 from k = 0:
    unless (skip) the rounded a's 16 x 16 slab of the element's 16-row group (rows from multiples of 16,
    zero-padded past M and K) is all zeros of either sign, acc = float32(double(acc) + a_k0 b_k0 + ... +
    a_k15 b_k15), the sum in double in that order: the host stand-in's instruction, not the GPU's."""
    nb, m, k = a.shape
    n = bt.shape[1]
    mp, kp = -(-m // 16) * 16, -(-k // 16) * 16
    ar = np.zeros((nb, mp, kp))
    ar[:, :m, :k] = round16(a, dtype)
    br = np.zeros((bt.shape[0], n, kp))
    br[:, :, :k] = bt
    br = br[np.arange(nb) // group]  # [B, N, Kp]: each batch element's right operand
    acc = np.zeros((nb, mp, n), np.float32)
    with np.errstate(invalid="ignore"):  # (0 x inf: NaN, as on the instruction)
        for k0 in range(0, kp, 16):
            slab = ar[:, :, k0:k0 + 16].reshape(nb, mp // 16, 256)
            live = np.repeat((slab != 0).any(axis=2), 16, axis=1) if skip else np.ones((nb, mp), bool)
            s = acc.astype(np.float64)
            for kk in range(k0, k0 + 16):
                s = s + ar[:, :, kk, None] * br[:, None, :, kk]
            acc = np.where(live[:, :, None], s.astype(np.float32), acc)
    return acc[:, :m]


def _operands(rng, dtype, nb, m, n, k, group):
    """a float32 [B, M, K] of magnitude ~3 with some exact ties of the 16-bit type (rounded to even as
    read), bt [B // group, N, K] of the 16-bit type."""
    a = rng.standard_normal((nb, m, k), dtype=np.float32) * 3
    ties = rng.random(a.shape) < 0.1
    half = 0x8000 if dtype == "bfloat16" else 0x1000  # half a unit of the last place kept
    bits = a.view(np.uint32)
    bits[ties] = (bits[ties] & ~np.uint32(2 * half - 1)) | np.uint32(half)
    bt = _mx16(rng.standard_normal((nb // group, n, k), dtype=np.float32), dtype)
    return a, bt


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [8, 40, 80])
@pytest.mark.parametrize("nb,group", [(1, 1), (4, 2)])
def test_mma_matmul_on_the_host_is_mma_dot_bit_for_bit(launched, dtype, k, nb, group):
    """attention.cu's mma_matmul, as `kernels.mma_matmul` launches it (a warp per 16 x 8 tile, the
    instruction's fragment layout), equals `emulate_mma_dot` bit for bit, over M = 37, N = 29 (last
    tiles partial in rows and columns) and K = 8 (one partial k-step), 40 (two full ones, then a
    partial one) and 80 (five full ones), a GQA group of 2 (batch b reading bt[b // 2]), a float32 left
    operand with exact ties (round to nearest even as read). The emulation is a dot product of the
    rounded operands: within (K/16 + 1) 2^-24 sum|a b| of float64's (one rounding a k-step), and the
    inputs tell the order from a plain float32 loop (some value differs), so the emulation is not the
    test's own tautology."""
    rng = np.random.default_rng(k * 10 + nb)
    m, n = 37, 29
    a, bt = _operands(rng, dtype, nb, m, n, k, group)
    got = np.array(kernels.mma_matmul("cuda", mx.array(a), bt, group))
    assert launched == ["mma_matmul"]
    btf = _widened(bt)
    want = emulate_mma_dot(a, btf, dtype, group)
    _assert_same_bits(got, want, f"mma_matmul {dtype} [{nb}, {m}, {k}] x [{nb // group}, {n}, {k}]")
    ar, br = round16(a, dtype), btf.astype(np.float64)[np.arange(nb) // group]
    exact = np.einsum("bik,bjk->bij", ar, br)
    bound = (k / 16 + 1) * U32 * np.einsum("bik,bjk->bij", np.abs(ar), np.abs(br))
    assert np.all(np.abs(want - exact) <= bound)
    plain = np.zeros((nb, m, n), np.float32)  # one float32 chain in k: another order
    for kk in range(k):
        plain = (plain + (ar[:, :, kk, None] * br[:, None, :, kk]).astype(np.float32)).astype(np.float32)
    assert (plain != want).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_mma_matmul_skips_all_zero_k_steps_of_16_aligned_rows(launched, dtype):
    """The skip rule, made observable. With finite operands the host's instruction cannot show it: a
    step of zero products adds only zeros of either sign to a float32 accumulator that is never -0
    (it starts at +0, and an exact sum that cancels is +0), so skipping or not gives the same bits. An
    infinity in bt does: 0 x inf is NaN unless the step is skipped. So a's rows 16-31 are zero (+0, -0
    and a float32 1e-45 that rounds to 0 as read) over k 16-31, the last row group (rows 32-36, padded
    to 48) over k 32-39 (padded to 48), and rows 8-15 only (half a group: not skipped) over k 16-31;
    bt holds +inf at (j 5, k 20) and -inf at (j 11, k 35). The kernel equals the emulation with the
    skip: finite where a whole aligned slab is zero, NaN where half a group is; the emulation without
    the skip differs (NaN at the skipped slabs' rows)."""
    rng = np.random.default_rng(11)
    m, n, k = 37, 29, 40
    a, _ = _operands(rng, dtype, 1, m, n, k, 1)
    tiny = np.float32(1e-45)
    a[0, 16:32, 16:32] = rng.choice(np.array([0.0, -0.0, tiny, -tiny], np.float32), (16, 16))
    a[0, 32:37, 32:40] = -0.0
    a[0, 8:16, 16:32] = 0.0
    b = rng.standard_normal((1, n, k), dtype=np.float32)
    b[0, 5, 20], b[0, 11, 35] = np.inf, -np.inf
    bt = _mx16(b, dtype)
    btf = _widened(bt)
    got = np.array(kernels.mma_matmul("cuda", mx.array(a), bt))
    want = emulate_mma_dot(a, btf, dtype)
    _assert_same_bits(got, want, f"mma_matmul {dtype} with zero k-steps")
    assert np.isfinite(got[0, 16:32, 5]).all() and np.isfinite(got[0, 32:37, 11]).all()  # skipped
    assert np.isnan(got[0, 8:16, 5]).all()  # half a group is zero: the step runs, 0 x inf
    unskipped = emulate_mma_dot(a, btf, dtype, skip=False)
    assert np.isnan(unskipped[0, 16:32, 5]).all() and np.isnan(unskipped[0, 32:37, 11]).all()


# -- 2. mma_softmax --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _libm_expf():
    f = ctypes.CDLL("libm.so.6").expf
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return f


def expf(x: np.ndarray) -> np.ndarray:
    """glibc's expf elementwise (the host kernel's exp; the GPU's is CUDA's expf)."""
    f = _libm_expf()
    return np.array([f(float(v)) for v in np.asarray(x, np.float32).ravel()], np.float32).reshape(np.shape(x))


def emulate_mma_softmax(x: np.ndarray, chains: int = 4) -> np.ndarray:
    """mma_softmax in numpy float32: m the row's maximum; e_j = expf(x_j - m); chain c adds e_j for the j
    with (j mod 8) // 2 == c in increasing j from 0.0f; total = (c0 + c1) + (c2 + c3); y_j = e_j / total.
    chains=1: one chain in j instead (another order, to show the inputs tell them apart)."""
    x = np.asarray(x, np.float32)
    e = expf(x - x.max(axis=1, keepdims=True))
    c = np.zeros((x.shape[0], 4), np.float32)
    for j in range(x.shape[1]):
        i = (j % 8) // 2 if chains == 4 else 0
        c[:, i] = c[:, i] + e[:, j]
    total = (c[:, 0] + c[:, 1]) + (c[:, 2] + c[:, 3])
    return e / total[:, None]


@pytest.mark.parametrize("n", [1, 7, 9, 300])
def test_mma_softmax_on_the_host_is_its_order_bit_for_bit(launched, n):
    """attention.cu's mma_softmax (a quad of threads a row, the quad's shuffles), launched as
    `kernels.mma_softmax` launches it, equals `emulate_mma_softmax` bit for bit on 5 rows (a quad past
    the last row in the launch) of n = 1, 7, 9, 300 scores (not whole groups of 8) of standard deviation
    3 to 6.7, with -inf (masked) entries in every row of more than one score (each row keeps a finite
    one); for 300 scores some row's bits differ from one chain's (the inputs tell the orders apart)."""
    rng = np.random.default_rng(n)
    spread = np.float32(3) * np.arange(1, 6, dtype=np.float32)[:, None] ** 0.5
    x = rng.standard_normal((5, n), dtype=np.float32) * spread
    if n > 1:
        masked = rng.random(x.shape) < 0.3
        masked[:, rng.integers(n)] = False
        x[masked] = -np.inf
    got = np.array(kernels.mma_softmax("cuda", mx.array(x)))
    assert launched == ["mma_softmax"]
    want = emulate_mma_softmax(x)
    _assert_same_bits(got, want, f"mma_softmax over rows of {n}")
    assert np.isfinite(got).all() and np.all(got[x == -np.inf] == 0)
    if n == 300:
        assert (emulate_mma_softmax(x, chains=1) != want).any()


# -- 3. mma_attention = the per-head reference ----------------------------------------------------------
def _fused_cases():
    """`mma_check_cases` at head sizes 16 and 48 (one k-step, three), those of one sequence (a decode row
    beside runs kernels the host header lacks), and a causal chunk from mid-cache without a window, also
    at head size 144 (past 128: the kernel stages fewer keys at a time). That chunk starts at position
    81: each full 16-row tile's last row sees a key that begins a step of 16 keys on its own (a step
    dropped at the end of a tile's keys shows there; from positions 0, 70 and 170 it would not)."""
    cases = [c for c in mma_check_cases(head_dims=(16, 48)) if len(c.seqs) == 1]
    rows, s = PREFILL_ROWS + 2, PREFILL_ROWS + 2 + 81
    cases += [CheckCase(f"a {rows}-row chunk over {s} keys (from position {s - rows})",
                        AttentionSpec.standard(4, 2, d), ((s, rows),)) for d in (16, 48, 144)]
    return cases


def _mma_backend(dtype: str) -> MLXBackend:
    """An MLX backend on the CPU made to take CUDA's tensor-core path (as on a GPU with that dtype): its
    products and softmax of PREFILL_ROWS rows or more go to `kernels.mma_*`, i.e. to the host kernels.
    Attention's results in float32 (`attention_dtype`, as the self-check compares them): every bit of the
    order, not only what survives its rounding to the dtype (that rounding: the error-model test's)."""
    b = MLXBackend(device="cpu", dtype=dtype)
    b.gpu_kernels = b.kernel = "cuda"
    b.mma = True
    b.attention_dtype = mx.float32
    return b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", _fused_cases(), ids=str)
def test_fused_mma_attention_is_the_per_head_reference_on_the_host(launched, dtype, case):
    """`fused_attention_override` on a 16-bit chunk of PREFILL_ROWS + 2 rows (not whole tiles of 16) runs
    mma_attention alone, in one launch, and its output has the bits of `per_head_attention`, which runs
    the reference's steps a head at a time through mma_matmul, the scale (and the soft-cap, by the tanh
    kernel), the mask and mma_softmax: GQA (4 heads over 2), head sizes 16, 48 and 144, over 130, 211
    and 300 keys (not whole steps of 16), chunks from mid-cache (causal from position 81, and from 170
    with a window of 40 and a soft-cap of 50), bfloat16 and float16. 130 rows: a last block of rows
    with one part-filled tile of 16 and tiles with no row at all."""
    b = _mma_backend(dtype)
    q, view, batch = check_case_inputs(b, case)
    ref = b.to_numpy(b.per_head_attention(q, view, batch, case.spec))
    assert {"mma_matmul", "mma_softmax"} <= set(launched) and "mma_attention" not in launched
    launched.clear()
    got = b.to_numpy(b.fused_attention_override(q, view, batch, case.spec))
    assert launched == ["mma_attention"]
    assert np.isfinite(ref).all()
    _assert_same_bits(got, ref, f"{case}, {dtype}")


def _chunk_inputs(b: MLXBackend, spec, q: np.ndarray, k: np.ndarray, v: np.ndarray):
    """(q, cache view, batch) of one sequence whose S keys and values are k, v (the last T of them this
    pass's rows, T = len(q)), written as `check_case_inputs` writes a case's."""
    s, t = k.shape[0], q.shape[0]
    cache = KV_CACHES["prealloc"](b, 1, k.shape[1])
    slot = cache.alloc()
    if s > t:
        pre = Batch(b, [slot], [0], [s - t])
        cache.reserve(pre)
        cache.update(b, 0, b.from_numpy(k[:s - t]), b.from_numpy(v[:s - t]), pre)
    batch = Batch(b, [slot], [s - t], [t])
    cache.reserve(batch)
    view = cache.update(b, 0, b.from_numpy(k[s - t:]), b.from_numpy(v[s - t:]), batch)
    return b.activation(b.from_numpy(q)), view, batch


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_paths_skip_the_same_all_zero_k_steps(launched, dtype):
    """The skip rule in mma_attention's two products, against the reference's (mma_matmul's), made
    observable with infinities (with finite values skipping a step of zero products changes no bit).
    Scores: every query's head dimensions 0-15 are zeros (+0 and -0), so that k-step is all zeros in
    every 16-row tile and is skipped (`zmask`); a key holds +inf there, which a step taken would turn
    into NaN scores. Context: keys 32-47 score about -170 below the others (their head dimensions 16-31
    are -30, the queries' about 2), so their weights are exactly 0 for every row (expf underflows), and
    key 40 holds +inf in V: that step of 16 keys is all zeros in every tile and is skipped; taken, it
    would give NaN. Both paths must give the same, finite, bits (H 2 over KV 1, D 32, 130 rows over 150
    keys, causal)."""
    rng = np.random.default_rng(5)
    spec = AttentionSpec.standard(2, 1, 32)
    s, t = 150, PREFILL_ROWS + 2
    q = np.zeros((t, 2, 32), np.float32)
    q[:, :, :16] = rng.choice(np.array([0.0, -0.0], np.float32), (t, 2, 16))
    q[:, :, 16:] = 2 + rng.standard_normal((t, 2, 16), dtype=np.float32) * np.float32(0.25)
    k = rng.standard_normal((s, 32), dtype=np.float32) * 3
    k[32:48, 16:] = -30
    k[5, 3] = np.inf
    v = rng.standard_normal((s, 32), dtype=np.float32)
    v[40, 7] = np.inf
    b = _mma_backend(dtype)
    qm, view, batch = _chunk_inputs(b, spec, q.reshape(t, 64), k, v)
    ref = b.to_numpy(b.per_head_attention(qm, view, batch, spec))
    launched.clear()
    got = b.to_numpy(b.fused_attention_override(qm, view, batch, spec))
    assert launched == ["mma_attention"]
    assert np.isfinite(ref).all() and np.isfinite(got).all()
    _assert_same_bits(got, ref, f"zero k-steps, {dtype}")


# -- 4. the error model ------------------------------------------------------------------------------
def _attention_bound(qf, kf, vf, positions, spec, u16, eta):
    """(float64 attention of the widened 16-bit q [T, H*D], K, V [S, KV*D], its error bound per output).

    The fused kernel's output against it (first order in the unit roundoffs u = 2^-24 of float32 and
    u16 = 2^-8 (bfloat16) or 2^-11 (float16), to nearest):
    - scores: mma_dot over D rounds D/16 times, each by <= u of the running sum's magnitude, which is
      <= sum_d |q_d k_d|; then times the float32 scale (itself within u of 1/sqrt(D)), a rounding:
      |s^ - s| <= Delta = (D/16) u scale sum|q k| + 2 u |s|, Delta_r its maximum over row r's keys;
    - weights: e_j = expf(fl(s^_j - m)) is within g = Delta_r + u R + 2u of exp(s_j - m) relatively
      (R >= |s^_j - m|: the range of the row's scores plus 2 Delta_r; expf within one ulp, 2u), the
      total sums S/4 + 2 of them a chain (<= (S/4 + 2) u relatively), the division one more u, and m
      cancels: the float32 weight p~_j is within rho = 2g + (S/4 + 3) u of the exact p_j relatively;
      rounded to the 16-bit type, |p^_j - p~_j| <= u16 p~_j + eta (eta: half the type's smallest
      subnormal, 2^-134 or 2^-25);
    - context: sum_j p^_j v_jd in ceil(S/16) k-steps, each <= u sum_j p^_j |v_jd|;
    so |o^ - o| <= (u16 (1 + rho) + rho + ceil(S/16) u (1 + u16)(1 + rho)) sum_j p_j |v_jd|
                   + eta (1 + ceil(S/16) u) sum_visible |v_jd|,
    times 1 + 2^-10 for the second-order terms (products of the roundoffs; the host instruction's double
    sum, within 16 x 2^-53 of exact a step). The u16 term dominates: the weights' rounding to 16 bits."""
    t = qf.shape[0]
    h_all, kvh, d = spec.n_heads, spec.n_kv_heads, spec.head_dim
    s_len = kf.shape[0]
    keys = np.arange(s_len)[None, :]
    hidden = (keys > positions[:, None]) if spec.causal else np.zeros((t, s_len), bool)
    if spec.window:
        hidden |= keys <= positions[:, None] - spec.window
    steps = -(-s_len // 16)
    out, bound = np.zeros((t, h_all * d)), np.zeros((t, h_all * d))
    for h in range(h_all):
        c = (h // spec.group) * d
        qh, kh, vh = qf[:, h * d:(h + 1) * d], kf[:, c:c + d], vf[:, c:c + d]
        s = qh @ kh.T * spec.scale
        delta = np.where(hidden, 0.0, (d / 16) * U32 * spec.scale * (np.abs(qh) @ np.abs(kh).T) + 2 * U32 * np.abs(s))
        delta = delta.max(axis=1)
        sv = np.where(hidden, np.nan, s)
        r = np.nanmax(sv, axis=1) - np.nanmin(sv, axis=1) + 2 * delta
        g = delta + U32 * r + 2 * U32
        rho = 2 * g + (s_len / 4 + 3) * U32
        e = np.where(hidden, 0.0, np.exp(np.where(hidden, -np.inf, s) - np.nanmax(sv, axis=1)[:, None]))
        p = e / e.sum(axis=1, keepdims=True)
        out[:, h * d:(h + 1) * d] = p @ vh
        coef = u16 * (1 + rho) + rho + steps * U32 * (1 + u16) * (1 + rho)
        bound[:, h * d:(h + 1) * d] = (coef[:, None] * (p @ np.abs(vh))
                                       + eta * (1 + steps * U32) * ((~hidden) @ np.abs(vh)))
    return out, bound * (1 + 2.0 ** -10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,window", [(48, None), (16, 24)])
def test_fused_16_bit_attention_is_within_its_error_model_of_float64(launched, dtype, d, window):
    """`kernels.mma_attention` on the host (a 70-row causal chunk from position 80 over 150 keys, 4 heads
    over 2, head size 48, and 16 with a window of 24; q and K ~3, V ~1, in the 16-bit type) against
    float64 attention of the same 16-bit values widened: every output within the bound derived in
    `_attention_bound` (the weights' rounding to 16 bits, u16 sum_j p_j |v_jd|, plus float32's
    roundings), then the result's own rounding to the 16-bit type (the kernel writes q's type, as MLX's
    astype rounds: |o^ - o~| <= u16 |o~| + eta). Not vacuous: the error is > 0, and at its worst more
    than a quarter of the bound (the bound is not loose by orders of magnitude), and the bound of float32
    weights (u16 = eta = 0 in the weights, the result still rounded) does not hold: the weights' rounding
    is what shows."""
    rng = np.random.default_rng(d + (window or 0))
    spec = AttentionSpec.standard(4, 2, d, window=window)
    s, t = 150, 70
    q = _mx16(rng.standard_normal((t, 4 * d), dtype=np.float32) * 3, dtype)
    k = _mx16(rng.standard_normal((s, 2 * d), dtype=np.float32) * 3, dtype)
    v = _mx16(rng.standard_normal((s, 2 * d), dtype=np.float32), dtype)
    positions = np.arange(s - t, s, dtype=np.int32)
    out = kernels.mma_attention("cuda", q, k, v, mx.array(positions), spec)
    assert launched == ["mma_attention"] and out.dtype == q.dtype
    got = np.array(out.astype(mx.float32)).astype(np.float64)
    widened = [_widened(x).astype(np.float64) for x in (q, k, v)]
    u16, eta = U16[dtype], ETA16[dtype]

    def rounded(bound):  # the float32 result o~ (within `bound` of exact) rounded to the 16-bit type
        return bound + u16 * (np.abs(exact) + bound) + eta

    exact, bound = _attention_bound(*widened, positions, spec, u16, eta)
    err = np.abs(got - exact)
    assert np.all(err <= rounded(bound)), f"worst {np.max(err / rounded(bound)):.3g} of the bound"
    assert err.max() > 0 and np.max(err / rounded(bound)) > 1 / 4
    _, float32_bound = _attention_bound(*widened, positions, spec, 0.0, 0.0)
    assert np.any(err > rounded(float32_bound))


# -- 5. the switch ---------------------------------------------------------------------------------
def test_the_cpu_never_takes_the_tensor_core_path():
    """On MLX's CPU there are no CUDA kernels: `mma` is False whatever the dtype."""
    for dtype in ("float32", *DTYPES):
        b = MLXBackend(device="cpu", dtype=dtype)
        assert b.mma is False and b.gpu_kernels is None


def test_mma_fits_whole_k_steps_up_to_256():
    """mma_attention takes head sizes of whole k-steps of 16 up to MAX_HEAD_DIM (256)."""
    for d in (16, 64, 80, 128, 256):
        assert kernels.mma_fits(AttentionSpec.standard(4, 2, d)), d
    for d in (72, 264):
        assert not kernels.mma_fits(AttentionSpec.standard(4, 2, d)), d


@pytest.mark.parametrize("gpu,dtype,kv_dtype,mma", [
    ("cuda", "bfloat16", None, True), ("cuda", "float16", "float16", True), ("cuda", "float32", None, False),
    ("cuda", "bfloat16", "float16", False), ("cuda", "bfloat16", "q8_0", False), ("metal", "bfloat16", None, False),
    ("cuda-sm75", "bfloat16", None, False)])
def test_the_construction_rule(monkeypatch, gpu, dtype, kv_dtype, mma):
    """`mma` at construction, with MLX made to report a GPU (`gpu_kind`; the device never activated, no
    kernel run: --kernel given skips the self-check): on CUDA of compute capability 8.0 or more only (the
    instruction's; "cuda-sm75": a Turing GPU), q and the cache of one 16-bit type; a prefill pass of
    MMA_PREFILL_CHUNK (2,048) tokens there, the protocol's 512 elsewhere."""
    b = MLXBackend(device="gpu", kernel=cuda_host.pretend_gpu(monkeypatch, gpu), dtype=dtype, kv_dtype=kv_dtype)
    assert b.mma is mma
    b.sdpa = False  # (MLX's fused attention takes 2,048 too: tests/test_sdpa_prefill.py)
    assert b.prefill_chunk == (2048 if mma else 512) and Backend.prefill_chunk == 512


def test_the_engine_takes_the_backends_prefill_chunk(monkeypatch, synthetic):
    """A load without prefill_chunk takes the backend's once its self-check has run (the tensor-core path's
    2,048 while it is on, 512 when the check turned it off); a chunk given is kept."""
    tiny_model, b = synthetic(), MLXBackend(device="cpu")
    monkeypatch.setattr(b, "check_model", lambda specs: setattr(b, "mma", True))
    assert Engine(tiny_model, b).prefill_chunk == MMA_PREFILL_CHUNK == 2048
    assert Engine(tiny_model, b, prefill_chunk=64).prefill_chunk == 64
    monkeypatch.setattr(b, "check_model", lambda specs: setattr(b, "mma", False))
    assert Engine(tiny_model, b).prefill_chunk == 512


def test_products_and_softmax_take_the_order_from_prefill_rows(monkeypatch):
    """With `mma`, the reference's products and softmax of PREFILL_ROWS rows or more go to mma_matmul and
    mma_softmax (the right operand in the dtype), fewer rows to the published-order kernels; the fused
    override sends a chunk of PREFILL_ROWS rows to mma_attention where `mma_fits` (head size 64) and
    to the per-head reference where not (72). (Stand-in kernels that record and return zeros.)"""
    calls = []

    def kernel(kind, name):
        def launch(**kw):
            calls.append(name)
            if name == "mma_matmul":
                assert kw["inputs"][1].dtype == mx.uint16 and dict(kw["template"])["BF"] is True
            return [mx.zeros(s, dtype=t) for s, t in zip(kw["output_shapes"], kw["output_dtypes"])]
        return launch

    monkeypatch.setattr(kernels, "_kernel", kernel)
    b = _mma_backend("bfloat16")
    for rows, want in ((PREFILL_ROWS - 1, ["matmul", "softmax"]), (PREFILL_ROWS, ["mma_matmul", "mma_softmax"])):
        calls.clear()
        scores = b.matmul(mx.zeros((rows, 16)), mx.zeros((16, 40)))
        mx.eval(b.softmax_rows(scores))
        assert calls == want, rows
    for d, mma in ((64, True), (72, False)):
        spec = AttentionSpec.standard(2, 1, d)
        case = CheckCase("a chunk", spec, ((PREFILL_ROWS, PREFILL_ROWS),))
        q, view, batch = check_case_inputs(b, case)
        calls.clear()
        mx.eval(b.fused_attention_override(q, view, batch, spec))
        assert (calls == ["mma_attention"]) if mma else ("mma_attention" not in calls and "mma_matmul" in calls), d


def test_the_backend_line_names_the_tensor_core_path():
    """The backend's one-line description (the metrics, the server's system_fingerprint, the prompt cache's
    identity) says whether 16-bit chunks take the tensor-core order, or that its self-check failed: a
    chunk's bits depend on it."""
    b = MLXBackend(device="cpu", dtype="bfloat16")
    b.device, b.gpu_kernels, b.kernel = "gpu", "cuda", "cuda"  # as on CUDA after the self-check
    b.mma = True
    assert "tensor-core prefill" in b.describe() and "failed" not in b.describe()
    b.mma, b.mma_fallback = False, "fused attention kernel differs"
    assert "tensor-core prefill failed its self-check" in b.describe()
    b.mma_fallback = None
    assert "tensor-core" not in b.describe()


def test_blocks_past_the_last_head_write_nothing(launched, monkeypatch):
    """A 2-D grid holds at most 65,535 blocks a row, so a launch of more is rounded up to whole rows of
    blocks (`kernels.launch_grid`); the blocks past the last (head, 64 rows) must idle, not take a head past H
    and write other rows. Here the row is capped at 5 blocks, so 12 blocks become 15."""
    real = kernels.launch_grid
    monkeypatch.setattr(kernels, "launch_grid", lambda blocks, threads=kernels.THREADS: real(blocks, threads) if blocks != 12
                        else (5 * threads, 3, 1))
    b = MLXBackend(device="cpu", dtype="bfloat16")
    b.gpu_kernels = b.kernel = "cuda"
    b.mma = True
    case = CheckCase("a 130-row chunk over 150 keys", AttentionSpec.standard(4, 2, 16), ((150, 130),))
    q, view, batch = check_case_inputs(b, case)
    fused = b.to_numpy(b.fused_attention_override(q, view, batch, case.spec))  # 3 row blocks x 4 heads = 12
    ref = b.to_numpy(b.per_head_attention(q, view, batch, case.spec))
    assert np.array_equal(fused.view(np.uint32), ref.view(np.uint32))
