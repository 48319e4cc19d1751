"""The one interface every kind of slice offers to buckets, the engine, the admin API and metrics.

A slice is where a group of buckets runs: one worker (a thread, a process, later a Ray actor)
that steps the buckets' batchers in turns. Everything outside a slice names a bucket by its
key, ``(model name, bucket name, layout number)``, and talks to it through the slice: a bucket is a handle
``(slice, key)`` whatever the kind, so nothing outside branches on the slice's type.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from buckets.batcher import Batcher
from buckets.request import Request
from buckets.settings import ContinuousBatcherSettings, DynamicBatcherSettings
from buckets.stats import BatchObserver, BucketStats

# (model name, bucket name, layout number): a new bucket layout of a model may reuse its bucket
# names while the old buckets drain on the same slices, so the layout's number tells them apart.
BucketKey = tuple[str, str, int]
BatcherSettings = ContinuousBatcherSettings | DynamicBatcherSettings


class SliceState(enum.Enum):
    """Where a slice is in its life. A thread slice goes ``STOPPED -> READY -> STOPPED``; a
    process slice also passes ``STARTING`` and, after a crash, ``RESTARTING``; ``FAILED``: its
    worker could not be started and it serves nothing."""

    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class BucketSpec:
    """What a slice needs to host one bucket.

    ``make_batcher`` builds the bucket's real batcher (runner, KV pool: slow, and it needs the
    model's weights in this process). A slice whose worker runs in this process calls it once
    in :meth:`Slice.attach`; a slice whose worker is elsewhere never does (the worker builds its
    own from the config). ``settings`` are the batcher's settings at start; ``backend_info`` the
    bucket's backend description (``configured``, ``running``, ``gate``...), filled in by
    ``make_batcher`` or by the remote worker.
    """

    kind: str  # "continuous" or "dynamic"
    settings: BatcherSettings
    make_batcher: Callable[[], Batcher]
    backend_info: dict[str, Any] = field(default_factory=dict)


FIXED_CONTINUOUS_SETTINGS = ("block_size", "enable_prefix_caching")


def check_fixed_settings(old: BatcherSettings, new: BatcherSettings) -> None:
    """Refuse a change of a setting fixed for a bucket's life.

    Raises:
        ValueError: a continuous bucket's ``block_size`` or ``enable_prefix_caching`` differ.
    """
    if isinstance(old, ContinuousBatcherSettings) and any(
        getattr(new, name) != getattr(old, name) for name in FIXED_CONTINUOUS_SETTINGS
    ):
        raise ValueError("block_size and enable_prefix_caching are fixed for a bucket's life")


class Slice(Protocol):
    """Where a group of buckets runs. Implemented by :class:`~buckets.slices.thread.ThreadSlice`
    and :class:`~buckets.slices.process.ProcessSlice`.

    The engine calls :meth:`attach` / :meth:`detach` (off the event loop), :meth:`start` and
    :meth:`stop`; buckets call :meth:`submit`, :meth:`stats`, :meth:`update_settings` and
    :meth:`add_batch_observer` with their key from any thread; a :class:`Request`'s
    ``cancel()`` reaches :meth:`cancel` through the request's ``on_cancel`` callback, which
    :meth:`submit` registers. The admin API reads :meth:`describe`, metrics :attr:`busy_s` and
    :meth:`busy_ratio`.
    """

    name: str
    device: str  # "cpu", "cuda:N", or a MIG instance's UUID
    num_threads: int
    isolation: str  # the config's word for the kind: "thread", "process", "ray"

    @property
    def state(self) -> SliceState: ...

    @property
    def needs_weights(self) -> bool:
        """Whether the buckets on this slice run their models in this process (the gateway must
        then load the weights; otherwise a tokenizer and the model's config are enough)."""

    @property
    def busy_s(self) -> float:
        """Seconds its worker has spent in steps since start."""

    def busy_ratio(self, now: float | None = None) -> float:
        """The worker's share of the last seconds spent in steps (0 to 1)."""

    def describe(self) -> dict[str, Any]:
        """The slice for the admin API: name, device, num_threads, isolation, state (its
        enum's value), busy_ratio, and what its kind adds (a process's ``worker_pid``)."""

    def attach(self, key: BucketKey, spec: BucketSpec) -> None:
        """Host bucket ``key`` from now on (a local slice builds its batcher here: slow)."""

    def detach(self, key: BucketKey) -> None:
        """Take bucket ``key`` off, after a step of it already under way, and fail what it still
        holds with :class:`~buckets.errors.ShuttingDownError`.

        Raises:
            KeyError: ``key`` is not attached here.
        """

    def submit(self, key: BucketKey, request: Request) -> None:
        """Queue ``request`` on bucket ``key`` and wake the worker (thread-safe, never blocks).

        Raises:
            SliceUnavailableError: the worker is not ready (a process starting or restarting).
        """

    def cancel(self, request: Request) -> None:
        """``request`` was cancelled (client gone, deadline): have the worker drop it and free
        its KV blocks. Thread-safe; a request not (or no longer) here is ignored."""

    def stats(self, key: BucketKey) -> BucketStats:
        """A snapshot of bucket ``key``'s batcher (a remote one's latest report)."""

    def update_settings(self, key: BucketKey, settings: BatcherSettings) -> None:
        """Bucket ``key`` uses ``settings`` from its next step or batch on.

        Raises:
            ValueError: a setting fixed for the bucket's life differs (``block_size``).
        """

    def add_batch_observer(self, key: BucketKey, observer: BatchObserver) -> None:
        """Call ``observer(num_seqs, num_tokens, num_padding_tokens)`` after every forward of
        bucket ``key`` (on a worker or reader thread)."""

    def backend_info(self, key: BucketKey) -> dict[str, Any]:
        """Bucket ``key``'s backend description (``configured``, ``running``, ``gate``...)."""

    def start(self) -> None:
        """Start the worker (a process: wait until it is ready; slow).

        Raises:
            RuntimeError: the worker could not be started.
        """

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the worker after its current step and fail whatever is still queued."""
