"""The layout of one forward pass: which sequences it advances, and by how many rows each.

A pass advances B sequences. Sequence b owns cache slot `slots[b]`, already holds `starts[b]` tokens in
its cache, and contributes `lengths[b]` consecutive rows to the pass (a prefill chunk: many; a decode
step: one). The rows of all sequences are packed one sequence after another into N = sum(lengths)
rows, the activations' first dimension; sequence b's rows sit at positions starts[b] .. starts[b] +
lengths[b] - 1. After the pass, its cache holds kv_lens[b] = starts[b] + lengths[b] tokens.

The host lists drive loops that are per sequence by nature (the per-head reference attention, the cpu
backend's per-sequence products); the backend arrays (`positions`, `row_slots`, `row_lens`, `logit_rows`:
one entry per row; read-only, all slices of one `packed` array, `IndexArrays`) are what kernels and a
compiled step read, so no position or length is baked into a graph.
"""

from __future__ import annotations

from functools import cached_property
from itertools import accumulate
from typing import NamedTuple

from .errors import RequestError


MIN_INDEX_ENTRIES = 4  # MLX's CUDA allocator keeps arrays of up to 8 bytes (two int32) in its small pool
# of host memory, which the GPU reads across the bus: a kernel reading one row's slot, position or length
# then waits on it (2x the attention's time at 512 keys on the H200). So index arrays are made by
# `pack_index_arrays`, at least this many entries each.


def zero_padded(lists, widths) -> list:
    """The lists one after another, list i zero-padded to widths[i] entries."""
    return [v for x, w in zip(lists, widths) for v in list(x) + [0] * (w - len(x))]


def pack_index_arrays(ops, lists, width: int | None = None) -> tuple:
    """Index arrays made from host lists as slices of one array (one transfer), each list in a section of
    `width` entries (default: its own length), at least MIN_INDEX_ENTRIES, zero-padded.
    -> (the whole array, (each list's slice, ...))."""
    widths = [max(width or len(x), MIN_INDEX_ENTRIES) for x in lists]
    whole = ops.index_array(zero_padded(lists, widths))
    starts = accumulate([0] + widths[:-1])
    return whole, tuple(whole[a:a + len(x)] for a, x in zip(starts, lists))


class IndexArrays(NamedTuple):
    """A pass's index arrays, one entry per row (`logit_rows`: per sampled row), all slices of
    `packed` = [positions | row_slots | row_lens | logit_rows], each section `Batch.index_width` long."""

    packed: object
    positions: object  # each row's position
    row_slots: object  # each row's cache slot
    row_lens: object  # each row's sequence length after the pass
    logit_rows: object  # the rows whose logits are computed


