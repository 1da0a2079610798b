"""Tensor parallelism (mlxinfer.models.shard, mlxinfer.collectives): the shard plan, the sharded view of a GGUF file, and real
two-rank runs on this CPU over MLX's ring backend, started with `mlx.launch`, against one process."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mlxinfer
from mlxinfer.gguf_file import ShardedGGUF
from mlxinfer.launch import free_ports
from mlxinfer.models.shard import Shard, split
from mlxinfer.errors import RequestError
from mlxinfer.gguf_file import GGUFFile
from mlxinfer.models import model_args
from mlxinfer.synthetic import llama3_rope_factors, write_f32_copy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TP_ATOL = 1e-4  # the bound: TP=2 logits against TP=1 on all-F32 weights


def launch(tp, *argv, timeout=300):
    """Run `python <argv>` as `tp` ranks under mlx.launch (ring over 127.0.0.1, on free ports: with the
    launcher's fixed default, two tests launching at once in other workers joined each other's ranks)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()", "-n", str(tp),
           "--backend", "ring", "--starting-port", str(free_ports(tp)), "--", sys.executable, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


# -- the plan ------------------------------------------------------------------------------------
def test_split_is_even_contiguous_and_in_whole_units():
    assert split(9, 2) == [(0, 5), (5, 9)]
    assert split(3, 2) == [(0, 2), (2, 3)]
    assert split(1536, 2, 32) == [(0, 768), (768, 1536)]
    assert split(96, 2, 32) == [(0, 64), (64, 96)]
    for n, parts, unit in ((17408, 2, 32), (151936, 3, 1), (12, 4, 3)):
        r = split(n, parts, unit)
        assert r[0][0] == 0 and r[-1][1] == n and all(a[1] == b[0] for a, b in zip(r, r[1:]))
        assert all((b - a) % unit == 0 for a, b in r) and max(b - a for a, b in r) - min(b - a for a, b in r) <= unit


def test_plan_splits_by_kv_head_groups(synthetic):
    g = GGUFFile(synthetic(arch="llama", hidden=96, n_heads=9, n_kv_heads=3, head_dim=32, ffn=192, vocab_size=331))
    args = model_args(g)
    s0, s1 = (Shard.plan(g, args, r, 2) for r in range(2))
    assert (s0.kv_heads, s1.kv_heads) == ((0, 2), (2, 3))
    assert (s0.heads, s1.heads) == ((0, 6), (6, 9))  # query heads follow their KV heads (groups of 3)
    assert (s0.ffn, s1.ffn) == ((0, 96), (96, 192))
    assert (s0.vocab, s1.vocab, s0.vocab_rows) == ((0, 166), (166, 331), 166)
    assert s0.tensors["blk.1.attn_output.weight"] == (1, 0, 192, None)
    assert s1.tensors["output.weight"] == (0, 166, 331, 166)
    assert Shard.plan(g, args, 0, 1) == Shard.whole(args)


def test_plan_refuses_fewer_kv_heads_than_ranks(synthetic):
    g = GGUFFile(synthetic(n_heads=4, n_kv_heads=1))
    with pytest.raises(RequestError, match="at least 2 KV heads; .* 4 query heads and 1 KV heads"):
        Shard.plan(g, model_args(g), 0, 2)


