"""The kinds of slice, by the config's ``isolation`` word: each maps to a factory of plain
values, so a new kind (a Ray actor) is one module and one entry here, and the engine, the
build code and the buckets do not change."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from buckets.slices.process import ProcessSlice
from buckets.slices.ray_actor import RayPlacement
from buckets.slices.ray_slice import RaySlice
from buckets.slices.slice import Slice
from buckets.slices.thread import ThreadSlice


@dataclass(frozen=True)
class SliceOptions:
    """A slice's config as plain values.

    ``worker_main`` is what a slice whose worker runs elsewhere runs there,
    ``worker_main(conn, *worker_args())`` (``worker_args`` is called at each (re)start, so a
    restart serves the current config); ``None`` where no such worker is possible. ``ray``:
    where a Ray slice's actors run (``None`` for the other kinds).
    """

    name: str
    device: str
    num_threads: int
    max_consecutive_steps: int
    worker_main: Callable[..., None] | None
    worker_args: Callable[[], tuple[Any, ...]]
    ray: RayPlacement | None = None


def thread_slice(options: SliceOptions) -> Slice:
    return ThreadSlice(options.name, options.device, options.num_threads, options.max_consecutive_steps)


def process_slice(options: SliceOptions) -> Slice:
    """Raises ValueError: no ``worker_main`` to run in the process."""
    if options.worker_main is None:
        raise ValueError(f"slice {options.name!r} has isolation: process, and no worker main was given to run in it")
    return ProcessSlice(options.name, options.device, options.num_threads, options.worker_main, options.worker_args)


def ray_slice(options: SliceOptions) -> Slice:
    """Raises ValueError: no ``worker_main`` to run in the actors, or no Ray placement."""
    if options.worker_main is None or options.ray is None:
        raise ValueError(f"slice {options.name!r} has isolation: ray, and no worker main or Ray placement was given")
    return RaySlice(options.name, options.device, options.num_threads, options.worker_main, options.worker_args, options.ray)


SLICE_KINDS: dict[str, Callable[[SliceOptions], Slice]] = {
    "thread": thread_slice, "process": process_slice, "ray": ray_slice,
}


def make_slice(isolation: str, options: SliceOptions) -> Slice:
    """The slice of kind ``isolation`` (a key of :data:`SLICE_KINDS`) for ``options``.

    Raises:
        KeyError: no such kind.
        ValueError: as the kind's factory (a process slice without a worker main).
    """
    return SLICE_KINDS[isolation](options)
