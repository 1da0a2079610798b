"""bench/bench.py's comparison with its peers: ratios pair rows of the same round only."""

import importlib.util
import os

import pytest

pytest.importorskip("mlx.core")  # bench.py imports the engine's MLX backend helpers


def _script(monkeypatch, name: str):
    """bench/<name>.py as a module; bench/ goes first on sys.path, as when the script runs (bench.py imports
    its neighbour peers.py)."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    monkeypatch.syspath_prepend(here)
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", os.path.join(here, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(engine, rnd, tok_s, prompt=17):
    return dict(engine=engine, round=rnd, prompt_tokens=prompt, batch_size=1, decode_tokens_per_second=tok_s,
                total_tokens_per_second=tok_s, attention="fused", device="gpu", kv_cache="prealloc")


def test_peer_ratios_pair_rows_of_one_round_and_give_their_median(monkeypatch):
    bench = _script(monkeypatch, "bench")
    rows = [_row("mlxinfer mlx", 1, 300.0), _row("mlxinfer mlx", 2, 200.0), _row("mlxinfer mlx", 3, 260.0),
            _row("mlx-lm", 1, 200.0), _row("mlx-lm", 2, 250.0), _row("mlx-lm", 3, 200.0)]
    text = bench.peer_ratios(rows)
    assert "rounds 1.50x 0.80x 1.30x; median 1.30x, at least 1.2x (unrounded) in 2 of 3" in text


def test_peer_ratios_of_one_round_print_one_ratio(monkeypatch):
    bench = _script(monkeypatch, "bench")
    text = bench.peer_ratios([_row("mlxinfer mlx", 1, 300.0), _row("mlx-lm", 1, 200.0, prompt=511),
                              _row("mlx-lm", 1, 250.0)])
    assert text.splitlines()[1].endswith("(prompt 17, batch 1): 1.20x")
    assert "prompt 511" not in text


def test_ab_trees_compares_each_round_s_intervals_and_counts_b_s_wins(monkeypatch):
    ab = _script(monkeypatch, "ab_trees")
    intervals = {(1, "A"): 2.8, (1, "B"): 2.5, (2, "A"): 2.9, (2, "B"): 3.0, (3, "A"): 3.7, (3, "B"): 2.6}
    rows = [dict(round=k, tree=t, prompt=17, interval_ms=v) for (k, t), v in intervals.items()]
    text = ab.compare(rows)
    assert "| 1 | A | 2.800 | 2.500 |" in text and "| 2 | B | 2.900 | 3.000 |" in text
    assert "prompt 17: median interval A 2.900 ms, B 2.600 ms (B/A 0.897;" in text
    assert text.endswith("B shorter in 2 of 3 rounds")
