"""The KV cache: the keys and values of every position each sequence has seen, per layer.

Models see one interface: `cache.update(ops, layer, k, v, batch)` writes the pass's rows and returns a
layer view whose `sequence(ops, b)` gives sequence b's [S, KV*D] keys and values (the per-head
reference reads them that way), whose `store` is the cache's own tensor for kernels that address it
directly (or None) and whose `batch` is the pass as that layer's rows are addressed: the pass itself,
or for a windowed layer's store the pass with positions and lengths counted from each slot's origin
(attention reads the view's batch: the mask compares differences of positions, which the shift keeps). Slots are the cache's unit of ownership: `alloc()` gives a free one to a new
sequence, `release(slot, tokens)` returns it; `reserve(batch)` makes room before a pass.

- `PreallocKVCache` (the default): per layer one [slots, capacity, KV*D] tensor for keys and one for
  values, written in place at (slot, position) by `scatter_rows`. Capacity grows in steps of `step`
  tokens (a prompt reserves its whole length at once) and shrinks again when the longest sequence is
  released, so memory follows the tokens held: slots x longest sequence, rounded up to a step.
  Sliding-window layers (Gemma's; `windows`) keep only the positions a query can still see: each
  slot's rows there start at an origin, a multiple of `step` that follows the window, and their
  capacity is about window + pass rows, not the sequence (mlx-lm's RotatingKVCache, llama.cpp's SWA cache).
- `PagedKVCache` (`--kv paged`, the server's default): a pool of fixed-size blocks per layer; which
  blocks a sequence holds, which are shared and which stay cached for prefix reuse is the
  `BlockManager`'s bookkeeping (`mlxinfer.block_manager`); this class owns the tensors and the index
  arrays a pass reads.
- `BasicKVCache` (the book's first cache, kept for comparison with `--kv basic`): per slot and layer a
  tensor grown by `concat_dim0`, which copies the whole tensor every step (O(S) per token per layer).

The compiled decode step (`mlxinfer.decode_step`) sees a cache through one interface, which the caches
with `compiles = True` implement: `step_inputs(ops, batch)` (the index arrays the step takes besides the
stores), `step_cache(keys, values, inputs)` (a cache that writes the traced stores with those arrays:
nothing in it comes from the host) and `set_stores(keys, values)` (the step's written stores adopted).
"""

from __future__ import annotations

import math

import numpy as np

