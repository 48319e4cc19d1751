"""The state of one generation request inside the continuous batcher."""

from __future__ import annotations

import dataclasses
import enum
import itertools

from buckets.block_manager import hash_block_tokens, lora_root_hash
from buckets.request import GenerationRequest
from models.step_io import LoraRequest, SamplingParams

_seq_ids = itertools.count()

# torch.Generator seeds lie in [-2**63, 2**64 - 1]; a child seed past the top wraps around.
_SEED_MODULUS = 2**64


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded with ``seed``: ``seed + index`` (vLLM's
    rule in ``ParentRequest._get_child_sampling_params``), wrapped below ``2**64``; choice 0
    keeps the request's seed, so ``n=1`` samples as before. ``None`` stays ``None``."""
    if seed is None:
        return None
    total = seed + index
    return total - _SEED_MODULUS if total >= _SEED_MODULUS else total


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    FORK_PENDING = "fork_pending"  # a choice waiting for its parent's prompt to be prefilled
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its blocks freed; recomputes prompt + outputs when resumed
    SWAPPED = "swapped"  # waiting again, its KV in the host pool; copied back in when resumed
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a sequence ended. ``STOP``, ``LENGTH`` and ``TIMEOUT`` are the ``finish_reason`` a
    client sees (their values); a ``CANCELLED`` or ``ERROR`` sequence ends without one."""

    STOP = "stop"  # an end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached
    TIMEOUT = "timeout"  # the request's deadline passed
    CANCELLED = "cancelled"  # Request.cancel(): the client left, or the gateway's own timeout
    ERROR = "error"  # a failed forward, or the bucket shutting down


class Sequence:
    """Prompt and output tokens of one choice of a request, how many are computed, and its
    prefix-cache keys.

    Choice 0 of a request with ``n`` choices is its parent: it alone prefills the prompt, and
    holds the other choices in :attr:`forks` (``FORK_PENDING``) until then; the scheduler forks
    them off its blocks after the prompt's last chunk. ``params`` are the request's, with the
    seed of :func:`child_seed` for a seeded request.

    Owned by the bucket's worker thread; the scheduler changes it, the output stage reads it.
    """

    def __init__(self, request: GenerationRequest, eos_token_ids: frozenset[int], index: int = 0) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        params = request.params
        self.params: SamplingParams = params if index == 0 else dataclasses.replace(params, seed=child_seed(params.seed, index))
        self.parent: Sequence | None = None
        self.forks: list[Sequence] = []
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.arrival_s = 0.0  # when it joined its bucket's queue (seconds, the scheduler's clock)
        self.progress_s = 0.0  # when it last sampled a token (its arrival before that): the starvation floor's
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None  # set by the scheduler when it ends
        # Chained prefix-cache keys of its full blocks of known tokens (see :meth:`extend_block_hashes`).
        self.block_hashes: list[int] = []
        self._eos_token_ids = frozenset() if request.ignore_eos else eos_token_ids
        self._stop_token_ids = frozenset(request.params.stop_token_ids)
        # Whether it ended on one of ``params.stop_token_ids`` (a token left out of the text).
        self.stopped_on_token = False

    def spawn_forks(self) -> list[Sequence]:
        """Create the request's choices ``1 .. n - 1`` as this sequence's pending :attr:`forks`
        and return them (called once, when the scheduler queues choice 0)."""
        self.forks = [Sequence(self.request, self._eos_token_ids, index) for index in range(1, self.request.n)]
        for child in self.forks:
            child.parent = self
            child.status = SequenceStatus.FORK_PENDING
        return list(self.forks)

    def take_parent_state(self, parent: Sequence) -> None:
        """Continue from ``parent``'s prefilled prompt: its computed count and prompt block keys
        (the scheduler calls it at the fork, before either appends a token)."""
        self.num_computed_tokens = parent.num_computed_tokens
        self.block_hashes = list(parent.block_hashes)
        self.arrival_s = parent.arrival_s
        self.progress_s = parent.progress_s
        self.parent = None

    @property
    def lora(self) -> LoraRequest | None:
        """The request's LoRA adapter (``None``: the base model); every choice runs with it."""
        return self.request.lora

    @property
    def has_sampler_state(self) -> bool:
        """Whether the runner may hold a generator for it (it ran, or sampled a token)."""
        return self.status is SequenceStatus.RUNNING or self.num_preemptions > 0 or bool(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this sequence can reach: prompt + ``max_tokens``."""
        return len(self.prompt_token_ids) + self.request.max_tokens

    @property
    def is_waiting(self) -> bool:
        return self.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED, SequenceStatus.SWAPPED)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens known but not yet in the KV cache: 1 for a decode, more while prefilling."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens ``start .. end - 1`` of prompt then outputs, without joining the two lists."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def next_input_token_ids(self, num_tokens: int) -> list[int]:
        """The next ``num_tokens`` tokens not yet in the KV cache (a prompt chunk, or the last sampled token)."""
        return self.token_ids_between(self.num_computed_tokens, self.num_computed_tokens + num_tokens)

    def extend_block_hashes(self, block_size: int) -> None:
        """Hash the full blocks of ``block_size`` known tokens not hashed yet, chaining onto
        :attr:`block_hashes` (:func:`~buckets.block_manager.hash_block_tokens`). Each block is
        hashed once in the sequence's life: the scheduler calls this when it queues the sequence
        and after each token it appends, so a sequence that waits many steps is not re-hashed.
        A sequence with a LoRA adapter chains its first block onto the adapter's key."""
        root = lora_root_hash(self.lora.adapter_id) if self.lora is not None else None
        for start in range(len(self.block_hashes) * block_size, self.num_tokens - block_size + 1, block_size):
            parent_hash = self.block_hashes[-1] if self.block_hashes else root
            self.block_hashes.append(hash_block_tokens(parent_hash, self.token_ids_between(start, start + block_size)))

    @property
    def text_token_ids(self) -> list[int]:
        """The outputs whose text the client gets: all of them, but the last when it is one of
        ``params.stop_token_ids`` that ended the sequence (vLLM leaves it out too)."""
        return self.output_token_ids[:-1] if self.stopped_on_token else self.output_token_ids

    def append_token(self, token_id: int, constraint_done: bool = False) -> FinishReason | None:
        """Add a sampled token; return why the sequence must end now (``STOP`` when
        ``constraint_done``: its ``params.constraint`` is complete; ``STOP`` at an
        end-of-sequence token unless ``ignore_eos``, or at one of ``params.stop_token_ids``,
        once ``params.min_tokens`` are out; ``LENGTH`` at ``max_tokens``), else ``None``."""
        self.output_token_ids.append(token_id)
        if constraint_done:
            return FinishReason.STOP
        if len(self.output_token_ids) >= self.request.params.min_tokens:
            if token_id in self._eos_token_ids:
                return FinishReason.STOP
            if token_id in self._stop_token_ids:
                self.stopped_on_token = True
                return FinishReason.STOP
        if len(self.output_token_ids) >= self.request.max_tokens:
            return FinishReason.LENGTH
        return None
