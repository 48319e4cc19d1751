"""OpenMP thread pools: only the threads that step models keep one.

torch's CPU build runs its intra-op parallelism on GNU OpenMP (libgomp). Every thread that
enters a parallel region gets a pool of worker threads of its own, kept for its next region
while the thread lives. libgomp spins a worker between regions (about 300,000 iterations) only
while it manages no more threads than there are CPUs; past that it spins about 100 iterations
and sleeps on a futex (``gomp_throttled_spin_count_var``, libgomp's ``env.c``), so every region
then pays a futex wake-up of its workers. A decode step of a small model is hundreds of short
regions (SmolLM2-135M on the lean int4 kind: four quantized products, the norms and the
attention per layer, 30 layers), and one idle pool left in the process doubles it: on a 2-core
machine a thread that had run one parallel product before a slice thread started made that
slice's decode step 19.1 ms instead of 9.8 ms (``python -m bench.token_path``'s note has the run).

The gateway loads and builds models on threads that live on (the executor thread of
``asyncio.to_thread``, a process slice worker's main thread), so those call
:func:`release_thread_pool` when their build is done (:func:`releasing_thread_pool`); a thread
that ends frees its pool itself. OpenMP 5.0's ``omp_pause_resource_all(omp_pause_soft)`` frees
the calling thread's pool, and a later parallel region on it builds a new one.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import structlog

log = structlog.get_logger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep nothing warm
_RUNTIME_NAMES = ("libgomp", "libiomp5", "libomp")


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (found in this process's mapped libraries), or ``None``
    (not Linux, no OpenMP runtime loaded, or one without ``omp_pause_resource_all``)."""
    import torch  # noqa: F401  (loads the runtime)

    maps = Path("/proc/self/maps")
    if not sys.platform.startswith("linux") or not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if Path(path).name.startswith(_RUNTIME_NAMES) and ".so" in path:
            try:
                runtime = ctypes.CDLL(path)
                runtime.omp_pause_resource_all.argtypes = [ctypes.c_int]
                runtime.omp_pause_resource_all.restype = ctypes.c_int
            except (OSError, AttributeError):
                continue
            return runtime
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads, if it has any (cheap when it has none).

    Returns whether the runtime accepted it (``False``: no OpenMP runtime found, or the call
    was made inside a parallel region).
    """
    runtime = _runtime()
    if runtime is None:
        return False
    return bool(runtime.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0)


def releasing_thread_pool(fn: Callable[P, T]) -> Callable[P, T]:
    """``fn`` wrapped to call :func:`release_thread_pool` on its thread when it returns or raises:
    for work handed to a thread that outlives it (``asyncio.to_thread(releasing_thread_pool(f))``)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            release_thread_pool()

    return wrapper