from .batch import pack_index_arrays, zero_padded
from .block_manager import BlockManager, prefix_hash
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

    compiles = False  # implements the compiled decode step's interface (see the module docstring)
    step_config = frozenset()  # what the step's cache depends on besides its inputs (`step_cache`'s config)
    forks = False  # `fork` gives a slot another's positions without computing them again

    def __init__(self):
        self.held: dict[int, int] = {}  # slot -> tokens held
        self.expected: dict[int, int] = {}  # slot -> tokens announced (a prompt's length)

    def next_slot(self) -> int:
        """The slot `alloc` gives next: the lowest free one."""
        return self.next_slots(1)[0]

    def next_slots(self, n: int) -> list[int]:
        """The slots n calls of `alloc` give next."""
        return [i for i in range(len(self.held) + n) if i not in self.held][:n]

    def alloc(self) -> int:
        slot = self.next_slot()
        self.held[slot] = 0
        return slot

    def nbytes_for(self, lengths: dict[int, int]) -> int:
        """Bytes the stores take when each slot s holds lengths[s] tokens, with this cache's own rounding
        (what a memory budget has to count)."""
        raise NotImplementedError

    def _bytes(self, positions: int) -> int:
        """Keys and values of every layer at `positions` cache positions, in the backend's stored type."""
        return self._layer_bytes(self.n_layers * positions)

    def _layer_bytes(self, layer_positions: int) -> int:
        """Keys and values of `layer_positions` positions summed over the layers, in the stored type."""
        return math.ceil(2 * layer_positions * self.width * self.ops.kv_value_bytes)

    def release(self, slot: int, tokens=None) -> None:
        """Free a slot (`tokens`, what its rows hold, matters only to a cache that keeps prefixes)."""
        if slot not in self.held:
            raise RequestError(f"KV cache slot {slot} is not in use")
        del self.held[slot]
        self.expected.pop(slot, None)

    def expect(self, slot: int, n_tokens: int) -> None:
        """Announce that `slot` will soon hold `n_tokens` (a prompt): room is made once, not per chunk."""
        self.expected[slot] = n_tokens

    def match_prefix(self, slot: int, prompt, accept=None) -> int:
        """The prompt tokens a fresh slot already holds from the cache (only the paged cache keeps any)."""
        return 0

    def resume(self, slot: int, tokens, prompt) -> tuple[int, int]:
        """A held slot (whose rows hold `tokens`, in order) continued by `prompt`: the rows past the longest
        start they share are dropped (leaving at least one prompt token to prefill). Returns (slot, tokens
        it holds now). A conversation's next turn prefills only what its prompt adds."""
        shared = 0
        for a, b in zip(list(tokens)[:len(prompt) - 1], prompt):
            if a != b:
                break
            shared += 1
        self._truncate(slot, shared)
        return slot, shared

    def _truncate(self, slot: int, n: int) -> None:
        if not 0 <= n <= self.held.get(slot, -1):
            raise RequestError(f"KV cache slot {slot} holds {self.held.get(slot)} tokens, not {n} or more")
        self.held[slot] = n

    def publish(self, slot: int, tokens) -> None:
        """Offer a running slot's first positions, written and holding `tokens`, to later prompts (only
        the paged cache shares any)."""

    def check(self, batch) -> None:
        for slot, start in zip(batch.slots, batch.starts):
            if slot not in self.held:
                raise RequestError(f"KV cache slot {slot} is not in use")
            if start != self.held[slot]:
                raise RequestError(f"slot {slot} holds {self.held[slot]} tokens; the pass starts at {start}")

    @property
    def in_use(self) -> int:
        return len(self.held)

    def set_stores(self, keys, values) -> None:
        """Adopt the stores a compiled decode step wrote."""
        self.keys[:], self.values[:] = keys, values


# -- preallocated slots ----------------------------------------------------------------------------
class PreallocLayer:
    def __init__(self, keys, values, batch):
        self.keys, self.values, self.batch = keys, values, batch

    @property
    def store(self):
        return self.keys, self.values

    def sequence(self, ops, b: int):
        slot, n = self.batch.slots[b], self.batch.kv_lens[b]
        return ops.read_rows(self.keys, slot, n), ops.read_rows(self.values, slot, n)


class SlotStores:
    """Per layer a [slots, capacity, width] key and value store, written in place at each row's (slot,
    position): the preallocated cache's storage, and what its compiled decode step writes. The
    `windowed` layers' stores hold each slot's positions from its origin: `shift(ops, batch)` gives the
    pass as they address it (positions and lengths less the origins)."""

    def __init__(self, keys: list, values: list, windowed=frozenset(), shift=None):
        self.keys, self.values = keys, values
        self.windowed, self.shift = windowed, shift
        self._shifted = (None, None)  # (the pass, as the windowed stores address it)

    def update(self, ops, layer: int, k, v, batch) -> PreallocLayer:
        if layer in self.windowed:
            if self._shifted[0] is not batch:
                self._shifted = (batch, self.shift(ops, batch))
            batch = self._shifted[1]
        self.keys[layer] = ops.scatter_rows(self.keys[layer], batch.row_slots, batch.positions, k)
        self.values[layer] = ops.scatter_rows(self.values[layer], batch.row_slots, batch.positions, v)
        return PreallocLayer(self.keys[layer], self.values[layer], batch)


