"""Swap preemption's bookkeeping: the host block pool and which of its blocks hold whose KV.

A victim of preemption (:meth:`buckets.scheduler.Scheduler._preempt`) either drops its KV and
recomputes it when it resumes, or, when :func:`policies.preemption.should_swap` says so, has its
computed blocks copied to a pool in host memory (vLLM V0's ``swap_space``): the runner copies
``ForwardInput.swap_out`` pairs ``(device block, host block)`` after the step's fork block copies
(a fork preempted in the step after its fork holds its copied block only then) and before the
forward writes KV, so the device blocks the victim frees can serve another sequence in the same step. When it
resumes, it gets device blocks again and the runner copies ``ForwardInput.swap_in`` pairs
``(host block, device block)`` back before the forward; its host blocks are free from then on.

Prefix-cached blocks: a victim's blocks are all copied out, those it shares with other
sequences included. A full block is never written again once computed, so its host copy stays
valid; the victim then drops its device references like any freed sequence (a block others
still hold stays on the device for them; a cached block nobody holds becomes evictable). When it
resumes, its leading full blocks still in the prefix cache are taken back by reference, uncopied
(:meth:`buckets.block_manager.BlockManager.allocate`), and only the rest are copied in.

Plain integers only (no torch), as :mod:`buckets.block_manager`; owned by one bucket's worker.
"""

from __future__ import annotations

import collections

from buckets.block_manager import BlockManager
from buckets.sequence import Sequence, SequenceStatus
from policies.preemption import PreemptionMode, SwapCostModel, should_swap


