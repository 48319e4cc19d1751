"""One replica of a Ray slice as Ray sees it: an actor that runs the same worker main as a
process slice's worker process, and the two ends of the channel between it and the gateway.

The worker main (:func:`gateway.slice_worker.run_slice_worker`) and its
:class:`~buckets.slices.host.SliceHost` talk to a ``multiprocessing`` connection: ``send`` and
``recv`` of the tuples of :mod:`buckets.slices.messages`. Here that connection is made of Ray
Core calls alone (no RPC of ours): the gateway's messages are actor method calls
(:meth:`SliceActor.put`, numbered, since a threaded actor may run two calls out of order), and
the worker's messages come back on one streaming generator (:meth:`SliceActor.events`, each
item the messages queued since the last one), as vLLM's Ray executor and Ray Serve's streaming
replicas do. Each gateway has a channel of its own (:mod:`buckets.slices.ray_channels`), so a
detached actor (``ray.detached``) serves every gateway of the same config and outlives them:
a restarted gateway attaches to it again instead of loading the models. The gateway's side (:class:`ActorConnection`) turns the end of that stream or the
actor's death into end of file, and :class:`ActorProcess` stands in for the worker process, so
:class:`~buckets.slices.process.ProcessSlice`'s supervision (fail what is in flight, restart with
backoff) runs unchanged on an actor. Ray is imported only when a Ray slice starts.
"""

from __future__ import annotations

import ipaddress
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from buckets.slices.messages import Message
from buckets.slices.ray_channels import ActorInbox

# Ray's switch for a cluster kept on one machine: with it, Ray does not swap a loopback address
# (the cluster's, a node's) for the host's network address.
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_CONNECT_LOCK = threading.Lock()
# Threads of the actor for its calls: each attached gateway's events stream holds one for good,
# put, renew, attach and where hold one for a moment.
ACTOR_MAX_CONCURRENCY = 16
CHANNEL_LEASE_S = 10.0  # a detached actor closes a gateway's channel not renewed for this long
CHANNEL_RENEW_S = 2.0  # how often a gateway renews its channel's lease
LEASE_CHECK_S = 1.0


@dataclass(frozen=True)
class RayPlacement:
    """Where a Ray slice's actors run, from the config.

    Fields:
        address: the cluster's address (``auto``, ``ray://host:port`` or the GCS ``host:port``).
        num_cpus, num_gpus: what each actor reserves.
        custom_resources: custom resources each actor reserves (``{"node1": 0.1}``).
        node_id: the Ray node every replica must run on (hex), or ``None``.
        replicas: how many actors serve the slice's buckets.
        strategy: ``PACK`` (Ray's default placement) or ``SPREAD`` (over the nodes).
        namespace: the Ray namespace of the actors.
        detached: the actors are detached and shared: named in ``namespace``, they outlive the
            gateway that created them, and every gateway of the same config attaches to them.
    """

    address: str
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    custom_resources: dict[str, float] = field(default_factory=dict)
    node_id: str | None = None
    replicas: int = 1
    strategy: str = "PACK"
    namespace: str = "sluice"
    detached: bool = False