class PreallocKVCache(_Slots, SlotStores):
    name = "prealloc"
    compiles = True

    def __init__(self, ops, n_layers: int, width: int, step: int = 256, windows=None):
        """windows: each layer's sliding window (None: the layer sees every position), as the model's
        attention specs say; windowed layers keep only what their window can still show."""
        _Slots.__init__(self)
        windows = list(windows or [None] * n_layers)
        if len(windows) != n_layers:
            raise ValueError(f"{len(windows)} windows for {n_layers} layers")
        windowed = frozenset(i for i, w in enumerate(windows) if w)
        SlotStores.__init__(self, [None] * n_layers, [None] * n_layers, windowed,
                            None if not windowed else self._origin_batch)
        self.ops, self.n_layers, self.width, self.step = ops, n_layers, width, step
        self.window = max((w for w in windows if w), default=None)  # what the windowed layers keep
        self.origin: dict[int, int] = {}  # slot -> the position its windowed rows start at (a multiple of step)
        self.n_slots = 0
        self.capacity = 0  # positions a slot holds in the other layers
        self.window_capacity = 0  # positions a slot holds in the windowed layers
        self.pass_rows = 1  # the most rows a sequence has given one pass
        self._delta = (None, None)  # (slots and origins, their shift of a decode step's index arrays)

    @property
    def step_config(self):
        """What the compiled decode step's cache depends on besides its inputs: the windowed layers."""
        return self.windowed

    def _origin_batch(self, ops, batch):
        """The pass as the windowed stores address it: each sequence's positions less its slot's origin."""
        origins = [self.origin.get(slot, 0) for slot in batch.slots]
        return batch if not any(origins) else batch.shifted(origins)

    def _resize(self, n_slots: int, capacity: int, window_capacity: int) -> None:
        if (n_slots, capacity, window_capacity) == (self.n_slots, self.capacity, self.window_capacity):
            return
        if n_slots == 0:
            self.keys[:] = self.values[:] = [None] * self.n_layers
        else:
            for layers, c in (([i for i in range(self.n_layers) if i not in self.windowed], capacity),
                              (sorted(self.windowed), window_capacity)):
                keys, values = [self.keys[i] for i in layers], [self.values[i] for i in layers]
                _resize_stores(self.ops, keys, values, n_slots, c, self.width)
                for i, kx, vx in zip(layers, keys, values):
                    self.keys[i], self.values[i] = kx, vx
        self.n_slots, self.capacity, self.window_capacity = n_slots, capacity, window_capacity
        self.ops.sync(*[x for x in self.keys + self.values if x is not None])

    def _fit(self) -> None:
        """Size the stores to the slots in use and the longest sequence, rounded up to a step (the
        windowed layers: the longest run of positions a slot keeps there)."""
        if not self.held:
            self._resize(0, 0, 0)
            return
        n_slots = max(self.held) + 1
        longest = max(max(self.held.values()), max(self.expected.values(), default=0))
        capacity = self._capacity(longest)
        window_capacity = 0
        if self.windowed:  # a slot keeps at most window + step - 2 positions before a pass's rows: once
            # one holds a whole window that many (not fewer, then more again, as its origin moves on)
            most = self.window + self.step - 2 + self.pass_rows
            kept = [max(n, self.expected.get(s, 0)) - self.origin.get(s, 0) for s, n in self.held.items()]
            window_capacity = min(capacity, self._capacity(most if max(kept) >= self.window else max(kept)))
        if capacity > self.capacity or n_slots > self.n_slots or capacity + self.step <= self.capacity \
                or n_slots < self.n_slots or window_capacity > self.window_capacity \
                or window_capacity + self.step <= self.window_capacity:
            self._resize(n_slots, capacity, window_capacity)

    def release(self, slot: int, tokens=None) -> None:
        super().release(slot)
        self.origin.pop(slot, None)
        self._fit()

    def reserve(self, batch) -> None:
        """Room for the pass: every sequence's rows fit its slot (grows the stores if needed); in the
        windowed layers, the rows no row of this pass or a later one can see are dropped first."""
        self.check(batch)
        self.pass_rows = max(self.pass_rows, *batch.lengths)
        for slot, start, n in zip(batch.slots, batch.starts, batch.kv_lens):
            if self.windowed:
                self._advance(slot, start)
            self.held[slot] = n
        self._fit()
        if self.windowed and any(n - self.origin.get(s, 0) > self.window_capacity for s, n in self.held.items()):
            raise RuntimeError("a windowed KV store is shorter than a slot's rows")  # (a scatter past it corrupts)

    def _advance(self, slot: int, start: int) -> None:
        """Move a slot's windowed rows so that they start at the last multiple of `step` at or before the
        first position the pass's first row (at `start`) sees, start - window + 1."""
        old = self.origin.get(slot, 0)
        new = max(0, start - self.window + 1) // self.step * self.step
        if new <= old:
            return
        for i in self.windowed:
            for stores in (self.keys, self.values):
                stores[i] = self.ops.move_rows(stores[i], slot, new - old, start - new)
        self.origin[slot] = new

    def resume(self, slot: int, tokens, prompt) -> tuple[int, int]:
        """As `_Slots.resume`; where the windowed layers dropped positions the continuation would see
        (it starts before origin + window - 1), the slot starts over."""
        slot, shared = super().resume(slot, tokens, prompt)
        if self.windowed and shared and max(0, shared - self.window + 1) < self.origin.get(slot, 0):
            self._truncate(slot, 0)
            shared = 0
        return slot, shared

    def _truncate(self, slot: int, n: int) -> None:
        super()._truncate(slot, n)
        if n == 0:
            self.origin.pop(slot, None)

    def _capacity(self, longest: int) -> int:
        """Positions per slot for a longest sequence of `longest` tokens: rounded up to the step."""
        return self.step * max(1, math.ceil(longest / self.step))

    def nbytes(self) -> int:
        windowed = len(self.windowed)
        return self._layer_bytes(self.n_slots * ((self.n_layers - windowed) * self.capacity
                                                 + windowed * self.window_capacity))

    def nbytes_for(self, lengths: dict[int, int]) -> int:
        """Every slot up to the highest one in use, each as long as the longest sequence, rounded up (the
        windowed layers counted as the others: an upper bound)."""
        return self._bytes((max(lengths) + 1) * self._capacity(max(lengths.values())))

    def arrays(self) -> list:
        """The cache's tensors (what a pass that samples nothing produces)."""
        return [x for x in self.keys + self.values if x is not None]

    # -- the compiled decode step's interface --------------------------------------------------
    def step_inputs(self, ops, batch) -> tuple:
        """Nothing: the batch's own slots and positions say where each row goes; with windowed layers,
        what to take from the step's index arrays for them (each slot's origin: `Batch.shift_delta`),
        made again only when an origin moves."""
        if not self.windowed:
            return ()
        key = tuple((slot, self.origin.get(slot, 0)) for slot in batch.slots)
        if self._delta[0] != key:
            self._delta = (key, batch.shift_delta(ops, [o for _, o in key]))
        return (self._delta[1],)

    @staticmethod
    def step_cache(keys, values, inputs, config=frozenset()) -> SlotStores:
        if not config:
            return SlotStores(list(keys), list(values))
        (delta,) = inputs
        return SlotStores(list(keys), list(values), config, lambda ops, batch: batch.traced_shift(ops, delta))


