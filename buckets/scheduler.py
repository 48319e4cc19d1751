"""Iteration-level scheduling for the continuous batcher: which tokens run in the next step.

One step is three calls with plain data between them (as in vLLM v1 and nano-vllm):
``schedule() -> StepPlan``, ``ModelRunner.run(plan.forward) -> ForwardOutput``,
``postprocess(plan, output) -> finished``. The scheduler is integer bookkeeping only; it never
touches tensors. Running sequences decode first; waiting prompts join while the step's token
budget (``max_num_batched_tokens``) and ``max_num_seqs`` allow, first come first served.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Callable

from buckets.sequence import Sequence, SequenceStatus
from buckets.settings import ContinuousBatcherSettings
from models.step_io import ForwardInput, ForwardOutput, SequenceInput


@dataclass(frozen=True)
class StepPlan:
    """What one step computes.

    Fields:
        step_id: increasing id of this step (logged in request timelines).
        forward: the runner's input: packed sequences and ids released since the last step.
        scheduled: the sequences in ``forward.sequences``, same order.
    """

    step_id: int
    forward: ForwardInput
    scheduled: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.forward.sequences and not self.forward.released_seq_ids


class Scheduler:
    """Owns the waiting queue and the running list of one bucket. Worker thread only.

    Args:
        settings: step budgets.
        clock: returns seconds (monotonic); stamps request timelines.
    """

    def __init__(self, settings: ContinuousBatcherSettings, clock: Callable[[], float]):
        self.settings = settings
        self.clock = clock
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._released: list[int] = []
        self._step_ids = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._released)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (called by the batcher when it takes a request from its inbox)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def drop_cancelled(self) -> list[Sequence]:
        """Remove cancelled sequences from both queues; their KV is released next step."""
        dropped = [s for s in itertools.chain(self.waiting, self.running) if s.request.is_cancelled]
        for seq in dropped:
            self._finish(seq, "cancelled")
        return dropped

    def schedule(self) -> StepPlan:
        """Plan the next step: every running sequence decodes, then waiting prompts are admitted."""
        budget = self.settings.max_num_batched_tokens
        scheduled: list[Sequence] = []
        for seq in self.running:
            scheduled.append(seq)
            budget -= len(seq.next_input_token_ids())
        while self.waiting and len(self.running) < self.settings.max_num_seqs:
            head = self.waiting[0]
            if len(head.next_input_token_ids()) > budget:
                break
            self.waiting.popleft()
            head.status = SequenceStatus.RUNNING
            self.running.append(head)
            scheduled.append(head)
            budget -= len(head.next_input_token_ids())
        step_id = next(self._step_ids)
        inputs = [self._input_of(seq) for seq in scheduled]
        for index, seq in enumerate(scheduled):
            seq.request.batches.append((step_id, index))
        return StepPlan(step_id=step_id, forward=ForwardInput(inputs, self.take_released()), scheduled=scheduled)

    def postprocess(self, plan: StepPlan, output: ForwardOutput) -> list[Sequence]:
        """Record computed tokens, append sampled ones, emit events; return finished sequences."""
        finished: list[Sequence] = []
        now = self.clock()
        for seq, seq_input in zip(plan.scheduled, plan.forward.sequences):
            seq.num_computed_tokens += len(seq_input.token_ids)
            token_id = output.sampled_token_ids.get(seq.seq_id)
            if token_id is None:
                continue
            event = seq.append_token(token_id)
            seq.request.timeline.setdefault("first_token", now)
            seq.request.emit(event)
            if seq.finish_reason is not None:
                self._finish(seq, seq.finish_reason)
                finished.append(seq)
        return finished

    def take_released(self) -> list[int]:
        """Ids released since the last plan, handed over once (for a final runner call on shutdown)."""
        released, self._released = self._released, []
        return released

    def fail(self, seqs: list[Sequence]) -> None:
        """Take failed sequences out of the queues and release their KV."""
        for seq in seqs:
            self._finish(seq, "error")

    def _finish(self, seq: Sequence, outcome: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._released.append(seq.seq_id)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.request.timeline["finished"] = self.clock()
        seq.request.info["outcome"] = outcome

    def _input_of(self, seq: Sequence) -> SequenceInput:
        token_ids = seq.next_input_token_ids()
        return SequenceInput(
            seq_id=seq.seq_id,
            token_ids=token_ids,
            position=seq.num_computed_tokens,
            capacity_tokens=seq.capacity_tokens,
            do_sample=seq.num_computed_tokens + len(token_ids) >= seq.num_tokens,
            params=seq.request.params,
        )