class Batch:
    def __init__(self, ops, slots, starts, lengths, all_logits: bool = False, logits_for=None):
        if not (len(slots) == len(starts) == len(lengths)) or not slots:
            raise RequestError("a batch needs one slot, start and length per sequence, and at least one sequence")
        if min(lengths) < 1:
            raise RequestError("every sequence in a pass contributes at least one row")
        self.slots = tuple(int(s) for s in slots)
        self.starts = tuple(int(s) for s in starts)
        self.lengths = tuple(int(n) for n in lengths)
        ends = list(accumulate(self.lengths))
        self.rows = tuple(zip([0] + ends[:-1], ends))  # (r0, r1) of each sequence in the packed rows
        self.n_rows = ends[-1]
        self.kv_lens = tuple(s + n for s, n in zip(self.starts, self.lengths))
        self.all_logits = all_logits
        positions = [p for s, n in zip(self.starts, self.lengths) for p in range(s, s + n)]
        row_slots = [slot for slot, n in zip(self.slots, self.lengths) for _ in range(n)]
        if all_logits:  # every row's logits, each sequence's rows one group
            logit_rows = list(range(self.n_rows))
            self.logit_groups = self.rows
        else:  # the last row of each sequence that samples (`logits_for`; a mid-prompt chunk does not)
            wanted = [True] * len(self.slots) if logits_for is None else list(logits_for)
            logit_rows = [r1 - 1 for (_, r1), w in zip(self.rows, wanted) if w]
            self.logit_groups = tuple((i, i + 1) for i in range(len(logit_rows)))
        self.n_logit_rows = len(logit_rows)
        self._ops = ops
        self._positions_host = positions
        self._host_rows = (positions, row_slots, [n for n, k in zip(self.kv_lens, self.lengths) for _ in range(k)],
                           logit_rows)
        self._per_sequence: dict[int, object] = {}
        # each layer's output as the model builds it, where the loop will start this pass a few layers
        # at a time (`Loop._start`, PACE_MIN_ROWS); None: not recorded
        self.layer_outputs: list | None = None

    def layer_done(self, x) -> None:
        """The model has built a layer's output `x`: a point where the pass may be started in pieces
        (recorded only where the loop asked: `layer_outputs`)."""
        if self.layer_outputs is not None:
            self.layer_outputs.append(x)

    @classmethod
    def traced_decode(cls, ops, n: int, packed):
        """The batch a compiled decode step is traced with: n sequences of one row each, its index
        arrays the slices of `packed` (a traced input, laid out as `IndexArrays`), and no host value the
        graph could depend on: its slots, starts and lengths are None (reading them fails), so
        `max_kv_len` is None and a compiled step reads only the arrays."""
        b = cls(ops, list(range(n)), [0] * n, [1] * n)
        w = b.index_width
        b.index = IndexArrays(packed, *(packed[i * w:i * w + n] for i in range(4)))
        b.slots = b.starts = b.kv_lens = b._positions_host = None
        return b

    def shifted(self, offsets):
        """The same rows with sequence b's positions, start and length less offsets[b] (a windowed KV
        store whose rows start at position offsets[b]: `kv_cache.PreallocKVCache`)."""
        return Batch(self._ops, self.slots, [s - o for s, o in zip(self.starts, offsets)], self.lengths)

    def shift_delta(self, ops, offsets):
        """What `traced_shift` takes from a decode pass's packed index arrays for `shifted(offsets)`:
        the offsets in the positions' and the lengths' sections, zeros elsewhere."""
        if self.n_rows != len(self.lengths):
            raise ValueError("shift_delta is for decode passes (one row a sequence)")
        w, pad = self.index_width, [0] * (self.index_width - len(offsets))
        return ops.index_array([*offsets, *pad, *[0] * w, *offsets, *pad, *[0] * w])

    def traced_shift(self, ops, delta):
        """`shifted` of a decode pass from its index arrays alone (a compiled step's), `delta` from
        `shift_delta`."""
        return Batch.traced_decode(ops, len(self.lengths), self.packed - delta)

    @property
    def max_kv_len(self) -> int | None:
        """The longest sequence after the pass, or None where the lengths live only in the index arrays
        (a traced decode batch)."""
        return None if self.kv_lens is None else max(self.kv_lens)

    @classmethod
    def decode_step_delta(cls, ops, n: int):
        """What a decode step of n sequences adds to its packed index arrays to give the next step's:
        positions and lengths one more, slots and logit rows the same."""
        w = cls(ops, list(range(n)), [0] * n, [1] * n).index_width  # (no array is made)
        return ops.index_array([1] * w + [0] * w + [1] * w + [0] * w)

    @property
    def index_width(self) -> int:
        """Entries per section of the packed index arrays: at least MIN_INDEX_ENTRIES (see there)."""
        return max(self.n_rows, self.n_logit_rows, MIN_INDEX_ENTRIES)

    @cached_property
    def index(self) -> IndexArrays:
        """The pass's index arrays, made from the host lists on first use, as one array."""
        whole, arrays = pack_index_arrays(self._ops, self._host_rows, self.index_width)
        return IndexArrays(whole, *arrays)

    packed = property(lambda self: self.index.packed, doc="the four index arrays in one (IndexArrays)")
    positions = property(lambda self: self.index.positions, doc="each row's position (index array)")
    row_slots = property(lambda self: self.index.row_slots, doc="each row's cache slot")
    row_lens = property(lambda self: self.index.row_lens, doc="each row's sequence length after this pass")
    logit_rows = property(lambda self: self.index.logit_rows, doc="the rows whose logits are computed")

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def logits_of_every_row(self) -> bool:
        """The logit rows are all the rows, in order (no gather needed before the output head)."""
        return self.n_logit_rows == self.n_rows

    def positions_of(self, ops, b: int):
        """Index array of sequence b's query positions (its slice of `positions`)."""
        if b not in self._per_sequence:
            r0, r1 = self.rows[b]
            self._per_sequence[b] = ops.index_array(self._positions_host[r0:r1])
        return self._per_sequence[b]

    def __repr__(self):
        return f"Batch(slots={self.slots}, starts={self.starts}, lengths={self.lengths})"
