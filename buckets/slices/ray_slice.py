"""A slice whose buckets run in Ray actors, one per replica, on any node of a Ray cluster.

Each replica is a :class:`RayReplica`: a :class:`~buckets.slices.process.ProcessSlice` whose
worker is a Ray actor (:mod:`buckets.slices.ray_actor`) instead of a local process. The actor
runs the same worker main, so requests, events with their timeline stamps, cancellations,
deadlines, stats and rebuilds cross as they do for a process slice, and the supervision is the
same: when an actor or its node dies, its requests in flight fail with
:class:`~buckets.errors.WorkerCrashedError` and the gateway creates a new actor (with backoff),
which loads the models from its node's files again. With ``placement.detached`` the actors are
detached and shared: named after the slice and the replica, they serve every gateway of the same
config in the namespace (each on a channel of its own), a gateway's stop closes its channel only,
and a restarted gateway attaches again to the actors still alive, which load nothing.

:class:`RaySlice` is the slice the engine sees: it attaches every bucket to every replica and
routes each request to one replica with :class:`~policies.replica_routing.ReplicaRouter` (power
of two choices on the load each replica pushed, prefix affinity on the prompt's block hashes).
Its stats are the sum over the replicas, so admission counts the bucket as a whole.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import uuid
from collections.abc import Callable
from typing import Any

from buckets.block_manager import hash_block_tokens
from buckets.errors import SliceUnavailableError
from buckets.request import Request
from buckets.settings import ContinuousBatcherSettings
from buckets.slices.messages import Message
from buckets.slices.process import RETRY_AFTER_S, ProcessSlice
from buckets.slices.ray_actor import (
    CHANNEL_LEASE_S,
    ActorConnection,
    ActorProcess,
    RayPlacement,
    actor_class,
    actor_options,
    connect,
)
from buckets.slices.ray_channels import actor_name, config_fingerprint
from buckets.slices.remote import InFlight
from buckets.slices.slice import BatcherSettings, BucketKey, BucketSpec, SliceState
from buckets.slices.worker import WorkerProcess
from buckets.stats import BY_KEY_FIELDS, STEP_TIME_FIELDS, BatchObserver, BucketStats, add_by_key
from policies.replica_routing import ReplicaLoad, ReplicaRouter

MAX_STATS_FIELDS = frozenset({"max_batch_seqs", "kv_block_size"}) | STEP_TIME_FIELDS  # the replicas' largest, not their sum


class RayReplica(ProcessSlice):
    """One replica of a Ray slice: a process slice whose worker is the Ray actor ``name``.

    Args:
        name: the replica's name (the slice's name and its index), also its actor's name.
        placement: where its actor runs.
        index: which replica it is (its actor's options).
        on_stats: called with this replica after each stats push (the router's load).
        Others as :class:`~buckets.slices.process.ProcessSlice`.
    """

    isolation = "ray"

    def __init__(
        self, name: str, device: str, num_threads: int, target: Callable[..., None],
        worker_args: Callable[[], tuple[Any, ...]], placement: RayPlacement, index: int,
        on_stats: Callable[["RayReplica"], None],
    ):
        super().__init__(name, device, num_threads, target, worker_args)
        self.placement = placement
        self.index = index
        self._on_stats = on_stats
        self._dequeued: set[int] = set()  # requests in flight the worker has started

    def start(self) -> None:
        """Connect to the cluster, start the actor and wait until it is ready (it loads its models).

        Raises:
            RuntimeError: the actor could not start; the message carries the worker's error
                (a model source missing on the actor's node, for one).
        """
        connect(self.placement.address, self.placement.namespace)
        try:
            super().start()
        except RuntimeError as exc:
            worker = self._worker
            error = worker.process.error if worker is not None else None
            raise RuntimeError(f"slice {self.name!r}: the Ray actor did not start: {error or exc}") from None

    def describe(self) -> dict[str, Any]:
        """The process slice's description plus the actor's ``node_id`` and ``node_ip``, the
        requests sent to it and those still in flight, its buckets' prefix-cache hits (in blocks),
        and of its actor: ``actor_name``, ``actor_loads`` (worker mains it started: 1) and
        ``attached_to_running`` (this gateway found it serving already: nothing was loaded)."""
        worker = self._worker
        where = worker.process.where if worker is not None else {}
        hits = sum(bucket.stats.prefix_cache_hits for bucket in self._buckets.values())
        return {
            **super().describe(), "node_id": where.get("node_id"), "node_ip": where.get("node_ip"),
            "num_submitted": self.num_submitted, "num_in_flight": self.num_in_flight, "prefix_cache_hits": hits,
            "actor_name": self.name, "actor_loads": where.get("num_loads"),
            "attached_to_running": where.get("num_attaches", 0) > 1,
        }

    def load(self) -> ReplicaLoad:
        """Prompt tokens of the requests sent here and not yet started, and sequences running."""
        with self._lock:
            queued = sum(len(e.request.prompt_token_ids) for no, e in self._in_flight.items() if no not in self._dequeued)
        running = sum(bucket.stats.num_running for bucket in self._buckets.values())
        return ReplicaLoad(queued, running)

    def _spawn(self) -> tuple[Any, Any]:
        """Create the actor (or, detached, find it), attach a channel of this gateway to it (the
        first attach starts the worker main) and open the channel's stream.

        Raises:
            RuntimeError: the detached actor of this name runs another config (its models or
                buckets differ): refused, since replacing it would drop what it serves for the
                gateways of that config.
        """
        import ray

        args = self._worker_args()
        fingerprint = config_fingerprint(args[0], args[1])
        actor = actor_class().options(**actor_options(self.placement, self.index, self.name)).remote()
        process = ActorProcess(actor, uuid.uuid4().hex, self.placement.detached)
        lease_s = CHANNEL_LEASE_S if self.placement.detached else None
        try:
            process.where = ray.get(
                actor.attach.remote(process.channel_id, fingerprint, self._target, args, lease_s), timeout=self.start_timeout_s,
            )
        except ray.exceptions.RayError as exc:
            process.error = f"{type(exc).__name__}: {exc}"
        if process.where and not process.where["attached"]:
            raise RuntimeError(
                f"the detached Ray actor {self.name!r} in namespace {self.placement.namespace!r} runs another config "
                f"(fingerprint {process.where['fingerprint']}, this config's {fingerprint}); kill it "
                f"(ray.kill(ray.get_actor({self.name!r}, namespace={self.placement.namespace!r}))) or set another ray.namespace"
            )
        return process, ActorConnection(process, actor.events.remote(process.channel_id))

    def _dispatch(self, worker: WorkerProcess, message: Message) -> None:
        if message[0] == "dequeued":
            self._dequeued.add(message[1])
        super()._dispatch(worker, message)
        if message[0] == "stats":
            self._on_stats(self)

    def _take(self, request_no: int) -> InFlight:
        self._dequeued.discard(request_no)
        return super()._take(request_no)


def merge_stats(snapshots: list[BucketStats]) -> BucketStats:
    """One bucket's stats over its replicas: counters and queues summed, maxima the largest."""
    first = snapshots[0]
    merged: dict[str, Any] = {"kind": first.kind}
    for item in dataclasses.fields(BucketStats):
        if item.name != "kind":
            values = [getattr(s, item.name) for s in snapshots]
            if item.name in BY_KEY_FIELDS:
                merged[item.name] = add_by_key(values)
            else:
                merged[item.name] = max(values) if item.name in MAX_STATS_FIELDS else sum(values)
    return BucketStats(**merged)


class RaySlice:
    """Implements :class:`~buckets.slices.slice.Slice` for ``isolation: ray``: the slice's
    buckets on ``placement.replicas`` Ray actors, each request routed to one of them.

    Args:
        name, device, num_threads, target, worker_args: as :class:`ProcessSlice`.
        placement: the cluster and where the actors run.
        router: the replica router (a seeded one in tests).
    """

    isolation = "ray"
    needs_weights = False  # the actors load the weights; the gateway tokenizes only

    def __init__(
        self, name: str, device: str, num_threads: int, target: Callable[..., None],
        worker_args: Callable[[], tuple[Any, ...]], placement: RayPlacement, router: ReplicaRouter | None = None,
    ):
        self.name = name
        self.device = device
        self.num_threads = num_threads
        self.placement = placement
        self.replicas = [
            RayReplica(actor_name(name, i), device, num_threads, target, worker_args, placement, i, self._on_stats)
            for i in range(placement.replicas)
        ]
        self._router = router or ReplicaRouter()
        self._router_lock = threading.Lock()
        self._block_sizes: dict[BucketKey, int] = {}

    @property
    def state(self) -> SliceState:
        """``READY`` while any replica is; else the first replica's state."""
        states = [replica.state for replica in self.replicas]
        return SliceState.READY if SliceState.READY in states else states[0]

    @property
    def busy_s(self) -> float:
        return sum(replica.busy_s for replica in self.replicas)

    def busy_ratio(self, now: float | None = None) -> float:
        """The replicas' mean share of the last seconds spent in steps."""
        return sum(replica.busy_ratio(now) for replica in self.replicas) / len(self.replicas)

    def describe(self) -> dict[str, Any]:
        """The slice, and per replica its name, node, state, actor pid and restarts."""
        return {
            "name": self.name, "device": self.device, "num_threads": self.num_threads, "isolation": self.isolation,
            "state": self.state.value, "busy_ratio": self.busy_ratio(), "num_replicas": len(self.replicas),
            "replicas": [replica.describe() for replica in self.replicas],
        }

    def attach(self, key: BucketKey, spec: BucketSpec) -> None:
        if isinstance(spec.settings, ContinuousBatcherSettings):
            self._block_sizes[key] = spec.settings.block_size
        for replica in self.replicas:
            replica.attach(key, spec)

    def detach(self, key: BucketKey) -> None:
        for replica in self.replicas:
            replica.detach(key)
        self._block_sizes.pop(key, None)

    def start(self) -> None:
        """Start every replica's actor, side by side, and wait until each is ready.

        Raises:
            RuntimeError: an actor could not start (it is ``FAILED``, the others are stopped).
        """
        with concurrent.futures.ThreadPoolExecutor(len(self.replicas), thread_name_prefix=f"slice-{self.name}-start") as pool:
            futures = [pool.submit(replica.start) for replica in self.replicas]
        errors = {replica: future.exception() for replica, future in zip(self.replicas, futures) if future.exception()}
        if errors:
            self.stop()
            for replica in errors:
                replica.state = SliceState.FAILED
            raise RuntimeError("; ".join(str(error) for error in errors.values()))

    def stop(self, timeout_s: float = 10.0) -> None:
        for replica in self.replicas:
            replica.stop(timeout_s)
        with self._router_lock:
            for replica in self.replicas:
                self._router.forget(replica.name)

    def submit(self, key: BucketKey, request: Request) -> None:
        """Send ``request`` to the replica the router picks among the ready ones.

        Raises:
            SliceUnavailableError: no replica is ready.
        """
        ready = {replica.name: replica for replica in self.replicas if replica.state is SliceState.READY}
        if not ready:
            raise SliceUnavailableError(f"no replica of slice {self.name!r} is ready ({self.state.value})", RETRY_AFTER_S)
        hashes = self._prefix_hashes(key, request.prompt_token_ids)
        with self._router_lock:
            chosen = self._router.pick(list(ready), hashes, len(request.prompt_token_ids))
        ready[chosen].submit(key, request)

    def cancel(self, request: Request) -> None:
        """Forward to every replica (the one holding ``request`` drops it; the others ignore it)."""
        for replica in self.replicas:
            replica.cancel(request)

    def stats(self, key: BucketKey) -> BucketStats:
        """Bucket ``key``'s latest stats summed over its replicas."""
        return merge_stats([replica.stats(key) for replica in self.replicas])

    def update_settings(self, key: BucketKey, settings: BatcherSettings) -> None:
        for replica in self.replicas:
            replica.update_settings(key, settings)

    def add_batch_observer(self, key: BucketKey, observer: BatchObserver) -> None:
        for replica in self.replicas:
            replica.add_batch_observer(key, observer)

    def backend_info(self, key: BucketKey) -> dict[str, Any]:
        """Bucket ``key``'s backend description, as the first replica's worker reported it."""
        return self.replicas[0].backend_info(key)

    def _prefix_hashes(self, key: BucketKey, token_ids: list[int]) -> list[int]:
        """The chained hashes of the prompt's full blocks (none for a bucket without blocks)."""
        block_size = self._block_sizes.get(key)
        hashes: list[int] = []
        if block_size is None:
            return hashes
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
        return hashes

    def _on_stats(self, replica: RayReplica) -> None:
        load = replica.load()
        with self._router_lock:
            self._router.update_load(replica.name, load)
