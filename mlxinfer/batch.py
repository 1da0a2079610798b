"""The layout of one forward pass: which sequences it advances, and by how many rows each.

A pass advances B sequences. Sequence b owns cache slot `slots[b]`, already holds `starts[b]` tokens in
its cache, and contributes `lengths[b]` consecutive rows to the pass (a prefill chunk: many; a decode
step: one). The rows of all sequences are packed one sequence after another into N = sum(lengths)
rows, the activations' first dimension; sequence b's rows sit at positions starts[b] .. starts[b] +
lengths[b] - 1. After the pass, its cache holds kv_lens[b] = starts[b] + lengths[b] tokens.

The host lists drive loops that are per sequence by nature (the per-head reference attention, the cpu
backend's per-sequence products); the backend arrays (`positions`, `row_slots`, `row_lens`, `logit_rows`: one entry per row)
are what kernels and a compiled step read, so no position or length is baked into a graph.
"""

from __future__ import annotations

from itertools import accumulate

from .errors import RequestError


MIN_INDEX_ENTRIES = 4  # MLX's CUDA allocator keeps arrays of up to 8 bytes (two int32) in its small pool
# of host memory, which the GPU reads across the bus: every kernel that reads one row's slot, position
# or length of a one-sequence decode step waited on it (H200, 2026-11-30 20:50 UTC, bench/decode_attention.py
# --gpu-clock, one row: 19.6 / 35.5 / 62.8 / 246.0 us at 512 / 2,048 / 8,192 / 32,768 keys; the same rows
# padded to 4 entries: 8.9 / 13.2 / 42.3 / 226.2). Every index array is a slice of one `packed` array
# of at least 4 x MIN_INDEX_ENTRIES int32.


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
        self._arrays = None  # (positions, row_slots, row_lens, logit_rows): made on first use (`packed`)
        self._per_sequence: dict[int, object] = {}
        self.traced = False  # True in the batch a compiled step is traced with (decode_template)

    @classmethod
    def decode_template(cls, ops, n: int, positions, row_slots, row_lens, logit_rows=None):
        """The batch a compiled decode step is traced with: n sequences of one row each, every array
        given (traced inputs), no host value that the graph could depend on (its slots, starts and
        lengths are placeholders: a compiled step reads only the arrays)."""
        b = cls(ops, list(range(n)), [0] * n, [1] * n)
        if logit_rows is None:  # every row samples (a decode step): rows 0..n-1
            logit_rows = ops.index_array(list(range(n)) + [0] * max(0, MIN_INDEX_ENTRIES - n))[:n]
        b._arrays = (positions, row_slots, row_lens, logit_rows, None)
        b.traced = True
        b.slots = b.starts = b.kv_lens = b._positions_host = None  # placeholders: reading them fails
        return b

    @property
    def packed(self):
        """The pass's four index arrays in one: [positions | row_slots | row_lens | logit_rows], each
        `width` (index_width) entries, zero-padded; made from the host lists once, on first use, as
        one array (one transfer), of which `positions` etc. are slices."""
        if self._arrays is None:
            w = self.index_width
            packed = [0] * (4 * w)
            for i, values in enumerate(self._host_rows):
                packed[i * w:i * w + len(values)] = values
            whole = self._ops.index_array(packed)
            self._arrays = tuple(whole[i * w:i * w + len(v)] for i, v in enumerate(self._host_rows)) + (whole,)
        return self._arrays[4]

    @property
    def index_width(self) -> int:
        """Entries per index array in `packed`: at least MIN_INDEX_ENTRIES (see there)."""
        return max(self.n_rows, self.n_logit_rows, MIN_INDEX_ENTRIES)

    def _index(self, i: int):
        if self._arrays is None:
            self.packed
        return self._arrays[i]

    positions = property(lambda self: self._index(0), doc="each row's position (index array)")
    row_slots = property(lambda self: self._index(1), doc="each row's cache slot")
    row_lens = property(lambda self: self._index(2), doc="each row's sequence length after this pass")
    logit_rows = property(lambda self: self._index(3), doc="the rows whose logits are computed")

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
