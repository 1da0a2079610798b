"""Op counts of one decode step, as formulas of the model's shape (issue: tracing backend)."""

import io

import numpy as np
import pytest

import mlxinfer
from mlxinfer.backend import OPS
from mlxinfer.tracing import TracingBackend, install_tracer

SHAPES = [
    dict(arch="qwen3", n_layers=3, hidden=64, ffn=96, n_heads=4, n_kv_heads=2, head_dim=32),
    dict(arch="qwen3", n_layers=2, hidden=96, ffn=128, n_heads=6, n_kv_heads=3, head_dim=48),
    dict(arch="llama", n_layers=4, hidden=64, ffn=96, n_heads=8, n_kv_heads=2, head_dim=8),
    dict(arch="llama", n_layers=1, hidden=32, ffn=64, n_heads=2, n_kv_heads=1, head_dim=16),
    dict(arch="phi3", n_layers=2, hidden=64, ffn=96, n_heads=4, n_kv_heads=2, head_dim=16),  # fused matrices: same counts
]


def traced_passes(path, backend, attention, n_new=3, prompts=None):
    engine = mlxinfer.load(path, backend=backend, attention=attention)
    out = io.StringIO()
    tracer = install_tracer(engine, stream=out)
    passes = []

    def end(name):
        passes.append((name, dict(tracer.counts)))
        tracer.end_pass(name)

    if prompts is None:
        gen = engine.generate([3, 4, 5, 6, 7], max_tokens=n_new, on_forward=end)
    else:
        gen = engine.generate_batch(prompts, max_tokens=n_new, on_forward=end)
    tracer.print_summary()
    return engine, passes, out.getvalue(), gen


PER_HEAD_OPS = ("matmul", "transpose_2d", "softmax_rows", "copy_2d_from", "copy_2d_into", "scale", "zeros",
                "read_rows", "mask_scores")


def check_pass(f, p, L, H, B, T):
    """Op counts of one pass of B sequences with T rows each, L layers, H query heads: fused (f) and
    per-head (p) attention. Weight products: 7 per layer plus the output head, whatever B and T."""
    assert f["fused_attention"] == L and p["fused_attention"] == L
    assert f["linear"] == p["linear"] == 7 * L + 1
    assert f["scatter_rows"] == p["scatter_rows"] == 2 * L  # keys and values, all sequences at once
    assert f["rope"] == p["rope"] == 2 * L
    assert f["sample_tokens"] == p["sample_tokens"] == 1
    assert f["gather_rows"] == (1 if T == 1 else 2)  # embedding (+ the logit rows of a prefill pass)
    assert f.get("matmul", 0) == 0 and p["matmul"] == 2 * H * B * L  # per layer, per head, per sequence
    assert f.get("transpose_2d", 0) == 0 and p["transpose_2d"] == H * B * L
    assert f.get("softmax_rows", 0) == 0 and p["softmax_rows"] == H * B * L
    assert p["copy_2d_from"] == 3 * H * B * L and p["copy_2d_into"] == H * B * L
    assert p["read_rows"] == 2 * B * L and p["zeros"] == L
    assert p.get("mask_scores", 0) == (H * B * L if T > 1 else 0)
    assert p["scale"] - f["scale"] == H * B * L
    for op in set(f) | set(p):  # everything else is the same in both paths
        if op not in PER_HEAD_OPS:
            assert f.get(op, 0) == p.get(op, 0), op


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s['arch']}-L{s['n_layers']}-H{s['n_heads']}")
def test_op_counts_per_layer_head_and_sequence(synthetic, shape, backend):
    path = synthetic(**shape, seed=1)
    L, H = shape["n_layers"], shape["n_heads"]
    _, fused, _, _ = traced_passes(path, backend, "fused")
    _, per_head, _, _ = traced_passes(path, backend, "per-head")
    assert [p[0] for p in fused] == ["prefill", "decode 1", "decode 2"]
    check_pass(fused[0][1], per_head[0][1], L, H, B=1, T=5)
    check_pass(fused[1][1], per_head[1][1], L, H, B=1, T=1)
    prompts = [[3, 4, 5], [6, 7, 8], [9, 10, 11]]
    _, fused, _, _ = traced_passes(path, backend, "fused", prompts=prompts)
    _, per_head, _, _ = traced_passes(path, backend, "per-head", prompts=prompts)
    assert fused[1][0] == "pass 2 (3 rows, 3 sequences)"
    check_pass(fused[0][1], per_head[0][1], L, H, B=3, T=3)
    check_pass(fused[1][1], per_head[1][1], L, H, B=3, T=1)


