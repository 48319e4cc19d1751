"""The channels of the gateways attached to one Ray slice actor, multiplexed onto the one
connection its worker main serves, and what names such an actor and the config it runs.

A gateway attaches a channel (an id of its own, a fresh ``uuid4`` hex per attach) and talks
over it as over a process slice's pipe: its messages are numbered per channel, and its events
come back on its own stream. :class:`ActorInbox` is the worker's end of them all: one
connection (``recv`` / ``send``) for the :class:`~buckets.slices.host.SliceHost`, which serves
every channel with the same batchers, KV pools and prefix caches. Request numbers are the
gateways' own, so the inbox makes them ``(channel_id, request_no)`` on the way in and gives each
event back to its channel with the gateway's number again: two gateways' numbers never collide.
Stats, batch reports and readiness go to every channel; a channel opened after the worker is
ready is told so at once (the ready message is kept, with the backend info of later rebuilds).

A shared (detached) actor outlives its gateways: a gateway's ``("stop",)`` closes its channel
only, and so does a lease not renewed within ``lease_s`` (a gateway that died). Closing a
channel cancels its requests in flight in the worker (which frees their KV blocks) and ends its
stream; the other channels' requests go on.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from buckets.slices.messages import Message

CANCEL_REASON = "cancelled"  # what a closed channel's requests are cancelled with in the worker
BROADCAST_KINDS = frozenset({"ready", "stats", "batch", "rebuilt", "exited"})


def actor_name(slice_name: str, index: int) -> str:
    """The Ray actor name of replica ``index`` of slice ``slice_name`` (unique in a namespace)."""
    return f"{slice_name}-{index}"


def config_fingerprint(config_data: dict[str, Any], slice_name: str) -> str:
    """What identifies the models a slice's actors run: a hash (16 hex digits, SHA-256) of the
    slice's entry of the config (its ``replicas`` left out: a scaled slice keeps its actors) and
    of every model with a bucket on it, with those buckets alone.

    ``config_data`` is the whole config as plain JSON data (``GatewayConfig.model_dump(mode="json")``,
    the first of the worker arguments a Ray slice is given).

    Raises:
        StopIteration: no slice ``slice_name`` in ``config_data``.
    """
    the_slice = {k: v for k, v in next(s for s in config_data["slices"] if s["name"] == slice_name).items() if k != "replicas"}
    models = []
    for model in config_data["models"]:
        buckets = [b for b in model["buckets"] if b["slice"] == slice_name]
        if buckets:
            models.append({**model, "buckets": buckets})
    text = json.dumps({"slice": the_slice, "models": models}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Channel:
    """One gateway's channel: its messages not yet in order, its events, its requests in flight."""

    renewed_s: float
    outbox: queue.SimpleQueue[Message | None] = field(default_factory=queue.SimpleQueue)
    pending: dict[int, Message] = field(default_factory=dict)
    next_no: int = 0
    in_flight: set[int] = field(default_factory=set)


