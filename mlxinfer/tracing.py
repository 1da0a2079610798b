"""Tracing backend: wraps any backend, counts and times every protocol op call, per forward pass.

    mlxinfer generate --trace "The capital of France is"        (or MLXINFER_TRACE=1)

prints on stderr, after each forward pass, the book chapter's histogram:

    [CPU] decode 1: op invocation counts (total 1029, 27.412 ms)
      add: 60  (0.210 ms)
      ...

and a summary over the whole run at the end. The wrapper methods are generated from
`mlxinfer.backend.OPS`, so an op added to the protocol is traced the day it is added. Without
`--trace` no wrapper exists and nothing is paid.

Times: on the CPU backend each op is timed as it runs. MLX builds a lazy graph, so an op's call
alone costs only graph building; while tracing, a lazy backend is evaluated after every op
(`sync`), which makes the per-op times real and the whole run slower than an untraced one (and the
engine does not pipeline passes while tracing).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

from .backend import OPS, PRIMITIVE_OPS, Backend


class TracingBackend:
    """A Backend that forwards to `inner`, counting and timing each op. Non-op attributes (weights
    loading, to_numpy, name, device...) pass through untouched."""

    lazy = False  # every op is evaluated as it is traced: nothing to pipeline
    compiles_decode = False  # a compiled step would run its ops unseen
    holds_pass_buffers = False  # (nothing is left in flight: every op is evaluated as it is traced)

    def __init__(self, inner: Backend, stream=sys.stderr):
        self.inner = inner
        self.stream = stream
        self.eval_each_op = inner.lazy
        self.start_pass()
        self.run_counts: dict[str, int] = defaultdict(int)
        self.run_times: dict[str, float] = defaultdict(float)
        self.run_time = 0.0
        self.passes = 0
        self._depth = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def label(self) -> str:
        return self.inner.label()

    def _call(self, op, fn, args, kwargs):
        self._depth += 1
        t0 = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
            if self.eval_each_op:
                self.inner.sync(*(out if isinstance(out, tuple) else (out,)))
        finally:
            self._depth -= 1
        dt = time.perf_counter() - t0
        self.counts[op] += 1
        self.times[op] += dt
        if self._depth == 0:  # ops called inside the per-head default count once, in fused_attention
            self.pass_time += dt
        return out

    def rms_norm(self, x, weight, eps):
        # The primitive default, on the tracer: its primitives are what the op-count formulas count.
        return Backend.rms_norm(self, x, weight, eps)

    def qk_norm_rope(self, *args, **kwargs):
        # The default too: reshape, rms_norm, reshape, rope, for the queries and for the keys
        return Backend.qk_norm_rope(self, *args, **kwargs)

    def linear_group(self, x, ws, groups=None):
        # The default too: one counted `linear` per matrix of the group.
        return Backend.linear_group(self, x, ws, groups)

    def rms_norm_linear_group(self, x, weight, eps, ws, groups=None):
        # The default too: the counted rms_norm's primitives, then the group's counted `linear`s.
        return Backend.rms_norm_linear_group(self, x, weight, eps, ws, groups)

    def linear_add(self, x, w, residual, groups=None):
        # The default too: a counted `linear`, then a counted `add`.
        return Backend.linear_add(self, x, w, residual, groups)

    def swiglu_ffn(self, x, weight, eps, gate_up, down, groups=None):
        # The default too: the two composites above with a counted silu and hadamard between them.
        return Backend.swiglu_ffn(self, x, weight, eps, gate_up, down, groups)

    def per_head_sequence(self, q, kv, batch, spec, b, out):
        # the per-head reference's steps on the tracer (counted), as `per_head_attention` calls them;
        # where the inner backend makes steps 3-7 one op a head (`sequence_op`: MLX's fused attention on
        # a 16-bit chunk), its own steps, counted as that op, so the bits stay the reference's
        r0, r1 = batch.rows[b]
        op = self.inner.sequence_op(spec, r1 - r0)
        if op is not None:
            return self._call(op, self.inner.per_head_sequence, (q, kv, batch, spec, b, out), {})
        return Backend.per_head_sequence(self, q, kv, batch, spec, b, out)

    def fused_attention(self, q, kv, batch, spec):
        # The per-head reference runs on the tracer, so the primitives it is built from are counted.
        if self.inner.attention == "per-head":
            fn = Backend.per_head_attention.__get__(self)
        else:
            fn = self.inner.fused_attention_override
        return self._call("fused_attention", fn, (q, kv, kv.batch, spec), {})

    # -- reporting ----------------------------------------------------------------------------
    def histogram(self, title, counts, times, total_time) -> str:
        lines = [f"[{self.label()}] {title}: op invocation counts (total {sum(counts.values())}, "
                 f"{total_time * 1000:.3f} ms)"]
        for op in sorted(counts):
            lines.append(f"  {op}: {counts[op]}  ({times[op] * 1000:.3f} ms)")
        return "\n".join(lines)

    def end_pass(self, name: str) -> None:
        """Print this pass's histogram, fold it into the run totals and start a new pass."""
        print(self.histogram(name, self.counts, self.times, self.pass_time), file=self.stream)
        for op, n in self.counts.items():
            self.run_counts[op] += n
            self.run_times[op] += self.times[op]
        self.run_time += self.pass_time
        self.passes += 1
        self.start_pass()

    def start_pass(self) -> None:
        """Start counting a new pass (what was counted since the last `end_pass` is dropped)."""
        self.counts: dict[str, int] = defaultdict(int)
        self.times: dict[str, float] = defaultdict(float)
        self.pass_time = 0.0

    def print_summary(self) -> None:
        print(self.histogram(f"whole run ({self.passes} forward passes)", self.run_counts, self.run_times,
                             self.run_time), file=self.stream)


def _traced(op):
    def method(self, *args, **kwargs):
        return self._call(op, getattr(self.inner, op), args, kwargs)

    method.__name__ = op
    method.__doc__ = f"Traced `{op}` of the wrapped backend."
    return method


for _op in PRIMITIVE_OPS:
    setattr(TracingBackend, _op, _traced(_op))
assert all(callable(getattr(TracingBackend, op)) for op in OPS)


def install_tracer(engine, stream=sys.stderr) -> TracingBackend:
    """Wrap the engine's backend in a TracingBackend (the model's weights stay where they are)."""
    tracer = TracingBackend(engine.backend, stream)
    engine.backend = tracer
    return tracer