# -- basic (concatenation) ---------------------------------------------------------------------------
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
        if ops.kv_dtype != ops.dtype_name:
            raise RequestError("--kv basic keeps the keys and values as the pass computed them: "
                               "a --kv-dtype other than --dtype needs --kv prealloc or paged")
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

    def _truncate(self, slot: int, n: int) -> None:
        super()._truncate(slot, n)
        for stores in self.entries[slot]:
            for layer, x in enumerate(stores):
                stores[layer] = None if n == 0 or x is None else self.ops.copy_2d_from(x, 0, n, 0, self.width)

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
        return self.nbytes_for(self.held)

    def nbytes_for(self, lengths: dict[int, int]) -> int:
        return self._bytes(sum(lengths.values()))

    def arrays(self) -> list:
        return [x for keys, values in self.entries.values() for x in keys + values if x is not None]


# -- paged -----------------------------------------------------------------------------------------
class PassRows:
    """The pool rows one pass writes and reads: each row's (block, offset) write target, and for the
    attention either every sequence's rows gathered at once (`padded`: positions 0..S_max-1 of each
    sequence, [B * S_max], with each query row's sequence index `row_seq`) or one sequence's
    (`sequence_rows`). Made from the block tables once per pass (`PagedKVCache.pass_rows`); a compiled
    decode step is handed its own as traced arrays (`PagedKVCache.step_cache`)."""

    def __init__(self, blocks, offsets, padded=None, lists=None, batch=None):
        self.blocks, self.offsets = blocks, offsets
        self.padded = padded  # (rows, row_seq, s_max), or built from `lists` on first use
        self.lists, self.batch = lists, batch  # each sequence's pool rows (host lists)
        self._arrays = {}

    def batch_rows(self, ops):
        if self.padded is None:
            s_max = max(self.batch.kv_lens)
            padded = zero_padded(self.lists, [s_max] * len(self.lists))  # past a length: never read
            row_seq = [b for b, n in enumerate(self.batch.lengths) for _ in range(n)]
            _, (padded, row_seq) = pack_index_arrays(ops, (padded, row_seq))
            self.padded = (padded, row_seq, s_max)
        return self.padded

    def sequence_rows(self, ops, b: int):
        if b not in self._arrays:
            self._arrays[b] = ops.index_array(self.lists[b])
        return self._arrays[b]