class ActorInbox:
    """The worker's end of every gateway's channel (thread-safe).

    Args:
        shared: a detached actor's: a channel's ``("stop",)`` closes that channel alone (else it
            stops the worker, as a process slice's does).
        clock: seconds, monotonic (the leases).
    """

    def __init__(self, shared: bool = False, clock: Callable[[], float] = time.monotonic):
        self.shared = shared
        self.clock = clock
        self._cond = threading.Condition()
        self._channels: dict[str, Channel] = {}
        self._inbound: deque[Message] = deque()
        self._ready: Message | None = None
        self._exited: Message | None = None
        self._closed = False

    @property
    def num_channels(self) -> int:
        return len(self._channels)

    def open(self, channel_id: str) -> None:
        """Attach channel ``channel_id``; it is told at once if the worker is ready or has exited."""
        with self._cond:
            channel = self._channels[channel_id] = Channel(self.clock())
            for message in (self._ready, self._exited):
                if message is not None:
                    channel.outbox.put(message)
            if self._closed:
                self._channels.pop(channel_id).outbox.put(None)

    def outbox(self, channel_id: str) -> queue.SimpleQueue[Message | None]:
        """Channel ``channel_id``'s events, ``None`` last (its stream ends there).

        Raises:
            KeyError: no such channel is open.
        """
        with self._cond:
            return self._channels[channel_id].outbox

    def put(self, channel_id: str, message_no: int, message: Message) -> None:
        """Channel ``channel_id``'s ``message_no``-th message (numbered from 0); those of a
        closed channel are dropped."""
        with self._cond:
            channel = self._channels.get(channel_id)
            if channel is None:
                return
            channel.pending[message_no] = message
            while channel.next_no in channel.pending:
                self._accept(channel_id, channel, channel.pending.pop(channel.next_no))
                channel.next_no += 1
            self._cond.notify_all()

    def _accept(self, channel_id: str, channel: Channel, message: Message) -> None:
        """Queue one message of a channel for the worker, its request number made the inbox's."""
        kind = message[0]
        if kind == "stop" and self.shared:
            self._close(channel_id)
            return
        if kind == "submit":
            wire = message[2]
            channel.in_flight.add(wire["request_no"])
            message = ("submit", message[1], {**wire, "request_no": (channel_id, wire["request_no"])})
        elif kind == "cancel":
            channel.in_flight.discard(message[1])
            message = ("cancel", (channel_id, message[1]), message[2])
        self._inbound.append(message)

    def renew(self, channel_id: str) -> None:
        """Channel ``channel_id``'s gateway is alive (its lease starts again)."""
        with self._cond:
            if (channel := self._channels.get(channel_id)) is not None:
                channel.renewed_s = self.clock()

    def expire(self, lease_s: float) -> list[str]:
        """Close the channels not renewed for ``lease_s`` seconds; return their ids."""
        with self._cond:
            now = self.clock()
            expired = [cid for cid, channel in self._channels.items() if now - channel.renewed_s > lease_s]
            for channel_id in expired:
                self._close(channel_id)
            self._cond.notify_all()
        return expired

    def close_channel(self, channel_id: str) -> None:
        """Close channel ``channel_id`` (see :meth:`_close`); nothing if it is closed already."""
        with self._cond:
            self._close(channel_id)
            self._cond.notify_all()

    def _close(self, channel_id: str) -> None:
        """Cancel the channel's requests in flight in the worker and end its stream (lock held)."""
        channel = self._channels.pop(channel_id, None)
        if channel is None:
            return
        for request_no in sorted(channel.in_flight):
            self._inbound.append(("cancel", (channel_id, request_no), CANCEL_REASON))
        channel.outbox.put(None)

    def recv(self) -> Message:
        """The next message of any channel for the worker (blocking).

        Raises:
            EOFError: the worker has exited (:meth:`send` of ``None``).
        """
        with self._cond:
            while not self._inbound:
                if self._closed:
                    raise EOFError("the actor's channels are closed")
                self._cond.wait()
            return self._inbound.popleft()

    def send(self, message: Message | None) -> None:
        """Route one of the worker's messages: a request's to its channel (its number the
        gateway's again), the others to every channel; ``None`` (the worker exited) ends them all."""
        with self._cond:
            if message is None:
                self._closed = True
                for channel in self._channels.values():
                    channel.outbox.put(None)
                self._channels.clear()
                self._cond.notify_all()
                return
            if message[0] in BROADCAST_KINDS:
                self._remember(message)
                for each in self._channels.values():
                    each.outbox.put(message)
                return
            channel_id, request_no = message[1]
            if (owner := self._channels.get(channel_id)) is None:
                return  # its gateway left: the request was cancelled
            if message[0] == "event" and message[4] is not None:  # a final event carries its batches
                owner.in_flight.discard(request_no)
            owner.outbox.put((message[0], request_no, *message[2:]))

    def _remember(self, message: Message) -> None:
        """Keep what a channel opened later is told: readiness (with rebuilt backends), the exit."""
        if message[0] == "ready":
            self._ready = message
        elif message[0] == "exited":
            self._exited = message
        elif message[0] == "rebuilt" and message[2] is not None and self._ready is not None:
            infos = dict(self._ready[2])  # a new message: the old one may still be on its way out
            infos[message[1]] = {**infos.get(message[1], {}), **message[2]}
            self._ready = (*self._ready[:2], infos)
