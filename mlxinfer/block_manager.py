"""The paged KV cache's bookkeeping: block tables, reference counts, prefix lookup, LRU eviction.

Pure bookkeeping over block ids (no tensors: `kv_cache.PagedKVCache` owns the storage and asks this
class which pool rows a pass writes and reads). As nano-vllm's block manager:

- each sequence (a cache slot) has a block table, its blocks in position order;
- a block is used by `refs` sequences; at 0 it is free, or, if it holds a full block of a sequence's
  tokens, *cached*: kept for a later prompt that starts with the same tokens, and evicted
  least-recently-used when the pool has no free block;
- a block is *published* (findable by later prompts) as soon as it is full and written (`publish`),
  while its sequence still runs: its values are final then, so a prompt that extends a running
  sequence's prefix shares its blocks (one more reference each) instead of prefilling them again;
- a cached block is found by a hash of its tokens and of everything before them, and then **its token
  ids and its parent are compared**: a hash collision is a miss, never a wrong share. The parent is
  compared by identity, (block id, version), where the version counts the block's reuses, so a parent
  that was evicted and refilled with other tokens is not taken for the old one.

`hash_fn` is injectable so a test can make every hash collide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .errors import RequestError


def prefix_hash(parent: int, tokens: tuple) -> int:
    """The lookup key of a full block: its tokens and the key of the block before it (0 for the first)."""
    return hash((parent, tokens))


@dataclass
class Block:
    refs: int = 0  # sequences using it
    version: int = 0  # times it was taken fresh: (id, version) names its contents
    key: int | None = None  # prefix hash while cached
    tokens: tuple = ()  # its tokens while cached
    parent: tuple | None = None  # (id, version) of the block before it while cached; None for a first block


class BlockManager:
    def __init__(self, block_size: int, grow: Callable[[int], None], max_blocks: int | None = None,
                 hash_fn: Callable[[int, tuple], int] = prefix_hash):
        """`grow(n)` is called when the pool must hold n blocks (the storage resizes); with `max_blocks`
        the pool never grows past it."""
        self.block_size, self.max_blocks, self.hash_fn, self._grow = block_size, max_blocks, hash_fn, grow
        self.blocks: list[Block] = []
        self.free: list[int] = []
        self.tables: dict[int, list[int]] = {}  # slot -> its blocks, in position order
        # slot -> (its first blocks published, the prefix hash and (id, version) of the last of them);
        # None once one of its blocks could not be published (nothing after it is reachable)
        self.published: dict[int, tuple | None] = {}
        self.cached: dict[int, int] = {}  # prefix hash -> cached block
        self.lru: dict[int, None] = {}  # cached blocks no sequence uses, least recently used first
        self.hits = 0  # prompt tokens served from cached blocks

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def used(self) -> int:
        return sum(1 for b in self.blocks if b.refs > 0)

    @property
    def n_cached(self) -> int:
        """Cached blocks no sequence uses (evictable)."""
        return len(self.lru)

    # -- blocks ---------------------------------------------------------------------------------
    def _take(self) -> int:
        if not self.free and self.lru:  # evict the least recently used cached block
            bid = next(iter(self.lru))
            self._uncache(bid)
            self.free.append(bid)
        if not self.free:
            n = len(self.blocks)
            if self.max_blocks is not None and n >= self.max_blocks:
                raise RequestError(f"KV cache full: all {n} blocks of {self.block_size} positions in use")
            grown = max(16, 2 * n) if self.max_blocks is None else min(self.max_blocks, max(16, 2 * n))
            self._grow(grown)
            self.blocks += [Block() for _ in range(grown - n)]
            self.free.extend(range(grown - 1, n - 1, -1))
        bid = self.free.pop()
        block = self.blocks[bid]
        block.refs, block.version = 1, block.version + 1
        return bid

    def _uncache(self, bid: int) -> None:
        block = self.blocks[bid]
        del self.lru[bid], self.cached[block.key]
        block.key, block.tokens, block.parent = None, (), None

    def _drop(self, bid: int) -> None:
        block = self.blocks[bid]
        block.refs -= 1
        if block.refs == 0:
            if block.key is not None:
                self.lru[bid] = None
            else:
                self.free.append(bid)

    def _full_blocks(self, tokens):
        """(prefix hash, tokens) of each full block of `tokens`, in order."""
        key, b = 0, self.block_size
        for i in range(len(tokens) // b):
            part = tuple(tokens[i * b:(i + 1) * b])
            key = self.hash_fn(key, part)
            yield key, part

    # -- tables -----------------------------------------------------------------------------------
    def new_table(self, slot: int) -> None:
        self.tables[slot] = []
        self.published[slot] = (0, 0, None)

    def match_prefix(self, slot: int, prompt, accept: Callable[[int], bool] = lambda held: True) -> int:
        """Give a fresh table the cached blocks its prompt starts with (leaving at least one prompt
        token to prefill, whose logits the first token needs, and as many as `accept(positions)`
        allows, blocks dropped from the end until it does); returns the positions it now holds."""
        table = self.tables[slot]
        if table:
            raise RequestError(f"KV cache slot {slot} is not fresh")
        found, parent = [], None  # (block, its prefix hash)
        for key, tokens in self._full_blocks(list(prompt)[:len(prompt) - 1]):
            bid = self._lookup(key, tokens, parent)
            if bid is None:
                break
            found.append((bid, key))
            parent = (bid, self.blocks[bid].version)
        while found and not accept(len(found) * self.block_size):
            found.pop()
        for bid, _ in found:
            self.lru.pop(bid, None)
            self.blocks[bid].refs += 1
            table.append(bid)
        if found:
            bid, key = found[-1]
            self.published[slot] = (len(found), key, (bid, self.blocks[bid].version))
        held = len(table) * self.block_size
        self.hits += held
        return held

    def _lookup(self, key: int, tokens: tuple, parent) -> int | None:
        """The cached block holding `tokens` after the block `parent` names, or None (a hash that
        matches another block's is a miss)."""
        bid = self.cached.get(key)
        if bid is None:
            return None
        block = self.blocks[bid]
        return bid if block.tokens == tokens and block.parent == parent else None

    def fork(self, src: int, dst: int, n_positions: int) -> tuple[int, int] | None:
        """Give a fresh table what the first n_positions of `src` hold: its full blocks shared (one more
        reference each), and a block of its own for a partial last one, returned as (src's block, the
        new block) for the storage to copy (None when there is none)."""
        table, full = self.tables[dst], n_positions // self.block_size
        if table:
            raise RequestError(f"KV cache slot {dst} is not fresh")
        for bid in self.tables[src][:full]:
            self.blocks[bid].refs += 1
            table.append(bid)
        state = self.published[src]
        self.published[dst] = state if state is None or state[0] <= full else (0, 0, None)
        if n_positions % self.block_size == 0:
            return None
        table.append(self._take())
        return self.tables[src][full], table[-1]

    def extend(self, slot: int, n_positions: int) -> None:
        """Blocks for the table to hold n_positions."""
        table = self.tables[slot]
        while len(table) * self.block_size < n_positions:
            table.append(self._take())

    def publish(self, slot: int, tokens) -> None:
        """Make the full blocks of a live table findable by later prompts; `tokens`: what its first
        positions hold, all of them written (a block's values are final once it is full and written).
        Blocks published before are not looked at again."""
        state, table, b = self.published[slot], self.tables[slot], self.block_size
        if state is None:
            return
        done, key, parent = state
        for i in range(done, min(len(tokens) // b, len(table))):
            part = tuple(tokens[i * b:(i + 1) * b])
            key = self.hash_fn(key, part)
            block = self.blocks[table[i]]
            if block.key is None and key not in self.cached:
                block.key, block.tokens, block.parent = key, part, parent
                self.cached[key] = table[i]
            found = self._lookup(key, part, parent)  # the block later prompts will reach here
            if found is None:  # (another block holds this hash): nothing after it is reachable
                self.published[slot] = None
                return
            parent = (found, self.blocks[found].version)
            done = i + 1
        self.published[slot] = (done, key, parent)

    def release(self, slot: int, tokens=None) -> None:
        """Drop a table. With `tokens` (what its positions hold, in order) its full blocks stay cached
        for later prompts that start with the same tokens (those published while it ran stay too)."""
        if tokens is not None:
            self.publish(slot, tokens)
        table = self.tables.pop(slot)
        del self.published[slot]
        for bid in table:
            self._drop(bid)

    # -- the pool rows of a pass ------------------------------------------------------------------
    def targets(self, slot: int, start: int, n: int) -> tuple[list, list]:
        """The (block, offset) positions start .. start+n-1 of `slot` are written to."""
        bs, table = self.block_size, self.tables[slot]
        return [table[p // bs] for p in range(start, start + n)], [p % bs for p in range(start, start + n)]

    def pool_rows(self, slot: int, n: int) -> list:
        """The pool rows (block * block_size + offset) of positions 0..n-1 of `slot` (fewer where its
        table holds fewer)."""
        bs = self.block_size
        return [b * bs + o for b in self.tables[slot] for o in range(bs)][:n]
