"""The KV cache: the keys and values of every position each sequence has seen, per layer.

Models see one interface: `cache.update(ops, layer, k, v, batch)` writes the pass's rows and returns a
layer view whose `sequence(ops, b)` gives sequence b's [S, KV*D] keys and values (the per-head
reference reads them that way) and whose `store` is the cache's own tensor for kernels that address it
directly (or None). Slots are the cache's unit of ownership: `alloc()` gives a free one to a new
sequence, `release(slot, tokens)` returns it; `reserve(batch)` makes room before a pass.

- `PreallocKVCache` (the default): per layer one [slots, capacity, KV*D] tensor for keys and one for
  values, written in place at (slot, position) by `scatter_rows`. Capacity grows in steps of `step`
  tokens (a prompt reserves its whole length at once) and shrinks again when the longest sequence is
  released, so memory follows the tokens held: slots x longest sequence, rounded up to a step.
- `PagedKVCache` (`--kv paged`, the server's default): fixed-size blocks in one pool and a block table
  per sequence; full blocks of finished sequences stay cached by a hash of their token prefix and are
  reused by prompts that start with the same tokens (prefix reuse), evicted least-recently-used.
- `BasicKVCache` (the book's first cache, kept for comparison with `--kv basic`): per slot and layer a
  tensor grown by `concat_dim0`, which copies the whole tensor every step (O(S) per token per layer).
"""

from __future__ import annotations

import math

from .batch import pack_index_arrays, zero_padded
from .errors import RequestError


def _resize_stores(ops, keys: list, values: list, rows: int, capacity: int, width: int) -> None:
    """Every layer's key and value store made [rows, capacity, width], in the lists: a new zeroed one
    where there is none, else the old one grown or trimmed (its rows kept)."""
    for stores in (keys, values):
        for i, store in enumerate(stores):
            stores[i] = (ops.new_store(rows, capacity, width) if store is None
                         else ops.resize_store(store, rows, capacity))


class _Slots:
    """Slot bookkeeping shared by the caches: which slots are in use and how many tokens each holds."""

    def __init__(self):
        self.held: dict[int, int] = {}  # slot -> tokens held
        self.expected: dict[int, int] = {}  # slot -> tokens announced (a prompt's length)

    def alloc(self) -> int:
        slot = next(i for i in range(len(self.held) + 1) if i not in self.held)
        self.held[slot] = 0
        return slot

    def release(self, slot: int, tokens=None) -> None:
        """Free a slot (`tokens`, what its rows hold, matters only to a cache that keeps prefixes)."""
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
        if n_slots == 0:
            self.keys[:] = self.values[:] = [None] * self.n_layers
        else:
            _resize_stores(self.ops, self.keys, self.values, n_slots, capacity, self.width)
        self.n_slots, self.capacity = n_slots, capacity
        self.ops.sync(*[x for x in self.keys + self.values if x is not None])

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

    def release(self, slot: int, tokens=None) -> None:
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

    def release(self, slot: int, tokens=None) -> None:
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


class PagedLayer:
    def __init__(self, keys, values, cache, batch):
        self.keys, self.values, self.cache, self.batch = keys, values, cache, batch
        self.store = None  # no tensor in [slot, position] layout: kernels gather (`batch_rows`)

    def batch_rows(self, ops):
        """The pass's (padded pool rows, row -> sequence index, S_max): see PagedKVCache.batch_rows."""
        return self.cache.batch_rows(ops, self.batch)

    def sequence(self, ops, b: int):
        rows = self.cache.pass_rows(ops, self.batch)[b]
        n = self.keys.shape[0] * self.keys.shape[1]
        return (ops.gather_rows(ops.reshape(self.keys, n, self.cache.width), rows),
                ops.gather_rows(ops.reshape(self.values, n, self.cache.width), rows))


