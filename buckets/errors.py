"""Errors raised by the batching core."""


class BucketError(Exception):
    """Base class of every error raised by ``buckets/``."""


class BatchFailedError(BucketError):
    """The forward that carried this request failed; the batcher goes on with other work."""


class ShuttingDownError(BucketError):
    """The bucket stopped before this request finished."""


class KVCapacityError(BucketError):
    """A sequence needs more KV blocks than the bucket's whole pool holds; it could never finish."""