def test_plan_refuses_ffn_not_in_whole_blocks(synthetic):
    g = GGUFFile(synthetic(ffn=96, n_heads=8, n_kv_heads=4, head_dim=32, qtype="Q8_0"))  # 3 blocks of 32, 4 ranks
    with pytest.raises(RequestError, match="FFN width 96 cannot be split over 4 ranks"):
        Shard.plan(g, model_args(g), 0, 4)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_sharded_view_reads_exactly_the_slices(synthetic, qtype):
    path = synthetic(arch="qwen3", hidden=64, ffn=192, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=333,
                     qtype=qtype)
    g = GGUFFile(path)
    args = model_args(g)
    full = {n: g.dequantize(n) for n in ("blk.1.attn_q.weight", "blk.1.attn_output.weight",
                                         "blk.0.ffn_down.weight", "token_embd.weight")}
    for rank in range(2):
        s = Shard.plan(g, args, rank, 2)
        v = s.view(g)
        assert isinstance(v, ShardedGGUF)
        (h0, h1), (f0, f1), (v0, v1) = s.heads, s.ffn, s.vocab
        np.testing.assert_array_equal(v.dequantize("blk.1.attn_q.weight"), full["blk.1.attn_q.weight"][h0 * 32:h1 * 32])
        np.testing.assert_array_equal(v.dequantize("blk.1.attn_output.weight"),
                                      full["blk.1.attn_output.weight"][:, h0 * 32:h1 * 32])
        np.testing.assert_array_equal(v.dequantize("blk.0.ffn_down.weight"), full["blk.0.ffn_down.weight"][:, f0:f1])
        head = v.dequantize("output.weight")  # tied: the embedding's rows, padded to 167 with zeros
        assert head.shape == (167, 64) and v.tensor("output.weight").shape == (167, 64)
        np.testing.assert_array_equal(head[:v1 - v0], full["token_embd.weight"][v0:v1])
        assert not head[v1 - v0:].any()
        np.testing.assert_array_equal(v.dequantize("token_embd.weight"), full["token_embd.weight"])  # not cut


def test_biases_are_cut_with_their_heads(synthetic):
    """Qwen2's Q/K/V biases: each rank reads the entries of its own query and KV heads."""
    g = GGUFFile(synthetic(arch="qwen2", hidden=96, ffn=192, n_heads=6, n_kv_heads=3, head_dim=16))
    args = model_args(g)
    for rank in range(2):
        s = Shard.plan(g, args, rank, 2)
        v = s.view(g)
        (h0, h1), (k0, k1) = s.heads, s.kv_heads
        np.testing.assert_array_equal(v.dequantize("blk.1.attn_q.bias"), g.dequantize("blk.1.attn_q.bias")[h0 * 16:h1 * 16])
        for name in ("blk.1.attn_k.bias", "blk.0.attn_v.bias"):
            np.testing.assert_array_equal(v.dequantize(name), g.dequantize(name)[k0 * 16:k1 * 16])
        np.testing.assert_array_equal(v.dequantize("blk.0.attn_norm.weight"), g.dequantize("blk.0.attn_norm.weight"))


def test_row_slices_are_views_of_the_map(synthetic):
    g = GGUFFile(synthetic(qtype="Q8_0"))
    v = Shard.plan(g, model_args(g), 1, 2).view(g)
    part, whole = v.raw("blk.0.attn_q.weight"), g.raw("blk.0.attn_q.weight")
    assert np.shares_memory(part, whole) and part.nbytes == whole.nbytes // 2


