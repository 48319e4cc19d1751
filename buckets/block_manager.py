"""Host-side bookkeeping of a paged KV cache: block tables, ref counts and the prefix cache.

Plain integers only (no torch, no I/O), as in nano-vllm's ``BlockManager`` and vLLM v1's
``BlockPool``. The KV tensors live with the model runner; this class only decides which block
ids a sequence owns. Capacity questions come in pairs: ``can_allocate`` / ``allocate`` and
``can_append`` / ``append``; running out is an answer from ``can_*``, and calling the action
without asking first is a caller bug (``AssertionError``).

Prefix caching: a full block ``i`` of a sequence is keyed by the chained hash
``h_i = H(h_{i-1} || token_ids[i*bs:(i+1)*bs])`` with ``h_{-1}`` empty (or, for a sequence run
with a LoRA adapter, the adapter's key :func:`lora_root_hash`, so the same prompt under two
adapters, or under one and the base model, never shares KV: vLLM's ``extra_keys``), so a key
names the whole prefix up to and including that block. ``H`` is 128-bit BLAKE2b (vLLM moved from Python's
``hash`` to SHA-256 for the same reason: a collision would silently reuse another prompt's KV).
The caller computes a sequence's hashes once (with :func:`hash_block_tokens`, kept on the
``Sequence`` and extended as outputs fill blocks) and passes them in; the manager never hashes tokens itself.
Only full, computed blocks are registered (by ``commit``). A block whose ref count drops to 0 keeps its hash and waits in an LRU set of
evictable blocks; a later sequence with the same prefix takes it back, and a fresh allocation
that finds the free list empty evicts the least recently freed one.

Hashes are deterministic across processes but never persisted or sent anywhere.

Owned by one bucket's worker thread; no locks.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockManagerStats:
    """A snapshot of the block pool, from :meth:`BlockManager.stats`.

    ``num_free_blocks`` counts every block a new allocation can take, evictable ones included;
    ``prefix_cache_queries`` counts full prompt blocks eligible for lookup at ``allocate``;
    ``prefix_cache_hits`` those reused from the cache; ``num_evictions`` cached blocks whose
    hash was dropped so the block could be reused. Counters run since construction.
    """

    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_evictable_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The chained key of one full block: its tokens plus the key of the block before it
    (128-bit BLAKE2b of the parent key's bytes and the token ids as int64)."""
    digest = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        digest.update(parent_hash.to_bytes(16, "little"))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


def lora_root_hash(adapter_id: int) -> int:
    """The key a LoRA sequence's first block chains onto (``h_{-1}``): 128-bit BLAKE2b of the
    adapter's id (unique per load: :class:`models.step_io.LoraRequest`), which no block key equals."""
    digest = hashlib.blake2b(b"lora:" + adapter_id.to_bytes(8, "little", signed=True), digest_size=16)
    return int.from_bytes(digest.digest(), "little")


