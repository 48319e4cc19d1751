"""Plain data passed between the scheduler and the model runner (no torch here)."""

from __future__ import annotations

import enum
from dataclasses import KW_ONLY, dataclass, field
from typing import Any


GREEDY_TEMPERATURE = 1e-5


class ConstraintKind(enum.Enum):
    """What a :class:`Constraint`'s ``value`` holds."""

    JSON_SCHEMA = "json_schema"  # value: the schema as a JSON string (json.dumps, key order kept: llguidance emits properties in it)
    JSON_OBJECT = "json_object"  # value: "" (any JSON object)
    REGEX = "regex"  # value: the regex
    CHOICE = "choice"  # value: json.dumps(list of strings)
    LARK = "lark"  # value: a Lark grammar in llguidance's dialect (may embed %json {...})


@dataclass(frozen=True)
class Constraint:
    """The structure a request's output must have (compiled by :mod:`models.structured`):
    every sampled token is one the grammar allows."""

    kind: ConstraintKind
    value: str


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    ``temperature`` below ``GREEDY_TEMPERATURE`` is greedy (argmax). ``top_k == 0`` and ``top_p == 1`` turn those filters
    off. ``seed`` makes sampling reproducible per request, whatever else shares the batch.

    The logits processors of :mod:`models.logits_processors` (their defaults turn each off):
    ``frequency_penalty`` and ``presence_penalty`` (OpenAI's, over the generated tokens),
    ``repetition_penalty`` (vLLM's, over prompt and generated tokens; 1 is off), ``min_p``
    (vLLM's: tokens below ``min_p`` times the top token's probability are dropped),
    ``logit_bias`` (``(token id, bias)`` pairs added to the logits), ``min_tokens`` (the
    end-of-sequence and ``stop_token_ids`` tokens are masked, and stop strings ignored, until
    that many tokens are generated). ``stop_token_ids`` end generation like an end-of-sequence
    token, with ``finish_reason="stop"`` and the token left out of the text. ``constraint``
    (``None``: none): the output follows it (:mod:`models.structured`) and ends with
    ``finish_reason="stop"`` once the grammar is complete.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    constraint: Constraint | None = None

    @property
    def is_greedy(self) -> bool:
        """Temperatures below ``GREEDY_TEMPERATURE`` pick the argmax (as vLLM's ``_SAMPLING_EPS``):
        dividing float32 logits by them would give 0/0 for the top token."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        """Whether any of the three penalties is on (they need the sequence's token history)."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def uses_prompt_tokens(self) -> bool:
        """Whether sampling looks at the prompt's tokens (only ``repetition_penalty`` does)."""
        return self.repetition_penalty != 1.0

    @property
    def needs_history(self) -> bool:
        """Whether the runner keeps this sequence's token history (penalties, ``min_tokens``)."""
        return self.uses_penalties or self.min_tokens > 0

    @property
    def uses_logits_processors(self) -> bool:
        """Whether any processor applied before the greedy pick is on (penalties,
        ``logit_bias``, ``min_tokens``); ``min_p`` is applied after it, see :mod:`models.sampling`."""
        return self.needs_history or bool(self.logit_bias)


@dataclass(frozen=True, eq=False)
class LoraRequest:
    """The LoRA adapter a generation request runs with (``None`` on a request: the base model).

    Fields:
        name: the adapter's served model id (``"model"`` in a request body).
        adapter_id: unique per load of an adapter in this process: an adapter unloaded and
            loaded again under the same name gets a new one, so runner slots and prefix-cached
            KV blocks (keyed by it) never mix the two.
        weights: the adapter's tensors, a :class:`models.lora.LoraAdapter`; opaque to the
            scheduler, which only hands it to the runner in :attr:`ForwardInput.lora_loads`.
            A request holds its adapter's weights until it ends, so evicting the adapter from
            the gateway's in-memory cache never pulls them from under a running sequence.
    """

    name: str
    adapter_id: int
    weights: Any = field(repr=False)


@dataclass(frozen=True)
class SequenceInput:
    """One sequence's share of a step.

    Fields:
        seq_id: the sequence's id, stable for its life.
        token_ids: the tokens to compute this step (a whole prompt, a prefill chunk, or the last
            sampled token for a decode).
        position: how many of the sequence's tokens are already in its KV cache; the first of
            ``token_ids`` sits at this absolute position.
        block_table: the sequence's KV block ids, enough to hold ``position + len(token_ids)`` tokens.
        do_sample: whether to sample a next token after this step (false for a non-final prefill chunk).
        params: sampling parameters.
        forks: ``(seq_id, params)`` of the sequences that fork off this one after its prompt's
            last chunk: each samples its own first token from this sequence's last logits row,
            with its own sampler state (only with ``do_sample``); they take this sequence's
            ``num_top_logprobs``.
        num_top_logprobs: ``None``: no logprobs; ``k`` (0 to 20): the sampled token's logprob
            and the ``k`` most likely tokens' (see :mod:`models.logprobs`).
        prompt_logprob_token_ids: the known tokens at positions ``position + 1`` on, whose
            logprobs given the tokens before them the runner computes from this step's rows
            ``0 .. len - 1`` (with ``num_top_logprobs`` alternatives); empty for most requests.
        prompt_token_ids: the whole prompt, sent with each chunk of the prompt's prefill when
            ``params.uses_prompt_tokens`` (the runner keeps it for ``repetition_penalty``; with
            prefix caching the chunks alone miss the cached part), else ``None``.
        lora_slot: the runner's LoRA slot (``0 .. max_loras - 1``) holding this sequence's
            adapter, loaded there by this or an earlier step's :attr:`ForwardInput.lora_loads`;
            ``None``: the base model. Its forks run with the same adapter.
    """

    seq_id: int
    token_ids: list[int]
    position: int
    block_table: list[int]
    do_sample: bool
    params: SamplingParams
    _: KW_ONLY  # the optional fields below are named at every call site
    forks: tuple[tuple[int, SamplingParams], ...] = ()
    num_top_logprobs: int | None = None
    prompt_logprob_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    lora_slot: int | None = None


@dataclass(frozen=True)
class ForwardInput:
    """The runner's whole input for one step.

    ``sequences`` run packed in one forward. ``released_seq_ids`` are sequences that ended since
    the last step: the runner drops their sampler state before running (their KV blocks are
    already back in the block manager's pool; the runner never owns blocks). ``block_copies``
    are ``(source, destination)`` KV block ids to copy before the forward (a forked sequence's
    copy of its parent's last, partly filled block, as vLLM V0's ``blocks_to_copy``).
    ``lora_loads`` are ``(slot, adapter)`` pairs: the runner copies each adapter's weights into
    that LoRA slot before the forward, replacing what the slot held (no running sequence uses a
    slot the scheduler reloads; :class:`policies.lora_slots.LoraSlots`).

    Swap preemption (:mod:`buckets.swap_space`): ``swap_out`` are ``(device block, host block)``
    pairs the runner copies to its host pool after the block copies and before the forward (the
    device blocks were freed by a victim this plan and may already serve another sequence in
    it; a fork swapped out in the step after its fork holds its copied block only once the block
    copies ran); ``swap_in`` are ``(host block, device block)`` pairs it copies back next.
    """

    sequences: list[SequenceInput]
    released_seq_ids: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    lora_loads: list[tuple[int, LoraRequest]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's log-probabilities, from the model's raw logits (natural log).

    Fields:
        token_id: the token at this position (sampled, or the prompt's).
        logprob: its log-probability.
        top: the most likely tokens at this position, ``(token_id, logprob)``, most likely
            first (as many as the request asked for; ``token_id`` may be among them).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class ForwardOutput:
    """The runner's result.

    Fields:
        sampled_token_ids: one sampled token id for each sequence with ``do_sample``, and for
            each of its ``forks``.
        logprobs: the sampled token's :class:`TokenLogprobs`, for each sampling sequence with
            ``num_top_logprobs`` set and each of its ``forks``.
        prompt_logprobs: for each sequence with ``prompt_logprob_token_ids``, one
            :class:`TokenLogprobs` per such token, in order.
        constraint_done: the sequences whose constraint is complete with the token sampled
            this step (nothing but end-of-sequence may follow): they end with ``finish_reason="stop"``.
        sampling_s: wall seconds the runner spent sampling (and masking), for the step's phases
            (:class:`buckets.stats.BucketStats`).
    """

    sampled_token_ids: dict[int, int]
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    constraint_done: frozenset[int] = frozenset()
    sampling_s: float = 0.0
