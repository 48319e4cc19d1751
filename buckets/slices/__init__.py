"""Slices: where a group of buckets runs (the :class:`~buckets.slices.slice.Slice` protocol),
and its kinds: a worker thread in this process (:mod:`buckets.slices.thread`) and a supervised
worker process (:mod:`buckets.slices.process`, served by :mod:`buckets.slices.host` over the
messages of :mod:`buckets.slices.messages`)."""
