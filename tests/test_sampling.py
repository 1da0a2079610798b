"""The sampling surface (mlxinfer.sampling), each option by its numbers: logit bias, repetition /
presence / frequency penalties, top-k, min-p and top_logprobs, on numpy and on MLX (its CPU device), and
the two paths against each other.

Error model: step 0 (bias and penalties) is the same float32 operations in the same order on both
backends (add, divide or multiply by r, multiply-add and subtract), each correctly rounded, so the two
adjusted rows are compared bit for bit; the log-probabilities are a float32 log-softmax on MLX and a
float64 one rounded to float32 on numpy: within 1e-5 for logits of size ~5."""

import numpy as np
import pytest

from mlxinfer.errors import RequestError
from mlxinfer.sampling import (History, NumpyRandom, Sampler, SamplingParams, adjust_logits_numpy,
                               filter_probs_numpy)

V = 64
RNG = np.random.default_rng(7)
ROW = (RNG.standard_normal(V) * 3).astype(np.float32)  # signs of both kinds, no ties
PROMPT = [3, 5, 5, 9]
GENERATED = [5, 11, 11, 11, 20]


def counts(ids):
    return np.bincount(np.array(ids), minlength=V)


def test_logit_bias_adds_to_its_tokens_only():
    p = SamplingParams(logit_bias={7: 100, 8: -100, 9: 0.5})
    x = adjust_logits_numpy(ROW, p, None)
    assert x[7] == np.float32(ROW[7] + np.float32(100)) and x[8] == np.float32(ROW[8] - np.float32(100))
    assert x[9] == np.float32(ROW[9] + np.float32(0.5))
    others = np.setdiff1d(np.arange(V), [7, 8, 9])
    assert np.array_equal(x[others], ROW[others])
    tokens, _ = Sampler([p], [None]).sample_numpy(ROW[None])
    assert tokens[0] == 7  # +100 forces it (the logits span ~20)
    tokens, _ = Sampler([SamplingParams(logit_bias={int(np.argmax(ROW)): -100})], [None]).sample_numpy(ROW[None])
    assert tokens[0] == np.argsort(-ROW)[1]  # -100 bans the argmax: the second takes its place


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    r = 1.7
    x = adjust_logits_numpy(ROW, SamplingParams(repetition_penalty=r), History(PROMPT, GENERATED))
    seen = np.unique(PROMPT + GENERATED)
    want = np.where(ROW > 0, ROW / np.float32(r), ROW * np.float32(r))
    assert np.array_equal(x[seen], want[seen])  # the prompt's tokens count too, once each
    unseen = np.setdiff1d(np.arange(V), seen)
    assert np.array_equal(x[unseen], ROW[unseen])
    assert (ROW[seen] > 0).any() and (ROW[seen] < 0).any()  # both branches are exercised


def test_presence_and_frequency_penalties_subtract_by_generated_counts():
    a, f = 0.6, 0.25
    x = adjust_logits_numpy(ROW, SamplingParams(presence_penalty=a, frequency_penalty=f), History(PROMPT, GENERATED))
    c = counts(GENERATED)
    for t in range(V):
        if c[t]:
            assert x[t] == np.float32(ROW[t] - (np.float32(f) * np.float32(c[t]) + np.float32(a)))
        else:  # prompt-only tokens (3, 9) are not penalised: OpenAI's penalties read generated tokens
            assert x[t] == ROW[t]
    assert x[11] == pytest.approx(ROW[11] - (3 * f + a), abs=1e-5)


