"""`mlxinfer bench` (mlxinfer/benchmark.py): ours / peer ratios pair rows of one round, rounds alternate
which engine goes first, a row is the median of its runs, bad options are one line, and a real tiny run
writes the table and the JSON lines. No timing is asserted: performance lives in bench/, not here."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from mlxinfer import benchmark
from mlxinfer.cli import main
from mlxinfer.peers import summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(engine, rnd, tok_s, prompt=17):
    return dict(engine=engine, round=rnd, prompt_tokens=prompt, batch_size=1, decode_tokens_per_second=tok_s,
                total_tokens_per_second=tok_s, attention="fused", device="gpu", kv_cache="prealloc")


def test_peer_ratios_pair_rows_of_one_round_and_give_their_median():
    rows = [_row("mlxinfer mlx", 1, 300.0), _row("mlxinfer mlx", 2, 200.0), _row("mlxinfer mlx", 3, 260.0),
            _row("mlx-lm", 1, 200.0), _row("mlx-lm", 2, 250.0), _row("mlx-lm", 3, 200.0)]
    text = benchmark.peer_ratios(rows)
    assert "rounds 1.50x 0.80x 1.30x; median 1.30x, at least 1.2x (unrounded) in 2 of 3" in text


def test_peer_ratios_of_one_round_print_one_ratio():
    text = benchmark.peer_ratios([_row("mlxinfer mlx", 1, 300.0), _row("mlx-lm", 1, 200.0, prompt=511),
                                  _row("mlx-lm", 1, 250.0)])
    assert text.splitlines()[1].endswith("(prompt 17, batch 1): 1.20x")
    assert "prompt 511" not in text


def test_peer_ratios_pair_rows_of_one_device():
    text = benchmark.peer_ratios([_row("mlxinfer mlx", 1, 300.0), dict(_row("mlxinfer mlx", 1, 30.0), device="cpu"),
                                  _row("mlx-lm", 1, 200.0)])
    assert text.splitlines()[1:] == ["  mlxinfer mlx/gpu fused prealloc vs mlx-lm (prompt 17, batch 1): 1.50x"]


def test_a_row_is_the_median_of_its_runs_with_min_and_max():
    runs = [dict(engine="mlxinfer cpu", decode_tokens_per_second=x, intervals=[1.0, 3.0]) for x in (1.0, 6.0, 2.0)]
    row = summarize(runs)
    assert (row["decode_tokens_per_second"], row["decode_tokens_per_second_min"], row["decode_tokens_per_second_max"]) \
        == (2.0, 1.0, 6.0)
    assert benchmark.spread(row, "decode_tokens_per_second", ".2f") == "2.00 [1.00-6.00]"
    assert (row["token_interval_ms_min"], row["token_interval_ms_mean"], row["runs"]) == (1.0, 2.0, 3)


def test_rounds_alternate_which_engine_goes_first(monkeypatch, tmp_path, capsys, synthetic):
    """Three rounds: ours then the peer, the peer then ours, ours then the peer; each round's ratio."""
    order, speed = [], {("ours", 1): 300.0, ("peer", 1): 200.0, ("ours", 2): 200.0, ("peer", 2): 250.0,
                        ("ours", 3): 260.0, ("peer", 3): 200.0}

    def fake(who, tok_s):
        return dict(_row("mlxinfer cpu" if who == "ours" else "mlx-lm", 0, tok_s), device="cpu", generated=4,
                    token_interval_ms_min=1.0, token_interval_ms_mean=1.0, token_interval_ms_max=1.0,
                    time_to_first_token_ms=1.0, peak_memory_mb=1.0, runs=1)

    def run_row(job):
        order.append("ours")
        return fake("ours", speed[("ours", order.count("ours"))])

    def run_peer(job):
        order.append("peer")
        return [fake("peer", speed[("peer", order.count("peer"))])], None

    monkeypatch.setattr(benchmark, "run_row", run_row)
    monkeypatch.setattr(benchmark, "run_peer", run_peer)
    monkeypatch.setattr(benchmark, "installed", lambda peer: True)
    rc = main(["bench", "-m", synthetic(), "--backends", "cpu", "--devices", "cpu", "-p", "17", "--rounds", "3",
               "--peers", "mlx-lm", "--peer-dtypes", "float32", "--out", str(tmp_path)])
    assert rc == 0
    assert order == ["ours", "peer", "peer", "ours", "ours", "peer"]
    assert "rounds 1.50x 0.80x 1.30x; median 1.30x" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r.get("round") for r in rows] == [None, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("options, message", [
    (["--batch", "0"], "--batch takes comma-separated integers of at least 1, got '0'"),
    (["-p", "17,x"], "-p/--prompt-tokens takes comma-separated integers of at least 1, got '17,x'"),
    (["--kv", "prealloc,ring"], "--kv: unknown 'ring' (choose from prealloc, paged, basic)"),
    (["--peers", "vllm"], "--peers: unknown 'vllm' (choose from mlx-lm, llama.cpp)"),
    (["--peer-dtypes", "int8"], "--peer-dtypes: unknown 'int8'"),
    (["--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["--dtypes", "float32,int8"], "--dtypes: unknown 'int8' (choose from float32, bfloat16, float16)"),
    (["--kv-dtype", "q4_0"], "argument --kv-dtype: invalid choice: 'q4_0'"),
    (["-n", "x"], "argument -n/--gen-tokens: invalid int value: 'x'"),
    (["--report", "/nonexistent/results.jsonl"], "--report /nonexistent/results.jsonl: not a results.jsonl file"),
])
def test_bad_options_are_one_line(options, message, capsys):
    try:
        rc = main(["bench", *options])
    except SystemExit as e:  # argparse's own errors, through the CLI's parser: one line, status 1
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 1
    assert len(err.strip().splitlines()) == 1 and err.startswith("mlxinfer: error: ") and message in err, err


def test_a_tiny_run_writes_the_table_and_json_lines(synthetic, tmp_path):
    model = synthetic()
    argv = ["bench", "-m", model, "--backends", "cpu", "-p", "8", "-n", "4", "--runs", "1", "--out", str(tmp_path)]
    r = subprocess.run([sys.executable, "-m", "mlxinfer", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    table = [line for line in r.stdout.splitlines() if line.startswith("|")]
    assert table[0].startswith("| engine | device | attention | kv | batch | prompt | gen | TTFT ms |")
    assert len(table) == 3 and table[2].startswith("| mlxinfer cpu | cpu | fused | prealloc | 1 | 8 | 4 | ")
    head, *rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert head["kind"] == "header" and head["command"] == "mlxinfer " + " ".join(argv)
    assert head["model"] == model and head["versions"]["mlxinfer"] and head["machine"] and head["date"].endswith("UTC")
    assert len(rows) == 1
    row = rows[0]
    assert (row["engine"], row["prompt_tokens"], row["generated"], row["runs"], row["round"]) \
        == ("mlxinfer cpu", 8, 4, 1, 1)
    assert row["backend"].startswith("cpu (") and row["decode_tokens_per_second"] > 0 and row["peak_memory_mb"] > 0
    assert (tmp_path / "results.md").read_text().startswith("command: mlxinfer bench -m ")


def test_mlx_rows_in_each_dtype(synthetic, tmp_path):
    """--dtypes: one set of MLX rows per dtype, each named by it (and --kv-dtype), each run in that dtype."""
    argv = ["bench", "-m", synthetic(), "--backends", "mlx", "--devices", "cpu", "-p", "8", "-n", "3", "--runs", "1",
            "--dtypes", "float32,bfloat16", "--kv-dtype", "q8_0", "--out", str(tmp_path)]
    r = subprocess.run([sys.executable, "-m", "mlxinfer", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _, *rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [row["engine"] for row in rows] == ["mlxinfer mlx float32 kv q8_0", "mlxinfer mlx bfloat16 kv q8_0"]
    assert [row["backend"].split(", ")[1:3] for row in rows] == [["float32", "q8_0 KV cache"],
                                                                  ["bfloat16", "q8_0 KV cache"]]


def test_an_mlx_row_without_dtypes_is_named_by_the_dtype_it_ran(synthetic, tmp_path):
    """Without --dtypes an MLX row runs the device's default dtype (float32 on MLX's CPU, bfloat16 on
    CUDA) and is named by it, so rows of different defaults never share a name."""
    argv = ["bench", "-m", synthetic(), "--backends", "mlx", "--devices", "cpu", "-p", "8", "-n", "2", "--runs", "1",
            "--out", str(tmp_path)]
    r = subprocess.run([sys.executable, "-m", "mlxinfer", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _, row = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert row["engine"] == "mlxinfer mlx float32" and row["backend"].split(", ")[1] == "float32"


def test_rows_for_each_prefill_chunk(synthetic, tmp_path):
    """--prefill-chunks: one set of rows per chunk size, each named by it and run with it (the metrics'
    prefill_chunk), so a run compares chunk sizes side by side."""
    argv = ["bench", "-m", synthetic(), "--backends", "cpu", "-p", "8", "-n", "2", "--runs", "1",
            "--prefill-chunks", "3,16", "--out", str(tmp_path)]
    r = subprocess.run([sys.executable, "-m", "mlxinfer", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _, *rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(row["engine"], row["prefill_chunk"]) for row in rows] == [("mlxinfer cpu chunk 3", 3),
                                                                       ("mlxinfer cpu chunk 16", 16)]


def test_mlx_lm_weights_take_gguf_py_values_where_mx_load_would_misread(synthetic, monkeypatch):
    """The mlx-lm peer reads the GGUF through `mx.load` only for the types it returns exactly (F32, F16,
    Q8_0, Q4_0, Q4_1: it mis-decodes Q4_K and rounds BF16); every other type is dequantized by gguf-py.
    Here a Q8_0 file read both ways: quantized as the file's bits, or (with no type trusted to mx.load)
    as gguf-py's floats, and the two hold the same values."""
    import mlx.core as mx

    from mlxinfer import peers
    from mlxinfer.gguf_file import GGUFFile
    from mlxinfer.models import model_args

    path = synthetic(arch="qwen3", n_layers=1, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=32,
                     vocab_size=320, qtype="Q8_0")
    with GGUFFile(path) as g:
        args = model_args(g)
        quantized, bits = peers._mlx_lm_weights(g, mx.load(str(path)), args, mx.float32)
        monkeypatch.setattr(peers, "MX_LOAD_EXACT", set())
        floats, no_bits = peers._mlx_lm_weights(g, mx.load(str(path)), args, mx.float32)
    key = "model.layers.0.mlp.down_proj"
    assert bits[key] == 8 and not no_bits and key + ".scales" not in floats
    q = quantized
    values = mx.dequantize(q[key + ".weight"], q[key + ".scales"], q[key + ".biases"], group_size=32, bits=8)
    assert (values == floats[key + ".weight"]).all().item()


def test_mlx_lm_peer_refuses_architectures_it_does_not_map(synthetic, tmp_path):
    """A Gemma file is refused in one line (its norms' Hugging Face names are not llama's: converted with
    them, two norms a layer would land on one name)."""
    from mlxinfer.errors import UnsupportedError
    from mlxinfer.peers import write_mlx_lm_model

    path = synthetic(arch="gemma2", n_layers=1, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=320)
    with pytest.raises(UnsupportedError, match="the mlx-lm peer is written for dense llama and qwen3 files, not gemma2"):
        write_mlx_lm_model(path, tmp_path / "peer")


@pytest.mark.parametrize("warmup_tokens,want", [(0, (20, 64)), (8, (8, 4))])
def test_the_warm_up_runs_the_rows_own_shapes(monkeypatch, warmup_tokens, want):
    """The warm-up takes the row's whole prompts and every generated token (the same cache capacity and
    compiled shapes as the measured runs: a kernel compiled inside a run is not its speed); with
    --warmup-tokens it is a short prompt and 4 tokens. (A stand-in engine records each call.)"""
    calls = []

    class Vocab:
        vocab_size = 1000

    monkeypatch.setattr(benchmark, "load", lambda *a, **k: SimpleNamespace(backend=SimpleNamespace(dtype_name="float32")))
    monkeypatch.setattr(benchmark, "load_tokenizer", lambda *a, **k: Vocab())
    monkeypatch.setattr(benchmark, "one_run", lambda engine, on_mlx, prompts, n_gen: calls.append(
        (len(prompts[0]), n_gen)) or dict(decode_tokens_per_second=1.0))
    monkeypatch.setattr(benchmark, "summarize", lambda runs: {})
    job = dict(model="m", backend="mlx", attention="fused", device="gpu", kv="prealloc", threads=None, prompt=20,
               gen=64, batch=2, runs=2, warmup_tokens=warmup_tokens)
    benchmark.measure_row(job)
    assert calls == [want, (20, 64), (20, 64)]


def test_a_setting_reaches_the_rows_child_process(synthetic, tmp_path):
    """bench/probes/setting.py's A/B: a row runs in a child process (`benchmark.CHILD`), which must see the
    changed constant too. Here a GGUF reader bound of 1 entry: the row fails in its child, naming it (a
    child that ran the defaults would measure the row)."""
    model = synthetic()
    probe = os.path.join(ROOT, "bench", "probes", "setting.py")
    argv = ["mlxinfer.gguf_file.MAX_ENTRIES=1", "--", "bench", "-m", model, "--backends", "cpu", "-p", "8", "-n", "2",
            "--runs", "1", "--out", str(tmp_path)]
    r = subprocess.run([sys.executable, probe, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (tmp_path / "results.jsonl").exists(), (r.returncode, r.stderr)
    (row,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()][1:]
    assert "is more than mlxinfer reads (1)" in row.get("error", ""), (row, r.stderr)


def test_the_sliced_columns_ablation_gives_the_backends_columns(monkeypatch):
    """bench/probes/ablations.py's SlicedColumns (step_profile's `sliced-columns`) overrides the backend's
    `_group_columns` with its own signature: a slice a matrix, the same columns as the backend's Split."""
    import mlx.core as mx
    import numpy as np

    from mlxinfer.backends.mlx import MLXBackend

    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench", "probes"))
    from ablations import SlicedColumns

    y = mx.array(np.arange(2 * 14, dtype=np.float32).reshape(2, 14))
    sizes = (8, 4, 2)
    got, want = SlicedColumns._group_columns(y, sizes), MLXBackend._group_columns(y, sizes)
    assert len(got) == len(want) == 3
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(got, want))


def test_the_formed_graph_ablation_turns_only_the_formed_kernels_off(monkeypatch):
    """bench/probes/ablations.py's FormedGraph (step_profile's `formed-graph`): on a GPU (MLX made to report
    a CUDA one) the backend's formed kernels are off before a model loads, the block kernels still on."""
    from mlxinfer.backends.mlx import MLXBackend

    from .cuda_host import pretend_gpu

    kind = pretend_gpu(monkeypatch, "cuda")
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench", "probes"))
    from ablations import FormedGraph

    assert MLXBackend(device="gpu", kernel=kind).formed_kind == kind
    b = FormedGraph(device="gpu", kernel=kind)
    assert b.formed_kind is None and b.block_kind == kind