class PagedLayer:
    def __init__(self, keys, values, rows: PassRows, width: int, batch=None):
        self.keys, self.values, self.rows, self.width, self.batch = keys, values, rows, width, batch
        self.store = None  # no tensor in [slot, position] layout: kernels gather (`batch_rows`)

    def batch_rows(self, ops):
        """The pass's (padded pool rows, row -> sequence index, S_max): see PassRows."""
        return self.rows.batch_rows(ops)

    def sequence(self, ops, b: int):
        rows = self.rows.sequence_rows(ops, b)
        n = self.keys.shape[0] * self.keys.shape[1]
        return (ops.gather_rows(ops.reshape(self.keys, n, self.width), rows),
                ops.gather_rows(ops.reshape(self.values, n, self.width), rows))


class BlockStores:
    """Per layer a pool of [blocks, block_size, width] keys and values; a pass's rows written at their
    (block, offset) and read by pool rows (`PassRows`)."""

    def __init__(self, keys: list, values: list, rows: PassRows | None, width: int):
        self.keys, self.values, self.rows, self.width = keys, values, rows, width

    def update(self, ops, layer: int, k, v, batch) -> PagedLayer:
        rows = self.rows
        self.keys[layer] = ops.scatter_rows(self.keys[layer], rows.blocks, rows.offsets, k)
        self.values[layer] = ops.scatter_rows(self.values[layer], rows.blocks, rows.offsets, v)
        return PagedLayer(self.keys[layer], self.values[layer], rows, self.width, batch)