def test_top_k_1_is_greedy_and_min_p_keeps_tokens_above_its_share_of_the_top():
    p = SamplingParams(temperature=1.0, top_k=1)
    rng = NumpyRandom(1)
    draws = {int(Sampler([p], [rng]).sample_numpy(ROW[None])[0][0]) for _ in range(50)}
    assert draws == {int(np.argmax(ROW))}
    probs = np.exp(ROW.astype(np.float64) - ROW.max())
    probs /= probs.sum()
    kept = filter_probs_numpy(ROW, SamplingParams(temperature=1.0, min_p=0.2))
    assert set(np.flatnonzero(kept)) == set(np.flatnonzero(probs >= 0.2 * probs.max()))
    assert kept.sum() == pytest.approx(1.0) and kept[probs >= 0.2 * probs.max()] == pytest.approx(
        probs[probs >= 0.2 * probs.max()] / probs[probs >= 0.2 * probs.max()].sum())


def test_top_logprobs_are_the_model_distributions_most_likely():
    logits = np.stack([ROW, ROW[::-1].copy()])
    s = Sampler([SamplingParams(top_logprobs=3), SamplingParams(top_logprobs=5, logit_bias={0: 50})], [None, None])
    tokens, lps = s.sample_numpy(logits)
    ids, top = s.top
    assert ids.shape == (2, 5)
    for i in range(2):
        ref = logits[i].astype(np.float64) - np.log(np.sum(np.exp(logits[i].astype(np.float64))))
        assert list(ids[i]) == list(np.argsort(-ref)[:5])  # the raw distribution: the bias does not move them
        assert top[i] == pytest.approx(ref[ids[i]], abs=1e-6)
    assert tokens[1] == 0 and lps[1] == pytest.approx(logits[1][0] - np.log(np.exp(logits[1].astype(np.float64)).sum()))


@pytest.mark.parametrize("bad", [dict(repetition_penalty=0), dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                                 dict(logit_bias={1: 101}), dict(logit_bias={-1: 1}), dict(logit_bias={"a": 1}),
                                 dict(top_logprobs=21), dict(top_logprobs=True)])
def test_bad_options_are_request_errors(bad):
    with pytest.raises(RequestError, match=next(iter(bad))):
        SamplingParams(**bad)


# -- numpy against MLX ---------------------------------------------------------------------------

CASES = [dict(logit_bias={7: 3.5, 30: -2}), dict(repetition_penalty=1.3), dict(repetition_penalty=0.8),
         dict(presence_penalty=0.5, frequency_penalty=-0.3),
         dict(repetition_penalty=1.1, presence_penalty=1.0, frequency_penalty=0.7, logit_bias={11: 9})]


@pytest.mark.parametrize("options", CASES)
@pytest.mark.parametrize("pending", [False, True])
def test_mlx_adjusts_the_logits_bit_for_bit_as_numpy(options, pending):
    """`pending`: the newest generated token still on the device (a pipelined pass), as the loop hands it."""
    mx = pytest.importorskip("mlx.core")
    from mlxinfer.sampling import adjust_logits_mlx

    p = SamplingParams(**options)
    host = History(PROMPT, GENERATED)
    if pending:
        device = History(PROMPT, GENERATED[:-1], mx.array([GENERATED[-1]], dtype=mx.int32))
    else:
        device = host
    want = adjust_logits_numpy(ROW, p, host)
    got = np.array(adjust_logits_mlx(mx.array(ROW), p, device))
    assert np.array_equal(got, want)
    assert not np.array_equal(want, ROW)


def test_mlx_sampler_rows_equal_numpys_greedy_and_top_logprobs():
    mx = pytest.importorskip("mlx.core")
    logits = (RNG.standard_normal((len(CASES), V)) * 3).astype(np.float32)
    params = [SamplingParams(top_logprobs=4, **o) for o in CASES]
    hist = [History(PROMPT, GENERATED)] * len(CASES)
    a = Sampler(params, [None] * len(CASES), hist)
    b = Sampler(params, [None] * len(CASES), hist)
    tokens, lps = a.sample_numpy(logits)
    mtokens, mlps = b.sample_mlx(mx.array(logits))
    assert list(np.array(mtokens)) == list(tokens)
    assert np.array(mlps) == pytest.approx(lps, abs=1e-5)
    assert np.array_equal(np.array(b.top[0]), a.top[0]) and np.array(b.top[1]) == pytest.approx(a.top[1], abs=1e-5)


