"""Which replica of a bucket serves a request: the power of two choices on load, with prefix
affinity.

Load: a replica's ``queued_prompt_tokens + running_seqs * running_seq_cost_tokens`` from the
stats it last pushed, plus what this router sent it since (so a burst between two pushes does
not pile onto one replica). Two replicas are drawn at random and the less loaded one serves
(Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing", 2001: the most loaded of
``n`` replicas then carries ``O(log log n)`` above the mean instead of ``O(log n / log log n)``
for one random choice), which needs no global view and spreads a burst without herding onto
whichever replica looked idlest at the last push.

Prefix affinity, as llm-d's prefix-cache scorer does it: the router remembers, per prefix-block
hash, which replicas it sent a prompt holding that block (an LRU index, bounded in blocks, the
last ``max_owners_per_block`` replicas each), and a request whose leading ``min_prefix_blocks``
or more blocks a replica holds goes to the one holding the longest run, unless that replica's
load is over ``max_affinity_load_ratio`` times the least loaded one's plus
``affinity_slack_tokens`` (a hot prefix must not pin all its traffic on one overloaded replica).
The hashes are the chained block hashes the block manager uses for prefix caching
(``buckets.sequence``), so "holds" means "its prefix cache likely has it".
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    """What a replica last pushed: prompt tokens waiting in its queues and sequences running."""

    queued_prompt_tokens: int
    running_seqs: int


@dataclass(frozen=True)
class RoutingSettings:
    """Knobs of :class:`ReplicaRouter`.

    Fields:
        running_seq_cost_tokens: what one running sequence weighs against queued prompt tokens
            (a decode step per running sequence costs about as much as this many prefill tokens).
        min_prefix_blocks: the fewest leading blocks a replica must hold for affinity.
        max_affinity_load_ratio, affinity_slack_tokens: affinity is kept while the holder's load
            is at most ``ratio * least + slack``.
        prefix_index_blocks: how many block hashes the index remembers (least recently routed
            dropped first).
        max_owners_per_block: how many replicas the index remembers per block (the most recent).
    """

    running_seq_cost_tokens: int = 64
    min_prefix_blocks: int = 4
    max_affinity_load_ratio: float = 2.0
    affinity_slack_tokens: int = 512
    prefix_index_blocks: int = 100_000
    max_owners_per_block: int = 4


class ReplicaRouter:
    """Picks a replica for each request (:meth:`pick`) and keeps the prefix index; not
    thread-safe (the gateway calls it from its event loop).

    Args:
        settings: the knobs.
        rng: the random source of the two choices (seed it for tests).
    """

    def __init__(self, settings: RoutingSettings | None = None, rng: random.Random | None = None):
        self.settings = settings or RoutingSettings()
        self._rng = rng or random.Random()
        self._prefix_owners: OrderedDict[int, list[str]] = OrderedDict()  # most recent owner first
        self._loads: dict[str, ReplicaLoad] = {}
        self._sent_tokens: dict[str, int] = {}

    def update_load(self, replica: str, load: ReplicaLoad) -> None:
        """A replica pushed its stats: they replace what this router had sent it since."""
        self._loads[replica] = load
        self._sent_tokens[replica] = 0

    def forget(self, replica: str) -> None:
        """A replica is gone: its load and the prefixes it held are dropped."""
        self._loads.pop(replica, None)
        self._sent_tokens.pop(replica, None)
        for block_hash, owners in list(self._prefix_owners.items()):
            if replica in owners:
                owners.remove(replica)
                if not owners:
                    del self._prefix_owners[block_hash]

    def load_tokens(self, replica: str) -> int:
        """The replica's load in prompt-token units (0 for one that never pushed)."""
        load = self._loads.get(replica, ReplicaLoad(0, 0))
        own = load.queued_prompt_tokens + load.running_seqs * self.settings.running_seq_cost_tokens
        return own + self._sent_tokens.get(replica, 0)

    def pick(self, replicas: Sequence[str], prefix_hashes: Sequence[int], num_prompt_tokens: int) -> str:
        """The replica that serves a request of ``num_prompt_tokens`` whose full prompt blocks
        hash to ``prefix_hashes`` (chained, first block first); records the choice.

        Raises:
            ValueError: no replica.
        """
        if not replicas:
            raise ValueError("no replica to route to")
        chosen = self._affine(replicas, prefix_hashes) or self._two_choices(replicas)
        self._sent_tokens[chosen] = self._sent_tokens.get(chosen, 0) + num_prompt_tokens
        for block_hash in prefix_hashes:
            owners = self._prefix_owners.setdefault(block_hash, [])
            if chosen in owners:
                owners.remove(chosen)
            owners.insert(0, chosen)
            del owners[self.settings.max_owners_per_block:]
            self._prefix_owners.move_to_end(block_hash)
        while len(self._prefix_owners) > self.settings.prefix_index_blocks:
            self._prefix_owners.popitem(last=False)
        return chosen

    def matched_blocks(self, replica: str, prefix_hashes: Sequence[int]) -> int:
        """How many leading blocks of ``prefix_hashes`` the index says ``replica`` holds."""
        count = 0
        for block_hash in prefix_hashes:
            if replica not in self._prefix_owners.get(block_hash, ()):
                break
            count += 1
        return count

    def _affine(self, replicas: Sequence[str], prefix_hashes: Sequence[int]) -> str | None:
        """The replica holding the longest leading run of blocks (the less loaded among equals),
        when it is long enough and that replica is not too loaded; else ``None``."""
        if len(prefix_hashes) < self.settings.min_prefix_blocks:
            return None
        holders = [r for r in self._prefix_owners.get(prefix_hashes[0], ()) if r in replicas]
        if not holders:
            return None
        holder = max(holders, key=lambda r: (self.matched_blocks(r, prefix_hashes), -self.load_tokens(r)))
        if self.matched_blocks(holder, prefix_hashes) < self.settings.min_prefix_blocks:
            return None
        least = min(self.load_tokens(r) for r in replicas)
        bound = self.settings.max_affinity_load_ratio * least + self.settings.affinity_slack_tokens
        return holder if self.load_tokens(holder) <= bound else None

    def _two_choices(self, replicas: Sequence[str]) -> str:
        """The less loaded of two replicas drawn at random (the only one, when there is one)."""
        if len(replicas) == 1:
            return replicas[0]
        first, second = self._rng.sample(list(replicas), 2)
        return first if self.load_tokens(first) <= self.load_tokens(second) else second
