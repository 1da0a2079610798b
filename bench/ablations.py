"""Backends with one piece taken out, for measuring what that piece costs (bench/step_profile.py,
bench/attention_plans.py, bench/tp_bench.py). Each is a subclass of the MLX backend, so an ablation is a
backend of its own (built for its own engine, named by `describe()`), never a method patched onto a
running engine's backend. Their text is wrong by design: only their timings mean something.
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


class NoAllSum(MLXBackend):
    """Tensor parallelism without its all-sums (each rank keeps its partial sums): their cost."""

    def all_sum(self, x, group):
        return x

    def describe(self) -> str:
        return super().describe() + ", all-sums ablated"


class OwnProducts(MLXBackend):
    """On a GPU, attention's activation products and softmax on MLX's own ops instead of our
    published-order kernels (`gpu_kernels`): what routing them through our kernels costs (on CUDA the
    fused and per-head paths then differ in their bits). Without `gpu_kernels` the CUDA norms-and-RoPE
    kernel (`qk_norm_rope`) goes too: mx.fast's kernels take its place."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gpu_kernels = None

    def describe(self) -> str:
        return super().describe() + ", MLX's own products"
