"""The heap frozen after the models load: full collections skip it, and a dropped model's
reference cycles are still collected when memory is released."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from models.cpu_memory import freeze_long_lived_objects, release_memory


class Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def thawed_after() -> Iterator[None]:
    try:
        yield
    finally:
        gc.unfreeze()  # the rest of the test session keeps the collector as it was


def test_frozen_objects_are_skipped_by_collections_and_freed_by_release_memory(thawed_after: None) -> None:
    loaded = Node()
    alive = weakref.ref(loaded)
    # The count can fall between the two calls: a frozen object freed meanwhile leaves it.
    assert freeze_long_lived_objects() > 0 and gc.get_freeze_count() > 0
    del loaded
    gc.collect()
    assert alive() is not None  # frozen: a full collection does not look at it
    release_memory()
    assert alive() is None
    assert gc.get_freeze_count() > 0  # the survivors are frozen again


def test_release_memory_leaves_an_unfrozen_heap_unfrozen() -> None:
    gc.unfreeze()
    dropped = weakref.ref(Node())
    release_memory()
    assert dropped() is None and gc.get_freeze_count() == 0
