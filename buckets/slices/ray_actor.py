"""One replica of a Ray slice as Ray sees it: an actor that runs the same worker main as a
process slice's worker process, and the two ends of the channel between it and the gateway.

The worker main (:func:`gateway.slice_worker.run_slice_worker`) and its
:class:`~buckets.slices.host.SliceHost` talk to a ``multiprocessing`` connection: ``send`` and
``recv`` of the tuples of :mod:`buckets.slices.messages`. Here that connection is made of Ray
Core calls alone (no RPC of ours): the gateway's messages are actor method calls
(:meth:`SliceActor.put`, numbered, since a threaded actor may run two calls out of order), and
the worker's messages come back on one streaming generator (:meth:`SliceActor.events`, each
item the messages queued since the last one), as vLLM's Ray executor and Ray Serve's streaming
replicas do. The gateway's side (:class:`ActorConnection`) turns the end of that stream or the
actor's death into end of file, and :class:`ActorProcess` stands in for the worker process, so
:class:`~buckets.slices.process.ProcessSlice`'s supervision (fail what is in flight, restart with
backoff) runs unchanged on an actor. Ray is imported only when a Ray slice starts.
"""

from __future__ import annotations

import ipaddress
import os
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from buckets.slices.messages import Message

# Ray's switch for a cluster kept on one machine: with it, Ray does not swap a loopback address
# (the cluster's, a node's) for the host's network address.
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_CONNECT_LOCK = threading.Lock()
ACTOR_MAX_CONCURRENCY = 4  # put, events, where and run may each hold a thread of the actor


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
    """

    address: str
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    custom_resources: dict[str, float] = field(default_factory=dict)
    node_id: str | None = None
    replicas: int = 1
    strategy: str = "PACK"
    namespace: str = "sluice"


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


class ActorInbox:
    """The worker's end of the channel, inside the actor: ``recv`` returns the gateway's
    messages in the order they were sent, ``send`` queues one for :meth:`SliceActor.events`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[int, Message] = {}
        self._next_no = 0
        self._closed = False
        self.outbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()

    def put(self, message_no: int, message: Message) -> None:
        with self._cond:
            self._pending[message_no] = message
            self._cond.notify_all()

    def recv(self) -> Message:
        """The next message from the gateway (blocking).

        Raises:
            EOFError: the channel is closed.
        """
        with self._cond:
            while self._next_no not in self._pending:
                if self._closed:
                    raise EOFError("the gateway's channel is closed")
                self._cond.wait()
            self._next_no += 1
            return self._pending.pop(self._next_no - 1)

    def send(self, message: Message | None) -> None:
        """Queue ``message`` for the gateway; ``None`` ends the stream."""
        self.outbox.put(message)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class SliceActor:
    """The actor of one replica (wrapped with ``ray.remote`` by :func:`actor_class`): runs
    ``target(inbox, *args)`` on a thread; the gateway reads its messages from :meth:`events`."""

    def __init__(self) -> None:
        self._inbox = ActorInbox()

    def where(self) -> dict[str, Any]:
        """The actor's node (id, address) and process id."""
        import ray

        node_ip: Callable[[], str] = ray.util.get_node_ip_address  # untyped in Ray's stubs
        return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": node_ip(), "pid": os.getpid()}

    def run(self, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        """Start the worker main; when it returns or raises, the stream ends with
        ``("exited", error or None)``."""
        threading.Thread(target=self._main, args=(target, args), name="slice-actor-main", daemon=True).start()

    def _main(self, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        error = None
        try:
            target(self._inbox, *args)
        except BaseException as exc:  # the gateway is told why the worker could not serve
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            traceback.print_exc()
        self._inbox.send(("exited", error))
        self._inbox.send(None)

    def put(self, message_no: int, message: Message) -> None:
        """The gateway's ``message_no``-th message (numbered from 0)."""
        self._inbox.put(message_no, message)

    def events(self) -> Any:
        """The worker's messages, a list of those queued since the last item, until it exits."""
        while True:
            batch = [self._inbox.outbox.get()]
            while True:
                try:
                    batch.append(self._inbox.outbox.get_nowait())
                except queue.Empty:
                    break
            done = batch[-1] is None
            yield [m for m in batch if m is not None]
            if done:
                self._inbox.close()
                return


def actor_class() -> Any:
    """:class:`SliceActor` as a Ray actor class (threaded: a call blocked on the stream must not
    hold back the gateway's messages)."""
    import ray

    remote: Any = ray.remote  # its stubs lack the actor options
    return remote(max_restarts=0, max_concurrency=ACTOR_MAX_CONCURRENCY)(SliceActor)


def actor_options(placement: RayPlacement, index: int, name: str) -> dict[str, Any]:
    """Ray ``.options()`` of replica ``index`` (named ``name``) of a slice placed by ``placement``."""
    options: dict[str, Any] = {
        "name": name, "namespace": placement.namespace, "num_cpus": placement.num_cpus,
        "num_gpus": placement.num_gpus, "resources": dict(placement.custom_resources),
    }
    if placement.node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(placement.node_id, soft=False)
    elif placement.strategy == "SPREAD":
        options["scheduling_strategy"] = "SPREAD"
    return options


class ActorProcess:
    """Stands in for a worker process (``pid``, ``exitcode``, ``is_alive``, ``join``, ``kill``):
    alive until the actor's stream ends; ``error`` is what the worker main raised, if it did."""

    def __init__(self, actor: Any):
        self.actor = actor
        self.pid: int | None = None
        self.exitcode: int | None = None
        self.error: str | None = None
        self.where: dict[str, Any] = {}
        self._ended = threading.Event()

    def is_alive(self) -> bool:
        return not self._ended.is_set()

    def join(self, timeout_s: float | None = None) -> None:
        self._ended.wait(timeout_s)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    def ended(self, exitcode: int) -> None:
        """The stream ended (``exitcode`` 0: the worker returned; else it failed or died): the
        actor is killed, so its resources go back to the cluster."""
        if self.exitcode is None:
            self.exitcode = exitcode
        try:
            self.kill()
        except Exception:  # already gone
            pass
        self._ended.set()


class ActorConnection:
    """The gateway's end of the channel (the :class:`~multiprocessing.connection.Connection`
    calls the process slice uses): ``send`` calls :meth:`SliceActor.put`, ``recv`` reads the
    stream; its end, the actor's death or the node's loss is :class:`EOFError`."""

    def __init__(self, process: ActorProcess, stream: Any):
        self.process = process
        self._stream = stream
        self._received: list[Message] = []
        self._next_no = 0
        self._send_lock = threading.Lock()

    def send(self, message: Message) -> None:
        with self._send_lock:
            message_no, self._next_no = self._next_no, self._next_no + 1
        self.process.actor.put.remote(message_no, message)

    def recv(self) -> Message:
        """The worker's next message (blocking).

        Raises:
            EOFError: the worker exited, or the actor or its node died.
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
                    self.process.error = message[1]
                else:
                    self._received.append(message)
        return self._received.pop(0)

    def close(self) -> None:
        """Nothing to release: the stream ends with the actor."""
