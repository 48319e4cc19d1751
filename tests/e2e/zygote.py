"""A process that forks the end-to-end tests' gateway servers, with the libraries imported and
the test config's models loaded once.

A gateway start costs ~13.7 s of CPU on our 2-core VMs, which the suite pays ~20 times: 3.2 s
importing torch, transformers and the gateway, 6.7 s loading SmolLM2 (4.4 s of it prepacking
its linears into fresh pages), and most of the rest page faults. A fork of a process that has
done all that shares its pages copy-on-write, so the server starts with the models in memory.
It then runs the real ``gateway`` entry point (``python -m gateway`` through :mod:`runpy`) with
its own argv, environment, working directory and log file, exactly as a process started with
:mod:`subprocess` would, and takes the preloaded models through
:func:`models.loader.preload` (a config whose model folder, task, dtype or device differs
loads its own).

Protocol, one JSON object per line: on stdin, ``{"argv", "env", "cwd", "log"}`` asks for a
server; on stdout, ``{"ready": pid}`` once loaded, then ``{"started": pid}`` per request, in
order, and ``{"exited": pid, "returncode": code}`` when a child ends (``code`` as
:attr:`subprocess.Popen.returncode`: negative for a signal). At end of input it stops its
children (SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``) and exits.

Forking is safe here because this process has one thread when it forks (checked before each
fork) and its OpenMP runtime has started no pool (the harness starts it only with
``OMP_NUM_THREADS=1``, see :func:`tests.e2e.conftest.can_fork`).
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import yaml

CONFIG = Path(__file__).parent / "config.yaml"
STOP_TIMEOUT_S = 30.0
# How long a fork request waits for threads that are ending (a preload pool's) to be gone.
THREAD_EXIT_TIMEOUT_S = 5.0
# Between two checks for children that ended, when no request comes in.
REAP_POLL_S = 0.05


def _preload_test_models() -> None:
    """Import what a gateway imports, and load the test config's models with their weights."""
    import tqdm

    tqdm.tqdm.monitor_interval = 0  # its monitor thread (transformers' loading bars) would stay
    import gateway.cli  # noqa: F401  (what ``python -m gateway`` imports first)
    import gateway.app  # noqa: F401
    import uvicorn  # noqa: F401
    from gateway.config import load_config
    from models.cpu_memory import keep_freed_memory_in_heap
    from models.loader import preload
    from models.source import default_cache_dir

    keep_freed_memory_in_heap()  # as ``sluice serve`` does before loading
    config = load_config(CONFIG)
    devices = {s.name: s.device for s in config.slices}
    for model in config.models:
        preload(model.source, model.task, model.dtype, devices[model.buckets[0].slice], default_cache_dir())


# The protocol's output: this process's stdout as it started; fd 1 itself goes to stderr (the
# zygote's log), so what libraries print does not mix with the messages.
_messages: Any = None


def _send(message: dict[str, Any]) -> None:
    _messages.write(json.dumps(message) + "\n")
    _messages.flush()


def _serve_in_child(request: dict[str, Any]) -> int:
    """In the forked child: become ``python -m gateway ARGV`` with the request's environment,
    working directory and log file; return its exit status."""
    log_fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null_fd)
    os.close(log_fd)
    os.close(_messages.fileno())
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = ["-m", *request["argv"]]
    code: Any = 0
    try:
        runpy.run_module("gateway", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001  (as the interpreter would: a traceback and status 1)
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # What the interpreter does at exit: join non-daemon threads, run atexit handlers, flush.
    threading._shutdown()  # type: ignore[attr-defined]
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code or 0


def _num_threads_settled(timeout_s: float = THREAD_EXIT_TIMEOUT_S) -> int:
    """This process's thread count, once threads that are ending have gone (at most
    ``timeout_s``): a pool the preload used (the prepack's, for one) may still be tearing its
    native threads down when the first fork is asked for."""
    deadline = time.monotonic() + timeout_s
    while (num_threads := len(os.listdir("/proc/self/task"))) != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    return num_threads


def _fork(request: dict[str, Any]) -> int:
    num_threads = _num_threads_settled()
    if num_threads != 1:
        names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
        raise RuntimeError(f"the zygote has {num_threads} threads ({names}, Python: {threading.enumerate()}): forking it is not safe")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            status = _serve_in_child(request)
        finally:
            os._exit(status)
    return pid


def _reap(children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            _send({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _stop(children: set[int]) -> None:
    for pid in children:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while children and time.monotonic() < deadline:
        _reap(children)
        time.sleep(REAP_POLL_S)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def main() -> None:
    global _messages
    _messages = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _preload_test_models()
    _send({"ready": os.getpid()})
    children: set[int] = set()
    buffered = b""
    stdin_fd = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([stdin_fd], [], [], REAP_POLL_S)
        _reap(children)
        if not readable:
            continue
        chunk = os.read(stdin_fd, 65536)
        if not chunk:
            break
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            pid = _fork(json.loads(line))
            children.add(pid)
            _send({"started": pid})
    _stop(children)


if __name__ == "__main__":
    main()
