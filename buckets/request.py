"""Requests as the batching core sees them, and the events it sends back.

The gateway builds a request with a ``sink``: a callable the worker thread calls with each
event (it hands the event to the event loop with ``loop.call_soon_threadsafe``). The worker
never blocks on the sink. ``cancel()`` may be called from any thread; the batcher drops a
cancelled request at its next step and frees what it held.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from models.step_io import LoraRequest, SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class TokenEvent:
    """New generated text of one choice. ``finish_reason`` is set on the choice's last event:
    ``stop``, ``length``, or ``timeout`` (the deadline passed after some tokens; that last event
    may carry no new token).

    ``index`` is the choice (``0 .. n - 1`` of its request); ``num_completion_tokens`` counts that
    choice's tokens so far. ``num_open_choices`` is how many other choices of the request are
    still generating after this event: the request is over at a finished event with 0 left.

    ``logprobs`` has one entry per id of ``token_ids`` when the request asked for logprobs
    (``num_top_logprobs``), else none. ``prompt_logprobs`` is set on each choice's first event
    of a request with ``needs_prompt_logprobs``: one entry per prompt token, the first ``None``
    (nothing precedes it).
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_completion_tokens: int
    index: int = 0
    num_open_choices: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    @property
    def ends_request(self) -> bool:
        """Whether nothing follows this event for its request (its last open choice finished)."""
        return self.finish_reason is not None and self.num_open_choices == 0


@dataclass(frozen=True)
class EmbeddingEvent:
    """One input's embedding (``hidden_size`` floats, L2-normalised when the model says so)."""

    embedding: list[float]
    num_prompt_tokens: int


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed inside the core; it is finished."""

    error: Exception


RequestEvent = TokenEvent | EmbeddingEvent | ErrorEvent
Sink = Callable[[RequestEvent], None]

_cancel_lock = threading.Lock()


@dataclass
class Request:
    """A tokenised request routed to one bucket.

    ``timeline`` maps stage names (``arrival``, ``enqueued``, ``started`` (left the queue to
    run), ``first_token``, ``finished``) to
    clock readings in seconds, and ``batches`` records ``(batch or step id, index in batch)`` for
    each forward the request took part in. Both are written by the worker and read by the
    gateway after the final event.

    ``deadline_s`` is when the request times out (monotonic seconds, the batcher's clock;
    ``None``: never): the batcher drops it then, queued or running, and frees what it held.

    ``tenant`` names who sent it (an API key's tenant; ``"anonymous"`` without auth) and
    ``tenant_weight`` is that tenant's weight in a bucket's fair share (> 0, default 1): the
    scheduler serves competing tenants tokens in proportion to their weights
    (:mod:`policies.fair_share`).

    ``on_dequeue`` is called when the request leaves its bucket's queue (it starts, is dropped
    or fails; :meth:`leave_queue`); the bucket sets it to release its admission ticket.
    ``on_cancel`` is called with the request once, by the first :meth:`cancel`, on the
    cancelling thread; its slice sets it (a process slice tells its worker to drop it).
    """

    request_id: str
    prompt_token_ids: list[int]
    sink: Sink
    priority: int = 0
    deadline_s: float | None = None
    tenant: str = "anonymous"
    tenant_weight: float = 1.0
    timeline: dict[str, float] = field(default_factory=dict)
    batches: list[tuple[int, int]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)
    _cancel_reason: str = field(default="cancelled", repr=False)
    on_dequeue: Callable[[], None] | None = field(default=None, repr=False)
    on_cancel: Callable[[Request], None] | None = field(default=None, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs as (admission counts each): 1, or a generation's ``n``."""
        return 1

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def cancel_reason(self) -> str | None:
        """Why it was cancelled (``"cancelled"``: client gone or done with; ``"timeout"``), or ``None``."""
        return self._cancel_reason if self._cancelled.is_set() else None

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the batcher to drop this request (client gone: ``"cancelled"``; deadline passed:
        ``"timeout"``). The first reason given stands. Thread-safe."""
        with _cancel_lock:
            if self._cancelled.is_set():
                return
            self._cancel_reason = reason
            self._cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel(self)

    def leave_queue(self) -> None:
        """Called by the batcher when the request starts or is dropped; later calls do nothing."""
        callback, self.on_dequeue = self.on_dequeue, None
        if callback is not None:
            callback()

    def emit(self, event: RequestEvent) -> None:
        """Hand ``event`` to the sink; a request that emits has left its queue."""
        self.leave_queue()
        self.sink(event)


@dataclass
class GenerationRequest(Request):
    """A completion or chat request: prompt tokens in, a stream of :class:`TokenEvent` out.

    ``max_tokens`` bounds new tokens of each choice (0: the prompt is computed and nothing is
    generated, for its prompt logprobs); ``stop`` strings end generation (not returned);
    ``ignore_eos`` keeps generating past end-of-sequence tokens (benchmarks use it).
    ``n`` choices continue from one prefill of the prompt (:class:`buckets.sequence.Sequence`
    forks), each with its own sampler state; their events carry the choice's ``index``.

    ``num_top_logprobs`` (``None``: none) asks for each generated token's logprob with that
    many alternatives (0 to 20); ``needs_prompt_logprobs`` also asks for the prompt tokens'
    (with as many alternatives, on every choice), which the scheduler computes without the
    prefix cache.

    ``lora`` (``None``: the base model) is the LoRA adapter every choice runs with: the
    scheduler gives it a runner slot while the sequence runs, and keys its prefix-cached blocks
    by the adapter, so the same prompt under two adapters never shares KV.
    """

    max_tokens: int = 16
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    num_top_logprobs: int | None = None
    needs_prompt_logprobs: bool = False
    lora: LoraRequest | None = None

    @property
    def num_seqs(self) -> int:
        return self.n


@dataclass
class EmbeddingRequest(Request):
    """One embedding input: prompt tokens in, one :class:`EmbeddingEvent` out."""
