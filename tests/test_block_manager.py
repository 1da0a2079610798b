"""The paged cache's bookkeeping (`mlxinfer.block_manager`) driven by random sequences of admissions,
decode steps, publications (a running sequence's written blocks made findable) and releases, several
sequences live at once and sharing cached prefix blocks (finished or still running ones'), checked after
every step against a model of what each block holds.

The model writes each token into the (block, offset) the manager names for it; after every operation
every live sequence must read back its own tokens from its table (a block that another sequence could
write while this one still uses it fails that), reference counts equal the number of live tables holding
a block, and every block is exactly one of used, cached-and-idle or free. A tiny alphabet and block
size make prefixes collide often; a small pool makes eviction and a full cache happen.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlxinfer.block_manager import BlockManager
from mlxinfer.errors import RequestError

BLOCK = 2
MAX_BLOCKS = 10
TOKENS = st.integers(0, 2)  # three tokens: prompts share prefixes all the time


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = []  # block -> [token at each offset] (None: never written)
        self.m = BlockManager(BLOCK, self._grow, max_blocks=MAX_BLOCKS)
        self.live: dict[int, list] = {}  # slot -> the tokens its positions hold
        self.next_slot = 0

    def _grow(self, n):
        self.pool += [[None] * BLOCK for _ in range(n - len(self.pool))]

    def _write(self, slot, start, tokens):
        blocks, offsets = self.m.targets(slot, start, len(tokens))
        for b, o, t in zip(blocks, offsets, tokens):
            self.pool[b][o] = t

    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=9))
    def admit(self, prompt):
        slot, self.next_slot = self.next_slot, self.next_slot + 1
        self.m.new_table(slot)
        held = self.m.match_prefix(slot, prompt)
        assert held % BLOCK == 0 and held < len(prompt), "at least one prompt token is left to prefill"
        self.live[slot] = list(prompt[:held])
        self._check_reads(slot)  # the shared blocks hold this prompt's tokens
        try:
            self.m.extend(slot, len(prompt))
        except RequestError:  # cache full: the request fails and gives its blocks back
            self.m.release(slot)
            del self.live[slot]
            return
        self._write(slot, held, prompt[held:])
        self.live[slot] = list(prompt)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=TOKENS)
    def decode(self, data, token):
        slot = data.draw(st.sampled_from(sorted(self.live)))
        n = len(self.live[slot])
        try:
            self.m.extend(slot, n + 1)
        except RequestError:
            return
        self._write(slot, n, [token])
        self.live[slot].append(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def publish(self, data):
        """A running sequence's written full blocks become findable (the loop does this after each
        prefill chunk): later prompts share them while it still runs."""
        slot = data.draw(st.sampled_from(sorted(self.live)))
        self.m.publish(slot, self.live[slot])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), keep=st.booleans())
    def release(self, data, keep):
        slot = data.draw(st.sampled_from(sorted(self.live)))
        tokens = self.live.pop(slot)
        self.m.release(slot, tokens if keep else None)

    def _check_reads(self, slot):
        tokens, bs = self.live[slot], BLOCK
        table = self.m.tables[slot]
        read = [self.pool[table[p // bs]][p % bs] for p in range(len(tokens))]
        assert read == tokens, f"slot {slot} reads {read}, holds {tokens}"

    @invariant()
    def every_live_sequence_reads_its_own_tokens(self):
        for slot in self.live:
            self._check_reads(slot)

    @invariant()
    def counts_and_lists_agree(self):
        m = self.m
        in_tables = [0] * m.n_blocks
        for slot, table in m.tables.items():
            assert len(set(table)) == len(table), f"slot {slot}'s table holds a block twice"
            for b in table:
                in_tables[b] += 1
        assert [b.refs for b in m.blocks] == in_tables, "refs must count the live tables holding each block"
        free, lru = set(m.free), set(m.lru)
        assert len(free) == len(m.free) and not free & lru
        for bid, block in enumerate(m.blocks):
            idle = block.refs == 0
            assert idle == (bid in free or bid in lru), f"block {bid}: refs {block.refs}, free/cached disagree"
            if bid in lru:
                assert block.key is not None and m.cached[block.key] == bid
        for key, bid in m.cached.items():
            assert m.blocks[bid].key == key
            # findable blocks (running sequences' too) are full and hold exactly their tokens
            assert self.pool[bid] == list(m.blocks[bid].tokens), f"block {bid} is findable before it is written"
        assert m.n_blocks <= MAX_BLOCKS


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=300, derandomize=True, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