class PagedKVCache(_Slots):
    """Fixed-size blocks of `block_size` positions in one pool per layer ([blocks, block_size, KV*D]
    for keys and for values) and, through the `BlockManager`, a block table per slot, so sequences take
    memory a block at a time and blocks can be shared: a sequence's full prompt blocks, once written
    (`publish`, while it runs) and after it finishes, are cached, and a new sequence whose prompt starts
    with the same tokens takes them instead of prefilling them again (`match_prefix`). With `max_blocks` the pool never grows past it (the server's memory budget);
    otherwise it doubles when full.

    Attention reads a sequence's keys and values gathered from its blocks (`sequence`), so every
    fused-attention override meets the per-head reference on the same gathered rows."""

    name = "paged"
    compiles = True
    BLOCK_SIZE = 16

    def __init__(self, ops, n_layers: int, width: int, step: int = 0, block_size: int = BLOCK_SIZE,
                 max_blocks: int | None = None, hash_fn=prefix_hash, disk=None):
        """disk: a `prompt_cache.DiskPrefixCache` where full prompt blocks are kept across restarts."""
        super().__init__()
        self.disk = disk
        self.ops, self.n_layers, self.width, self.block_size = ops, n_layers, width, block_size
        self.keys: list = [None] * n_layers
        self.values: list = [None] * n_layers
        self.blocks = BlockManager(block_size, self._grow, max_blocks, hash_fn)
        self._pass = (None, None)  # (batch, its PassRows)
        self._decode_rows = (None, None)  # (S_max and the block tables, their padded pool rows): step_inputs

    def _grow(self, n_blocks: int) -> None:
        _resize_stores(self.ops, self.keys, self.values, n_blocks, self.block_size, self.width)

    @property
    def max_blocks(self) -> int | None:
        return self.blocks.max_blocks

    # -- slots -------------------------------------------------------------------------------
    def alloc(self) -> int:
        slot = super().alloc()
        self.blocks.new_table(slot)
        return slot

    def match_prefix(self, slot: int, prompt, accept=None) -> int:
        """Give a fresh slot the cached blocks its prompt starts with (leaving at least one prompt token
        to prefill, and no more than `accept(tokens)` allows); returns the tokens it now holds."""
        if self.held[slot]:
            raise RequestError(f"KV cache slot {slot} is not fresh")
        accept = accept or (lambda held: True)
        self.held[slot] = self.blocks.match_prefix(slot, prompt, accept)
        if self.disk is not None:
            self.held[slot] = self._load_blocks(slot, list(prompt), self.held[slot], accept)
        return self.held[slot]

    def resume(self, slot: int, tokens, prompt) -> tuple[int, int]:
        """The slot's full blocks kept as cached prefix blocks and a fresh slot given those `prompt` starts
        with (whole blocks: up to block_size - 1 shared tokens are prefilled again)."""
        self.release(slot, tokens)
        slot = self.alloc()
        return slot, self.match_prefix(slot, prompt)

    def _load_blocks(self, slot: int, prompt: list, held: int, accept) -> int:
        """After the blocks found in memory, those the disk keeps for the prompt's next positions (one
        token always left to prefill, and no more than `accept` allows): read into fresh blocks and
        published, as if prefilled here. Returns the tokens the slot now holds."""
        bs = self.block_size
        ends = []  # the ends of the blocks kept, consecutive from `held`
        for end in range(held + bs, len(prompt), bs):
            if not self.disk.has(prompt[:end]):
                break
            ends.append(end)
        while ends and not accept(ends[-1]):
            ends.pop()
        found = []
        for end in ends:
            block = self.disk.load(prompt[:end])
            if block is None:  # (corrupt: one warning, a miss)
                break
            found.append(block)
        while found and not accept(held + len(found) * bs):
            found.pop()
        if not found:
            return held
        try:
            self.blocks.extend(slot, held + len(found) * bs)
        except RequestError:  # no room in the pool now: prefill them instead
            return held
        ops, stacked = self.ops, np.concatenate(found, axis=2)  # [2, layers, n * block, width]
        blocks, offsets = self.blocks.targets(slot, held, len(found) * bs)
        blocks, offsets = ops.index_array(blocks), ops.index_array(offsets)
        for kv, stores in zip(stacked, (self.keys, self.values)):
            for layer, rows in enumerate(kv):
                stores[layer] = ops.scatter_rows(stores[layer], blocks, offsets, ops.from_numpy(rows))
        held += len(found) * bs
        self.blocks.publish(slot, prompt[:held])
        return held

    def _save_blocks(self, slot: int, tokens: list) -> None:
        """Keep the slot's full blocks of `tokens` (its prompt's, written) on disk, those not kept yet."""
        bs, table = self.block_size, self.blocks.tables[slot]
        ends = [e for e in range(bs, len(tokens) + 1, bs) if not self.disk.has(tokens[:e])]
        if not ends:
            return
        ops = self.ops
        rows = ops.index_array([table[e // bs - 1] * bs + o for e in ends for o in range(bs)])
        kv = np.stack([np.stack([ops.to_numpy(ops.gather_rows(ops.reshape(store, store.shape[0] * bs, self.width),
                                                              rows)) for store in stores])
                       for stores in (self.keys, self.values)])  # [2, layers, n * block, width]
        for i, end in enumerate(ends):
            self.disk.save(tokens[:end], kv[:, :, i * bs:(i + 1) * bs])

    forks = True

    def fork(self, src: int, dst: int, n_positions: int) -> None:
        """A fresh slot `dst` holds the first n_positions of `src` (n choices of one prompt): the full
        blocks shared, a partial last block copied (each copy then writes its own positions)."""
        if self.held[dst]:
            raise RequestError(f"KV cache slot {dst} is not fresh")
        copy = self.blocks.fork(src, dst, n_positions)
        if copy is not None:
            bs, ops = self.block_size, self.ops
            rows = ops.index_array([copy[0] * bs + o for o in range(bs)])
            blocks, offsets = ops.index_array([copy[1]] * bs), ops.index_array(list(range(bs)))
            for stores in (self.keys, self.values):
                for i, store in enumerate(stores):
                    read = ops.gather_rows(ops.reshape(store, store.shape[0] * bs, self.width), rows)
                    stores[i] = ops.scatter_rows(store, blocks, offsets, read)
        self.held[dst] = n_positions

    def publish(self, slot: int, tokens) -> None:
        """A running slot's full blocks among its first positions (written, holding `tokens`) are
        shared with later prompts from now on: their values are final."""
        self.blocks.publish(slot, tokens)

    def release(self, slot: int, tokens=None) -> None:
        """Free a slot. With `tokens` (what its cache rows hold, in order) its full blocks stay cached
        for later prompts that start with the same tokens."""
        held = self.held.get(slot, 0)
        if tokens is not None and self.disk is not None and slot in self.held:
            self._save_blocks(slot, list(tokens)[:held])
        super().release(slot)
        self.blocks.release(slot, None if tokens is None else list(tokens)[:held])

    def reserve(self, batch) -> None:
        self.check(batch)
        for slot, n in zip(batch.slots, batch.kv_lens):
            self.blocks.extend(slot, n)
            self.held[slot] = n

    # -- the pass's pool rows ------------------------------------------------------------------
    def _targets(self, batch) -> tuple[list, list]:
        blocks, offsets = [], []
        for slot, start, n in zip(batch.slots, batch.starts, batch.lengths):
            b, o = self.blocks.targets(slot, start, n)
            blocks += b
            offsets += o
        return blocks, offsets

    def pass_rows(self, ops, batch) -> PassRows:
        """The pass's write targets (slices of one array, `pack_index_arrays`) and each sequence's pool
        rows (host lists; arrays on request), built once per pass."""
        if self._pass[0] is not batch:
            _, (blocks, offsets) = pack_index_arrays(ops, self._targets(batch))
            lists = [self.blocks.pool_rows(slot, total) for slot, total in zip(batch.slots, batch.kv_lens)]
            self._pass = (batch, PassRows(blocks, offsets, lists=lists, batch=batch))
        return self._pass[1]

    def update(self, ops, layer: int, k, v, batch) -> PagedLayer:
        return BlockStores(self.keys, self.values, self.pass_rows(ops, batch), self.width).update(ops, layer, k, v,
                                                                                                  batch)

    # -- the compiled decode step's interface --------------------------------------------------
    def step_inputs(self, ops, batch, bucket: int = 256) -> tuple:
        """(blocks, offsets) the rows are written to, and (padded pool rows, row -> sequence) of every
        sequence's positions 0..S_max-1 with S_max rounded up to `bucket`, so that the step's shapes
        change once per `bucket` positions, not per token (the kernel reads each row only up to its
        length: the padding is never read). The padded rows follow the block tables alone (positions
        past a table's blocks: 0), so they are made again only when a table or S_max changes, not every
        step (one array, which then stays where the GPU read it); the other three are slices of one
        array (`pack_index_arrays`)."""
        s_max = bucket * -(-max(batch.kv_lens) // bucket)
        tables = (s_max, tuple(tuple(self.blocks.tables[slot]) for slot in batch.slots))
        if self._decode_rows[0] != tables:
            padded = zero_padded([self.blocks.pool_rows(slot, s_max) for slot in batch.slots], [s_max] * len(batch))
            self._decode_rows = (tables, ops.index_array(padded))
        _, (blocks, offsets, row_seq) = pack_index_arrays(ops, (*self._targets(batch), list(range(len(batch)))))
        return blocks, offsets, self._decode_rows[1], row_seq

    @staticmethod
    def step_cache(keys, values, inputs, config=frozenset()) -> BlockStores:
        blocks, offsets, padded, row_seq = inputs  # one entry a sequence (a decode row each), but padded
        rows = PassRows(blocks, offsets, padded=(padded, row_seq, padded.shape[0] // blocks.shape[0]))
        return BlockStores(list(keys), list(values), rows, keys[0].shape[2])

    # -- reporting -----------------------------------------------------------------------------
    def nbytes(self) -> int:
        return self._bytes(self.blocks.n_blocks * self.block_size)

    def nbytes_for(self, lengths: dict[int, int]) -> int:
        """Whole blocks per sequence (blocks shared with a cached prefix counted as its own: an upper bound)."""
        bs = self.block_size
        return self._bytes(sum(-(-n // bs) * bs for n in lengths.values()))

    def arrays(self) -> list:
        return [x for x in self.keys + self.values if x is not None]


KV_CACHES = {"prealloc": PreallocKVCache, "basic": BasicKVCache, "paged": PagedKVCache}
