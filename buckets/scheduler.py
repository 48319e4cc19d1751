"""Iteration-level scheduling for the continuous batcher: which tokens run in the next step.

One step is four calls with plain data between them (as in vLLM v1 and nano-vllm):
``schedule() -> StepPlan``, ``ModelRunner.run(plan.forward) -> ForwardOutput``,
``postprocess(plan, output) -> StepResult``, then
:meth:`buckets.output.OutputProcessor.process` turns the result into text and events. The
scheduler and its :class:`~buckets.block_manager.BlockManager` are integer bookkeeping only:
they never touch tensors, text, events or admission tickets.

Each step, within ``max_num_batched_tokens`` and ``max_num_seqs``:

1. running sequences that decode get their one token first, then running sequences still in
   prefill get their next chunk, within the step's prefill room: with decodes running, the
   most prefill tokens that keep the step within its time target (a :class:`PrefillBudget`,
   :class:`policies.step_time.StallFreeBudget`: Sarathi-Serve's stall-free batching; a chunk's
   cost grows with its position, as its attention does), never fewer than its floor; with
   nothing decoding, or without a budget object, the whole ``max_num_batched_tokens``. A long
   prompt runs in chunks across steps, and the decodes beside it wait one chunk, never the
   whole prefill;
2. a sequence whose blocks run out preempts: the victim (lowest effective priority, latest
   arrival, :func:`policies.preemption.pick_victim`) frees its blocks and goes back to the
   waiting queue under its original arrival time (so near the front), to recompute its prompt
   and outputs when it resumes, or, with swap preemption (:mod:`buckets.swap_space`) when the
   policy chooses it, with its KV copied to the host pool first and back when it resumes;
3. waiting sequences join while blocks and budget allow, reusing prefix-cached blocks (a long
   prompt runs as a first chunk): first those that sampled nothing for over ``max_starvation_s /
   2`` while a more urgent one heads the queue, preempting running ones not starved themselves
   (the only ones to join after a step-2 preemption); then by priority band, fair share between
   tenants by tokens computed, aging. One finding no seat, blocks or step budget (then only a
   prefill chunk of this step is a victim) preempts a running sequence, never a starved one, of
   a less urgent priority, else, of its own priority, one of a tenant over its share of
   ``max_num_seqs`` when its own tenant is under its share (:mod:`policies.fair_share`).

With LoRA slots (``max_loras`` > 0), a sequence with an adapter starts running only when its
adapter is in one of the runner's slots or can take one (:class:`policies.lora_slots.LoraSlots`),
so no step holds more than ``max_loras`` distinct adapters; the step's ``lora_loads`` tell the
runner which adapters to copy into which slots first. A waiting sequence whose adapter finds no
slot is passed over, its place kept: the sequences behind it may start, but only those without
an adapter, so the adapters running drain and one of their slots comes free for it (vLLM's
scheduler passes such requests over without that guard, which lets a busy adapter starve it).

A request with ``n`` choices is queued as its choice 0 holding the others as pending forks, and
takes room for all ``n`` in ``max_num_seqs`` when it joins (or the whole room when nothing else
runs). Its prompt is prefilled once: the runner samples every choice's first token from the
prompt's last logits row, then each fork shares the parent's full blocks by reference and gets
a copy of its partly filled last block (:meth:`BlockManager.fork`; the copy runs before the next
forward). A fork that finds no free block for that copy waits as a preempted sequence and
recomputes its prompt (prefix-cached blocks included) when it resumes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from buckets.block_manager import BlockManager
from buckets.errors import KVCapacityError, LoraSlotsError
from buckets.sequence import FinishReason, Sequence, SequenceStatus
from buckets.settings import ContinuousBatcherSettings
from buckets.swap_space import Swapper
from models.step_io import ForwardInput, ForwardOutput, LoraRequest, SequenceInput, TokenLogprobs
from policies.deadlines import is_expired
from policies.fair_share import FairQueue, VirtualTokenCounter, fair_share_victim, priority_victims, under_share_tenants
from policies.lora_slots import LoraSlots
from policies.preemption import pick_victim
from policies.priority import priority_key
from policies.step_time import PrefillRoom, attended_pairs

# Waiting sequences one plan may pass over for want of a LoRA slot before it stops looking.
MAX_PASSED_OVER = 64


@dataclass(frozen=True)
class StepPlan:
    """What one step computes.

    Fields:
        step_id: increasing id of this step (logged in request timelines).
        forward: the runner's input: packed sequences and ids released since the last step.
        scheduled: the sequences in ``forward.sequences``, same order.
        num_preempted: sequences preempted while planning this step.
        num_decode_tokens: tokens of sequences that decode (one each); the rest of
            ``forward.num_tokens`` are prefill tokens (prompts, or recomputed outputs).
        num_attended_pairs: the (query, key) pairs the step's attention covers
            (:func:`policies.step_time.attended_pairs` summed over the sequences).
        max_prefill_tokens: the prefill tokens this step had room for at its start, counted as
            one chunk at position 0 (a deeper chunk attends more, so gets fewer).
        num_loras: distinct LoRA adapters among the scheduled sequences (at most ``max_loras``).
        swapped_out: the victims swapped out while planning this step (their copies are in
            ``forward.swap_out``; should the step fail, :meth:`Swapper.unswap` has them recompute).
    """

    step_id: int
    forward: ForwardInput
    scheduled: list[Sequence] = field(default_factory=list)
    num_preempted: int = 0
    num_decode_tokens: int = 0
    num_attended_pairs: int = 0
    max_prefill_tokens: int = 0
    num_loras: int = 0
    swapped_out: list[Sequence] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return self.forward.num_tokens - self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        forward = self.forward
        return not (forward.sequences or forward.released_seq_ids or forward.block_copies or forward.lora_loads or forward.swap_out)


@dataclass(frozen=True)
class StepResult:
    """What a step (or a drop of ended sequences) changed, for the output stage.

    Fields:
        new_token_ids: tokens appended this step, by ``seq_id`` (one sampled token each; a
            sequence whose prefill chunk sampled nothing is absent).
            A sequence with ``max_tokens`` 0 gets an empty list in the step its prompt is done.
        finished: sequences that ended, by ``seq_id``, with the reason; their blocks are freed.
        logprobs: for sequences that asked (``num_top_logprobs``), one entry per new token.
        prompt_logprobs: for sequences that asked (``needs_prompt_logprobs``), the prompt
            positions computed this step: ``(first position, one entry per position on)``. A
            preempted sequence recomputes positions it already reported; the output stage
            keeps the first report.
    """

    new_token_ids: Mapping[int, list[int]] = field(default_factory=dict)
    finished: Mapping[int, FinishReason] = field(default_factory=dict)
    logprobs: Mapping[int, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: Mapping[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


class PrefillBudget(Protocol):
    """How much prefill a step may take beside its decodes (the step-time policy)."""

    def open_step(self, num_decode_tokens: int, num_attended_pairs: int, max_tokens: int) -> PrefillRoom:
        """The prefill room of a step with ``num_decode_tokens`` decodes attending
        ``num_attended_pairs`` (query, key) pairs and ``max_tokens`` of its cap left after them.
        Called by :meth:`Scheduler.schedule` once per step; the budget measures nothing itself."""


@dataclass
class _StepBudget:
    """The tokens one step still has room for: in all (``max_num_batched_tokens``) and, by
    position, for prefill chunks (``prefill``)."""

    num_tokens: int
    prefill: PrefillRoom

    @property
    def has_prefill_room(self) -> bool:
        return self.num_tokens > 0 and self.prefill.num_tokens_left > 0

    def room(self, seq: Sequence, position: int, is_prefill: bool) -> int:
        """The tokens ``seq``, computing from ``position``, may take now."""
        wanted = min(seq.num_tokens - position, self.num_tokens)
        return self.prefill.tokens_for(position, wanted) if is_prefill else wanted

    def take(self, position: int, num_tokens: int, is_prefill: bool) -> None:
        """Spend ``num_tokens`` from ``position`` (negative: give them back, for a preempted sequence)."""
        self.num_tokens -= num_tokens
        if is_prefill:
            self.prefill.take(position, num_tokens)


@dataclass
class SchedulerCounters:
    """Totals since start: preemptions (by recompute or swap), victims swapped out and swapped
    back in, prefill chunks that left part of a prompt for later, the most distinct LoRA adapters
    in one step, adapters copied into a runner slot, and tokens computed by tenant."""

    num_preemptions: int = 0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_chunked_prefills: int = 0
    max_step_loras: int = 0
    num_lora_loads: int = 0
    tokens_served_by_tenant: Counter[str] = field(default_factory=Counter)


class Scheduler:
    """Owns the waiting queue, the running list and the block manager of one bucket. Worker thread only.

    Args:
        settings: step budgets.
        block_manager: the bucket's KV block bookkeeping.
        clock: returns seconds (monotonic); the arrival time of a sequence queued without an
            ``enqueued`` stamp.
        prefill_budget: the step's prefill token budget beside running decodes; ``None``: the
            whole ``max_num_batched_tokens`` (fixed chunking).
        swapper: swap preemption's books (``None``: victims always recompute).
    """

    def __init__(
        self,
        settings: ContinuousBatcherSettings,
        block_manager: BlockManager,
        clock: Callable[[], float],
        prefill_budget: PrefillBudget | None = None,
        swapper: Swapper | None = None,
    ) -> None:
        self.settings = settings
        self.swapper = swapper
        self.block_manager = block_manager
        self.clock = clock
        self.prefill_budget = prefill_budget
        self.max_prefill_tokens = settings.max_num_batched_tokens  # the last plan's prefill budget
        self.fair = VirtualTokenCounter()  # the tenants' weighted tokens served (policies.fair_share)
        self.waiting = FairQueue[Sequence](settings.priority_aging_s, self.fair if settings.fair_share else None)
        self.running: list[Sequence] = []
        self._live: dict[int, Sequence] = {}  # waiting or running, by seq_id
        self.counters = SchedulerCounters()
        self._released: list[int] = []
        self._block_copies: list[tuple[int, int]] = []  # for the next plan (forks' partial blocks)
        self.lora_slots = LoraSlots(settings.max_loras) if settings.max_loras else None
        self._lora_loads: list[tuple[int, LoraRequest]] = []  # for the next plan
        self._step_ids = itertools.count()
        self._swapped_out: list[Sequence] = []  # for the next plan

    def update_settings(self, settings: ContinuousBatcherSettings) -> None:
        """New budgets (and aging) from now on; the waiting queue is re-keyed when the aging or
        ``fair_share`` changes.

        Raises:
            ValueError: ``max_loras`` changes (the runner's slots are sized when it is built).
        """
        if settings.max_loras != self.settings.max_loras:
            raise ValueError(f"max_loras is fixed when the bucket is built ({self.settings.max_loras}); rebuild it to change it")
        if (settings.priority_aging_s, settings.fair_share) != (self.settings.priority_aging_s, self.settings.fair_share):
            queued, self.waiting = list(self.waiting), FairQueue(settings.priority_aging_s, self.fair if settings.fair_share else None)
            for seq in queued:
                self._enqueue(seq)
        self.settings = settings

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._released)

    @property
    def kv_capacity_tokens(self) -> int:
        """The most tokens one sequence can ever hold: the whole pool."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (called by the batcher when it takes a request from its inbox),
        stamping its arrival time for aging; a request with ``n > 1`` choices gets its other
        choices as pending forks of ``seq`` (:meth:`Sequence.spawn_forks`), live from now on.

        Raises:
            KVCapacityError: prompt + ``max_tokens`` needs more blocks than the whole pool holds,
                so the sequence could never finish (the gateway refuses such requests earlier).
            LoraSlotsError: the sequence has a LoRA adapter and the bucket has no slots
                (``max_loras`` 0).
        """
        if seq.lora is not None and self.lora_slots is None:
            raise LoraSlotsError(f"this bucket serves no LoRA adapters (max_loras 0); got adapter {seq.lora.name!r}")
        if seq.max_total_tokens > self.kv_capacity_tokens:
            raise KVCapacityError(
                f"prompt + max_tokens = {seq.max_total_tokens} tokens exceeds the KV pool's {self.kv_capacity_tokens} tokens"
            )
        seq.status = SequenceStatus.WAITING
        self._live[seq.seq_id] = seq
        if self.settings.enable_prefix_caching:
            seq.extend_block_hashes(self.block_manager.block_size)
        seq.arrival_s = seq.progress_s = seq.request.timeline.get("enqueued", self.clock())
        for child in (seq, *seq.spawn_forks()):
            self._live[child.seq_id] = child
            self.fair.activate(seq.request.tenant, seq.request.tenant_weight)
        self._enqueue(seq)

    def drop_ended(self, now: float) -> StepResult:
        """In one pass over both queues, end the cancelled sequences (``CANCELLED``) and those
        whose deadline has passed at ``now`` (``TIMEOUT``); their blocks return to the pool at
        once. The batcher calls it before each :meth:`schedule`; the output stage tells the
        clients (:meth:`buckets.output.OutputProcessor.process`)."""
        finished: dict[int, FinishReason] = {}
        for seq in self._live.values():
            if seq.request.is_cancelled:
                finished[seq.seq_id] = FinishReason.CANCELLED
            elif is_expired(seq.request.deadline_s, now):
                finished[seq.seq_id] = FinishReason.TIMEOUT
        for seq_id, reason in finished.items():
            self.finish(seq_id, reason)
        return StepResult(finished=finished)

    def schedule(self) -> StepPlan:
        """Plan the next step (decodes, then prefill chunks, then new sequences)."""
        budget = self._step_budget()
        self.max_prefill_tokens = budget.prefill.tokens_for(0, budget.num_tokens)
        scheduled: dict[int, tuple[Sequence, int]] = {}
        num_preempted = self._schedule_running(scheduled, budget)
        self._schedule_waiting(scheduled, budget, is_starved_only=num_preempted > 0)
        seqs = [seq for seq, _ in scheduled.values()]
        inputs = [self._input_of(seq, n) for seq, n in scheduled.values()]
        num_decode_tokens = sum(1 for seq, _ in scheduled.values() if not self._is_prefill(seq))
        num_pairs = sum(attended_pairs(seq.num_computed_tokens, n) for seq, n in scheduled.values())
        swap_out, swap_in = self.swapper.take_copies() if self.swapper is not None else ([], [])
        forward = ForwardInput(inputs, self.take_released(), self._block_copies, self._lora_loads, swap_out, swap_in)
        self._block_copies, self._lora_loads = [], []
        swapped_out, self._swapped_out = self._swapped_out, []
        num_loras = 0
        if self.lora_slots is not None:  # a bucket without slots runs no adapter
            num_loras = len({seq.lora.adapter_id for seq in seqs if seq.lora is not None})
            self.counters.max_step_loras = max(self.counters.max_step_loras, num_loras)
        return StepPlan(
            step_id=next(self._step_ids), forward=forward, scheduled=seqs, num_preempted=num_preempted,
            num_decode_tokens=num_decode_tokens, num_attended_pairs=num_pairs, max_prefill_tokens=self.max_prefill_tokens,
            num_loras=num_loras, swapped_out=swapped_out,
        )

    def _step_budget(self) -> _StepBudget:
        """This step's room: ``max_num_batched_tokens`` in all, and for prefill what the budget
        policy allows beside the running decodes (counted before any preemption, so a step that
        preempts a decode stays within its target)."""
        max_tokens = self.settings.max_num_batched_tokens
        decodes = [seq for seq in self.running if not self._is_prefill(seq)][:max_tokens]
        if self.prefill_budget is None:
            return _StepBudget(max_tokens, PrefillRoom(None, None, max_tokens, 0))
        num_pairs = sum(seq.num_computed_tokens + 1 for seq in decodes)
        return _StepBudget(max_tokens, self.prefill_budget.open_step(len(decodes), num_pairs, max_tokens - len(decodes)))

    @staticmethod
    def _is_prefill(seq: Sequence) -> bool:
        """Whether ``seq``'s next tokens are a prefill chunk (its prompt, or outputs it recomputes)."""
        return seq.num_uncomputed_tokens > 1

    def _schedule_running(self, scheduled: dict[int, tuple[Sequence, int]], budget: _StepBudget) -> int:
        """Give running sequences their tokens, decodes first; preempt when blocks run out.
        Returns how many sequences were preempted."""
        num_preempted = 0
        for seq in sorted(self.running, key=self._is_prefill):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            is_prefill = self._is_prefill(seq)
            num_tokens = budget.room(seq, seq.num_computed_tokens, is_prefill)
            if num_tokens == 0:
                break
            while not self.block_manager.can_append(seq.seq_id, seq.num_computed_tokens + num_tokens):
                victim = self._pick_victim(self.running)
                self._preempt(victim, scheduled, budget)
                num_preempted += 1
                if victim is seq:
                    break
            else:
                self.block_manager.append(seq.seq_id, seq.num_computed_tokens + num_tokens)
                scheduled[seq.seq_id] = (seq, num_tokens)
                budget.take(seq.num_computed_tokens, num_tokens, is_prefill)
        return num_preempted

    def _schedule_waiting(self, scheduled: dict[int, tuple[Sequence, int]], budget: _StepBudget, is_starved_only: bool = False) -> None:
        """Admit waiting sequences while seats, budget and blocks allow, first those starved
        behind a more urgent head (only them: ``is_starved_only``), then in the queue's order,
        preempting for them (:meth:`_make_room`); one whose LoRA adapter finds no slot is passed
        over (see the module's docstring)."""
        passed_over: list[Sequence] = []
        starved_before_s = self.clock() - self.settings.max_starvation_s / 2
        is_floor_open = True  # until a starved sequence finds no room: then the head may still preempt
        while self.waiting and budget.has_prefill_room:
            first = self._under_share_tenants()
            head = self.waiting.peek(first)
            starved = self.waiting.starved(starved_before_s, less_urgent_than=head.request.priority) if is_floor_open else None
            if starved is not None and starved.lora is not None and not self._can_take_slot(starved):
                starved = None  # a slot comes free as the running adapters drain (the passed-over rule)
            if starved is None and is_starved_only:
                break
            seq = starved or head
            if starved is None and seq.lora is not None and (passed_over or not self._can_take_slot(seq)):
                passed_over.append(self.waiting.pop())
                if len(passed_over) >= MAX_PASSED_OVER:
                    break
                continue
            admitted = None
            while admitted is None:
                num_seats = self._num_seats()
                if not num_seats or num_seats + 1 + len(seq.forks) <= self.settings.max_num_seqs:  # all its choices, or the whole room
                    admitted = self._admit(seq, budget)
                if admitted is None and not self._make_room(
                        seq, starved is not None, starved_before_s, scheduled, budget, self._lacks_budget(seq, budget)):
                    break
            if admitted is None and starved is not None and not is_starved_only:
                is_floor_open = False
                continue
            if admitted is None:
                break
            self.waiting.remove(seq)
            self._start_running(seq)
            scheduled[seq.seq_id] = (seq, admitted[0])
            budget.take(seq.num_computed_tokens, admitted[0], admitted[1])
        for seq in passed_over:
            self._enqueue(seq)

    def _under_share_tenants(self) -> frozenset[str]:
        """With ``fair_share``, the tenants under their share of seats (they go first in a band)."""
        if not self.settings.fair_share:
            return frozenset()
        return under_share_tenants(self._tenant_seats(), self.fair.weights, self.settings.max_num_seqs)

    def _tenant_seats(self) -> list[tuple[str, int]]:
        """``(tenant, seats held)`` of each running sequence (1 plus its pending forks)."""
        return [(s.request.tenant, 1 + len(s.forks)) for s in self.running]

    def _lacks_budget(self, seq: Sequence, budget: _StepBudget) -> bool:
        """Whether waiting ``seq`` gets no tokens from what is left of the step's budget (no
        preemption helps then); a fresh one counted from position 0 (cached prefix blocks only
        make its chunk start later)."""
        position = seq.num_computed_tokens if seq.status is SequenceStatus.SWAPPED else 0
        return budget.room(seq, position, self._is_prefill(seq) if position else True) == 0

    def _num_seats(self) -> int:
        """Seats taken: running sequences and the pending forks of those still prefilling."""
        return len(self.running) + sum(len(s.forks) for s in self.running)

    def _make_room(
        self, seq: Sequence, is_starved: bool, starved_before_s: float, scheduled: dict[int, tuple[Sequence, int]],
        budget: _StepBudget, lacks_budget: bool,
    ) -> bool:
        """Preempt one running sequence for ``seq``, which finds no seat, blocks or step budget,
        never one starved (no progress since ``starved_before_s``): for a starved ``seq`` (which
        waits behind a more urgent head) any other; else one of a less urgent priority
        (:func:`policies.fair_share.priority_victims`, as vLLM's priority policy preempts), else,
        with ``fair_share``, one of the same priority of the tenant :func:`fair_share_victim`
        names. Short of budget (``lacks_budget``), only a prefill chunk planned in this step
        gives its tokens back, so only such a one is preempted. Whether one was."""
        movable = [s for s in self.running if s.progress_s >= starved_before_s]
        if lacks_budget:
            movable = [s for s in movable if s.seq_id in scheduled and self._is_prefill(s)]
        candidates = movable if is_starved else priority_victims(seq.request.priority, movable)
        if not candidates and not is_starved and self.settings.fair_share:
            eligible = [s for s in movable if s.request.priority == seq.request.priority]
            tenants = sorted({s.request.tenant for s in eligible})
            victim = fair_share_victim(
                seq.request.tenant, self._tenant_seats(), self.fair.weights, self.settings.max_num_seqs, tenants
            )
            candidates = [s for s in eligible if s.request.tenant == victim]
        if candidates:
            self._preempt(self._pick_victim(candidates), scheduled, budget)
        return bool(candidates)

    def _admit(self, seq: Sequence, budget: _StepBudget) -> tuple[int, bool] | None:
        """Blocks for waiting ``seq``'s tokens this step: a swapped-out sequence's copied back in,
        another's fresh or from the prefix cache. Returns its tokens and whether they are
        prefill; ``None``: they do not fit."""
        if seq.status is SequenceStatus.SWAPPED:
            assert self.swapper is not None, "a sequence swapped out without a swapper"
            is_prefill = self._is_prefill(seq)
            num_tokens = budget.room(seq, seq.num_computed_tokens, is_prefill)
            if num_tokens == 0 or not self.swapper.can_swap_in(seq, num_tokens):
                return None
            self.swapper.swap_in(seq, num_tokens)
            self.counters.num_swap_ins += 1
            return num_tokens, is_prefill
        manager = self.block_manager
        num_known = seq.num_tokens
        # Prompt logprobs need every prompt position's logits, which cached blocks lack:
        # such a sequence skips the lookup and computes its whole prompt.
        hashes = [] if seq.request.needs_prompt_logprobs else seq.block_hashes
        num_cached = manager.num_cached_prefix_tokens(hashes, num_known)
        num_tokens = budget.room(seq, num_cached, True)
        if num_tokens == 0 or not manager.can_allocate(hashes, num_known, num_cached + num_tokens):
            return None
        seq.num_computed_tokens = manager.allocate(seq.seq_id, hashes, num_known, num_cached + num_tokens)
        assert seq.num_computed_tokens == num_cached, "prefix hits changed between lookup and allocate"
        return num_tokens, True

    def _can_take_slot(self, seq: Sequence) -> bool:
        """Whether ``seq``'s LoRA adapter has or can take a runner slot now."""
        assert seq.lora is not None and self.lora_slots is not None
        return self.lora_slots.can_take(seq.lora.adapter_id)

    def _lora_slot(self, seq: Sequence) -> int | None:
        """The runner slot of ``seq``'s adapter (``None``: the base model)."""
        if seq.lora is None or self.lora_slots is None:
            return None
        return self.lora_slots.slot_of(seq.lora.adapter_id)

    def _start_running(self, seq: Sequence) -> None:
        """``seq`` joins the running list; its adapter takes a slot (queued for loading into the
        runner with the next plan when it was not there)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if seq.lora is not None and self.lora_slots is not None:
            slot, needs_load = self.lora_slots.take(seq.lora.adapter_id)
            if needs_load:
                self._lora_loads.append((slot, seq.lora))
                self.counters.num_lora_loads += 1

    def _stop_running(self, seq: Sequence) -> None:
        """``seq`` leaves the running list (preempted or ended) and frees its blocks; its
        adapter's slot goes idle with its last running sequence."""
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        if seq.lora is not None and self.lora_slots is not None:
            self.lora_slots.release(seq.lora.adapter_id)

    def _pick_victim(self, running: list[Sequence]) -> Sequence:
        aging_s = self.settings.priority_aging_s
        candidates = [(priority_key(s.request.priority, s.arrival_s, aging_s), s.seq_id) for s in running]
        return running[pick_victim(candidates)]

    def best_effective_priority(self, now: float) -> float | None:
        """The most urgent effective priority among waiting and running sequences at ``now``."""
        aging_s = self.settings.priority_aging_s
        keys = [priority_key(s.request.priority, s.arrival_s, aging_s) for s in self.running]
        head_key = self.waiting.peek_key()
        if head_key is not None:
            keys.append(head_key)
        return min(keys) - now / aging_s if keys else None

    def _enqueue(self, seq: Sequence) -> None:
        self.waiting.push(seq, seq.request.priority, seq.arrival_s, seq.request.tenant, seq.progress_s)

    def _preempt(self, seq: Sequence, scheduled: dict[int, tuple[Sequence, int]], budget: _StepBudget) -> None:
        """Free ``seq``'s blocks and put it at the front of the waiting queue: swapped out when
        the swapper takes it (its KV copied to the host pool), else to recompute later; tokens it
        was ``scheduled`` for this step go back to ``budget``."""
        if seq.seq_id in scheduled:
            budget.take(seq.num_computed_tokens, -scheduled.pop(seq.seq_id)[1], self._is_prefill(seq))
        is_swapped = self.swapper is not None and self.swapper.swap_out(seq)
        self._stop_running(seq)
        if is_swapped:
            seq.status = SequenceStatus.SWAPPED
            self._swapped_out.append(seq)
            self.counters.num_swap_outs += 1
        else:
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self._enqueue(seq)
        self.counters.num_preemptions += 1

    def postprocess(self, plan: StepPlan, output: ForwardOutput) -> StepResult:
        """Record computed tokens, cache full blocks, append sampled tokens and finish the
        sequences that reached an end-of-sequence token or ``max_tokens`` (freeing their blocks;
        a ``max_tokens`` 0 sequence ends once its prompt is computed). Called by the batcher
        after the forward of ``plan``; the runner's logprobs pass through to the result."""
        new_token_ids: dict[int, list[int]] = {}
        finished: dict[int, FinishReason] = {}
        block_size = self.block_manager.block_size
        now = self.clock()
        for seq, seq_input in zip(plan.scheduled, plan.forward.sequences):
            before = seq.num_computed_tokens
            seq.num_computed_tokens += len(seq_input.token_ids)
            self.fair.charge(seq.request.tenant, len(seq_input.token_ids), seq.request.tenant_weight)
            self.counters.tokens_served_by_tenant[seq.request.tenant] += len(seq_input.token_ids)
            if self._filled_a_block(before, seq.num_computed_tokens):
                self.block_manager.commit(seq.seq_id, seq.block_hashes, seq.num_computed_tokens)
            token_id = output.sampled_token_ids.get(seq.seq_id)
            if token_id is None:
                if seq.request.max_tokens == 0 and seq.num_computed_tokens >= seq.num_tokens:
                    for choice in (*seq.forks, seq):  # pending forks end with it: nothing to generate
                        new_token_ids[choice.seq_id] = []
                        self._finish(choice, FinishReason.LENGTH)
                        finished[choice.seq_id] = FinishReason.LENGTH
                else:
                    self.counters.num_chunked_prefills += 1
                continue
            choices = [(seq, token_id)] + self._fork(seq, output) if seq.forks else [(seq, token_id)]
            for choice, choice_token_id in choices:
                reason = choice.append_token(choice_token_id, choice.seq_id in output.constraint_done)
                choice.progress_s = now  # a token for its client: the starvation floor's progress
                if self.settings.enable_prefix_caching:
                    choice.extend_block_hashes(block_size)
                new_token_ids[choice.seq_id] = [choice_token_id]
                if reason is not None:
                    self._finish(choice, reason)
                    finished[choice.seq_id] = reason
        logprobs = {seq_id: [lp] for seq_id, lp in output.logprobs.items()}
        prompt_logprobs = {
            s.seq_id: (s.position + 1, output.prompt_logprobs[s.seq_id])
            for s in plan.forward.sequences
            if s.seq_id in output.prompt_logprobs
        }
        return StepResult(new_token_ids, finished, logprobs, prompt_logprobs)

    def _fork(self, parent: Sequence, output: ForwardOutput) -> list[tuple[Sequence, int]]:
        """Fork ``parent``'s pending choices off its just-prefilled prompt, before any of them
        appends a token: each shares its blocks (:meth:`BlockManager.fork`) and runs, or, with no
        block free for its copy of the partial last block, waits to recompute (as a preempted
        sequence). Returns each fork with the first token the runner sampled for it.

        Raises:
            KeyError: the runner sampled no token for a fork (it ignored ``SequenceInput.forks``).
        """
        forks, parent.forks = parent.forks, []
        num_tokens = parent.num_computed_tokens
        sampled: list[tuple[Sequence, int]] = []
        for child in forks:
            child.take_parent_state(parent)
            if self.block_manager.can_fork(num_tokens):
                copy = self.block_manager.fork(parent.seq_id, child.seq_id, num_tokens)
                if copy is not None:
                    self._block_copies.append(copy)
                self._start_running(child)
            else:
                child.num_computed_tokens = 0
                child.status = SequenceStatus.PREEMPTED
                self._enqueue(child)
            sampled.append((child, output.sampled_token_ids[child.seq_id]))
        return sampled

    def _filled_a_block(self, before: int, after: int) -> bool:
        """Whether computing positions ``before .. after`` completed a block worth caching (most
        decode steps do not; skipping them spares a call every step)."""
        block_size = self.block_manager.block_size
        return self.settings.enable_prefix_caching and after // block_size > before // block_size

    def take_released(self) -> list[int]:
        """Ids released since the last plan, handed over once (for a final runner call on shutdown)."""
        released, self._released = self._released, []
        return released

    def finish(self, seq_id: int, reason: FinishReason) -> None:
        """End a waiting or running sequence now: out of its queue, its blocks freed, its
        sampler state released at the next plan. The output stage calls it when a stop string
        appears (``STOP``).

        Raises:
            KeyError: ``seq_id`` is not waiting or running (unknown, or already finished).
        """
        self._finish(self._live[seq_id], reason)

    def fail(self, seqs: list[Sequence]) -> list[Sequence]:
        """Take failed sequences out of the queues and free their blocks (``ERROR``), with the
        pending forks of each (they cannot start without it). Returns every sequence failed."""
        failed = [s for seq in seqs for s in (seq, *seq.forks)]
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING:  # the runner may have sampled for its forks
                self._released.extend(child.seq_id for child in seq.forks)
        for seq in failed:
            self._finish(seq, FinishReason.ERROR)
        return failed

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.has_sampler_state:
            self._released.append(seq.seq_id)  # the runner holds its sampler state
        if seq.status is SequenceStatus.SWAPPED and self.swapper is not None:
            self.swapper.free(seq.seq_id)
        if seq.status is SequenceStatus.RUNNING:
            self._stop_running(seq)
        elif seq.is_waiting:
            self.waiting.remove(seq)
        elif seq.parent is not None:  # a pending fork
            seq.parent.forks.remove(seq)
            seq.parent = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._live[seq.seq_id]
        self.fair.deactivate(seq.request.tenant)

    def _input_of(self, seq: Sequence, num_tokens: int) -> SequenceInput:
        token_ids = seq.next_input_token_ids(num_tokens)
        position = seq.num_computed_tokens
        request = seq.request
        do_sample = request.max_tokens > 0 and position + len(token_ids) >= seq.num_tokens
        params = seq.params
        in_prompt = position < len(seq.prompt_token_ids)
        prompt_targets: list[int] = []
        if request.needs_prompt_logprobs and not seq.output_token_ids:  # once outputs exist, all were reported
            prompt_targets = seq.token_ids_between(position + 1, min(position + len(token_ids) + 1, len(seq.prompt_token_ids)))
        return SequenceInput(
            seq_id=seq.seq_id,
            token_ids=token_ids,
            position=position,
            block_table=self.block_manager.block_table(seq.seq_id),
            do_sample=do_sample,
            params=params,
            forks=tuple((child.seq_id, child.params) for child in seq.forks) if do_sample else (),
            prompt_token_ids=seq.prompt_token_ids if params.uses_prompt_tokens and in_prompt else None,
            num_top_logprobs=request.num_top_logprobs,
            prompt_logprob_token_ids=prompt_targets,
            lora_slot=self._lora_slot(seq),
        )
