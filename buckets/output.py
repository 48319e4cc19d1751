"""The output stage of the continuous batcher: the fourth call of a step.

After ``Scheduler.postprocess`` has done the bookkeeping (tokens appended, ends on EOS or
length, blocks freed), :class:`OutputProcessor` turns its :class:`~buckets.scheduler.StepResult`
into what clients see: text by windowed incremental detokenization
(:class:`models.detokenizer.IncrementalDetokenizer`), stop strings (a hit finishes the sequence
through :meth:`Scheduler.finish`), events on each request's sink, timeline stamps
(``started``, ``first_token``, ``finished``) and the release of admission tickets.

Owned by the bucket's worker thread, like the scheduler; no locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from buckets.errors import DeadlineExceededError
from buckets.request import ErrorEvent, TokenEvent
from buckets.scheduler import Scheduler, StepPlan, StepResult
from buckets.sequence import FinishReason, Sequence
from models.detokenizer import IncrementalDetokenizer
from models.step_io import TokenLogprobs


@dataclass
class _SequenceOutput:
    """A live sequence, the detokenizer of its outputs, and its prompt logprobs so far (of
    positions 1 on, in order) until its first event carries them. The choices of one request
    share the prompt logprobs' list: choice 0 alone computes the prompt, every choice returns them."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    has_emitted: bool = False

    def add_prompt_logprobs(self, first_position: int, entries: list[TokenLogprobs]) -> None:
        """Keep the entries of positions not held yet (a recompute after preemption repeats some)."""
        skip = len(self.prompt_logprobs) + 1 - first_position
        if skip >= 0:
            self.prompt_logprobs.extend(entries[skip:])

    def first_event_prompt_logprobs(self) -> tuple[TokenLogprobs | None, ...] | None:
        """The prompt logprobs the next event carries: all of them (the first position's
        ``None``) on the first event of a request that asked, else ``None``."""
        if self.has_emitted or not self.seq.request.needs_prompt_logprobs:
            return None
        return (None, *self.prompt_logprobs)