def _draws(row, params, n=200, backend="numpy"):
    """The tokens of n draws from one row (numpy's sampler or MLX's, each draw its own key)."""
    if backend == "numpy":
        rng = NumpyRandom(3)
        out = [Sampler([params], [rng]).sample_numpy(row[None]) for _ in range(n)]
        return [int(t[0]) for t, _ in out], [float(lp[0]) for _, lp in out]
    mx = pytest.importorskip("mlx.core")
    from mlxinfer.sampling import MLXRandom

    rng = MLXRandom(3)
    out = [Sampler([params], [rng]).sample_mlx(mx.array(row[None])) for _ in range(n)]
    return [int(np.array(t)[0]) for t, _ in out], [float(np.array(lp)[0]) for _, lp in out]


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
def test_sampled_tokens_report_the_models_logprob(backend):
    """At temperature != 0 with top-k/top-p cutting the row, the logprob reported with a token is the
    model's (log-softmax of the raw logits), not that of the tempered, cut distribution it was drawn
    from. Error model: float64 rounded to float32 (numpy) vs a float32 log-softmax (MLX), logits ~5: 1e-5."""
    row = (ROW / 3).astype(np.float32)
    ref = row.astype(np.float64) - np.log(np.sum(np.exp(row.astype(np.float64))))
    tokens, lps = _draws(row, SamplingParams(temperature=1.5, top_k=8, top_p=0.9, seed=1), n=40, backend=backend)
    assert len(set(tokens)) > 1  # sampled, not greedy
    for t, lp in zip(tokens, lps):
        assert lp == pytest.approx(ref[t], abs=1e-5)


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
def test_top_k_keeps_ties_and_top_p_stops_at_its_exact_boundary(backend):
    """top_k keeps every token tied with the k-th (the docstring's rule, both backends); top_p keeps the
    smallest set whose probability reaches top_p, a boundary met exactly included: four equal logits are
    0.25 each exactly (in float32 and float64), so top_p 0.5 keeps two tokens, 0.5 + 1e-6 three."""
    tied = np.array([1.0, 3.0, 3.0, 0.0, 2.0], dtype=np.float32)
    tokens, _ = _draws(tied, SamplingParams(temperature=1.0, top_k=1, seed=1), backend=backend)
    assert set(tokens) == {1, 2}
    tokens, _ = _draws(tied, SamplingParams(temperature=1.0, top_k=2, seed=1), backend=backend)
    assert set(tokens) == {1, 2}
    flat = np.zeros(4, dtype=np.float32)
    for top_p, kept in ((0.5, 2), (0.5 + 1e-6, 3), (0.25, 1), (1.0, 4)):
        tokens, _ = _draws(flat, SamplingParams(temperature=1.0, top_p=top_p, seed=1), backend=backend)
        assert len(set(tokens)) == kept, (top_p, sorted(set(tokens)))
    if backend == "numpy":
        assert np.count_nonzero(filter_probs_numpy(flat, SamplingParams(temperature=1.0, top_p=0.5))) == 2


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
def test_min_p_keeps_a_token_exactly_at_its_share_of_the_top(backend):
    """min_p keeps p >= min_p * max(p), the boundary included: four equal logits (0.25 each, exact)
    under min_p 1 keep all four; a row without ties under min_p 1 keeps only its top token."""
    tokens, _ = _draws(np.zeros(4, dtype=np.float32), SamplingParams(temperature=1.0, min_p=1.0, seed=1),
                       backend=backend)
    assert set(tokens) == {0, 1, 2, 3}
    tokens, _ = _draws(ROW, SamplingParams(temperature=1.0, min_p=1.0, seed=1), n=20, backend=backend)
    assert set(tokens) == {int(np.argmax(ROW))}
