"""The KV cache: the keys and values of every position each sequence has seen, per layer.

Models see one interface: `cache.update(ops, layer, k, v, batch)` writes the pass's rows and returns a
layer view whose `sequence(ops, b)` gives sequence b's [S, KV*D] keys and values (the per-head
reference reads them that way) and whose `store` is the cache's own tensor for kernels that address it
directly (or None). Slots are the cache's unit of ownership: `alloc()` gives a free one to a new
sequence, `release(slot)` returns it; `reserve(batch)` makes room before a pass. A paged cache (blocks
and a block table per sequence) is one more class with this interface: models do not change.

- `PreallocKVCache` (the default): per layer one [slots, capacity, KV*D] tensor for keys and one for
  values, written in place at (slot, position) by `scatter_rows`. Capacity grows in steps of `step`
  tokens (a prompt reserves its whole length at once) and shrinks again when the longest sequence is
  released, so memory follows the tokens held: slots x longest sequence, rounded up to a step.
- `BasicKVCache` (the book's first cache, kept for comparison with `--kv basic`): per slot and layer a
  tensor grown by `concat_dim0`, which copies the whole tensor every step (O(S) per token per layer).
"""

from __future__ import annotations

import math

from .errors import RequestError


class _Slots:
    """Slot bookkeeping shared by the caches: which slots are in use and how many tokens each holds."""

    def __init__(self):
        self.held: dict[int, int] = {}  # slot -> tokens held
        self.expected: dict[int, int] = {}  # slot -> tokens announced (a prompt's length)

    def alloc(self) -> int:
        slot = next(i for i in range(len(self.held) + 1) if i not in self.held)
        self.held[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot not in self.held:
            raise RequestError(f"KV cache slot {slot} is not in use")
        del self.held[slot]
        self.expected.pop(slot, None)

    def expect(self, slot: int, n_tokens: int) -> None:
        """Announce that `slot` will soon hold `n_tokens` (a prompt): room is made once, not per chunk."""
        self.expected[slot] = n_tokens

    def check(self, batch) -> None:
        for slot, start in zip(batch.slots, batch.starts):
            if slot not in self.held:
                raise RequestError(f"KV cache slot {slot} is not in use")
            if start != self.held[slot]:
                raise RequestError(f"slot {slot} holds {self.held[slot]} tokens; the pass starts at {start}")

    @property
    def in_use(self) -> int:
        return len(self.held)


class PreallocLayer:
    def __init__(self, keys, values, batch):
        self.keys, self.values, self.batch = keys, values, batch

    @property
    def store(self):
        return self.keys, self.values

    def sequence(self, ops, b: int):
        slot, n = self.batch.slots[b], self.batch.kv_lens[b]
        return ops.read_rows(self.keys, slot, n), ops.read_rows(self.values, slot, n)


class PreallocKVCache(_Slots):
    name = "prealloc"

    def __init__(self, ops, n_layers: int, width: int, step: int = 256):
        super().__init__()
        self.ops, self.n_layers, self.width, self.step = ops, n_layers, width, step
        self.keys: list = [None] * n_layers
        self.values: list = [None] * n_layers
        self.n_slots = 0
        self.capacity = 0

    def _resize(self, n_slots: int, capacity: int) -> None:
        if (n_slots, capacity) == (self.n_slots, self.capacity):
            return
        ops = self.ops
        for i in range(self.n_layers):
            if n_slots == 0:
                self.keys[i] = self.values[i] = None
            elif self.keys[i] is None:
                self.keys[i] = ops.new_store(n_slots, capacity, self.width)
                self.values[i] = ops.new_store(n_slots, capacity, self.width)
            else:
                self.keys[i] = ops.resize_store(self.keys[i], n_slots, capacity)
                self.values[i] = ops.resize_store(self.values[i], n_slots, capacity)
        self.n_slots, self.capacity = n_slots, capacity
        ops.sync(*[x for x in self.keys + self.values if x is not None])

    def _fit(self) -> None:
        """Size the stores to the slots in use and the longest sequence, rounded up to a step."""
        if not self.held:
            self._resize(0, 0)
            return
        n_slots = max(self.held) + 1
        longest = max(max(self.held.values()), max(self.expected.values(), default=0))
        capacity = self.step * max(1, math.ceil(longest / self.step))
        if capacity > self.capacity or n_slots > self.n_slots or capacity + self.step <= self.capacity \
                or n_slots < self.n_slots:
            self._resize(n_slots, capacity)

    def release(self, slot: int) -> None:
        super().release(slot)
        self._fit()

    def reserve(self, batch) -> None:
        """Room for the pass: every sequence's rows fit its slot (grows the stores if needed)."""
        self.check(batch)
        for slot, n in zip(batch.slots, batch.kv_lens):
            self.held[slot] = n
        self._fit()

    def update(self, ops, layer: int, k, v, batch) -> PreallocLayer:
        self.keys[layer] = ops.scatter_rows(self.keys[layer], batch.row_slots, batch.positions, k)
        self.values[layer] = ops.scatter_rows(self.values[layer], batch.row_slots, batch.positions, v)
        return PreallocLayer(self.keys[layer], self.values[layer], batch)

    def nbytes(self) -> int:
        return 2 * self.n_layers * self.n_slots * self.capacity * self.width * 4

    def arrays(self) -> list:
        """The cache's tensors (what a pass that samples nothing produces)."""
        return [x for x in self.keys + self.values if x is not None]


class BasicLayer:
    def __init__(self, cache, layer, batch):
        self.cache, self.layer, self.batch = cache, layer, batch
        self.store = None  # no single tensor to address: kernels go sequence by sequence

    def sequence(self, ops, b: int):
        entry = self.cache.entries[self.batch.slots[b]]
        return entry[0][self.layer], entry[1][self.layer]


class BasicKVCache(_Slots):
    name = "basic"

    def __init__(self, ops, n_layers: int, width: int, step: int = 0):
        super().__init__()
        self.ops, self.n_layers, self.width = ops, n_layers, width
        self.entries: dict[int, tuple[list, list]] = {}  # slot -> (keys per layer, values per layer)

    def alloc(self) -> int:
        slot = super().alloc()
        self.entries[slot] = ([None] * self.n_layers, [None] * self.n_layers)
        return slot

    def release(self, slot: int) -> None:
        super().release(slot)
        del self.entries[slot]

    def reserve(self, batch) -> None:
        self.check(batch)
        for slot, n in zip(batch.slots, batch.kv_lens):
            self.held[slot] = n

    def update(self, ops, layer: int, k, v, batch) -> BasicLayer:
        for b, (r0, r1) in enumerate(batch.rows):
            keys, values = self.entries[batch.slots[b]]
            if len(batch) == 1:
                k_b, v_b = k, v
            else:
                k_b = ops.copy_2d_from(k, r0, r1 - r0, 0, self.width)
                v_b = ops.copy_2d_from(v, r0, r1 - r0, 0, self.width)
            if keys[layer] is None:
                keys[layer], values[layer] = k_b, v_b
            else:
                keys[layer] = ops.concat_dim0(keys[layer], k_b)
                values[layer] = ops.concat_dim0(values[layer], v_b)
        return BasicLayer(self, layer, batch)

    def nbytes(self) -> int:
        return 2 * self.n_layers * sum(self.held.values()) * self.width * 4

    def arrays(self) -> list:
        return [x for keys, values in self.entries.values() for x in keys + values if x is not None]


KV_CACHES = {"prealloc": PreallocKVCache, "basic": BasicKVCache}