def test_a_relaunch_takes_free_ports_of_its_own(monkeypatch):
    """`mlxinfer generate --tp N` starts its ranks on ports free when it starts (mlx.launch's defaults are
    fixed: two runs at once would join each other's ranks): the ring from a --starting-port whose N
    ports are free, NCCL's coordinator on a free --nccl-port; each run gets its own."""
    import socket

    from mlxinfer import launch as launch_mod

    seen = []
    monkeypatch.setattr(launch_mod.subprocess, "call", lambda cmd, **kw: seen.append(cmd) or 0)
    monkeypatch.setattr(launch_mod, "require_distributed", lambda: None)
    for backend in ("ring", "nccl"):
        monkeypatch.setattr(launch_mod, "default_backend", lambda device=None, b=backend: b)
        launch_mod.relaunch(3, ["generate", "hi"])
    ring, nccl = seen
    port = int(ring[ring.index("--starting-port") + 1])
    for p in range(port, port + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free (raises if not)
    assert "--nccl-port" in nccl and "--starting-port" not in nccl
    with socket.socket() as s:  # a taken port is never handed out
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert all(not (p <= taken < p + 2) for p in (free_ports(2) for _ in range(20)))


def test_load_without_launch_says_how(synthetic):
    with pytest.raises(RequestError, match=r"tp=2 needs 2 processes started by mlx.launch \(this run has 1\)"):
        mlxinfer.load(synthetic(), backend="cpu", tp=2)
    with pytest.raises(RequestError, match="tp must be a positive integer"):
        mlxinfer.load(synthetic(), backend="cpu", tp=0)


# -- two ranks over the ring ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory, smollm2_path, synthetic):
    """Every case run once as two ranks (one mlx.launch for all): case -> [rank 0 npz, rank 1 npz]."""
    root = tmp_path_factory.mktemp("tp")
    smol_f32 = write_f32_copy(smollm2_path, root / "smollm2-f32.gguf")
    qwen = synthetic(arch="qwen3", n_layers=3, hidden=128, ffn=320, n_heads=8, n_kv_heads=4, head_dim=32,
                     vocab_size=333, tied_output=False, seed=5)
    qwen_q8 = synthetic(arch="qwen3", n_layers=3, hidden=128, ffn=320, n_heads=8, n_kv_heads=4, head_dim=32,
                        vocab_size=333, qtype="Q8_0", tied_output=False, seed=6)
    qwen2 = synthetic(arch="qwen2", n_layers=2, hidden=128, ffn=320, n_heads=8, n_kv_heads=4, head_dim=32,
                      vocab_size=333, tied_output=False, seed=7)  # Q/K/V biases, cut with their heads
    llama3 = synthetic(arch="llama", n_layers=2, hidden=128, ffn=320, n_heads=4, n_kv_heads=2, head_dim=32,
                       vocab_size=333, rope_base=500000.0, rope_freqs=llama3_rope_factors(32, 500000.0), seed=8)
    gemma2 = synthetic(arch="gemma2", n_layers=3, hidden=128, ffn=320, n_heads=8, n_kv_heads=4, head_dim=32,
                       vocab_size=333, sliding_window=6, attn_softcap=5.0, final_softcap=3.0,
                       embedding_std=0.15 * 128 ** -0.5, seed=9)  # post-norms after the all-sum, capped gathered logits
    gemma3 = synthetic(arch="gemma3", n_layers=3, hidden=128, ffn=320, n_heads=8, n_kv_heads=4, head_dim=32,
                       vocab_size=333, sliding_window=6, swa_pattern=3, tied_output=False, seed=10)  # q/k norms per head
    prompt = [1, 504, 3458, 282, 4649, 314, 1072, 28, 260, 1837, 30, 1226, 1176, 25]  # SmolLM2 ids
    cases = [
        dict(model=smol_f32, backend="cpu", prompt=prompt, n=16, prefill_chunk=5),
        dict(model=qwen, backend="cpu", prompt=list(range(3, 40)), n=12, prefill_chunk=16),
        dict(model=qwen, backend="mlx", prompt=list(range(3, 40)), n=12, prefill_chunk=16, dtype="float32"),
        dict(model=qwen_q8, backend="cpu", prompt=list(range(3, 40)), n=12, temperature=1.5, seed=-1),
        dict(model=qwen2, backend="cpu", prompt=list(range(3, 40)), n=12, prefill_chunk=16),
        dict(model=llama3, backend="mlx", prompt=list(range(3, 40)), n=12, dtype="float32"),
        dict(model=gemma2, backend="cpu", prompt=list(range(3, 40)), n=12, prefill_chunk=16),
        dict(model=gemma3, backend="mlx", prompt=list(range(3, 40)), n=12, dtype="float32"),
    ]
    with open(root / "cases.json", "w") as f:
        json.dump(cases, f)
    r = launch(2, "-m", "tests.tp_worker", str(root / "cases.json"), str(root))
    assert r.returncode == 0, r.stderr[-3000:]
    runs = [[dict(np.load(root / f"case{i}.rank{k}.npz")) for k in range(2)] for i in range(len(cases))]
    return cases, runs


@pytest.mark.parametrize("i", [0, 1, 2, 4, 5, 6, 7], ids=["smollm2-f32-cpu", "qwen3-f32-cpu", "qwen3-f32-mlx",
                                                         "qwen2-f32-cpu", "llama3-rope-f32-mlx", "gemma2-f32-cpu",
                                                         "gemma3-f32-mlx"])
@pytest.mark.xdist_group("tp_runs")  # one two-rank run for all (conftest.pytest_configure)
def test_tp2_logits_and_greedy_text_match_one_process(tp_runs, i):
    cases, runs = tp_runs
    case = cases[i]
    one = mlxinfer.load(case["model"], backend=case["backend"], prefill_chunk=case.get("prefill_chunk"),
                        dtype=case.get("dtype"))
    want = one.logits(case["prompt"])
    want_tokens = one.generate(case["prompt"], max_tokens=case["n"]).token_ids
    for rank in runs[i]:
        err = np.max(np.abs(rank["logits_fused"] - want))
        assert rank["logits_fused"].shape == want.shape and err < TP_ATOL, err
        assert rank["tokens_fused"].tolist() == want_tokens
        assert rank["tokens_per_head"].tolist() == want_tokens
    # the two ranks hold different KV heads but compute the same logits, bit for bit
    np.testing.assert_array_equal(runs[i][0]["logits_fused"], runs[i][1]["logits_fused"])


@pytest.mark.xdist_group("tp_runs")  # one two-rank run for all (conftest.pytest_configure)
def test_ranks_share_the_cores(tp_runs):
    """Each rank's backend takes at most its share of the machine's cores (load(tp=...) passes the
    ranks to the backend's default thread count)."""
    _, runs = tp_runs
    for case in runs:
        for rank in case:
            assert 1 <= int(rank["threads"]) <= max(1, (os.cpu_count() or 1) // 2)


def test_load_passes_the_ranks_to_the_backend(monkeypatch):
    """load(tp=N) builds its backend for one of N processes sharing the cores (deterministic: the
    process count reaches the backend, whatever the machine's load)."""
    import mlxinfer.engine as engine

    seen = {}

    def backend(*args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(engine.collectives, "join", lambda tp: (0, None))
    monkeypatch.setattr(engine, "make_backend", backend)
    with pytest.raises(RuntimeError, match="stop before loading"):
        engine.load("unused.gguf", backend="cpu", tp=3)
    assert seen["ranks"] == 3


@pytest.mark.xdist_group("tp_runs")  # one two-rank run for all (conftest.pytest_configure)
@pytest.mark.parametrize("i", [0, 1, 2, 3, 4, 5, 6, 7])
def test_fused_is_bitwise_per_head_on_every_rank(tp_runs, i):
    for rank in tp_runs[1][i]:
        assert rank["fused_equals_per_head"]


@pytest.mark.xdist_group("tp_runs")  # one two-rank run for all (conftest.pytest_configure)
def test_uneven_heads_give_each_rank_its_own_kv_share(tp_runs):
    smol = tp_runs[1][0]
    assert [int(r["kv_width"]) for r in smol] == [2 * 64, 1 * 64]  # SmolLM2: 3 KV heads of 64 over 2 ranks


@pytest.mark.xdist_group("tp_runs")  # one two-rank run for all (conftest.pytest_configure)
def test_random_seed_is_agreed_so_ranks_sample_the_same_tokens(tp_runs):
    r0, r1 = tp_runs[1][3]
    for path in ("fused", "per_head"):  # the ranks use rank 0's seed, so they draw the same tokens
        assert r0[f"seed_{path}"] >= 0 and r0[f"seed_{path}"] == r1[f"seed_{path}"]
        assert r0[f"tokens_{path}"].tolist() == r1[f"tokens_{path}"].tolist()
    # a fresh random seed per generation (two equal 63-bit draws: chance 2**-63); the tokens themselves may
    # coincide or be empty (an end-of-generation token drawn first), so they are not what is compared here
    assert r0["seed_fused"] != r0["seed_per_head"]


def test_cli_tp2_prints_the_text_and_metrics_once(smollm2_path):
    argv = ["generate", "The capital of France is", "--raw", "--model", smollm2_path, "--backend", "cpu",
            "--max-tokens", "8"]
    one = subprocess.run([sys.executable, "-m", "mlxinfer", *argv], capture_output=True, text=True, cwd=ROOT)
    two = subprocess.run([sys.executable, "-m", "mlxinfer", *argv, "--tp", "2"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and one.stdout.startswith(" Paris.")
    assert two.stderr.count("metrics:") == 1 and "tensor parallel: 2 ranks" in two.stderr


def test_cli_tp_refusal_is_one_line(synthetic):
    path = synthetic(n_heads=4, n_kv_heads=1)
    r = subprocess.run([sys.executable, "-m", "mlxinfer", "generate", "hi", "--model", path, "--backend", "cpu",
                        "--tp", "2"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"mlxinfer: error: tensor parallelism over 2 ranks needs at least 2 KV heads; {path} has 4 query heads "
        "and 1 KV heads"]


def test_head_cut_inside_a_k_quant_block_of_any_layer_is_refused(synthetic, monkeypatch):
    """Files mix types across layers: every layer's attn_output block must contain no head boundary."""
    from dataclasses import replace

    from gguf import GGMLQuantizationType as Q

    g = GGUFFile(synthetic(n_layers=3, hidden=128, ffn=256, n_heads=4, n_kv_heads=2, head_dim=64, qtype="Q8_0"))
    args = model_args(g)
    assert Shard.plan(g, args, 0, 2).heads == (0, 2)  # the cut at column 128: fine in blocks of 32
    name = "blk.2.attn_output.weight"
    monkeypatch.setitem(g.tensors, name, replace(g.tensors[name], ggml_type=Q.Q4_K))  # blocks of 256
    with pytest.raises(RequestError, match=r"blk.2.attn_output.weight \(Q4_K, blocks of 256\) cannot be cut by "
                                           r"head at column 128 for 2 ranks"):
        Shard.plan(g, args, 0, 2)


def test_cli_tp_reads_stdin_once_and_fails_loudly(smollm2_path):
    base = [sys.executable, "-m", "mlxinfer", "generate", "--model", smollm2_path, "--backend", "cpu", "--tp", "2"]
    r = subprocess.run(base + ["-", "--raw", "--max-tokens", "3"], input="The capital of France is", capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith(" Paris"), r.stderr[-2000:]
    bad = subprocess.run(base + ["hi", "--temp", "-1"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [  # refused before any rank starts
        "mlxinfer: error: bad sampling option: temperature must be >= 0, got -1.0"]
    # a failure inside the ranks (here: the prompt does not fit the context) fails the command too
    long = subprocess.run(base + ["--max-tokens", "3", "-"], input="word " * 9000, capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert long.returncode == 1 and "context length" in long.stderr, long.stderr[-2000:]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_ffn_of_an_odd_number_of_blocks_splits_in_whole_blocks(synthetic, qtype):
    """An FFN 96 wide is 3 quantization blocks of 32: two ranks take 2 and 1 whole blocks (not 48 columns
    each, a cut inside a block), each rank's slices read back exactly, and the ranks' partial FFN
    outputs sum to the whole FFN's (float32 sums of the same products in another grouping: 1e-5 of the
    largest output)."""
    path = synthetic(arch="qwen3", hidden=64, ffn=96, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=333,
                     qtype=qtype)
    g = GGUFFile(path)
    args = model_args(g)
    gate, up, down = (g.dequantize(f"blk.0.ffn_{n}.weight") for n in ("gate", "up", "down"))
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)

    def ffn(gate, up, down):
        a = x @ gate.T
        return ((a / (1 + np.exp(-a))) * (x @ up.T)) @ down.T

    whole = ffn(gate, up, down)
    parts = []
    for rank in range(2):
        s = Shard.plan(g, args, rank, 2)
        assert s.ffn == ((0, 64), (64, 96))[rank]
        v = s.view(g)
        f0, f1 = s.ffn
        sliced = [v.dequantize(f"blk.0.ffn_{n}.weight") for n in ("gate", "up", "down")]
        np.testing.assert_array_equal(sliced[0], gate[f0:f1])
        np.testing.assert_array_equal(sliced[1], up[f0:f1])
        np.testing.assert_array_equal(sliced[2], down[:, f0:f1])
        parts.append(ffn(*sliced))
    assert np.max(np.abs(parts[0] + parts[1] - whole)) <= 1e-5 * np.max(np.abs(whole))
