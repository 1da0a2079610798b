"""Backends with one piece taken out, for measuring what that piece costs (step_profile.py,
attention_plans.py). Each is a subclass of the MLX backend, so an ablation is a backend of its own
(built for its own engine, named by `describe()`), never a method patched onto a running engine's
backend. Their text is wrong by design: only their timings mean something.
"""

from __future__ import annotations

from mlxinfer.backend import Backend
from mlxinfer.backends.mlx import MLXBackend


class NoAttention(MLXBackend):
    """Attention replaced by a copy of the queries: the rest of the step's cost."""

    def fused_attention(self, q, kv, batch, spec):
        return q + 0.0

    def describe(self) -> str:
        return super().describe() + ", attention ablated"


class SeparateWeights(MLXBackend):
    """Q, K, V (and gate, up) loaded and multiplied as separate products, as before weight groups."""

    load_weight_group = Backend.load_weight_group

    def describe(self) -> str:
        return super().describe() + ", weight groups ablated"