class BlockManager:
    """Which KV blocks each sequence owns, with ref-counted sharing of cached prefixes.

    The scheduler is the only caller: ``can_allocate``/``allocate`` when it admits a waiting
    sequence, ``can_append``/``append`` before each step grows a running one, ``can_fork``/``fork``
    when a request's other choices continue from its prefilled prompt, ``commit`` after
    the runner wrote KV, and ``free`` when a sequence finishes, is cancelled or is preempted
    (in ``finally``). The runner reads ``block_table``.

    Args:
        num_blocks: KV blocks in the pool (>= 1).
        block_size: tokens per block (>= 1).
        enable_prefix_caching: when False nothing is hashed, looked up or kept after ``free``.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # The hash a block is registered under in ``_cached_block_ids``; None when unregistered.
        self._block_hashes: list[int | None] = [None] * num_blocks
        self._free_block_ids: collections.deque[int] = collections.deque(range(num_blocks))
        # Cached blocks with ref count 0, least recently freed first.
        self._evictable_block_ids: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._cached_block_ids: dict[int, int] = {}
        self._block_tables: dict[int, list[int]] = {}
        # How many leading full computed blocks of each sequence were committed (registered or not).
        self._num_committed_blocks: dict[int, int] = {}
        self._num_used_blocks = 0
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        self._num_evictions = 0

    # ---- capacity -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: never used or plainly freed, plus evictable."""
        return len(self._free_block_ids) + len(self._evictable_block_ids)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref count > 0."""
        return self._num_used_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks with ref count 0 (a subset of :attr:`num_free_blocks`)."""
        return len(self._evictable_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        """``ceil(num_tokens / block_size)``. Raises ValueError for a negative ``num_tokens``."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block ids, in position order. The runner calls it each step.

        Raises KeyError for a sequence that is not allocated.
        """
        return list(self._block_tables[seq_id])

    def has_seq(self, seq_id: int) -> bool:
        """Whether ``seq_id`` holds a block table (allocated and not yet freed)."""
        return seq_id in self._block_tables

    # ---- allocation -----------------------------------------------------------------------

    def num_cached_prefix_tokens(self, block_hashes: Sequence[int], num_known_tokens: int) -> int:
        """How many leading tokens of a sequence :meth:`allocate` would find in the prefix cache
        now (a multiple of ``block_size``, at most ``num_known_tokens - 1``). ``block_hashes``
        are the chained keys of the full blocks of its ``num_known_tokens`` known tokens
        (:func:`hash_block_tokens`). The scheduler asks when it sizes a new sequence's first chunk;
        this changes nothing, stats included.
        """
        return len(self._find_cached_prefix(block_hashes, num_known_tokens)) * self.block_size

    def can_allocate(self, block_hashes: Sequence[int], num_known_tokens: int, num_tokens: int) -> bool:
        """Could a new sequence (``block_hashes`` of its ``num_known_tokens`` known tokens) get
        blocks for its first ``num_tokens`` positions? Prefix-cache hits need no fresh block,
        but an evictable hit stops counting as free once taken. The scheduler asks before
        :meth:`allocate`; this changes nothing, stats included.
        """
        return self._fits(self._find_cached_prefix(block_hashes, num_known_tokens), num_tokens)

    def allocate(self, seq_id: int, block_hashes: Sequence[int], num_known_tokens: int, num_tokens: int) -> int:
        """Create the block table of a new sequence and return how many of its leading tokens
        are already in the KV cache (``num_cached_tokens``, a multiple of ``block_size``).

        Reuses cached blocks for the longest cached prefix named by ``block_hashes`` (the keys of
        the full blocks of its ``num_known_tokens`` known tokens), capped so at least one token is
        left to compute, then takes fresh blocks up to ``max(blocks_needed(num_tokens), hits)``.
        Called by the scheduler when it admits a waiting (or preempted) sequence, after
        :meth:`can_allocate` said yes.

        Raises:
            ValueError: ``seq_id`` already holds a block table.
            AssertionError: the pool cannot hold it (the caller skipped :meth:`can_allocate`).
        """
        if seq_id in self._block_tables:
            raise ValueError(f"seq_id {seq_id} is already allocated")
        hits = self._find_cached_prefix(block_hashes, num_known_tokens)
        assert self._fits(hits, num_tokens), f"seq_id {seq_id} does not fit; ask can_allocate first"
        if self.enable_prefix_caching:
            self._prefix_cache_queries += self._max_cached_blocks(num_known_tokens)
            self._prefix_cache_hits += len(hits)
        table = [self._take_cached_block(block_id) for block_id in hits]
        num_fresh = max(self.blocks_needed(num_tokens), len(hits)) - len(hits)
        table.extend(self._take_free_block() for _ in range(num_fresh))
        self._block_tables[seq_id] = table
        self._num_committed_blocks[seq_id] = len(hits)
        self._check_counts()
        return len(hits) * self.block_size

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Can the sequence's table grow to hold ``num_tokens`` positions in total? The
        scheduler asks before each step that adds tokens. Raises KeyError for an unknown seq.
        """
        num_missing = self.blocks_needed(num_tokens) - len(self._block_tables[seq_id])
        return num_missing <= self.num_free_blocks

    def append(self, seq_id: int, num_tokens: int) -> None:
        """Grow the table to ``blocks_needed(num_tokens)`` blocks (no-op if it already has
        them). Called by the scheduler after :meth:`can_append` said yes.

        Raises:
            KeyError: unknown ``seq_id``.
            AssertionError: the pool cannot hold it (the caller skipped :meth:`can_append`).
        """
        table = self._block_tables[seq_id]
        num_missing = self.blocks_needed(num_tokens) - len(table)
        assert num_missing <= self.num_free_blocks, f"seq_id {seq_id} cannot grow; ask can_append first"
        table.extend(self._take_free_block() for _ in range(num_missing))
        self._check_counts()

    def can_fork(self, num_tokens: int) -> bool:
        """Could a sequence fork off a parent holding ``num_tokens`` computed tokens now? Its full
        blocks are shared; a partly filled last block needs one fresh block for the copy."""
        return num_tokens % self.block_size == 0 or self.num_free_blocks >= 1

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> tuple[int, int] | None:
        """Give ``child_id`` the KV of the first ``num_tokens`` positions of ``parent_id``: the
        parent's full blocks by reference (ref count + 1 each, as vLLM V0's
        ``BlockSpaceManager.fork``), and a fresh block for a partly filled last block, which the
        two would otherwise both write. Returns ``(source, destination)`` of that block for the
        runner to copy before its next forward (``None``: no partial block). Called by the
        scheduler after :meth:`can_fork` said yes; ``free`` of either sequence later drops only
        its own references.

        Raises:
            KeyError: unknown ``parent_id``.
            ValueError: ``child_id`` already holds a block table, or the parent's table holds
                fewer than ``num_tokens`` positions.
            AssertionError: no free block for the copy (the caller skipped :meth:`can_fork`).
        """
        table = self._block_tables[parent_id]
        if child_id in self._block_tables:
            raise ValueError(f"seq_id {child_id} is already allocated")
        if self.blocks_needed(num_tokens) > len(table):
            raise ValueError(f"num_tokens {num_tokens} exceeds seq_id {parent_id}'s {len(table)} blocks")
        assert self.can_fork(num_tokens), f"seq_id {child_id} cannot fork; ask can_fork first"
        num_full_blocks = num_tokens // self.block_size
        child_table = [self._take_cached_block(block_id) for block_id in table[:num_full_blocks]]
        copy = None
        if num_tokens % self.block_size:
            copy = (table[num_full_blocks], self._take_free_block())
            child_table.append(copy[1])
        self._block_tables[child_id] = child_table
        self._num_committed_blocks[child_id] = min(self._num_committed_blocks[parent_id], num_full_blocks)
        self._check_counts()
        return copy

    def commit(self, seq_id: int, block_hashes: Sequence[int], num_computed_tokens: int) -> None:
        """Register in the prefix cache every block now full of computed tokens.

        Called by the scheduler in ``postprocess``, after a forward wrote KV for positions
        ``< num_computed_tokens``; ``block_hashes`` are the keys of the sequence's full blocks so
        far (:func:`hash_block_tokens`). A block whose hash is already registered to another block
        stays unregistered (and is plainly freed later). Does nothing when prefix caching is
        disabled.

        Raises:
            KeyError: unknown ``seq_id``.
            ValueError: fewer hashes than full computed blocks, or more computed tokens than
                the table holds.
        """
        table = self._block_tables[seq_id]
        num_full_blocks = num_computed_tokens // self.block_size
        if self.blocks_needed(num_computed_tokens) > len(table):
            raise ValueError(f"num_computed_tokens {num_computed_tokens} exceeds seq_id {seq_id}'s {len(table)} blocks")
        if not self.enable_prefix_caching:
            return
        if len(block_hashes) < num_full_blocks:
            raise ValueError(f"{len(block_hashes)} block_hashes for {num_full_blocks} full computed blocks")
        for i in range(self._num_committed_blocks[seq_id], num_full_blocks):
            self._register(table[i], block_hashes[i])
        self._num_committed_blocks[seq_id] = max(self._num_committed_blocks[seq_id], num_full_blocks)

    def free(self, seq_id: int) -> None:
        """Drop the sequence's block table. Each block's ref count falls by one; a block left
        unreferenced becomes evictable if it is cached, else free. The table is released tail
        first so a shared prefix's head blocks stay cached longest (as vLLM does).

        Called by the scheduler when a sequence finishes, is cancelled or is preempted, on a
        guaranteed path. Raises KeyError for a sequence that is not allocated (double free).
        """
        if seq_id not in self._block_tables:
            raise KeyError(f"seq_id {seq_id} is not allocated")
        table = self._block_tables.pop(seq_id)
        del self._num_committed_blocks[seq_id]
        for block_id in reversed(table):
            self._release(block_id)
        self._check_counts()

    def stats(self) -> BlockManagerStats:
        """A snapshot for ``Bucket.stats()``; the gateway exports it."""
        return BlockManagerStats(
            num_blocks=self.num_blocks,
            num_used_blocks=self.num_used_blocks,
            num_free_blocks=self.num_free_blocks,
            num_evictable_blocks=self.num_evictable_blocks,
            prefix_cache_queries=self._prefix_cache_queries,
            prefix_cache_hits=self._prefix_cache_hits,
            num_evictions=self._num_evictions,
        )

    def check_invariants(self) -> None:
        """Full O(num_blocks) consistency check, for tests and debugging; the cheap checks run
        on every call anyway. Raises AssertionError on a broken invariant (an internal bug).
        """
        free_ids = set(self._free_block_ids)
        evictable_ids = set(self._evictable_block_ids)
        assert len(free_ids) == len(self._free_block_ids), "block on the free list twice"
        assert not free_ids & evictable_ids, "block both free and evictable"
        used_ids = {b for b, ref_count in enumerate(self._ref_counts) if ref_count > 0}
        assert all(ref_count >= 0 for ref_count in self._ref_counts), "negative ref count"
        assert not used_ids & (free_ids | evictable_ids), "block both free and used"
        assert len(used_ids) == self._num_used_blocks, "used block count drifted"
        assert len(used_ids) + len(free_ids) + len(evictable_ids) == self.num_blocks, "block lost"
        assert all(self._block_hashes[b] is None for b in free_ids), "free block still hashed"
        assert all(self._block_hashes[b] is not None for b in evictable_ids), "evictable block not hashed"
        for block_hash, block_id in self._cached_block_ids.items():
            assert self._block_hashes[block_id] == block_hash, "cache map and block hash disagree"
        references = collections.Counter(b for table in self._block_tables.values() for b in table)
        assert all(self._ref_counts[b] == references[b] for b in range(self.num_blocks)), "ref count != references"

    # ---- internals ------------------------------------------------------------------------

    def _max_cached_blocks(self, num_known_tokens: int) -> int:
        """Full blocks of a sequence that may be reused, leaving at least one token to compute."""
        return max(0, (num_known_tokens - 1) // self.block_size)

    def _find_cached_prefix(self, block_hashes: Sequence[int], num_known_tokens: int) -> list[int]:
        """Block ids of the cached leading blocks named by ``block_hashes``; stops at the first miss."""
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        for i in range(min(len(block_hashes), self._max_cached_blocks(num_known_tokens))):
            block_id = self._cached_block_ids.get(block_hashes[i])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _fits(self, hits: list[int], num_tokens: int) -> bool:
        """Whether the fresh blocks a new sequence needs beyond ``hits`` are free, not counting
        evictable hit blocks, which stop being free once the sequence takes them."""
        num_evictable_hits = sum(1 for block_id in hits if self._ref_counts[block_id] == 0)
        num_fresh = max(self.blocks_needed(num_tokens), len(hits)) - len(hits)
        return num_fresh <= self.num_free_blocks - num_evictable_hits

    def _take_cached_block(self, block_id: int) -> int:
        """Add a reference to a block (a cached prefix hit, or a parent's block a fork shares); an
        evictable one leaves the evictable set."""
        if self._ref_counts[block_id] == 0:
            assert block_id in self._evictable_block_ids, f"unreferenced cached block {block_id} not evictable"
            del self._evictable_block_ids[block_id]
            self._num_used_blocks += 1
        self._ref_counts[block_id] += 1
        return block_id

    def _take_free_block(self) -> int:
        """A fresh block with ref count 1: from the free list, else the LRU evictable block."""
        if self._free_block_ids:
            block_id = self._free_block_ids.popleft()
        else:
            block_id, _ = self._evictable_block_ids.popitem(last=False)
            block_hash = self._block_hashes[block_id]
            assert block_hash is not None and self._cached_block_ids[block_hash] == block_id
            del self._cached_block_ids[block_hash]
            self._block_hashes[block_id] = None
            self._num_evictions += 1
        assert self._ref_counts[block_id] == 0, f"free block {block_id} is in use"
        self._ref_counts[block_id] = 1
        self._num_used_blocks += 1
        return block_id

    def _register(self, block_id: int, block_hash: int) -> None:
        """Map ``block_hash`` to ``block_id`` unless the hash already names another block."""
        if block_hash in self._cached_block_ids:
            return
        assert self._block_hashes[block_id] is None, f"block {block_id} registered twice"
        assert self._ref_counts[block_id] > 0, f"committing unreferenced block {block_id}"
        self._cached_block_ids[block_hash] = block_id
        self._block_hashes[block_id] = block_hash

    def _release(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes evictable (cached) or free."""
        self._ref_counts[block_id] -= 1
        assert self._ref_counts[block_id] >= 0, f"negative ref count on block {block_id}"
        if self._ref_counts[block_id] > 0:
            return
        self._num_used_blocks -= 1
        if self._block_hashes[block_id] is None:
            self._free_block_ids.append(block_id)
        else:
            assert block_id not in self._evictable_block_ids, f"block {block_id} freed twice"
            self._evictable_block_ids[block_id] = None

    def _check_counts(self) -> None:
        assert self._num_used_blocks + self.num_free_blocks == self.num_blocks, "free + used != total"