def connect(address: str, namespace: str) -> None:
    """Connect this process to the Ray cluster at ``address``, in Ray namespace ``namespace``
    (once; later calls do nothing).

    A loopback address (``127.0.0.1:6379``, a local test cluster) keeps this driver on the
    loopback too: Ray would otherwise replace it by the host's network address.

    Raises:
        ConnectionError: no cluster answers at ``address``.
    """
    host = address.removeprefix("ray://").rsplit(":", 1)[0]
    if _is_loopback(host):
        os.environ.setdefault(LOOPBACK_ONLY_ENV, "0")  # read when Ray is imported, here or in a child
    import ray
    from ray._private import ray_constants

    if _is_loopback(host):  # Ray was imported before (by a test, say): its switch is already read
        ray_constants.ENABLE_RAY_CLUSTER = False

    with _CONNECT_LOCK:  # the replicas of a slice start side by side
        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = {"_node_ip_address": host} if _is_loopback(host) else {}
        ray.init(address=address, namespace=namespace, include_dashboard=False, log_to_driver=False, **kwargs)


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SliceActor:
    """The actor of one replica (wrapped with ``ray.remote`` by :func:`actor_class`): runs the
    worker main once, on a thread, and serves it to every gateway attached (:meth:`attach`);
    each reads its messages from :meth:`events` of its own channel."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inbox: ActorInbox | None = None
        self._fingerprint: str | None = None
        self.num_loads = 0  # worker mains started (the models loaded): 1 for the actor's life
        self.num_attaches = 0  # channels attached so far

    def where(self) -> dict[str, Any]:
        """The actor's node (id, address) and process id."""
        import ray

        node_ip: Callable[[], str] = ray.util.get_node_ip_address  # untyped in Ray's stubs
        return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": node_ip(), "pid": os.getpid()}

    def attach(
        self, channel_id: str, fingerprint: str, target: Callable[..., None], args: tuple[Any, ...],
        lease_s: float | None,
    ) -> dict[str, Any]:
        """Open channel ``channel_id`` for a gateway whose config has ``fingerprint``; the first
        attach starts the worker main, ``target(inbox, *args)`` (it loads the models).
        ``lease_s``: a shared (detached) actor's channel lease; ``None`` for an owned actor.

        Returns :meth:`where` plus the actor's ``fingerprint``, ``num_loads``, ``num_attaches``
        and ``attached`` (``False``: the actor runs another config, and no channel was opened).
        """
        with self._lock:
            if self._inbox is None:
                self._inbox, self._fingerprint = ActorInbox(shared=lease_s is not None), fingerprint
                self.num_loads += 1
                threading.Thread(target=self._main, args=(target, args), name="slice-actor-main", daemon=True).start()
                if lease_s is not None:
                    threading.Thread(target=self._expire, args=(lease_s,), name="slice-actor-leases", daemon=True).start()
            attached = fingerprint == self._fingerprint
            if attached:
                self._inbox.open(channel_id)
                self.num_attaches += 1
        info = {"fingerprint": self._fingerprint, "num_loads": self.num_loads, "num_attaches": self.num_attaches}
        return {**self.where(), **info, "attached": attached}

    def _main(self, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        assert self._inbox is not None
        error = None
        try:
            target(self._inbox, *args)
        except BaseException as exc:  # the gateways are told why the worker could not serve
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            traceback.print_exc()
        self._inbox.send(("exited", error))
        self._inbox.send(None)

    def _expire(self, lease_s: float) -> None:
        assert self._inbox is not None
        while True:
            time.sleep(LEASE_CHECK_S)  # the actor's own thread, for the actor's life
            for channel_id in self._inbox.expire(lease_s):
                print(f"channel {channel_id} closed: its gateway did not renew its lease within {lease_s} s", flush=True)

    def put(self, channel_id: str, message_no: int, message: Message) -> None:
        """Channel ``channel_id``'s ``message_no``-th message (numbered from 0)."""
        if self._inbox is not None:
            self._inbox.put(channel_id, message_no, message)

    def renew(self, channel_id: str) -> None:
        """Channel ``channel_id``'s gateway is alive (its lease starts again)."""
        if self._inbox is not None:
            self._inbox.renew(channel_id)

    def leave(self, channel_id: str) -> None:
        """Close channel ``channel_id`` now (its requests in flight are cancelled)."""
        if self._inbox is not None:
            self._inbox.close_channel(channel_id)

    def events(self, channel_id: str) -> Any:
        """Channel ``channel_id``'s messages, a list of those queued since the last item, until
        the channel closes or the worker exits."""
        assert self._inbox is not None
        outbox = self._inbox.outbox(channel_id)
        while True:
            batch = [outbox.get()]
            while True:
                try:
                    batch.append(outbox.get_nowait())
                except queue.Empty:
                    break
            yield [m for m in batch if m is not None]
            if batch[-1] is None:
                return


def actor_class() -> Any:
    """:class:`SliceActor` as a Ray actor class (threaded: a call blocked on the stream must not
    hold back the gateway's messages)."""
    import ray

    remote: Any = ray.remote  # its stubs lack the actor options
    return remote(max_restarts=0, max_concurrency=ACTOR_MAX_CONCURRENCY)(SliceActor)


def actor_options(placement: RayPlacement, index: int, name: str) -> dict[str, Any]:
    """Ray ``.options()`` of replica ``index`` (named ``name``) of a slice placed by ``placement``;
    a detached one is created unless it exists (``get_if_exists``), and outlives its creator."""
    options: dict[str, Any] = {
        "name": name, "namespace": placement.namespace, "num_cpus": placement.num_cpus,
        "num_gpus": placement.num_gpus, "resources": dict(placement.custom_resources),
    }
    if placement.detached:
        options.update(lifetime="detached", get_if_exists=True)
    if placement.node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(placement.node_id, soft=False)
    elif placement.strategy == "SPREAD":
        options["scheduling_strategy"] = "SPREAD"
    return options


class ActorProcess:
    """Stands in for a worker process (``pid``, ``exitcode``, ``is_alive``, ``join``, ``kill``):
    alive until this gateway's channel of the actor ends; ``error`` is what the worker main
    raised, if it did.

    Args:
        actor: the actor's handle.
        channel_id: this gateway's channel of the actor.
        detached: the actor is shared: ``kill`` closes this gateway's channel alone, and the
            end of the channel (a stop, a lapsed lease) leaves the actor running.
    """

    def __init__(self, actor: Any, channel_id: str = "", detached: bool = False):
        self.actor = actor
        self.channel_id = channel_id
        self.detached = detached
        self.pid: int | None = None
        self.exitcode: int | None = None
        self.error: str | None = None
        self.has_exited = False  # the worker main said it exited
        self.where: dict[str, Any] = {}
        self._ended = threading.Event()

    def is_alive(self) -> bool:
        return not self._ended.is_set()

    def join(self, timeout_s: float | None = None) -> None:
        self._ended.wait(timeout_s)

    def kill(self) -> None:
        """Kill the actor; a detached one's other gateways keep it: only this channel closes."""
        if self.detached:
            self.actor.leave.remote(self.channel_id)
            return
        self._kill_actor()

    def _kill_actor(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    def ended(self, exitcode: int) -> None:
        """The channel ended (``exitcode`` 0: the worker returned or the channel closed; else
        the worker failed or the actor died). The actor is killed, so its resources go back to
        the cluster, unless it is detached and its worker still serves (only the channel closed)."""
        if self.exitcode is None:
            self.exitcode = exitcode
        if not self.detached or self.has_exited or exitcode != 0:
            try:
                self._kill_actor()
            except Exception:  # already gone
                pass
        self._ended.set()


class ActorConnection:
    """The gateway's end of its channel (the :class:`~multiprocessing.connection.Connection`
    calls the process slice uses): ``send`` calls :meth:`SliceActor.put`, ``recv`` reads the
    channel's stream; its end, the actor's death or the node's loss is :class:`EOFError`. On a
    detached actor, a thread renews the channel's lease every ``CHANNEL_RENEW_S`` until its end."""

    def __init__(self, process: ActorProcess, stream: Any):
        self.process = process
        self._stream = stream
        self._received: list[Message] = []
        self._next_no = 0
        self._send_lock = threading.Lock()
        if process.detached:
            threading.Thread(target=self._renew, name="slice-actor-lease", daemon=True).start()

    def send(self, message: Message) -> None:
        with self._send_lock:
            message_no, self._next_no = self._next_no, self._next_no + 1
        self.process.actor.put.remote(self.process.channel_id, message_no, message)

    def _renew(self) -> None:
        while not self.process._ended.wait(CHANNEL_RENEW_S):
            try:
                self.process.actor.renew.remote(self.process.channel_id)
            except Exception:  # the actor is gone: the stream's end says so
                return

    def recv(self) -> Message:
        """The worker's next message (blocking).

        Raises:
            EOFError: the channel closed, the worker exited, or the actor or its node died.
        """
        import ray

        while not self._received:
            try:
                batch = ray.get(next(self._stream))
            except StopIteration:
                self.process.ended(0 if self.process.error is None else 1)
                raise EOFError("the actor's stream ended") from None
            except ray.exceptions.RayError as exc:
                self.process.error = self.process.error or f"{type(exc).__name__}: the actor died"
                self.process.ended(-9)
                raise EOFError(str(exc)) from None
            for message in batch:
                if message[0] == "exited":
                    self.process.has_exited = True
                    self.process.error = message[1]
                else:
                    self._received.append(message)
        return self._received.pop(0)

    def close(self) -> None:
        """Nothing to release: the stream ends with the channel."""
