"""One worker process of a process slice, as the gateway holds it: the process, the gateway's
end of its pipe, and a sender thread that writes queued messages to the pipe, so nothing that
sends to the worker ever blocks. A restart makes a new one."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import structlog

from buckets.slices.messages import Message

log = structlog.get_logger(__name__)


class WorkerProcess:
    """A started worker ``process`` (a ``multiprocessing`` process, or a stand-in with ``pid``,
    ``exitcode``, ``is_alive``, ``join`` and ``kill``) and ``conn``, the gateway's end of its pipe.

    ``ready`` is set when the worker says it is ready; ``pid`` is then the one it reported.
    ``reader`` is the thread the slice reads the pipe on.
    """

    def __init__(self, process: Any, conn: Connection, name: str):
        self.process = process
        self.conn = conn
        self.pid: int | None = process.pid
        self.ready = threading.Event()
        self.reader: threading.Thread | None = None
        self._outbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        threading.Thread(target=self._write, name=f"{name}-sender", daemon=True).start()

    def send(self, message: Message) -> None:
        """Queue ``message`` for the worker (thread-safe, never blocks); lost if the pipe is gone."""
        self._outbox.put(message)

    def close_outbox(self) -> None:
        """Stop the sender thread once what is queued is written."""
        self._outbox.put(None)

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.conn.send(message)
            except (OSError, ValueError):
                return  # the pipe is gone; the reader sees end of file

    def await_ready(self, timeout_s: float, stopping: threading.Event, slice_name: str) -> bool:
        """Wait until the worker is ready (``True``), exits or ``stopping`` is set (``False``). One
        not ready within ``timeout_s`` is killed (its end of file starts the next try)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.2):
            if not self.process.is_alive() or stopping.is_set():
                return False
            if time.monotonic() > deadline:
                log.error("worker_start_timeout", slice=slice_name, pid=self.pid, timeout_s=timeout_s)
                self.process.kill()
                return False
        return True


def spawn(target: Callable[..., None], args: tuple[Any, ...], name: str) -> tuple[Any, Connection]:
    """Start ``target(conn, *args)`` in a new ``spawn`` process called ``name``; return the
    process and the gateway's end of its pipe (the worker holds the only other end, so its exit
    is end of file here)."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=target, args=(theirs, *args), name=name, daemon=True)
    process.start()
    theirs.close()
    return process, ours
