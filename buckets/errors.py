"""Errors raised by the batching core."""


class BucketError(Exception):
    """Base class of every error raised by ``buckets/``."""


class BatchFailedError(BucketError):
    """The forward that carried this request failed; the batcher goes on with other work."""


class ShuttingDownError(BucketError):
    """The bucket stopped before this request finished."""


class KVCapacityError(BucketError):
    """A sequence needs more KV blocks than the bucket's whole pool holds; it could never finish."""


class LoraSlotsError(BucketError):
    """A request names a LoRA adapter and its bucket was built without LoRA slots (``max_loras`` 0)."""


class QueueFullError(BucketError):
    """The bucket's queue is at ``max_queue_len`` or ``max_queued_tokens``; try again later.

    Args:
        reason: which limit and its value.
        retry_after_s: whole seconds the client should wait, from the queue's recent drain rate.
    """

    def __init__(self, reason: str, retry_after_s: int):
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class DeadlineUnmeetableError(QueueFullError):
    """The bucket's expected queue wait already exceeds the request's timeout; it would expire queued."""


class DeadlineExceededError(BucketError):
    """The request's deadline passed before it produced anything; it was dropped and its blocks freed."""


class BucketClosedError(BucketError):
    """The bucket was replaced by a new layout and takes no new requests; route to the new one."""


class WorkerCrashedError(BucketError):
    """The worker process of the request's slice died while the request was in flight; the
    gateway restarts it, and the client may retry."""


class SliceUnavailableError(BucketError):
    """The worker process of the bucket's slice is (re)starting and takes no requests yet.

    Args:
        reason: what the slice is doing.
        retry_after_s: whole seconds the client should wait.
    """

    def __init__(self, reason: str, retry_after_s: int):
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s