class SwapSpace:
    """The host pool's blocks: a free list and the host block table of each swapped-out sequence.

    Args:
        num_blocks: blocks in the host pool (``swap_space_bytes // bytes_per_block``; 0: nothing
            ever fits, every victim recomputes).

    Raises:
        ValueError: ``num_blocks`` below 0.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free_block_ids: collections.deque[int] = collections.deque(range(num_blocks))
        self._block_tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids)

    def has_seq(self, seq_id: int) -> bool:
        """Whether ``seq_id`` holds host blocks (swapped out, not yet back in or freed)."""
        return seq_id in self._block_tables

    def swap_out(self, seq_id: int, device_block_ids: list[int]) -> list[tuple[int, int]]:
        """Take a host block for each of ``device_block_ids`` (a victim's computed blocks, in
        position order) and return the ``(device block, host block)`` pairs to copy.

        Raises:
            ValueError: ``seq_id`` already holds host blocks.
            AssertionError: too few free host blocks (the caller asks :attr:`num_free_blocks` first).
        """
        if seq_id in self._block_tables:
            raise ValueError(f"seq_id {seq_id} is already swapped out")
        assert len(device_block_ids) <= len(self._free_block_ids), f"seq_id {seq_id} does not fit in the host pool"
        host_block_ids = [self._free_block_ids.popleft() for _ in device_block_ids]
        self._block_tables[seq_id] = host_block_ids
        return list(zip(device_block_ids, host_block_ids))

    def swap_in(self, seq_id: int, device_block_ids: list[int], num_skipped: int) -> list[tuple[int, int]]:
        """Free ``seq_id``'s host blocks and return the ``(host block, device block)`` pairs to
        copy back: host block ``i`` into ``device_block_ids[i]``, from ``i = num_skipped`` on (the
        leading blocks found in the prefix cache need no copy).

        Raises:
            KeyError: ``seq_id`` holds no host blocks.
            ValueError: fewer device blocks than host blocks.
        """
        host_block_ids = self._block_tables[seq_id]
        if len(device_block_ids) < len(host_block_ids):
            raise ValueError(f"{len(device_block_ids)} device blocks for seq_id {seq_id}'s {len(host_block_ids)} host blocks")
        self.free(seq_id)
        return [(host_block_ids[i], device_block_ids[i]) for i in range(num_skipped, len(host_block_ids))]

    def free(self, seq_id: int) -> None:
        """Return ``seq_id``'s host blocks to the pool (swapped back in, or it ended while swapped).

        Raises:
            KeyError: ``seq_id`` holds no host blocks.
        """
        self._free_block_ids.extend(self._block_tables.pop(seq_id))

    def check_invariants(self) -> None:
        """Every host block is free or in exactly one table (tests and debugging)."""
        held = [b for table in self._block_tables.values() for b in table]
        assert len(set(held)) == len(held), "host block held twice"
        assert not set(held) & set(self._free_block_ids), "host block both free and held"
        assert len(held) + len(self._free_block_ids) == self.num_blocks, "host block lost"


class Swapper:
    """Swaps victims out and back in for the scheduler: asks the policy per victim, keeps both
    pools' books, and collects the copy pairs of the next plan.

    Args:
        mode: ``swap`` or ``auto`` (see :func:`policies.preemption.should_swap`).
        space: the host pool's books.
        block_manager: the device pool's books (the scheduler's).
        costs: the runner's measured costs (needed by ``auto``; without them it never swaps).
    """

    def __init__(
        self, mode: PreemptionMode, space: SwapSpace, block_manager: BlockManager, costs: SwapCostModel | None = None
    ) -> None:
        self.mode = mode
        self.space = space
        self.block_manager = block_manager
        self.costs = costs
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []

    def swap_out(self, seq: Sequence) -> bool:
        """Copy running ``seq``'s computed blocks to the host pool if the policy says so, before
        the scheduler frees its device blocks; ``seq`` keeps its computed tokens. Returns whether it
        was swapped (else the caller drops its KV to recompute)."""
        num_blocks = self.block_manager.blocks_needed(seq.num_computed_tokens)
        if not should_swap(self.mode, seq.num_computed_tokens, num_blocks, self.space.num_free_blocks, self.costs):
            return False
        table = self.block_manager.block_table(seq.seq_id)[:num_blocks]
        self._swap_out.extend(self.space.swap_out(seq.seq_id, table))
        return True

    def can_swap_in(self, seq: Sequence, num_tokens: int) -> bool:
        """Could swapped-out ``seq`` get device blocks for its computed tokens and ``num_tokens`` more?"""
        num_known = seq.num_computed_tokens + 1  # a lookup within its computed blocks
        return self.block_manager.can_allocate(self._cached_hashes(seq), num_known, seq.num_computed_tokens + num_tokens)

    def swap_in(self, seq: Sequence, num_tokens: int) -> None:
        """Give swapped-out ``seq`` device blocks for its computed tokens and ``num_tokens`` more
        (prefix-cached leading blocks by reference) and queue the copies of the others back in.
        Called after :meth:`can_swap_in` said yes."""
        manager = self.block_manager
        num_known = seq.num_computed_tokens + 1
        num_cached = manager.allocate(seq.seq_id, self._cached_hashes(seq), num_known, seq.num_computed_tokens + num_tokens)
        table = manager.block_table(seq.seq_id)
        self._swap_in.extend(self.space.swap_in(seq.seq_id, table, num_cached // manager.block_size))

    def free(self, seq_id: int) -> None:
        """Release the host blocks of ``seq_id`` if it holds any (it ended while swapped out)."""
        if self.space.has_seq(seq_id):
            self.space.free(seq_id)

    def unswap(self, seqs: list[Sequence]) -> None:
        """Have swapped-out ``seqs`` recompute instead: the forward that was to copy them out
        failed, so their host blocks may hold no copy. Called by the batcher when the runner
        raised, with the plan's ``swapped_out``; a sequence that ended meanwhile is skipped."""
        for seq in seqs:
            if seq.status is SequenceStatus.SWAPPED:
                self.space.free(seq.seq_id)
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.PREEMPTED

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The swap-out and swap-in pairs queued since the last plan, handed over once."""
        copies = self._swap_out, self._swap_in
        self._swap_out, self._swap_in = [], []
        return copies

    def _cached_hashes(self, seq: Sequence) -> list[int]:
        """The keys of ``seq``'s full computed blocks: a prefix-cache hit among them needs no copy
        (keys of known but uncomputed blocks are left out: the host pool holds no KV for them)."""
        return seq.block_hashes[: seq.num_computed_tokens // self.block_manager.block_size]
