"""One worker process of a process slice, as the gateway holds it: the process, the gateway's
end of its pipe, and a sender thread that writes queued messages to the pipe, so nothing that
sends to the worker ever blocks. A restart makes a new one."""

from __future__ import annotations

import queue
import threading
from multiprocessing.connection import Connection
from typing import Any

from buckets.slices.messages import Message


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
