"""Shared test factories: one fake clock, fake requests and a real scheduler with no model.

Small defaults, as the unit tests use them (``make_scheduler()`` is a scheduler of 64 blocks of
4 tokens, ``make_request()`` a 4-token prompt asking for 4 tokens). Nothing here imports torch
or a model, so any unit test can use them.
"""

from __future__ import annotations

from buckets.block_manager import BlockManager
from buckets.request import EmbeddingRequest, GenerationRequest, RequestEvent
from buckets.scheduler import PrefillBudget, Scheduler
from buckets.sequence import Sequence
from buckets.settings import ContinuousBatcherSettings
from buckets.swap_space import SwapSpace, Swapper
from models.step_io import LoraRequest
from policies.preemption import PreemptionMode, SwapCostModel

# The fake tokenizer's end-of-sequence token id; make_sequence stops on it.
EOS = 0


class FakeClock:
    """Seconds (float) that only move when a test says so: call it for the time, set ``now`` or
    :meth:`advance` it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward."""
        self.now += seconds


class FakeTokenizer:
    """Token ``i`` decodes to ``pieces[i]`` if given, else to the letter ``chr(ord('a') + i % 26)``.

    ``EOS`` decodes to ``</s>`` and is dropped with ``skip_special_tokens``.
    """

    all_special_ids = [EOS]

    def __init__(self, pieces: dict[int, str] | None = None) -> None:
        self.pieces = pieces or {}

    def decode(self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        """The text of ``ids`` (``clean_up_tokenization_spaces`` is accepted and ignored)."""
        out = []
        for i in ids:
            if i == EOS:
                if not skip_special_tokens:
                    out.append("</s>")
                continue
            out.append(self.pieces.get(i, chr(ord("a") + i % 26)))
        return "".join(out)


class Recorder:
    """A request sink that keeps every event it is given, in order, in ``events``."""

    def __init__(self) -> None:
        self.events: list[RequestEvent] = []

    def __call__(self, event: RequestEvent) -> None:
        self.events.append(event)


def events_of(request: GenerationRequest | EmbeddingRequest) -> list[RequestEvent]:
    """The events a request made with these factories has received."""
    assert isinstance(request.sink, Recorder)
    return request.sink.events


def make_request(
    prompt_len: int = 4,
    max_tokens: int = 4,
    stop: tuple[str, ...] = (),
    ignore_eos: bool = False,
    name: str = "r",
    priority: int = 0,
    first_token: int = 1,
    lora: LoraRequest | None = None,
) -> GenerationRequest:
    """A generation request named ``name`` whose prompt is the ids ``first_token`` ..
    ``first_token + prompt_len - 1``, recording its events, run with ``lora`` (none: the base)."""
    return GenerationRequest(
        request_id=name,
        priority=priority,
        prompt_token_ids=list(range(first_token, first_token + prompt_len)),
        sink=Recorder(),
        max_tokens=max_tokens,
        stop=stop,
        ignore_eos=ignore_eos,
        lora=lora,
    )


def make_requests(num: int, start_token: int = 1, length: int = 2) -> list[EmbeddingRequest]:
    """``num`` embedding requests; request ``i`` is named ``e{i}``, repeats token
    ``start_token + i`` and has ``length + i`` tokens."""
    return [
        EmbeddingRequest(request_id=f"e{i}", prompt_token_ids=[start_token + i] * (length + i), sink=Recorder())
        for i in range(num)
    ]


def make_sequence(request: GenerationRequest) -> Sequence:
    """``request`` as a scheduler sequence ending on ``EOS`` (its text is the output stage's:
    :class:`~buckets.output.OutputProcessor`)."""
    return Sequence(request, frozenset({EOS}))


def make_scheduler(
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 64,
    num_blocks: int = 64,
    block_size: int = 4,
    enable_prefix_caching: bool = True,
    clock: FakeClock | None = None,
    prefill_budget: PrefillBudget | None = None,
    max_loras: int = 0,
    preemption: PreemptionMode = "recompute",
    num_host_blocks: int = 0,
    swap_costs: SwapCostModel | None = None,
    fair_share: bool = True,
    max_starvation_s: float = 10.0,
) -> Scheduler:
    """A real :class:`Scheduler` over a real :class:`BlockManager` of ``num_blocks`` blocks of
    ``block_size`` tokens, on ``clock`` (a fresh :class:`FakeClock` at 0 s by default), with
    ``prefill_budget`` (none: prefill fills ``max_num_batched_tokens``) and ``max_loras`` LoRA slots;
    with ``preemption`` ``swap`` or ``auto``, a :class:`Swapper` over ``num_host_blocks`` host
    blocks and ``swap_costs``; ``fair_share`` and ``max_starvation_s`` as the settings'."""
    settings = ContinuousBatcherSettings(
        max_num_seqs, max_num_batched_tokens, block_size, enable_prefix_caching, max_loras=max_loras, preemption=preemption,
        fair_share=fair_share, max_starvation_s=max_starvation_s,
    )
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
    swapper = None if preemption == "recompute" else Swapper(preemption, SwapSpace(num_host_blocks), manager, swap_costs)
    return Scheduler(settings, manager, clock or FakeClock(), prefill_budget, swapper)
