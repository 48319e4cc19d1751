"""Snapshots of a bucket's counters; the gateway turns them into JSON and metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BucketStats:
    """Counters since the bucket started, plus the current queue state.

    ``num_steps`` counts forwards (continuous steps or dynamic batches);
    ``num_multi_seq_steps`` those that carried more than one request;
    ``max_batch_seqs`` the most requests in one forward;
    ``num_batched_tokens`` tokens computed (continuous) or padded input tokens (dynamic);
    ``num_padding_tokens`` padding inside dynamic batches.
    """

    kind: str
    num_waiting: int
    num_running: int
    num_steps: int
    num_multi_seq_steps: int
    max_batch_seqs: int
    num_batch_seqs_total: int
    num_batched_tokens: int
    num_padding_tokens: int
    num_finished: int
    num_cancelled: int
    num_failed: int

    @property
    def mean_batch_seqs(self) -> float:
        return self.num_batch_seqs_total / self.num_steps if self.num_steps else 0.0


@dataclass
class Counters:
    """The mutable counters behind :class:`BucketStats`; owned by the bucket's worker."""

    num_steps: int = 0
    num_multi_seq_steps: int = 0
    max_batch_seqs: int = 0
    num_batch_seqs_total: int = 0
    num_batched_tokens: int = 0
    num_padding_tokens: int = 0
    num_finished: int = 0
    num_cancelled: int = 0
    num_failed: int = 0

    def record_batch(self, num_seqs: int, num_tokens: int, num_padding_tokens: int = 0) -> None:
        self.num_steps += 1
        self.num_multi_seq_steps += num_seqs > 1
        self.max_batch_seqs = max(self.max_batch_seqs, num_seqs)
        self.num_batch_seqs_total += num_seqs
        self.num_batched_tokens += num_tokens
        self.num_padding_tokens += num_padding_tokens

    def snapshot(self, kind: str, num_waiting: int, num_running: int) -> BucketStats:
        return BucketStats(kind=kind, num_waiting=num_waiting, num_running=num_running, **self.__dict__)