class PagedKVCache(_Slots):
    """Fixed-size blocks of `block_size` positions in one pool per layer ([blocks, block_size, KV*D]
    for keys and for values) and a block table per slot, so sequences take memory a block at a time
    and blocks can be shared: a finished sequence's full blocks stay cached under a hash of their
    tokens and everything before them, and a new sequence whose prompt starts with the same tokens
    takes them instead of prefilling them again (`match_prefix`); unreferenced cached blocks are
    evicted least-recently-used when the pool is full. With `max_blocks` the pool never grows past it
    (the server's memory budget); otherwise it doubles when full.

    Attention reads a sequence's keys and values gathered from its blocks (`sequence`), so every
    fused-attention override meets the per-head reference on the same gathered rows."""

    name = "paged"
    BLOCK_SIZE = 16

    def __init__(self, ops, n_layers: int, width: int, step: int = 0, block_size: int = BLOCK_SIZE,
                 max_blocks: int | None = None):
        super().__init__()
        self.ops, self.n_layers, self.width, self.block_size = ops, n_layers, width, block_size
        self.max_blocks = max_blocks
        self.keys: list = [None] * n_layers
        self.values: list = [None] * n_layers
        self.n_blocks = 0
        self.tables: dict[int, list[int]] = {}  # slot -> its blocks, in position order
        self.refs: list[int] = []  # block -> sequences using it
        self.free: list[int] = []
        self.block_of: dict[int, int] = {}  # prefix hash -> cached block
        self.hash_of: dict[int, int] = {}  # cached block -> its prefix hash
        self.lru: dict[int, None] = {}  # cached blocks no sequence uses, least recently used first
        self.hits = 0  # prompt tokens served from cached blocks
        self._rows = (None, None)
        self._decode_rows = (None, None)  # (S_max and the block tables, their padded pool rows): decode_index

    # -- blocks ------------------------------------------------------------------------------
    def _grow(self, n_blocks: int) -> None:
        _resize_stores(self.ops, self.keys, self.values, n_blocks, self.block_size, self.width)
        self.free.extend(range(n_blocks - 1, self.n_blocks - 1, -1))
        self.refs.extend([0] * (n_blocks - self.n_blocks))
        self.n_blocks = n_blocks

    def _take(self) -> int:
        if not self.free and self.lru:  # evict the least recently used cached block
            block = next(iter(self.lru))
            del self.lru[block], self.block_of[self.hash_of.pop(block)]
            self.free.append(block)
        if not self.free:
            if self.max_blocks is not None and self.n_blocks >= self.max_blocks:
                raise RequestError(f"KV cache full: all {self.n_blocks} blocks of {self.block_size} positions in use")
            limit = self.max_blocks if self.max_blocks is not None else float("inf")
            self._grow(int(min(limit, max(16, 2 * self.n_blocks))))
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.lru[block] = None
            else:
                self.free.append(block)

    @property
    def blocks_used(self) -> int:
        return sum(1 for r in self.refs if r > 0)

    @property
    def blocks_cached(self) -> int:
        return len(self.lru)

    def _hashes(self, tokens):
        """The prefix hash of each full block of `tokens`: its tokens and everything before them."""
        h, b = 0, self.block_size
        for i in range(len(tokens) // b):
            h = hash((h, tuple(tokens[i * b:(i + 1) * b])))
            yield h

    # -- slots -------------------------------------------------------------------------------
    def alloc(self) -> int:
        slot = super().alloc()
        self.tables[slot] = []
        return slot

    def match_prefix(self, slot: int, prompt) -> int:
        """Give a fresh slot the cached blocks its prompt starts with (leaving at least one prompt token
        to prefill, whose logits the first token needs); returns the tokens it now holds."""
        table = self.tables[slot]
        if table or self.held[slot]:
            raise RequestError(f"KV cache slot {slot} is not fresh")
        for h in self._hashes(list(prompt)[:len(prompt) - 1]):
            block = self.block_of.get(h)
            if block is None:
                break
            self.lru.pop(block, None)
            self.refs[block] += 1
            table.append(block)
        self.held[slot] = len(table) * self.block_size
        self.hits += self.held[slot]
        return self.held[slot]

    def release(self, slot: int, tokens=None) -> None:
        """Free a slot. With `tokens` (what its cache rows hold, in order) its full blocks stay cached
        for later prompts that start with the same tokens."""
        held = self.held.get(slot, 0)
        super().release(slot)
        table = self.tables.pop(slot)
        if tokens is not None:
            for block, h in zip(table, self._hashes(list(tokens)[:held])):
                if h not in self.block_of and block not in self.hash_of:
                    self.block_of[h], self.hash_of[block] = block, h
        for block in table:
            self._drop(block)

    def reserve(self, batch) -> None:
        self.check(batch)
        for slot, n in zip(batch.slots, batch.kv_lens):
            table = self.tables[slot]
            while len(table) * self.block_size < n:
                table.append(self._take())
            self.held[slot] = n

    def _targets(self, batch) -> tuple[list, list]:
        """The pool (block, offset) each row of the pass is written to (host lists)."""
        bs = self.block_size
        blocks, offsets = [], []
        for slot, start, n in zip(batch.slots, batch.starts, batch.lengths):
            table = self.tables[slot]
            blocks += [table[p // bs] for p in range(start, start + n)]
            offsets += [p % bs for p in range(start, start + n)]
        return blocks, offsets

    def _pool_rows(self, slot: int, n: int) -> list:
        """The pool rows (block * block_size + offset) of positions 0..n-1 of `slot`'s sequence."""
        bs = self.block_size
        return [b * bs + o for b in self.tables[slot] for o in range(bs)][:n]

    def _index(self, ops, batch) -> dict:
        """Built once per pass: the pool (block, offset) each row of the pass is written to (slices of
        one array, `pack_index_arrays`), and per sequence the pool rows of its positions 0..S-1 (host
        lists; arrays on request, `pass_rows`). A compiled decode step's batch brings its own
        (`decode_index`, traced inputs)."""
        traced = getattr(batch, "paged_index", None)
        if traced is not None:
            return traced
        if self._rows[0] is not batch:
            blocks, offsets = self._targets(batch)
            lists = [self._pool_rows(slot, total) for slot, total in zip(batch.slots, batch.kv_lens)]
            _, (blocks, offsets) = pack_index_arrays(ops, (blocks, offsets))
            self._rows = (batch, dict(blocks=blocks, offsets=offsets, lists=lists))
        return self._rows[1]

    def batch_rows(self, ops, batch):
        """For kernels that take the whole batch at once: (pool rows of every sequence's positions
        0..S_max-1, padded, [B * S_max]; each query row's sequence index [N]; S_max). Built on first
        request in a pass."""
        index = self._index(ops, batch)
        if "padded" not in index:
            s_max = max(batch.kv_lens)
            padded = zero_padded(index["lists"], [s_max] * len(index["lists"]))  # past a length: never read
            row_seq = [b for b, n in enumerate(batch.lengths) for _ in range(n)]
            _, (padded, row_seq) = pack_index_arrays(ops, (padded, row_seq))
            index.update(padded=(padded, row_seq, s_max))
        return index["padded"]

    def decode_index(self, ops, batch, bucket: int = 256) -> tuple:
        """The host-built arrays a compiled decode step takes: (blocks, offsets) the rows are written
        to, and (padded pool rows, row -> sequence) of every sequence's positions 0..S_max-1 with S_max
        rounded up to `bucket`, so that the step's shapes change once per `bucket` positions, not per
        token (the kernel reads each row only up to its length: the padding is never read). The
        padded rows follow the block tables alone (positions past a table's blocks: 0), so they are
        made again only when a table or S_max changes, not every step (one array, which then stays
        where the GPU read it); the other three are slices of one array (`pack_index_arrays`)."""
        s_max = bucket * -(-max(batch.kv_lens) // bucket)
        tables = (s_max, tuple(tuple(self.tables[slot]) for slot in batch.slots))
        if self._decode_rows[0] != tables:
            padded = zero_padded([self._pool_rows(slot, s_max) for slot in batch.slots], [s_max] * len(batch))
            self._decode_rows = (tables, ops.index_array(padded))
        _, (blocks, offsets, row_seq) = pack_index_arrays(ops, (*self._targets(batch), list(range(len(batch)))))
        return blocks, offsets, self._decode_rows[1], row_seq

    def pass_rows(self, ops, batch) -> list:
        index = self._index(ops, batch)
        if "rows" not in index:
            index["rows"] = [ops.index_array(r) for r in index["lists"]]
        return index["rows"]

    def update(self, ops, layer: int, k, v, batch) -> PagedLayer:
        index = self._index(ops, batch)
        blocks, offsets = index["blocks"], index["offsets"]
        self.keys[layer] = ops.scatter_rows(self.keys[layer], blocks, offsets, k)
        self.values[layer] = ops.scatter_rows(self.values[layer], blocks, offsets, v)
        return PagedLayer(self.keys[layer], self.values[layer], self, batch)

    def nbytes(self) -> int:
        return 2 * self.n_layers * self.n_blocks * self.block_size * self.width * 4

    def arrays(self) -> list:
        return [x for x in self.keys + self.values if x is not None]


KV_CACHES = {"prealloc": PreallocKVCache, "basic": BasicKVCache, "paged": PagedKVCache}
