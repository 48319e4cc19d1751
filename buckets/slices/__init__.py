"""Slices: where a group of buckets runs (the :class:`~buckets.slices.slice.Slice` protocol),
and its kinds, registered by the config's ``isolation`` word in :mod:`buckets.slices.kinds`:
a worker thread in this process (:mod:`buckets.slices.thread`) and a supervised worker process
(:mod:`buckets.slices.process` and :mod:`buckets.slices.worker` on the gateway's side,
:mod:`buckets.slices.host` in the worker, :mod:`buckets.slices.messages` between them)."""
