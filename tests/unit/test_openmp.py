"""models.openmp: a thread's OpenMP pool is freed on request, and by the thread's end.

OpenMP workers are native threads: the tests count the process's threads (``/proc/self/task``)
and wait (bounded) for released workers to exit, which they do asynchronously.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
import torch

from models.openmp import release_thread_pool, releasing_thread_pool

pytestmark = pytest.mark.skipif(
    (os.cpu_count() or 1) < 2 or not os.path.isdir("/proc/self/task"), reason="needs 2 CPUs and Linux /proc"
)
EXIT_WAIT_S = 10.0


def _num_native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settles_at(expected: int) -> bool:
    deadline = time.monotonic() + EXIT_WAIT_S
    while _num_native_threads() != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _parallel_product() -> None:
    torch.set_num_threads(2)
    a = torch.randn(768, 768)
    (a @ a).sum()


def _run_in_thread(fn: Callable[[], None]) -> None:
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


@pytest.fixture(scope="module")
def baseline() -> int:
    """The process's thread count once torch's lazily started threads exist and a first pool
    has come and gone."""
    _run_in_thread(_parallel_product)
    deadline = time.monotonic() + EXIT_WAIT_S
    count = _num_native_threads()
    while time.monotonic() < deadline:  # until it stops falling
        time.sleep(0.2)
        if (now := _num_native_threads()) == count:
            break
        count = now
    return count


def test_release_frees_the_calling_threads_pool(baseline: int) -> None:
    seen: dict[str, object] = {}

    def work() -> None:
        _parallel_product()
        seen["with_pool"] = _num_native_threads()
        seen["released"] = release_thread_pool()
        seen["settled"] = _settles_at(baseline + 1)  # this thread alone

    _run_in_thread(work)
    assert seen["with_pool"] > baseline + 1, "the product should have started an OpenMP worker"
    assert seen["released"] is True
    assert seen["settled"], "the released worker did not exit"


def test_releasing_wrapper_frees_the_pool_when_the_work_raises(baseline: int) -> None:
    seen: dict[str, bool] = {}

    @releasing_thread_pool
    def build() -> None:
        _parallel_product()
        raise RuntimeError("build failed")

    def work() -> None:
        with pytest.raises(RuntimeError, match="build failed"):
            build()
        seen["settled"] = _settles_at(baseline + 1)

    _run_in_thread(work)
    assert seen["settled"]


def test_a_thread_that_ends_frees_its_pool(baseline: int) -> None:
    _run_in_thread(_parallel_product)
    assert _settles_at(baseline)


def test_release_without_a_pool_is_harmless(baseline: int) -> None:
    seen: dict[str, bool] = {}
    _run_in_thread(lambda: seen.update(released=release_thread_pool()))
    assert seen["released"] is True
    assert _settles_at(baseline)
