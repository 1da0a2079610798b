"""The compiled decode step: a decode pass of n sequences as one compiled function, gpt-fast's
`decode_one_token` under `torch.compile` (here the backend's `compile_decode`, MLX's `mx.compile`).

A pass runs compiled when every sequence in it decodes one token, into a cache that implements the
step's interface (`kv_cache`'s module docstring: `step_inputs`, `step_cache`, `set_stores`), on a
backend that compiles and whose attention for the batch reads nothing but the batch's arrays
(`Backend.compiles_pass`). The step is traced with `Batch.traced_decode`, whose host lengths are None,
so nothing the host knows is baked into the graph; the backend retraces it only when a shape changes
(the cache's capacity), so later requests reuse the trace.

The next step's positions and lengths are one more, made on the device: a run of steps over the same
rows reads no index array from the host (MLX's CUDA backend keeps arrays made on the host in managed
memory, which the GPU migrates or reads across the bus). Their contents follow from each row's (slot,
position) alone, so reusing them is exact whatever ran in between.
"""

from __future__ import annotations

from .batch import Batch

MAX_COMPILED_STEPS = 16  # compiled steps kept (one per cache class, its config and batch size), most recent


class DecodeStep:
    def __init__(self, model, specs, max_steps: int = MAX_COMPILED_STEPS):
        """specs: the attention spec of each of the model's layers (`Engine.specs`)."""
        self.model, self.max_steps = model, max_steps
        self.specs = list(dict.fromkeys(specs))  # the distinct ones
        self.steps = {}  # (cache class, batch size) -> the compiled function, least recently used first
        self._carried = None  # ((slot, position) of each row, the packed index arrays made for them)

    def covers(self, ops, batch, cache, decoding: bool) -> bool:
        """Whether this pass runs as the compiled step; `decoding`: every row is a sequence's decode row."""
        return (decoding and ops.compiles_decode and cache.compiles
                and all(ops.compiles_pass(batch, spec) for spec in self.specs))

    def __call__(self, ops, ids, batch, cache):
        """The pass's logits and the arrays to start with them (the next step's index arrays); the
        cache's stores are replaced by those the step wrote."""
        rows = tuple(zip(batch.slots, batch.starts))
        packed = self._carried[1] if self._carried is not None and self._carried[0] == rows else batch.packed
        step = self._step(ops, type(cache), len(batch), cache.step_config)
        logits, keys, values, next_packed = step(ids, packed, cache.keys, cache.values, *cache.step_inputs(ops, batch))
        cache.set_stores(keys, values)
        self._carried = (tuple((slot, position + 1) for slot, position in rows), next_packed)
        return logits, next_packed

    def _step(self, ops, kind: type, n: int, config=frozenset()):
        """The compiled step of `n` sequences over a cache of class `kind` (and `step_config`): (ids,
        packed index arrays (`Batch.packed`), keys, values, the cache's step inputs) -> (logits, keys,
        values, the next step's packed arrays), the per-layer stores in and out."""
        key = (kind, n, config)
        if key in self.steps:
            self.steps[key] = self.steps.pop(key)  # most recently used last
            return self.steps[key]
        while len(self.steps) >= self.max_steps:  # each holds its traces: keep the recent ones
            del self.steps[next(iter(self.steps))]
        one_more = Batch.decode_step_delta(ops, n)
        model = self.model

        def forward(ids, packed, keys, values, *inputs):
            batch = Batch.traced_decode(ops, n, packed)
            cache = kind.step_cache(keys, values, inputs, config)
            logits = model(ops, ids, batch, cache)
            return logits, cache.keys, cache.values, packed + one_more

        self.steps[key] = ops.compile_decode(forward)
        return self.steps[key]
