"""BlockManager: allocation, growth, prefix caching, eviction, and a stateful property test."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from buckets.block_manager import BlockManager, BlockManagerStats, hash_block_tokens


def hashes(bm: BlockManager, token_ids: list[int]) -> list[int]:
    """The chained keys of the full blocks of ``token_ids`` (what a ``Sequence`` keeps)."""
    keys: list[int] = []
    bs = bm.block_size
    for start in range(0, len(token_ids) - bs + 1, bs):
        keys.append(hash_block_tokens(keys[-1] if keys else None, token_ids[start : start + bs]))
    return keys


def known(bm: BlockManager, token_ids: list[int]) -> tuple[list[int], int]:
    """``(block_hashes, num_known_tokens)`` of a sequence whose known tokens are ``token_ids``."""
    return hashes(bm, token_ids), len(token_ids)


def make_block_manager(num_blocks: int = 8, block_size: int = 4, enable_prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, block_size=block_size, enable_prefix_caching=enable_prefix_caching)


def run_prompt(bm: BlockManager, seq_id: int, token_ids: list[int]) -> int:
    """Allocate a prompt, "compute" all of it and commit; returns the cached tokens at allocate."""
    assert bm.can_allocate(*known(bm, token_ids), len(token_ids))
    num_cached_tokens = bm.allocate(seq_id, *known(bm, token_ids), len(token_ids))
    bm.commit(seq_id, hashes(bm, token_ids), len(token_ids))
    bm.check_invariants()
    return num_cached_tokens


# ---- basics ------------------------------------------------------------------------------


def test_constructor_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, block_size=0)


def test_blocks_needed_is_ceil() -> None:
    bm = make_block_manager(block_size=4)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="num_tokens"):
        bm.blocks_needed(-1)


def test_allocate_takes_fresh_blocks() -> None:
    bm = make_block_manager(num_blocks=8, block_size=4)
    assert bm.allocate(7, *known(bm, list(range(10))), 10) == 0
    assert bm.has_seq(7) and not bm.has_seq(8)
    assert len(bm.block_table(7)) == 3
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_evictable_blocks) == (3, 5, 0)
    bm.block_table(7).append(99)  # a copy: the manager's table is unchanged
    assert len(bm.block_table(7)) == 3
    with pytest.raises(KeyError):
        bm.block_table(8)
    bm.check_invariants()


def test_allocate_twice_and_double_free_are_errors() -> None:
    bm = make_block_manager()
    bm.allocate(1, *known(bm, [1, 2]), 2)
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate(1, *known(bm, [1, 2]), 2)
    bm.free(1)
    with pytest.raises(KeyError):
        bm.free(1)
    bm.check_invariants()


def test_append_grows_across_block_boundary() -> None:
    bm = make_block_manager(num_blocks=4, block_size=4)
    bm.allocate(1, *known(bm, [1, 2, 3, 4]), 4)
    assert len(bm.block_table(1)) == 1
    bm.append(1, 4)  # already enough: no-op
    assert len(bm.block_table(1)) == 1
    assert bm.can_append(1, 5)
    bm.append(1, 5)
    assert len(bm.block_table(1)) == 2
    assert bm.can_append(1, 16) and not bm.can_append(1, 17)
    with pytest.raises(AssertionError):
        bm.append(1, 17)
    assert len(bm.block_table(1)) == 2
    with pytest.raises(KeyError):
        bm.can_append(2, 1)
    bm.check_invariants()


def test_can_allocate_false_when_exhausted_and_allocate_changes_nothing() -> None:
    bm = make_block_manager(num_blocks=3, block_size=4)
    bm.allocate(1, *known(bm, list(range(8))), 8)
    assert bm.can_allocate(*known(bm, [9] * 4), 4)
    assert not bm.can_allocate(*known(bm, [9] * 5), 5)
    before = bm.stats()
    with pytest.raises(AssertionError):
        bm.allocate(2, *known(bm, [9] * 5), 5)
    assert not bm.has_seq(2)
    assert bm.stats() == before
    bm.check_invariants()


def test_free_returns_every_block() -> None:
    bm = make_block_manager(num_blocks=6, block_size=2)
    bm.allocate(1, *known(bm, [1, 2, 3]), 3)
    bm.allocate(2, *known(bm, [4]), 1)
    bm.free(1)
    bm.free(2)
    assert (bm.num_used_blocks, bm.num_free_blocks) == (0, 6)
    bm.check_invariants()


# ---- prefix caching ----------------------------------------------------------------------


def test_prefix_hit_shares_blocks_and_counts_stats() -> None:
    bm = make_block_manager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    assert run_prompt(bm, 1, prompt) == 0
    assert bm.stats().prefix_cache_queries == 2 and bm.stats().prefix_cache_hits == 0
    assert run_prompt(bm, 2, prompt[:8] + [42, 43]) == 8
    table_1, table_2 = bm.block_table(1), bm.block_table(2)
    assert table_2[:2] == table_1[:2] and table_2[2] != table_1[2]
    assert bm.num_used_blocks == 4  # 2 shared + one tail each
    stats = bm.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (4, 2)
    assert stats.prefix_cache_hit_rate == 0.5
    bm.free(1)  # shared blocks keep seq 2's reference
    assert bm.num_used_blocks == 3 and bm.num_evictable_blocks == 0
    bm.check_invariants()


def test_hits_leave_at_least_one_token_to_compute() -> None:
    bm = make_block_manager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    run_prompt(bm, 1, prompt)
    assert bm.allocate(2, *known(bm, prompt), 8) == 4  # 8 tokens: only (8 - 1) // 4 = 1 block may hit
    assert bm.allocate(3, *known(bm, prompt + [8]), 9) == 8
    assert bm.allocate(4, *known(bm, prompt[:1]), 1) == 0
    assert bm.allocate(5, *known(bm, []), 0) == 0 and bm.block_table(5) == []
    bm.check_invariants()


def test_allocate_takes_at_least_the_hit_blocks() -> None:
    bm = make_block_manager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    run_prompt(bm, 1, prompt)
    assert bm.allocate(2, *known(bm, prompt), 1) == 4  # caller asked for 1 position but 2 blocks hit
    assert bm.block_table(2) == bm.block_table(1)[:2]
    bm.check_invariants()


def test_commit_registers_only_full_computed_blocks() -> None:
    bm = make_block_manager(num_blocks=8, block_size=4)
    prompt = list(range(12))
    bm.allocate(1, *known(bm, prompt), 12)
    assert bm.allocate(2, *known(bm, prompt), 12) == 0  # nothing computed yet: nothing cached
    bm.free(2)
    bm.commit(1, hashes(bm, prompt), 6)  # one full block computed
    assert bm.allocate(3, *known(bm, prompt), 12) == 4
    bm.commit(1, hashes(bm, prompt + [12]), 12)  # all three blocks full; idempotent for block 0
    assert bm.allocate(4, *known(bm, prompt + [12]), 13) == 12
    bm.check_invariants()


def test_commit_rejects_inconsistent_arguments() -> None:
    bm = make_block_manager(num_blocks=8, block_size=4)
    bm.allocate(1, *known(bm, [1, 2, 3, 4]), 4)
    with pytest.raises(ValueError, match="block_hashes"):
        bm.commit(1, hashes(bm, [1, 2, 3]), 4)
    with pytest.raises(ValueError, match="blocks"):
        bm.commit(1, hashes(bm, [1, 2, 3, 4, 5]), 5)
    with pytest.raises(KeyError):
        bm.commit(2, hashes(bm, [1]), 1)


def test_duplicate_hash_is_not_registered_twice() -> None:
    bm = make_block_manager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    bm.allocate(1, *known(bm, prompt), 5)
    bm.allocate(2, *known(bm, prompt), 5)  # both miss: nothing committed yet
    bm.commit(1, hashes(bm, prompt), 5)
    bm.commit(2, hashes(bm, prompt), 5)  # same hashes: seq 1's blocks keep the mapping
    bm.free(1)
    bm.free(2)
    assert bm.num_evictable_blocks == 2  # seq 1's two full blocks only
    assert bm.num_free_blocks == 8
    assert bm.allocate(3, *known(bm, prompt), 5) == 4
    bm.check_invariants()


def test_evictable_hit_leaves_evictable_set_and_counts_in_can_allocate() -> None:
    bm = make_block_manager(num_blocks=3, block_size=2)
    run_prompt(bm, 1, [1, 2, 3])
    bm.free(1)
    assert (bm.num_free_blocks, bm.num_evictable_blocks) == (3, 1)
    # 7 tokens need 4 blocks; 1 hits, but taking it uses up one of the 3 free blocks.
    assert not bm.can_allocate(*known(bm, [1, 2, 5, 6, 7, 8, 9]), 7)
    assert bm.can_allocate(*known(bm, [1, 2, 5, 6, 7]), 5)
    assert bm.allocate(2, *known(bm, [1, 2, 5, 6, 7]), 5) == 2
    assert (bm.num_free_blocks, bm.num_evictable_blocks, bm.num_used_blocks) == (0, 0, 3)
    assert bm.stats().num_evictions == 0
    bm.check_invariants()


def test_eviction_takes_free_list_first_then_least_recently_freed() -> None:
    bm = make_block_manager(num_blocks=6, block_size=2)
    run_prompt(bm, 1, [1, 1, 2])  # block [1, 1] cached, tail block not full
    run_prompt(bm, 2, [3, 3, 4])  # block [3, 3] cached
    bm.free(1)
    bm.free(2)  # LRU order: [1, 1] then [3, 3]
    assert (bm.num_free_blocks, bm.num_evictable_blocks) == (6, 2)
    bm.allocate(3, *known(bm, [7] * 8), 8)  # 4 free-list blocks: no eviction
    assert bm.stats().num_evictions == 0 and bm.num_evictable_blocks == 2
    bm.allocate(4, *known(bm, [8]), 1)  # evicts [1, 1], the least recently freed
    assert bm.stats().num_evictions == 1
    assert not bm.can_allocate(*known(bm, [3, 3, 9]), 3)  # the hit on [3, 3] would take the last free block
    bm.free(4)
    bm.free(3)
    assert bm.allocate(5, *known(bm, [1, 1, 9]), 3) == 0  # [1, 1] is gone
    assert bm.allocate(6, *known(bm, [3, 3, 9]), 3) == 2  # [3, 3] survived
    assert bm.stats().num_evictions == 1
    bm.check_invariants()


def test_hit_refreshes_lru_position() -> None:
    bm = make_block_manager(num_blocks=4, block_size=2)
    run_prompt(bm, 1, [1, 1, 2])
    run_prompt(bm, 2, [3, 3, 4])
    bm.free(1)
    bm.free(2)  # LRU: [1, 1], [3, 3]
    assert bm.allocate(3, *known(bm, [1, 1, 5]), 3) == 2  # take [1, 1] back ...
    assert bm.num_evictable_blocks == 1
    bm.free(3)  # ... and free it again: LRU now [3, 3], [1, 1]
    bm.allocate(4, *known(bm, [9] * 6), 6)  # 2 free-list blocks, then evicts [3, 3]
    assert bm.stats().num_evictions == 1
    bm.free(4)
    assert bm.allocate(5, *known(bm, [1, 1, 9]), 3) == 2
    assert bm.allocate(6, *known(bm, [3, 3, 9]), 3) == 0
    bm.check_invariants()


def test_free_in_reverse_order_keeps_prefix_head_longest() -> None:
    bm = make_block_manager(num_blocks=4, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    run_prompt(bm, 1, prompt)  # 4 blocks, the first 3 full and cached
    bm.free(1)
    assert bm.num_evictable_blocks == 3
    bm.allocate(2, *known(bm, [9, 9, 9]), 3)  # free-list block, then evicts the tail cached block
    assert bm.stats().num_evictions == 1
    bm.free(2)
    assert bm.allocate(3, *known(bm, prompt), 7) == 4  # the two head blocks survive
    bm.check_invariants()


def test_disabled_prefix_caching_never_hashes() -> None:
    bm = make_block_manager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    prompt = [1, 2, 3, 4, 5]
    assert run_prompt(bm, 1, prompt) == 0
    assert run_prompt(bm, 2, prompt) == 0
    assert bm.block_table(1)[0] != bm.block_table(2)[0]
    bm.free(1)
    bm.free(2)
    assert bm.num_evictable_blocks == 0 and bm.num_free_blocks == 8
    stats = bm.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.prefix_cache_hit_rate) == (0, 0, 0.0)


def test_the_manager_never_hashes_tokens_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    bm = make_block_manager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    keys = hashes(bm, prompt)
    monkeypatch.setattr("buckets.block_manager.hash_block_tokens", lambda *args: pytest.fail("hashed tokens"))
    assert bm.can_allocate(keys, len(prompt), 5)
    assert bm.allocate(1, keys, len(prompt), 5) == 0
    bm.commit(1, keys, 5)
    assert bm.num_cached_prefix_tokens(keys, len(prompt)) == 4
    assert bm.allocate(2, keys, len(prompt), 5) == 4


def test_fork_shares_full_blocks_copies_the_partial_one_and_frees_exactly() -> None:
    bm = make_block_manager(num_blocks=8, block_size=4)
    run_prompt(bm, 0, list(range(10)))  # blocks: 2 full + 1 partial
    parent = bm.block_table(0)
    copies = [bm.fork(0, child, 10) for child in (1, 2)]
    assert [c[0] for c in copies if c] == [parent[2], parent[2]]
    assert bm.num_used_blocks == 5
    for child in (1, 2):
        assert bm.block_table(child)[:2] == parent[:2] and bm.block_table(child)[2] not in parent
    bm.check_invariants()
    for seq_id in (0, 2, 1):  # the parent first: the shared blocks stay with the children
        bm.free(seq_id)
        bm.check_invariants()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8
    assert run_prompt(bm, 3, list(range(10))) == 8  # the shared full blocks stayed cached


def test_fork_needs_a_free_block_only_for_a_partial_last_block() -> None:
    bm = make_block_manager(num_blocks=2, block_size=4)
    run_prompt(bm, 0, list(range(8)))
    assert bm.can_fork(8) and bm.fork(0, 1, 8) is None
    assert not bm.can_fork(7)
    with pytest.raises(AssertionError):
        bm.fork(0, 2, 7)
    with pytest.raises(ValueError):
        bm.fork(0, 1, 8)  # already allocated
    bm.check_invariants()


def test_stats_is_a_frozen_snapshot() -> None:
    bm = make_block_manager(num_blocks=4)
    stats = bm.stats()
    assert stats == BlockManagerStats(4, 0, 4, 0, 0, 0, 0)
    assert stats.prefix_cache_hit_rate == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.num_blocks = 5  # type: ignore[misc]
    bm.allocate(1, *known(bm, [1]), 1)
    assert stats.num_used_blocks == 0 and bm.stats().num_used_blocks == 1


# ---- stateful property test --------------------------------------------------------------

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=12)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / step / finish / cancel sequences against a small pool.

    The model keeps each live sequence's tokens and computed count, and for each block the
    full token prefix it was committed with, so every cache hit can be checked for content.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bm = make_block_manager()
        self.tokens: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}
        self.block_prefix: dict[int, tuple[int, ...]] = {}
        self.freed: set[int] = set()
        self.next_seq_id = 0

    @initialize(
        num_blocks=st.integers(4, 24),
        block_size=st.integers(1, 4),
        enable_prefix_caching=st.sampled_from([True, True, True, False]),
    )
    def make_pool(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.bm = make_block_manager(num_blocks, block_size, enable_prefix_caching)

    @rule(token_ids=TOKENS, extra_tokens=st.integers(-4, 3))
    def admit(self, token_ids: list[int], extra_tokens: int) -> None:
        num_tokens = max(1, len(token_ids) + extra_tokens)  # < len: a chunked prefill
        seq_id, self.next_seq_id = self.next_seq_id, self.next_seq_id + 1
        if not self.bm.can_allocate(*known(self.bm, token_ids), num_tokens):
            with pytest.raises(AssertionError):
                self.bm.allocate(seq_id, *known(self.bm, token_ids), num_tokens)
            assert not self.bm.has_seq(seq_id)
            return
        num_cached_tokens = self.bm.allocate(seq_id, *known(self.bm, token_ids), num_tokens)
        bs = self.bm.block_size
        num_hits = num_cached_tokens // bs
        assert num_cached_tokens % bs == 0 and num_cached_tokens < len(token_ids)
        assert num_hits == 0 or self.bm.enable_prefix_caching
        table = self.bm.block_table(seq_id)
        assert len(table) == max(self.bm.blocks_needed(num_tokens), num_hits)
        for i, block_id in enumerate(table[:num_hits]):
            assert self.block_prefix[block_id] == tuple(token_ids[: (i + 1) * bs]), "hit on a block with other tokens"
        for block_id in table[num_hits:]:
            self.block_prefix.pop(block_id, None)  # fresh: its old KV is overwritten
        self.tokens[seq_id] = list(token_ids)
        self.num_computed[seq_id] = num_cached_tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), num_new_tokens=st.integers(1, 6), sampled=st.integers(0, 2))
    def step(self, data: st.DataObject, num_new_tokens: int, sampled: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        num_computed = self.num_computed[seq_id] + num_new_tokens
        if not self.bm.can_append(seq_id, num_computed):
            assert self.bm.blocks_needed(num_computed) - len(self.bm.block_table(seq_id)) > self.bm.num_free_blocks
            return
        self.bm.append(seq_id, num_computed)
        tokens = self.tokens[seq_id]
        tokens.extend([sampled] * (num_computed + 1 - len(tokens)))  # decode: one token past the computed
        old_num_full = self.num_computed[seq_id] // self.bm.block_size
        self.bm.commit(seq_id, hashes(self.bm, tokens), num_computed)
        self.num_computed[seq_id] = num_computed
        bs = self.bm.block_size
        table = self.bm.block_table(seq_id)
        for i in range(old_num_full, num_computed // bs):
            self.block_prefix[table[i]] = tuple(tokens[: (i + 1) * bs])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish_or_cancel(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.finish_or_cancel_one(seq_id)
        assert not self.bm.has_seq(seq_id)

    @precondition(lambda self: any(self.num_computed.values()))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent_id = data.draw(st.sampled_from(sorted(s for s, n in self.num_computed.items() if n)))
        num_tokens = self.num_computed[parent_id]
        child_id, self.next_seq_id = self.next_seq_id, self.next_seq_id + 1
        if not self.bm.can_fork(num_tokens):
            with pytest.raises(AssertionError):
                self.bm.fork(parent_id, child_id, num_tokens)
            assert not self.bm.has_seq(child_id)
            return
        copy = self.bm.fork(parent_id, child_id, num_tokens)
        parent_table, child_table = self.bm.block_table(parent_id), self.bm.block_table(child_id)
        num_full = num_tokens // self.bm.block_size
        assert child_table[:num_full] == parent_table[:num_full]
        assert len(child_table) == self.bm.blocks_needed(num_tokens)
        assert (copy is None) == (num_tokens % self.bm.block_size == 0)
        if copy is not None:
            assert copy == (parent_table[num_full], child_table[-1]) and child_table[-1] not in parent_table
            self.block_prefix.pop(child_table[-1], None)
        self.tokens[child_id] = self.tokens[parent_id][:num_tokens]
        self.num_computed[child_id] = num_tokens

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def double_free_is_an_error(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.freed)))
        with pytest.raises(KeyError):
            self.bm.free(seq_id)

    @rule()
    def free_all(self) -> None:
        for seq_id in list(self.tokens):
            self.finish_or_cancel_one(seq_id)
        self.check_drained()

    def finish_or_cancel_one(self, seq_id: int) -> None:
        self.bm.free(seq_id)
        del self.tokens[seq_id], self.num_computed[seq_id]
        self.freed.add(seq_id)

    def check_drained(self) -> None:
        assert self.bm.num_used_blocks == 0
        assert self.bm.num_free_blocks == self.bm.num_blocks
        if not self.bm.enable_prefix_caching:
            assert self.bm.num_evictable_blocks == 0

    @invariant()
    def pool_is_consistent(self) -> None:
        bm = self.bm
        bm.check_invariants()  # ref counts == references, none negative, no block free and used
        assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
        assert 0 <= bm.num_evictable_blocks <= bm.num_free_blocks
        tables = [bm.block_table(seq_id) for seq_id in self.tokens]
        assert sum(len(table) for table in tables) >= bm.num_used_blocks
        assert len({b for table in tables for b in table}) == bm.num_used_blocks
        stats = bm.stats()
        assert stats.prefix_cache_hits <= stats.prefix_cache_queries

    def teardown(self) -> None:
        for seq_id in list(self.tokens):
            self.finish_or_cancel_one(seq_id)
        self.check_drained()
        self.bm.check_invariants()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