GEMMA_SHAPES = [
    dict(arch="gemma2", n_layers=3, hidden=64, ffn=96, n_heads=4, n_kv_heads=2, head_dim=32, sliding_window=4,
         attn_softcap=20.0, final_softcap=10.0),
    dict(arch="gemma3", n_layers=3, hidden=64, ffn=96, n_heads=4, n_kv_heads=2, head_dim=32, sliding_window=4,
         swa_pattern=3, final_softcap=10.0),
]


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
@pytest.mark.parametrize("shape", GEMMA_SHAPES, ids=lambda s: s["arch"])
def test_gemma_op_counts(synthetic, shape, backend):
    """Gemma's ops per pass: one GELU a layer; four RMSNorms a layer (six with Gemma 3's q/k norms) and
    the final one, each with its one `scale`; beside them the embedding's scale, one query scale a layer
    and the final soft-capping's two scales and one tanh; the per-head reference adds, per head, sequence
    and layer, the attention scale and (Gemma 2) the soft-capping's two scales and tanh, and masks every
    windowed layer's scores even for one decode row."""
    path = synthetic(**shape, seed=1)
    L, H = shape["n_layers"], shape["n_heads"]
    attn_cap = "attn_softcap" in shape
    engine = mlxinfer.load(path, backend="cpu")
    windowed = sum(engine.args.swa_layers)
    assert windowed == 2  # layers 0 and 2 (Gemma 2), 0 and 1 (Gemma 3)
    prompts = [[3, 4, 5], [6, 7, 8], [9, 10, 11]]
    _, fused, _, _ = traced_passes(path, backend, "fused", prompts=prompts)
    _, per_head, _, _ = traced_passes(path, backend, "per-head", prompts=prompts)
    for (_, f), (_, p), T in ((fused[0], per_head[0], 3), (fused[1], per_head[1], 1)):
        B = 3
        norms = (4 + 2 * (shape["arch"] == "gemma3")) * L + 1
        assert f["gelu"] == p["gelu"] == L and f["add"] == 2 * L and f["rope"] == 2 * L
        assert f["linear"] == 7 * L + 1 and f["sum_squares_rows"] == norms
        assert f["scale"] == norms + 1 + L + 2 and f["tanh"] == 1
        assert p["scale"] - f["scale"] == (3 if attn_cap else 1) * H * B * L
        assert p["tanh"] - f["tanh"] == (H * B * L if attn_cap else 0)
        assert p.get("mask_scores", 0) == H * B * (L if T > 1 else windowed)


def test_histogram_format_and_summary(synthetic):
    path = synthetic(**SHAPES[0], seed=1)
    _, passes, text, gen = traced_passes(path, "cpu", "fused")
    lines = text.splitlines()
    assert lines[0].startswith("[CPU] prefill: op invocation counts (total ")
    assert lines[0].endswith(" ms)")
    block = lines[1:lines.index(next(x for x in lines[1:] if x.startswith("[CPU] decode 1")))]
    ops = [b.split(":")[0].strip() for b in block]
    assert ops == sorted(ops)
    assert all(b.startswith("  ") and b.endswith(" ms)") for b in block)
    total = int(lines[0].split("total ")[1].split(",")[0])
    assert total == sum(passes[0][1].values())
    summary = lines.index(next(x for x in lines if "whole run" in x))
    assert lines[summary].startswith("[CPU] whole run (3 forward passes): op invocation counts (total ")
    run_total = int(lines[summary].split("total ")[1].split(",")[0])
    assert run_total == sum(sum(c.values()) for _, c in passes)


def test_tracing_does_not_change_results(synthetic):
    path = synthetic(**SHAPES[1], seed=2)
    plain = mlxinfer.load(path, backend="cpu").generate([3, 4, 5, 6, 7], max_tokens=8)
    _, _, _, traced = traced_passes(path, "cpu", "per-head", n_new=8)
    assert traced.token_ids == plain.token_ids


def test_every_protocol_op_is_wrapped():
    for op in OPS:
        assert getattr(TracingBackend, op).__qualname__.startswith(("_traced", "TracingBackend"))


def test_no_wrapper_without_trace(synthetic):
    engine = mlxinfer.load(synthetic(**SHAPES[0], seed=1), backend="cpu")
    assert not isinstance(engine.backend, TracingBackend)


class _TickClock:
    """A clock that advances by one tick at each reading: an op's traced time is then 1 plus two ticks for
    every traced op called inside it."""

    def __init__(self):
        self.t = 0

    def perf_counter(self):
        self.t += 1
        return float(self.t)


def test_pass_time_counts_ops_nested_in_per_head_attention_once(synthetic, monkeypatch):
    """A pass's total is the time of its top-level ops: the per-head default's primitives run inside
    `fused_attention` and are already in its time. With one tick per clock reading, fused attention
    (nothing nested) totals N ticks for N ops; per-head totals 2*N_per_head - N_top, where the top-level
    calls N_top are the fused path's N (the same ops outside attention, one fused_attention a layer)."""
    import mlxinfer.tracing

    path = synthetic(**SHAPES[0], seed=1)
    totals = {}
    for attention in ("fused", "per-head"):
        monkeypatch.setattr(mlxinfer.tracing, "time", _TickClock())
        engine = mlxinfer.load(path, backend="cpu", attention=attention)
        tracer = install_tracer(engine, stream=io.StringIO())
        seen = []

        def end(name):
            seen.append((sum(tracer.counts.values()), tracer.pass_time))
            tracer.end_pass(name)

        engine.generate([3, 4, 5, 6, 7], max_tokens=2, on_forward=end)
        totals[attention] = seen
    for (n_fused, t_fused), (n_per_head, t_per_head) in zip(totals["fused"], totals["per-head"]):
        assert t_fused == n_fused
        assert n_per_head > n_fused and t_per_head == 2 * n_per_head - n_fused
