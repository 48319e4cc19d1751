"""The generation model runner: one packed forward per step over the paged KV pool, then sampling.

The runner owns tensors only: the bucket's KV pool (:class:`models.kv_cache.PagedKVCache`) and
each live sequence's sampler state. It never changes queues or block tables; the scheduler tells
it which sequences run, with which blocks, and which were released.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from models.attention import PackedStep, PrefillSegment
from models.backends.base import BackendUnavailableError, DecoderBackend, DecoderParts
from models.backends.eager import EagerDecoder
from models.backends.fallback import FallbackRunner, OnFallback
from models.backends.registry import DECODER_FACTORIES, build_decoder, supports_lora
from models.cuda_graphs import CudaGraphCapture, DecodeGraphs, GraphCapture
from models.kv_cache import KVShape, PagedKVCache, storage_dtype
from models.logits_processors import SequenceHistory
from models.logprobs import token_logprobs
from models.lora import projection_shapes
from models.lora_hooks import install_lora_hooks
from models.lora_stacks import LoraBatch, LoraStacks
from models.module_call_guard import module_calls
from models.paged_attention import compiled_kernel_available
from models.sampling import make_generator, sample
from models.step_io import Constraint, ForwardInput, ForwardOutput, SamplingParams, SequenceInput, TokenLogprobs
from models.structured_sampling import SequenceMatchers, TokenMask


class CausalLMRunner:
    """Runs steps of a Hugging Face decoder loaded with :data:`models.attention.ATTENTION_NAME`.

    Args:
        model: the decoder (Llama family: Llama, Qwen2, Mistral, SmolLM2, ...).
        num_blocks: blocks in the KV pool (see :meth:`KVShape.num_blocks_for`).
        block_size: tokens per block.
        backend: a decoder kind of :mod:`models.backends.registry` (``"eager"``: the module as
            loaded; ``"compiled"``: ``torch.compile`` of the decoder forward, prefill and decode
            apart, see :mod:`models.backends.compiled`).
        on_fallback: called once as ``on_fallback(backend, error)`` when a step of a non-eager
            backend fails and the runner reruns it, and every later step, on eager
            (:class:`models.backends.fallback.FallbackRunner`).
        eos_token_ids: the model's end-of-sequence ids, masked for a sequence with ``min_tokens``
            until it has that many tokens.
        tokenizer: the model's Hugging Face tokenizer, for sequences with a
            ``params.constraint`` (:mod:`models.structured_sampling`); ``None``: a constrained
            sequence is refused with ``ValueError`` at its first step.
        kv_cache_dtype: how the KV pool stores K/V (``float32``, ``bfloat16``, ``int8``;
            :mod:`models.kv_cache`); ``None``: in the model's dtype.
        max_loras: LoRA slots (:mod:`models.lora_stacks`): adapters the steps may run at once,
            loaded by :attr:`ForwardInput.lora_loads`, picked per sequence by
            :attr:`SequenceInput.lora_slot`. 0: LoRA off (nothing allocated, no hooks).
        max_lora_rank: the highest adapter rank a slot takes (lower ranks are zero-padded to it).
        swap_space_bytes: host memory for swap preemption's host pool
            (:class:`models.kv_cache.HostKVPool`): ``swap_space_bytes // bytes_per_block`` blocks;
            0: none.
        cuda_graph_sizes: the decode batch sizes :meth:`warm_up` captures as CUDA graphs
            (:func:`models.cuda_graphs.capture_sizes`); empty: every step runs eagerly. The pool
            then gets a pad block (:mod:`models.cuda_graphs`).
        graph_capture: how graphs are captured; ``None``: :class:`models.cuda_graphs.CudaGraphCapture`
            (tests pass a double that reruns the forward, to run graphs on a CPU).

    Raises:
        ValueError: an unknown ``backend`` or ``kv_cache_dtype``, a negative ``max_loras``,
            ``max_lora_rank`` below 1 with ``max_loras > 0``, or ``cuda_graph_sizes`` off a
            CUDA device without a ``graph_capture``.
        BackendUnavailableError: ``max_loras > 0`` on a kind that cannot run adapters
            (:func:`models.backends.registry.supports_lora`: ``compiled``).

    Called only from the bucket's worker thread: :meth:`warm_up` once at start, then once per
    step through :meth:`run`.
    """

    def __init__(
        self, model: Any, num_blocks: int, block_size: int, backend: str = "eager", on_fallback: OnFallback | None = None,
        eos_token_ids: frozenset[int] = frozenset(), tokenizer: Any = None, kv_cache_dtype: str | None = None,
        max_loras: int = 0, max_lora_rank: int = 16, swap_space_bytes: int = 0, cuda_graph_sizes: Sequence[int] = (),
        graph_capture: GraphCapture | None = None,
    ):
        if backend not in DECODER_FACTORIES:
            raise ValueError(f"backend must be one of {sorted(DECODER_FACTORIES)}, got {backend!r}")
        if max_loras < 0:
            raise ValueError(f"max_loras must be 0 (LoRA off) or more, got {max_loras}")
        if max_loras > 0 and not supports_lora(backend):
            raise BackendUnavailableError(f"the {backend} decoder backend cannot run LoRA adapters (max_loras {max_loras})")
        self.model = model
        self.decoder = getattr(model, model.base_model_prefix)
        self.lm_head = model.get_output_embeddings()
        self.kv_shape = KVShape.from_config(model.config)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if cuda_graph_sizes and graph_capture is None and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {self.device}")
        kv_dtype = storage_dtype(kv_cache_dtype, self.dtype)
        num_host_blocks = swap_space_bytes // (block_size * self.kv_shape.bytes_per_token_in(kv_dtype))
        self.kv_cache = PagedKVCache(
            self.kv_shape, num_blocks, block_size, kv_dtype, self.device, num_host_blocks, has_pad_block=bool(cuda_graph_sizes)
        )
        # Build (first start on a machine: ~30 s) or load the decode kernel now, not in a request.
        self.uses_compiled_kernel = compiled_kernel_available()
        self._generators: dict[int, torch.Generator] = {}
        # Token histories of the sequences whose sampling needs them (penalties, min_tokens).
        self._histories: dict[int, SequenceHistory] = {}
        self._eos_token_ids = eos_token_ids
        self._matchers = SequenceMatchers(tokenizer) if tokenizer is not None else None
        # A prepared 4D mask makes transformers skip building one; packed attention ignores it.
        dummy_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        eager = EagerDecoder(self.decoder, dummy_mask)
        self._lora: LoraStacks | None = None
        if max_loras > 0:
            self._lora = LoraStacks(
                projection_shapes(model.config), len(self.decoder.layers), max_loras, max_lora_rank, self.dtype, self.device
            )
            install_lora_hooks(self.decoder)
        self._primary = build_decoder(backend, DecoderParts(self.decoder, self.kv_cache, dummy_mask, self.lm_head))
        self._forward_backend: DecoderBackend = (
            eager if self._primary.name == eager.name else FallbackRunner(self._primary, eager, on_fallback)
        )
        self._graphs: DecodeGraphs | None = None
        if cuda_graph_sizes:
            max_blocks = min(num_blocks, -(-int(model.config.max_position_embeddings) // block_size))
            capture = graph_capture or CudaGraphCapture(self.device)
            self._graphs = DecodeGraphs(self._primary.hidden_states, self.kv_cache, cuda_graph_sizes, max_blocks, capture)

    @property
    def backend(self) -> str:
        """The kind steps run on now (``eager`` once a non-eager backend failed)."""
        return self._forward_backend.name

    @property
    def primary_backend(self) -> DecoderBackend:
        """The backend of the kind this runner was built for (steps run on eager instead once
        it failed): for the gate's hooks into a kind (:mod:`models.backends.decoder_gate`)."""
        return self._primary

    @property
    def cuda_graph_sizes(self) -> list[int]:
        """The decode batch sizes replayed as CUDA graphs (empty: none captured, or graphs off)."""
        return self._graphs.sizes if self._graphs is not None and self._graphs.is_captured else []

    @property
    def num_live_sequences(self) -> int:
        """Sequences with sampler state (running or preempted, not yet released)."""
        return len(self._generators)

    @torch.inference_mode()
    def run(self, batch: ForwardInput) -> ForwardOutput:
        """Run one step: release ended sequences, forward all scheduled tokens packed, sample.

        Returns the sampled token for every sequence with ``do_sample`` and for each of its
        ``forks`` (sampled from the same logits row, each with its own generator), its logprobs
        for those with ``num_top_logprobs`` (a fork's from the row it sampled from), and prompt
        logprobs for those with ``prompt_logprob_token_ids`` (all from the raw logits,
        :mod:`models.logprobs`). A step where no sequence asks for logprobs computes none. The
        ``block_copies`` run first, so a fork's block holds its parent's KV before anything
        reads it (a fork swapped out in this step copies it to the host), then the ``swap_out``
        copies (before the forward: the blocks a swapped-out victim freed may serve another
        sequence in this step), the ``swap_in`` copies and the ``lora_loads``; a sequence runs
        its ``lora_slot``'s adapter, its forks too.

        Raises:
            ValueError: a LoRA load or slot this runner cannot take (``max_loras`` 0, a slot out
                of range or empty, an adapter's rank above ``max_lora_rank``).
        """
        self._apply_changes(batch)
        if not batch.sequences:
            return ForwardOutput(sampled_token_ids={})
        # Single-token segments (decodes) go first: attention runs them in one paged call.
        ordered = sorted(batch.sequences, key=lambda s: len(s.token_ids) != 1)
        hidden = self._forward(ordered)
        starts = list(itertools.accumulate((len(s.token_ids) for s in ordered), initial=0))
        prompt_logprobs = self._prompt_logprobs(hidden, ordered, starts)
        rows: list[int] = []
        sampling: list[_Sampling] = []
        for seq, end in zip(ordered, starts[1:]):
            if seq.do_sample:
                for seq_id, params in ((seq.seq_id, seq.params), *seq.forks):
                    rows.append(end - 1)
                    sampling.append(_Sampling(seq_id, params, seq.num_top_logprobs, seq.prompt_token_ids))
        if not sampling:
            return ForwardOutput(sampled_token_ids={}, prompt_logprobs=prompt_logprobs)
        logits = self._logits(hidden[0, torch.tensor(rows, device=self.device)]).float()
        asking = [i for i, s in enumerate(sampling) if s.num_top_logprobs is not None]
        # Indexing copies the rows, so logits processors that work in place cannot reach them.
        raw = logits[torch.tensor(asking, device=self.device)] if asking else None
        sampling_started = time.perf_counter()
        generators = [self._generator(s.seq_id, s.params) for s in sampling]
        histories = [self._history(s) for s in sampling]
        constrained = [(i, s.seq_id, c) for i, s in enumerate(sampling) if (c := s.params.constraint) is not None]
        mask = self._token_mask(constrained) if constrained else None
        tokens = sample(logits, [s.params for s in sampling], generators, histories, self._eos_token_ids, mask)
        constraint_done = frozenset[int]()
        if self._matchers is not None and constrained:
            constraint_done = self._matchers.advance([seq_id for _, seq_id, _ in constrained], [tokens[i] for i, _, _ in constrained])
        for history, token in zip(histories, tokens):
            if history is not None:
                history.output_token_ids.append(token)
        sampling_s = time.perf_counter() - sampling_started
        logprobs: dict[int, TokenLogprobs] = {}
        if raw is not None:
            computed = token_logprobs(raw, [tokens[i] for i in asking], [sampling[i].num_top_logprobs or 0 for i in asking])
            logprobs = {sampling[i].seq_id: lp for i, lp in zip(asking, computed)}
        return ForwardOutput(
            sampled_token_ids={s.seq_id: t for s, t in zip(sampling, tokens)}, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            constraint_done=constraint_done, sampling_s=sampling_s,
        )

    def _apply_changes(self, batch: ForwardInput) -> None:
        """What ``batch`` changes before its forward, in :meth:`run`'s order: ended sequences'
        sampler state dropped, block copies, swap-outs, swap-ins, LoRA slot loads."""
        for seq_id in batch.released_seq_ids:
            self._generators.pop(seq_id, None)
            self._histories.pop(seq_id, None)
            if self._matchers is not None:
                self._matchers.release(seq_id)
        self.kv_cache.copy_blocks(batch.block_copies)
        self.kv_cache.swap_out(batch.swap_out)
        self.kv_cache.swap_in(batch.swap_in)
        for slot, request in batch.lora_loads:
            self._lora_stacks().load(slot, request.weights)

    def _token_mask(self, constrained: list[tuple[int, int, Constraint]]) -> TokenMask:
        """The allowed tokens of the step's constrained rows ``(row, seq_id, constraint)``.

        Raises:
            ValueError: the runner has no tokenizer to compile constraints with.
        """
        if self._matchers is None:
            raise ValueError("this runner was built without a tokenizer; it cannot run constrained sequences")
        return self._matchers.mask(constrained, self.device)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, ordered: list[SequenceInput], starts: list[int]
    ) -> dict[int, list[TokenLogprobs]]:
        """Logprobs of each sequence's ``prompt_logprob_token_ids`` from its rows of ``hidden``
        (``[1, T, hidden_size]``), the LM head run on at most ``_PROMPT_LOGPROB_ROWS`` rows at
        a time so a long prompt's logits never sit in memory whole."""
        result: dict[int, list[TokenLogprobs]] = {}
        for seq, start in zip(ordered, starts):
            targets = seq.prompt_logprob_token_ids
            if not targets:
                continue
            computed: list[TokenLogprobs] = []
            for offset in range(0, len(targets), _PROMPT_LOGPROB_ROWS):
                chunk = targets[offset : offset + _PROMPT_LOGPROB_ROWS]
                logits = self._logits(hidden[0, start + offset : start + offset + len(chunk)])
                computed.extend(token_logprobs(logits, chunk, [seq.num_top_logprobs or 0] * len(chunk)))
            result[seq.seq_id] = computed
        return result

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, hidden_size]`` -> ``[R, vocab_size]``: the serving backend's own LM head when it
        has one (``logits``, see :class:`models.backends.base.DecoderParts`), else the model's."""
        backend = self._forward_backend
        active = backend.active if isinstance(backend, FallbackRunner) else backend
        head = getattr(active, "logits", None) or self.lm_head
        logits: torch.Tensor = head(hidden)
        return logits

    def warm_up(self, shapes: Sequence[tuple[int, int]]) -> float:
        """Run the forward once at each step shape so no request pays for compilation; returns
        the seconds it took.

        A shape ``(num_sequences, num_tokens)`` is a step of ``num_sequences`` decodes when
        ``num_tokens`` is 1, else of ``num_sequences`` prompts of ``num_tokens`` tokens. With the
        compiled backend, include ``(1, 1)``, ``(n, 1)`` for some ``n > 1`` and one prefill to
        compile every graph. The steps write K/V into the pool's first blocks, whose contents
        are put back afterwards; no sampler state is created. With ``cuda_graph_sizes``, the
        decode graphs are captured last (the capture time logged as ``cuda_graphs_captured``);
        a capture that fails logs ``cuda_graphs_unavailable`` and leaves decodes eager.

        Raises:
            BackendUnavailableError: a non-eager backend failed to compile or run (warm-up runs
                it without the fallback, so the caller can build an eager runner instead).
        """
        block_size = self.kv_cache.block_size
        num_blocks = min(self.kv_cache.num_blocks, max((_blocks_for(s, block_size) for s in shapes), default=1))
        blocks = torch.arange(num_blocks, device=self.device)
        saved = self.kv_cache.save_blocks(blocks)
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                for shape in shapes:
                    self._forward(_scratch_step(shape, blocks.tolist(), block_size), self._primary)
        except Exception as exc:  # noqa: BLE001 - a compile failure of any kind means eager
            if self._primary.name == "eager":
                raise
            raise BackendUnavailableError(f"{self._primary.name} decoder backend failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self.kv_cache.restore_blocks(blocks, saved)
        if self.device.type == "cuda":  # the steps ran asynchronously: wait for them
            torch.cuda.synchronize(self.device)
        # Once: a later warm-up (swap preemption's cost measurement) replays the graphs it has.
        if self._graphs is not None and not self._graphs.is_captured and not self._graphs.try_capture(self._primary.name):
            self._graphs = None
        return time.perf_counter() - started

    @module_calls
    def _forward(self, sequences: list[SequenceInput], backend: DecoderBackend | None = None) -> torch.Tensor:
        """The decoder's last hidden states for the packed tokens: ``[1, T, hidden_size]``, run on
        ``backend`` (default: the serving one, behind its fallback to eager; a decode step that
        a captured graph holds replays it, while the primary backend serves)."""
        graphs = self._graphs
        if backend is None and graphs is not None and graphs.fits(sequences) and self.backend == self._primary.name:
            return graphs.run(sequences)
        token_ids: list[int] = []
        positions: list[int] = []
        for seq in sequences:
            token_ids.extend(seq.token_ids)
            positions.extend(range(seq.position, seq.position + len(seq.token_ids)))
        input_ids = torch.tensor([token_ids], device=self.device)
        position_ids = torch.tensor([positions], device=self.device)
        step = self._packed_step(sequences)
        if any(seq.lora_slot is not None for seq in sequences):
            step = dataclasses.replace(step, lora=self._lora_batch(sequences))
        # Slots are rewritten alike when a failed step is rerun on eager.
        return (backend or self._forward_backend).hidden_states(input_ids, position_ids, step)

    def _lora_stacks(self) -> LoraStacks:
        """The runner's slots.

        Raises:
            ValueError: LoRA is off (``max_loras`` 0).
        """
        if self._lora is None:
            raise ValueError("this runner was built with max_loras 0; it cannot run LoRA adapters")
        return self._lora

    def _lora_batch(self, sequences: list[SequenceInput]) -> LoraBatch | None:
        """The step's LoRA rows: each packed token runs its sequence's ``lora_slot``."""
        row_slots = [seq.lora_slot for seq in sequences for _ in seq.token_ids]
        return self._lora_stacks().batch(row_slots)

    def _packed_step(self, sequences: list[SequenceInput]) -> PackedStep:
        """Slot mapping, decode block tables and prefill segments of ``sequences`` (decodes first)."""
        block_size = self.kv_cache.block_size
        slots: list[int] = []
        decodes = [s for s in sequences if len(s.token_ids) == 1]
        prefills: list[PrefillSegment] = []
        start = 0
        for seq in sequences:
            table = seq.block_table
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(seq.position, seq.position + len(seq.token_ids)))
            if len(seq.token_ids) > 1:
                block_ids = torch.tensor(table, device=self.device) if seq.position > 0 else None
                prefills.append(PrefillSegment(start, len(seq.token_ids), seq.position, block_ids))
            start += len(seq.token_ids)
        max_blocks = max((len(s.block_table) for s in decodes), default=0)
        block_tables = torch.tensor(
            [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in decodes], dtype=torch.int32, device=self.device
        ).reshape(len(decodes), max_blocks)
        context_lens = torch.tensor([s.position + 1 for s in decodes], dtype=torch.int32, device=self.device)
        return PackedStep(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_decode_tokens=len(decodes),
            block_tables=block_tables,
            context_lens=context_lens,
            prefills=prefills,
        )

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator:
        generator = self._generators.get(seq_id)
        if generator is None:
            generator = self._generators[seq_id] = make_generator(params, self.device)
        return generator

    def _history(self, sampling: "_Sampling") -> SequenceHistory | None:
        """The sequence's token history when its sampling needs one (created at its first sample,
        with the prompt the scheduler sends along for ``repetition_penalty``), else ``None``.
        Sampled tokens are added by :meth:`run`; a preempted sequence keeps its history, so the
        outputs it recomputes are not counted twice."""
        if not sampling.params.needs_history:
            return None
        history = self._histories.get(sampling.seq_id)
        if history is None:
            history = self._histories[sampling.seq_id] = SequenceHistory(list(sampling.prompt_token_ids or []))
        return history


