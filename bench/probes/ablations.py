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


class Unfused(MLXBackend):
    """Each pre-norm block's norm apart from the products after it (mx.fast.rms_norm, then the products),
    its output product apart from the residual's add, and SwiGLU apart from the down product (MLX's silu
    and product): the step before the block kernels' NORM, ADD and SWIGLU forms (five launches a layer
    more; its text differs from the default's in the last bits, MLX's silu not being the swiglu
    kernel's)."""

    rms_norm_linear_group = Backend.rms_norm_linear_group
    linear_add = Backend.linear_add
    swiglu_ffn = Backend.swiglu_ffn

    def rms_norm(self, x, weight, eps):
        import mlx.core as mx

        return mx.fast.rms_norm(x, weight, eps)

    def describe(self) -> str:
        return super().describe() + ", norms and residuals apart from the products"


class SwigluApart(MLXBackend):
    """SwiGLU as MLX's own silu and product between the gate/up and down products (the composite
    `swiglu_ffn`'s default), the norms and residual adds still inside the products: the step before the
    SWIGLU form (one launch and two column views a layer more; its text differs from the default's in
    the last bits, MLX's silu not being the swiglu kernel's)."""

    swiglu_ffn = Backend.swiglu_ffn

    def describe(self) -> str:
        return super().describe() + ", SwiGLU apart from the down product"


class NormApart(MLXBackend):
    """Each pre-norm block's norm as the rms_norm kernel apart from the products after it (the NORM form
    off; ADD and SWIGLU as the default takes them): one launch a norm more, the same bits."""

    def _norm_form(self, x, weight, ws, groups=None) -> bool:
        return False

    def describe(self) -> str:
        return super().describe() + ", norms apart from the products"


class PrefillMLXOps(MLXBackend):
    """Our RMSNorm and SwiGLU kernels only for passes of rows the block kernels take (decode rows, where
    the fused forms need their bits); a prompt's pass of more rows on mx.fast.rms_norm and MLX's silu and
    product (its text differs from the default's in the last bits): what a prompt's pass costs the host
    with MLX's own ops there."""

    def rms_norm(self, x, weight, eps):
        import mlx.core as mx

        from mlxinfer import block_kernels

        if x.ndim == 2 and x.shape[0] > block_kernels.MAX_ROWS:
            return mx.fast.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def swiglu_ffn(self, x, weight, eps, gate_up, down, groups=None):
        from mlxinfer import block_kernels

        if x.shape[0] > block_kernels.MAX_ROWS:
            return Backend.swiglu_ffn(self, x, weight, eps, gate_up, down, groups)
        return super().swiglu_ffn(x, weight, eps, gate_up, down, groups)

    def describe(self) -> str:
        return super().describe() + ", MLX's norms and SwiGLU for a prompt's rows"


class SeparateWeights(MLXBackend):
    """Q, K, V (and gate, up) loaded and multiplied as separate products, as before weight groups. Since
    the SWIGLU form reads gate and up side by side, this also takes SwiGLU out of the down product
    (MLX's silu and product: as `SwigluApart` does, on top)."""

    load_weight_group = Backend.load_weight_group

    def describe(self) -> str:
        return super().describe() + ", weight groups ablated"


class SlicedColumns(MLXBackend):
    """A weight group's matrices' columns a slice each, as before 4230cb9 (one Split for all now): the same
    bits, a view primitive more a matrix a layer a pass."""

    @staticmethod
    def _group_columns(y, sizes):
        out, start = [], 0
        for n in sizes:
            out.append(y[:, start:start + n])
            start += n
        return tuple(out)

    def describe(self) -> str:
        return super().describe() + ", group columns sliced"


class FormedGraph(MLXBackend):
    """A prompt's products' scales and values formed by the graph's compiled kernels with the views around
    them (`mlx_weights.formed_scales`, `formed_values`), as before blocks.cu's formed kernels: the same
    bits, 336 view primitives more a 17-token Q4_K_M pass of the 0.6B shape."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.formed_kind = None  # (before the engine loads: its weights get no `former`)

    def describe(self) -> str:
        return super().describe() + ", formed kernels off"
