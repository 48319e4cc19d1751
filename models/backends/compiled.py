"""The ``compiled`` backend: ``torch.compile`` (TorchInductor) of the same modules the eager path runs.

Shapes vary at run time (the dynamic batcher pads a batch to its longest input; a generation
step packs a varying number of tokens), so everything compiles with ``dynamic=True``: one graph
serves every size, and a size only recompiles where Dynamo specialises it (a dimension of 1).
``warm_up`` compiles at the bucket's shapes, so no request pays for it. Graphs are frozen (weights
become constants; see :func:`_freezing`), so a compiled backend assumes the weights never change.

Encoders (:class:`CompiledEncoder`) compile whole, one graph per forward (``fullgraph=True``).

Decoders (:class:`CompiledDecoder`, used by :class:`models.causal_lm.CausalLMRunner` with
``backend="compiled"``) compile twice, like gpt-fast's prefill and decode: one callable for steps
of single-token decodes only, one for steps with any prefill segment. Sluice's packed paged
attention stays what the eager path runs (:func:`models.attention.packed_attention`, the C++
decode kernel included), wrapped as the custom op ``sluice::packed_attention``: the graph sees
one opaque op per layer that reads and writes the KV pool, so there is no graph break and the
step's Python structure (block tables, prefill segments) never becomes a guard. Its metadata
reaches the op as tensors whose sizes are unbacked, so their lengths never recompile either.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from models.attention import ATTENTION_NAME, PackedStep, PrefillSegment, packed_attention, register_attention
from models.backends.base import BackendUnavailableError, DecoderBackend, DecoderParts, EncoderBackend, EncoderParts, warm_up_encoder
from models.kv_cache import PagedKVCache

# Columns of CompiledStep.prefill_meta.
PREFILL_META_FIELDS = ("start", "num_tokens", "position", "block_offset", "num_blocks")


# Freezing makes weights graph constants: Inductor's lowering of the oneDNN prepacked linears
# (models/cpu_linear.py) takes only constant weights, and it prepacks plain ones itself. Dynamo
# reads the global flag while tracing, so it must be on around every call that may compile (a
# compile option reaches Inductor only). Buckets call from several worker threads: a count, not
# torch's save-and-restore patch, decides when it goes off again.
class _Freezing:
    """``torch._inductor.config.freezing`` on while any caller is inside; as it was after the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._num_inside = 0
        self._was_on = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._num_inside == 0:
                self._was_on = torch._inductor.config.freezing
                torch._inductor.config.freezing = True
            self._num_inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._num_inside -= 1
                if self._num_inside == 0:
                    torch._inductor.config.freezing = self._was_on


_freezing = _Freezing()


class CompiledEncoder:
    """``torch.compile(dynamic=True, fullgraph=True)`` of a Hugging Face encoder's forward, frozen.

    Args:
        model: the loaded encoder (``AutoModel``, BERT and kin), in eval mode.

    Freezing (weights as graph constants) lets Inductor prepack the linears for oneDNN: side by
    side with the unfrozen graph it was a tenth to a quarter faster. The weights must not change
    after the first call. Call :meth:`warm_up` at start: compilation happens there (and a compile
    error is raised there as :class:`BackendUnavailableError`). After it, every ``(batch, seq)``
    with batch and seq of at least 2 runs one graph; batch 1 has its own, also warmed.
    """

    name = "compiled"

    def __init__(self, model: Any):
        self.model = model
        self.device = next(model.parameters()).device
        self._compiled = torch.compile(_encoder_forward, dynamic=True, fullgraph=True)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with _freezing():
            return self._compiled(self.model, input_ids, attention_mask).float()

    def warm_up(self, shapes: Sequence[tuple[int, int]]) -> float:
        """Compile and run at each ``(batch, seq)`` shape, and at batch 1 (Dynamo specialises a
        dimension of 1); returns the seconds it took.

        Raises:
            BackendUnavailableError: torch.compile failed (no C++ compiler, an untraceable model).
        """
        extra = [(1, min(seq for _, seq in shapes))] if shapes and all(batch > 1 for batch, _ in shapes) else []
        try:
            return warm_up_encoder(self, [*shapes, *extra], self.device)
        except Exception as exc:  # noqa: BLE001 - any compile failure means falling back to eager
            raise BackendUnavailableError(f"torch.compile of the encoder failed: {type(exc).__name__}: {exc}") from exc