class _Sampling(NamedTuple):
    """One token to sample in a step: a sequence's, or a fork's from its parent's last row."""

    seq_id: int
    params: SamplingParams
    num_top_logprobs: int | None
    prompt_token_ids: list[int] | None  # a fork's is its parent's: the prompt they share


# Prompt positions whose logits are computed at once for prompt logprobs (49,152-token
# vocabulary: 48 MiB of float32 logits).
_PROMPT_LOGPROB_ROWS = 256

# A decode in a warm-up step sits at this position: its context spans two blocks.
_WARM_UP_DECODE_BLOCKS = 2


def _blocks_for(shape: tuple[int, int], block_size: int) -> int:
    num_sequences, num_tokens = shape
    per_sequence = _WARM_UP_DECODE_BLOCKS if num_tokens == 1 else -(-num_tokens // block_size)
    return num_sequences * per_sequence


def _scratch_step(shape: tuple[int, int], blocks: list[int], block_size: int) -> list[SequenceInput]:
    """The sequences of a warm-up step of ``shape`` (see :meth:`CausalLMRunner.warm_up`), their
    tables drawn in turn from ``blocks`` (shared when there are too few: the K/V are garbage)."""
    num_sequences, num_tokens = shape
    per_sequence = _blocks_for((1, num_tokens), block_size)
    position = block_size if num_tokens == 1 else 0
    return [
        SequenceInput(
            seq_id=i,
            token_ids=[0] * num_tokens,
            position=position,
            block_table=[blocks[(i * per_sequence + j) % len(blocks)] for j in range(per_sequence)],
            do_sample=False,
            params=SamplingParams(temperature=0.0),
        )
        for i in range(num_sequences)
    ]
