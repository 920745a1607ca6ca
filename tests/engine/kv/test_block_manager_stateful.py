"""A hypothesis state machine over the block manager: allocate, append, fork, free, swap out/in
and mark_computed in random order, checking the invariants after every step.

Besides the bookkeeping, it simulates the KV cache itself: every token is written into the
slot the manager gave it, the (src, dst) copies the manager returns are performed, and every
sequence must read its own tokens back through its block table. A missed copy-on-write, a
wrong swap mapping or a prefix hit on a block holding other tokens shows up as a wrong read."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv.block_manager import BlockManager

BLOCK_SIZE = 4
NUM_BLOCKS = 24
NUM_CPU_BLOCKS = 12
# Shared prompt heads (lengths across block boundaries) so prefix-cache hits happen often.
PREFIXES: list[list[int]] = [[], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 7, 7, 7, 2, 2, 2, 2]]
ALPHABET = st.integers(min_value=0, max_value=3)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random operation sequences against a model of tokens per sequence and a simulated cache."""

    prefix_caching = True

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(
            NUM_BLOCKS,
            BLOCK_SIZE,
            NUM_CPU_BLOCKS,
            watermark=0.1,
            enable_prefix_caching=self.prefix_caching,
        )
        self.tokens: dict[int, list[int]] = {}  # expected tokens per live sequence
        self.family: dict[int, int] = {}  # seq -> the root it was forked from
        self.device_kv: list[int | None] = [None] * (NUM_BLOCKS * BLOCK_SIZE)
        self.host_kv: list[int | None] = [None] * (NUM_CPU_BLOCKS * BLOCK_SIZE)
        self.next_id = 0
        self.next_token = 1000

    @initialize()
    def start_empty(self) -> None:
        assert self.manager.num_free_blocks == NUM_BLOCKS

    # ----- helpers ------------------------------------------------------------------------
    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _on_device(self) -> list[int]:
        return sorted(s for s in self.tokens if not self.manager.seqs[s].on_host)

    def _on_host(self) -> list[int]:
        return sorted(s for s in self.tokens if self.manager.seqs[s].on_host)

    def _write(self, seq_id: int, position: int) -> None:
        self.device_kv[self.manager.slot(seq_id, position)] = self.tokens[seq_id][position]

    @staticmethod
    def _copy(src_kv: list[int | None], src: int, dst_kv: list[int | None], dst: int) -> None:
        dst_kv[dst * BLOCK_SIZE : (dst + 1) * BLOCK_SIZE] = src_kv[src * BLOCK_SIZE : (src + 1) * BLOCK_SIZE]

    def _group(self, seq_id: int, members: list[int]) -> list[int]:
        return [s for s in members if self.family[s] == self.family[seq_id]]

    # ----- rules --------------------------------------------------------------------------
    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(ALPHABET, max_size=10),
    )
    def allocate(self, prefix: list[int], suffix: list[int]) -> None:
        prompt = prefix + suffix
        if not prompt or not self.manager.can_allocate(prompt):
            return
        seq_id = self._new_id()
        cached = self.manager.allocate(seq_id, prompt)
        assert cached % BLOCK_SIZE == 0 and 0 <= cached < len(prompt)
        if not self.prefix_caching:
            assert cached == 0
        self.tokens[seq_id] = list(prompt)
        self.family[seq_id] = seq_id
        assert len(self.manager.block_table(seq_id)) == -(-len(prompt) // BLOCK_SIZE)
        for position in range(cached, len(prompt)):  # the prefill writes only uncached tokens
            self._write(seq_id, position)

    @precondition(lambda self: self._on_device())
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self._on_device()), label="seq")
        if not self.manager.can_append_slot(seq_id):
            return
        table_before = list(self.manager.block_table(seq_id))
        last_shared = bool(table_before) and self.manager.blocks[table_before[-1]].ref_count > 1
        boundary = len(self.tokens[seq_id]) % BLOCK_SIZE == 0
        self.next_token += 1
        copy = self.manager.append_slot(seq_id, self.next_token)
        self.tokens[seq_id].append(self.next_token)
        if boundary or not last_shared:
            assert copy is None
        else:
            assert copy is not None
            src, dst = copy
            assert src == table_before[-1] and dst == self.manager.block_table(seq_id)[-1] and src != dst
            self._copy(self.device_kv, src, self.device_kv, dst)
        self._write(seq_id, len(self.tokens[seq_id]) - 1)

    @precondition(lambda self: self._on_device())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self._on_device()), label="parent")
        child = self._new_id()
        self.manager.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.family[child] = self.family[parent]
        assert self.manager.block_table(child) == self.manager.block_table(parent)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)), label="seq")
        self.manager.free(seq_id)
        del self.tokens[seq_id]
        assert not self.manager.has_seq(seq_id)

    @precondition(lambda self: self._on_device())
    @rule(data=st.data(), whole_family=st.booleans())
    def swap_out(self, data: st.DataObject, whole_family: bool) -> None:
        seq_id = data.draw(st.sampled_from(self._on_device()), label="seq")
        group = self._group(seq_id, self._on_device()) if whole_family else [seq_id]
        if not self.manager.can_swap_out(group):
            return
        distinct = {b for s in group for b in self.manager.block_table(s)}
        free_host = self.manager.num_free_cpu_blocks
        mapping = self.manager.swap_out(group)
        assert {dev for dev, _ in mapping} == distinct  # shared blocks move once
        assert len({host for _, host in mapping}) == len(mapping)
        assert self.manager.num_free_cpu_blocks == free_host - len(mapping)
        for dev, host in mapping:
            self._copy(self.device_kv, dev, self.host_kv, host)

    @precondition(lambda self: self._on_host())
    @rule(data=st.data(), whole_family=st.booleans())
    def swap_in(self, data: st.DataObject, whole_family: bool) -> None:
        seq_id = data.draw(st.sampled_from(self._on_host()), label="seq")
        group = self._group(seq_id, self._on_host()) if whole_family else [seq_id]
        if not self.manager.can_swap_in(group):
            return
        free_ids = {block.block_id for block in self.manager.free_queue}
        distinct = {b for s in group for b in self.manager.block_table(s)}
        mapping = self.manager.swap_in(group)
        assert {host for host, _ in mapping} == distinct
        assert {dev for _, dev in mapping} <= free_ids  # fresh device blocks only
        for host, dev in mapping:
            self._copy(self.host_kv, host, self.device_kv, dev)

    @precondition(lambda self: self._on_device())
    @rule(data=st.data())
    def mark_computed(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self._on_device()), label="seq")
        num_tokens = data.draw(st.integers(0, len(self.tokens[seq_id])), label="num_tokens")
        self.manager.mark_computed(seq_id, num_tokens)

    # ----- invariants ---------------------------------------------------------------------
    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        self.manager.check_invariants()

    @invariant()
    def every_sequence_reads_its_own_tokens(self) -> None:
        assert set(self.manager.seqs) == set(self.tokens)
        for seq_id, expected in self.tokens.items():
            seq = self.manager.seqs[seq_id]
            assert seq.token_ids == expected
            kv = self.host_kv if seq.on_host else self.device_kv
            table = seq.block_ids
            read = [kv[table[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE] for i in range(len(expected))]
            assert read == expected, f"seq {seq_id} reads {read}, expected {expected}"

    @invariant()
    def figures_agree(self) -> None:
        stats = self.manager.stats()
        assert stats.num_free_blocks + stats.num_used_blocks == NUM_BLOCKS
        assert 0.0 <= stats.usage_ratio <= 1.0 and 0.0 <= stats.block_utilization <= 1.0
        assert stats.prefix_hits <= stats.prefix_queries

    def teardown(self) -> None:
        for seq_id in sorted(self.tokens):
            self.manager.free(seq_id)
        self.tokens.clear()
        self.manager.check_invariants()
        assert self.manager.num_used_blocks == 0  # cached free blocks count as free
        assert self.manager.num_free_blocks == NUM_BLOCKS
        assert self.manager.num_stored_tokens == 0
        assert self.manager.num_free_cpu_blocks == NUM_CPU_BLOCKS


class BlockManagerNoPrefixMachine(BlockManagerMachine):
    """The same operations with prefix caching off."""

    prefix_caching = False


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
BlockManagerNoPrefixMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerNoPrefixStateful = BlockManagerNoPrefixMachine.TestCase