def _encoder_forward(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    # A function of our own, not the module's forward: its Dynamo cache is ours alone.
    return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


@dataclass(frozen=True)
class CompiledStep:
    """A :class:`models.attention.PackedStep` as tensors only, what a compiled graph takes.

    Fields:
        kv_data: the pool's tensor (``PagedKVCache.data``), written by the attention op.
        slot_mapping: ``[T]`` int64, as in ``PackedStep``.
        block_tables: ``[num_decode_tokens, max_blocks]`` int32; ``context_lens``: ``[num_decode_tokens]`` int32.
        prefill_meta: ``[num_prefills, 5]`` int64, one row per prefill segment, columns
            :data:`PREFILL_META_FIELDS`; ``block_offset`` and ``num_blocks`` locate the segment's
            block table in ``prefill_block_ids`` (``num_blocks`` is 0 for a segment at position 0).
        prefill_block_ids: ``[total]`` int64, the block tables of the prefill segments, back to back.
    """

    kv_data: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    prefill_meta: torch.Tensor
    prefill_block_ids: torch.Tensor

    @classmethod
    def from_packed(cls, step: PackedStep) -> "CompiledStep":
        rows: list[list[int]] = []
        block_ids: list[torch.Tensor] = []
        offset = 0
        for seg in step.prefills:
            num_blocks = 0 if seg.block_ids is None else len(seg.block_ids)
            rows.append([seg.start, seg.num_tokens, seg.position, offset, num_blocks])
            if seg.block_ids is not None:
                block_ids.append(seg.block_ids)
            offset += num_blocks
        device = step.slot_mapping.device
        compiled = cls(
            kv_data=step.kv_cache.data,
            slot_mapping=step.slot_mapping,
            block_tables=step.block_tables,
            context_lens=step.context_lens,
            # A decode-only step makes no host-to-device copy: it may be captured in a CUDA graph.
            prefill_meta=torch.tensor(rows, dtype=torch.int64, device=device).reshape(len(rows), len(PREFILL_META_FIELDS))
            if rows else torch.empty((0, len(PREFILL_META_FIELDS)), dtype=torch.int64, device=device),
            prefill_block_ids=torch.cat(block_ids) if block_ids else torch.empty(0, dtype=torch.int64, device=device),
        )
        compiled.mark_unbacked()
        return compiled

    def mark_unbacked(self) -> None:
        """Tell Dynamo the metadata sizes are unknown (no 0/1 specialisation, no duck-sized
        equalities): only the attention op reads them, so one graph fits every step."""
        for tensor, dims in (
            (self.block_tables, (0, 1)),
            (self.context_lens, (0,)),
            (self.prefill_meta, (0,)),
            (self.prefill_block_ids, (0,)),
        ):
            for dim in dims:
                torch._dynamo.decorators.mark_unbacked(tensor, dim)


# The pools compiled decoders run on, by the address of their tensor: the op receives the tensor
# and needs the PagedKVCache around it to run the eager attention code unchanged.
_POOLS: "weakref.WeakValueDictionary[int, PagedKVCache]" = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class _Layer:
    """What :func:`packed_attention` reads of the attention module."""

    layer_idx: int


@torch.library.custom_op("sluice::packed_attention", mutates_args=("kv_data",))
def packed_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_data: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    prefill_meta: torch.Tensor,
    prefill_block_ids: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`models.attention.packed_attention` of one layer as an opaque op (shapes as there;
    returns ``[1, T, num_heads, head_dim]``). Writes the step's K/V into ``kv_data``."""
    pool = _POOLS.get(kv_data.data_ptr())
    assert pool is not None, "the KV pool was copied or never registered: the op must write the pool in place"
    prefills = [
        PrefillSegment(start, num_tokens, position, prefill_block_ids[offset : offset + num_blocks] if position > 0 else None)
        for start, num_tokens, position, offset, num_blocks in (prefill_meta.tolist() if prefill_meta.numel() else [])
    ]  # no read-back for a decode-only step (a host sync, which a CUDA graph capture forbids)
    step = PackedStep(pool, slot_mapping, block_tables.shape[0], block_tables, context_lens, prefills)
    out, _ = packed_attention(_Layer(layer), query, key, value, None, scaling=scale, sluice_step=step)
    return out


@packed_attention_op.register_fake
def _packed_attention_fake(query: torch.Tensor, *args: Any) -> torch.Tensor:
    return query.new_empty((1, query.shape[2], query.shape[1], query.shape[3]))


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``ATTENTION_NAME`` once a compiled decoder exists:
    a :class:`CompiledStep` goes to the op, anything else to :func:`packed_attention` as before."""
    step = kwargs.get("sluice_step")
    if not isinstance(step, CompiledStep):
        return packed_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = packed_attention_op(
        query, key, value, step.kv_data, module.layer_idx, step.slot_mapping, step.block_tables,
        step.context_lens, step.prefill_meta, step.prefill_block_ids, scale,
    )  # fmt: skip
    return out, None


def register_compiled_attention() -> None:
    """Route ``ATTENTION_NAME`` through :func:`_attention` (eager steps behave exactly as before)."""
    from transformers import AttentionInterface

    register_attention()
    AttentionInterface.register(ATTENTION_NAME, _attention)


def _decoder_forward(
    decoder: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, step: CompiledStep
) -> torch.Tensor:
    out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False, sluice_step=step)
    return out.last_hidden_state


# Two entry points, so decode and prefill graphs live on different code objects, each with its
# own Dynamo cache and recompile limit.
def _decode_forward(
    decoder: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, step: CompiledStep
) -> torch.Tensor:
    return _decoder_forward(decoder, input_ids, position_ids, mask, step)


def _prefill_forward(
    decoder: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, step: CompiledStep
) -> torch.Tensor:
    return _decoder_forward(decoder, input_ids, position_ids, mask, step)


class CompiledDecoder:
    """The packed decoder forward of :class:`models.causal_lm.CausalLMRunner`, compiled.

    Args:
        decoder: the Hugging Face decoder (``model.model``), loaded with ``ATTENTION_NAME``.
        kv_cache: the runner's pool (registered so the attention op can find it).
        attention_mask: the runner's prepared dummy 4D mask.

    Graphs: decode-only steps compile once for 1 sequence and once for any other count (Dynamo
    specialises a dimension of 1); steps with a prefill compile once. Compilation happens on the
    first call at each; the runner's ``warm_up`` makes those calls.
    """

    def __init__(self, decoder: Any, kv_cache: PagedKVCache, attention_mask: torch.Tensor):
        register_compiled_attention()
        self.decoder = decoder
        self.attention_mask = attention_mask
        _POOLS[kv_cache.data.data_ptr()] = kv_cache
        # The pool's shape is fixed for the runner's life: no symbols (nor equalities) for it.
        torch._dynamo.mark_static(kv_cache.data)
        self._decode = torch.compile(_decode_forward, dynamic=True, fullgraph=True)
        self._prefill = torch.compile(_prefill_forward, dynamic=True, fullgraph=True)

    name = "compiled"

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, step: PackedStep) -> torch.Tensor:
        """Last hidden states ``[1, T, hidden_size]`` of the packed tokens (``input_ids`` and
        ``position_ids`` ``[1, T]`` int64)."""
        forward = self._prefill if step.prefills else self._decode
        with _freezing():
            return forward(self.decoder, input_ids, position_ids, self.attention_mask, CompiledStep.from_packed(step))


def _compiled_encoder(parts: EncoderParts) -> EncoderBackend:
    return CompiledEncoder(parts.model)


def _compiled_decoder(parts: DecoderParts) -> DecoderBackend:
    return CompiledDecoder(parts.decoder, parts.kv_cache, parts.attention_mask)


ENCODER_FACTORIES: dict[str, Callable[[EncoderParts], EncoderBackend]] = {"compiled": _compiled_encoder}
DECODER_FACTORIES: dict[str, Callable[[DecoderParts], DecoderBackend]] = {"compiled": _compiled_decoder}
