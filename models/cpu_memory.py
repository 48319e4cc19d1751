"""Keep freed activation memory in the process heap on Linux/glibc CPU machines.

glibc's ``malloc`` serves blocks above ``M_MMAP_THRESHOLD`` (128 KiB at first, adapting up to
32 MiB) with fresh ``mmap`` pages and returns the heap top to the kernel above
``M_TRIM_THRESHOLD``. A forward of a few thousand tokens allocates and frees activations of
several MiB per op, so every op pays page faults on memory it just gave back; on our VMs a
fault-heavy 56 MB buffer cost ~35 ms. Raising both thresholds (the usual advice for PyTorch CPU
inference, which otherwise swaps in jemalloc or tcmalloc) lets the heap reuse those pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import structlog

log = structlog.get_logger(__name__)

M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's upper bound on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024

_tuned = False


def keep_freed_memory_in_heap() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once). Returns whether it took
    effect: False off Linux, without glibc, or when ``mallopt`` refuses."""
    global _tuned
    if _tuned:
        return True
    if platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    except (OSError, AttributeError):
        return False
    _tuned = ok
    log.info("malloc_tuned", ok=ok, mmap_threshold_bytes=MMAP_THRESHOLD_BYTES, trim_threshold_bytes=TRIM_THRESHOLD_BYTES)
    return ok


def freeze_long_lived_objects() -> int:
    """Collect garbage, then move every object the collector tracks to its permanent generation
    (``gc.freeze``), once the models are loaded. Returns how many objects were frozen.

    A full collection traverses every tracked object, holding the GIL: a gateway serving the
    small chat model tracks about 410,000 after its start, which took 0.75 s on a loaded 2-core
    machine, and the allocations of a burst of requests set one off now and then, stalling the
    event loop under the whole burst. Frozen, the models, tokenizers and libraries are skipped
    by every collection; :func:`release_memory` thaws them first, so a dropped model's reference
    cycles are still collected.
    """
    import gc

    global _freeze_epoch
    gc.collect()
    gc.freeze()
    _freeze_epoch += 1
    return gc.get_freeze_count()


# Bumped by every gc.freeze here: an object created at epoch N is still unfrozen while the epoch
# is N (see release_memory's unfrozen_only).
_freeze_epoch = 0


def freeze_epoch() -> int:
    """How many times :func:`freeze_long_lived_objects` or :func:`release_memory` froze the heap."""
    return _freeze_epoch


def release_memory(unfrozen_only: bool = False) -> None:
    """Collect garbage, then hand the heap's free pages back to the kernel (glibc ``malloc_trim``),
    after a model or KV pool is dropped. Off Linux/glibc only the collection runs. Objects frozen by
    :func:`freeze_long_lived_objects` are collected too, and the survivors frozen again; with
    ``unfrozen_only``, only the objects not frozen are looked at (for a model loaded since the
    last freeze, :func:`freeze_epoch` unchanged): the collection holds the GIL for the objects
    it traverses, a whole gateway's heap (about 410,000, 0.25-0.75 s) against the few thousand
    of a model loaded on demand."""
    import gc

    global _freeze_epoch
    if unfrozen_only:
        gc.collect()
    else:
        frozen = gc.get_freeze_count() > 0
        gc.unfreeze()
        gc.collect()
        if frozen:
            gc.freeze()
            _freeze_epoch += 1
    if platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc":
        return
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