class OutputProcessor:
    """Text, stop strings, events, timelines and admission tickets for one bucket's sequences.

    The batcher calls :meth:`add` when a sequence is queued, :meth:`record_plan` after each
    ``schedule()`` (before the forward), :meth:`process` with every ``StepResult`` (from
    ``drop_ended`` and ``postprocess``), and :meth:`fail` when a forward fails or the bucket stops.

    Args:
        scheduler: the bucket's scheduler; a stop string finishes its sequence there.
        tokenizer: a Hugging Face tokenizer (``decode``).
        clock: seconds, monotonic (the scheduler's clock).
    """

    def __init__(self, scheduler: Scheduler, tokenizer: Any, clock: Callable[[], float]) -> None:
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self._clock = clock
        self._outputs: dict[int, _SequenceOutput] = {}
        # Choices still generating, by id() of their request (requests are not hashable), and
        # the requests already sent an error while some of their choices are open.
        self._open_choices: dict[int, int] = {}
        self._errored: set[int] = set()
        self.detokenize_s = 0.0  # wall seconds in the detokenizers since start (the step's phases)

    def add(self, seq: Sequence) -> None:
        """Follow a sequence the scheduler has just queued, and its pending forks (the request's
        other choices)."""
        prompt_logprobs: list[TokenLogprobs] = []  # one list: every choice returns the prompt's
        for choice in (seq, *seq.forks):
            detokenizer = IncrementalDetokenizer(self._tokenizer, choice.request.stop, choice.request.params.min_tokens)
            self._outputs[choice.seq_id] = _SequenceOutput(choice, detokenizer, prompt_logprobs)
        self._open_choices[id(seq.request)] = 1 + len(seq.forks)

    def _close_choice(self, seq: Sequence) -> int:
        """Forget one ended choice of ``seq``'s request; returns how many are still open."""
        key = id(seq.request)
        num_open = self._open_choices.pop(key) - 1
        if num_open:
            self._open_choices[key] = num_open
        else:
            self._errored.discard(key)
        return num_open

    def record_plan(self, plan: StepPlan) -> None:
        """Note each scheduled request's place in the step (``Request.batches``); the first time
        a request is scheduled, stamp ``started`` and release its admission ticket (it has left
        the queue, even if its prompt runs in several chunks)."""
        now = self._clock()
        for index, seq in enumerate(plan.scheduled):
            request = seq.request
            request.batches.append((plan.step_id, index))
            if "started" not in request.timeline:
                request.timeline["started"] = now
                request.leave_queue()

    def process(self, result: StepResult) -> list[Sequence]:
        """Emit the step's events; return the sequences that ended (a stop string included).

        Each new token gets a :class:`TokenEvent` with the text it released and its logprobs
        when asked (the last one carries ``finish_reason``; the first, the prompt logprobs when
        asked); a ``max_tokens`` 0 sequence gets one event without tokens. A sequence that
        ended without a new token was dropped: on ``TIMEOUT`` it gets a last event with the
        text held back so far when it has outputs, else an error event carrying
        :class:`DeadlineExceededError`; on ``CANCELLED`` nothing is emitted (whoever cancelled
        it answers the client) and its admission ticket is released.
        """
        now = self._clock()
        ended: list[Sequence] = []
        for seq_id, (first_position, entries) in result.prompt_logprobs.items():
            self._outputs[seq_id].add_prompt_logprobs(first_position, entries)
        for seq_id, token_ids in result.new_token_ids.items():
            seq = self._emit_tokens(seq_id, token_ids, result.finished.get(seq_id), now, result.logprobs.get(seq_id, []))
            if seq is not None:
                ended.append(seq)
        for seq_id, reason in result.finished.items():
            if seq_id not in result.new_token_ids:
                ended.append(self._end_dropped(seq_id, reason, now))
        return ended

    def fail(self, seqs: list[Sequence], error: Exception) -> None:
        """Send each sequence's request an :class:`ErrorEvent` carrying ``error`` (once per
        request) and forget the sequences."""
        now = self._clock()
        for seq in seqs:
            if self._outputs.pop(seq.seq_id, None) is None:
                continue
            key = id(seq.request)
            is_first_error = key not in self._errored
            self._errored.add(key)
            self._close_choice(seq)
            if is_first_error:
                seq.request.timeline["finished"] = now
                seq.request.emit(ErrorEvent(error))

    def _emit_tokens(
        self, seq_id: int, token_ids: list[int], reason: FinishReason | None, now: float, logprobs: list[TokenLogprobs]
    ) -> Sequence | None:
        """Detokenize, check stop strings and emit one token event; the sequence if it ended."""
        output = self._outputs[seq_id]
        seq, detokenizer = output.seq, output.detokenizer
        started = time.perf_counter()
        text = detokenizer.update(seq.text_token_ids, is_last=reason is not None)
        self.detokenize_s += time.perf_counter() - started
        if detokenizer.stopped:
            if reason is None:
                self._scheduler.finish(seq_id, FinishReason.STOP)
            reason = FinishReason.STOP  # a stop string in the last token's text wins over length
        request = seq.request
        request.timeline.setdefault("first_token", now)
        num_open = self._open_choices[id(request)] - 1
        if reason is not None:
            request.timeline["finished"] = now
            del self._outputs[seq_id]
            num_open = self._close_choice(seq)
        prompt_logprobs = output.first_event_prompt_logprobs()
        output.has_emitted = True
        request.emit(self._token_event(seq, text, token_ids, reason, num_open, tuple(logprobs), prompt_logprobs))
        return None if reason is None else seq

    @staticmethod
    def _token_event(
        seq: Sequence,
        text: str,
        token_ids: list[int],
        reason: FinishReason | None,
        num_open: int,
        logprobs: tuple[TokenLogprobs, ...] = (),
        prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None,
    ) -> TokenEvent:
        return TokenEvent(
            text=text,
            token_ids=token_ids,
            finish_reason=None if reason is None else reason.value,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_completion_tokens=len(seq.output_token_ids),
            index=seq.index,
            num_open_choices=num_open,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _end_dropped(self, seq_id: int, reason: FinishReason, now: float) -> Sequence:
        """Tell the client about a sequence dropped for ``reason`` (``TIMEOUT`` or ``CANCELLED``).

        A request's choices end together (they share its deadline and cancel flag): before
        their fork none has outputs, and only the last of them sends the deadline error."""
        output = self._outputs.pop(seq_id)
        seq, request = output.seq, output.seq.request
        request.timeline["finished"] = now
        num_open = self._close_choice(seq)
        if reason is not FinishReason.TIMEOUT:
            request.leave_queue()
        elif seq.output_token_ids:
            text = output.detokenizer.update(seq.output_token_ids, is_last=True)
            request.emit(self._token_event(seq, text, [], reason, num_open))
        elif num_open:
            request.leave_queue()
        else:
            waited_s = now - seq.arrival_s
            request.emit(ErrorEvent(DeadlineExceededError(
                f"the request's deadline passed after {waited_s:.3f} s, before its first token"
            )))
        return seq
