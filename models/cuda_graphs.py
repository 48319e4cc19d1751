"""Decode steps replayed as CUDA graphs at padded batch sizes, as vLLM and nano-vllm do.

A decode step of a small model launches hundreds of kernels (tens per layer) that each run for
microseconds, so on a GPU the step costs the launches more than the math. At warm-up the runner
captures the decoder forward of a decode-only step once per *capture size* (1, 2, 4, 8, then
multiples of 16 up to ``max_num_seqs``: :func:`capture_sizes`) over static input buffers, the
largest first, all graphs sharing one memory pool. A decode-only step of ``n`` sequences (every
one a single token, none with a LoRA adapter, ``n`` at most the largest size) then copies its
inputs into the first ``n`` rows of the buffers, fills the rest as *padding rows*
(:func:`pad_decode_inputs`) and replays the graph of the smallest size ``>= n``; the runner reads
the first ``n`` rows of the output. Prefill, mixed and LoRA steps run eagerly.

Padding rows are harmless by construction: each writes its K/V into slot 0 of the pool's *pad
block* (``PagedKVCache.pad_block_id``, one block past the block manager's range) and attends over
that one slot (context length 1), so they never touch a sequence's block, and their hidden states
are never sampled. The capture itself sits behind :class:`GraphCapture`: :class:`CudaGraphCapture`
on a GPU; tests swap in a double that "replays" by running the forward again on the same
buffers, which runs this whole path on a CPU.

A captured forward must not synchronise with the host (no ``.item()``, ``.tolist()``, ``bool()``
of a device tensor, no host-to-device copy of Python values): the paged decode kernel skips its
value checks while a capture is under way (:func:`models.paged_attention.paged_decode_attention`).
A capture that fails anyway (a backend that syncs) leaves the runner decoding eagerly, logged.
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import torch

from models.attention import PackedStep
from models.kv_cache import PagedKVCache
from models.module_call_guard import GUARD
from models.step_io import SequenceInput

log = structlog.get_logger(__name__)

# nano-vllm's sizes: the small batches one by one in powers of two, then every 16th.
SMALL_CAPTURE_SIZES = (1, 2, 4, 8)
CAPTURE_SIZE_STEP = 16

# The decoder forward a graph captures: ``(input_ids [1, n], position_ids [1, n], step) -> [1, n, hidden]``.
DecodeForward = Callable[[torch.Tensor, torch.Tensor, PackedStep], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture for a bucket of ``max_num_seqs``, ascending: 1, 2, 4, 8 (those
    up to ``max_num_seqs``), the multiples of 16 up to it, and ``max_num_seqs`` itself.

    Raises:
        ValueError: ``max_num_seqs`` below 1.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be 1 or more, got {max_num_seqs}")
    sizes = {s for s in SMALL_CAPTURE_SIZES if s <= max_num_seqs}
    sizes.update(range(CAPTURE_SIZE_STEP, max_num_seqs + 1, CAPTURE_SIZE_STEP))
    return sorted(sizes | {max_num_seqs})


@dataclass(frozen=True)
class PaddedDecode:
    """A decode step's inputs padded to a capture size (host lists, copied into the static buffers).

    Fields:
        token_ids, positions, slots, context_lens: ``[padded_size]`` each; rows ``[0, num_real)``
            are the step's sequences in order, the rest padding rows (token 0 at position 0,
            slot 0 of the pad block, context length 1).
        block_tables: ``[padded_size][width]``, width the longest real table (at least 1); a real
            row's table is padded with the pad block id (entries past its context are ignored),
            a padding row's is the pad block throughout.
        num_real: the step's sequences: the only rows whose output is read.
    """

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    num_real: int


def pad_decode_inputs(sequences: Sequence[SequenceInput], block_size: int, padded_size: int, pad_block_id: int) -> PaddedDecode:
    """Pad a decode-only step of ``sequences`` (one token each) to ``padded_size`` rows.

    Raises:
        ValueError: a sequence with other than one token, or more sequences than ``padded_size``.
    """
    if any(len(seq.token_ids) != 1 for seq in sequences):
        raise ValueError("a padded decode step takes sequences of one token each")
    num_pad = padded_size - len(sequences)
    if num_pad < 0:
        raise ValueError(f"{len(sequences)} sequences do not fit a capture size of {padded_size}")
    width = max((len(seq.block_table) for seq in sequences), default=1)
    pad_slot = pad_block_id * block_size
    return PaddedDecode(
        token_ids=[seq.token_ids[0] for seq in sequences] + [0] * num_pad,
        positions=[seq.position for seq in sequences] + [0] * num_pad,
        slots=[seq.block_table[seq.position // block_size] * block_size + seq.position % block_size for seq in sequences]
        + [pad_slot] * num_pad,
        context_lens=[seq.position + 1 for seq in sequences] + [1] * num_pad,
        block_tables=[seq.block_table + [pad_block_id] * (width - len(seq.block_table)) for seq in sequences]
        + [[pad_block_id] * width for _ in range(num_pad)],
        num_real=len(sequences),
    )


class CapturedStep(Protocol):
    """One captured forward over fixed buffers."""

    def replay(self) -> torch.Tensor:
        """Run the forward again on the buffers' current contents; returns its output tensor
        (for a CUDA graph the same static tensor every time, overwritten by the next replay)."""
        ...


class GraphCapture(Protocol):
    """The seam between :class:`DecodeGraphs` and the capture mechanism."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> CapturedStep:
        """Run ``forward`` once to warm up (lazy initialisations, kernel compiles), then capture
        it. Called from the runner's warm-up, once per capture size, the largest first.

        Raises:
            RuntimeError (or any error of ``forward``): the forward cannot be captured.
        """
        ...


class CudaGraphCapture:
    """Captures with ``torch.cuda.CUDAGraph``, every graph in one memory pool (the largest is
    captured first, so the smaller ones fit in its memory). The capture is ``thread_local``: a
    bucket is built (and captured) on a build thread while other buckets' workers keep stepping
    on the same GPU, whose CUDA calls a ``global`` capture would forbid (failing their steps).

    Args:
        device: the CUDA device the forward runs on.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._pool: Any = None

    def capture(self, forward: Callable[[], torch.Tensor]) -> CapturedStep:
        """See :meth:`GraphCapture.capture`."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        forward()
        torch.cuda.current_stream(self.device).synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            output = forward()
        torch.cuda.current_stream(self.device).synchronize()
        return _CudaStep(graph, output)


class _CudaStep:
    def __init__(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor):
        self._graph, self._output = graph, output

    def replay(self) -> torch.Tensor:
        self._graph.replay()
        return self._output


class DecodeGraphs:
    """A runner's captured decode steps and their static input buffers.

    Args:
        forward: the decoder forward to capture (the runner's primary backend's ``hidden_states``).
        kv_cache: the runner's pool, built with a pad block (``has_pad_block``).
        sizes: the batch sizes to capture (:func:`capture_sizes`).
        max_blocks_per_seq: block-table columns of the static buffer; a step with a longer
            table runs eagerly.
        capture: how forwards are captured (:class:`CudaGraphCapture` on a GPU).

    Raises:
        ValueError: ``kv_cache`` has no pad block, or ``sizes`` is empty.

    Called only from the bucket's worker thread (:meth:`capture_all` from the runner's warm-up).
    """

    def __init__(
        self, forward: DecodeForward, kv_cache: PagedKVCache, sizes: Sequence[int], max_blocks_per_seq: int, capture: GraphCapture
    ):
        if kv_cache.pad_block_id is None:
            raise ValueError("CUDA graphs need a KV pool with a pad block (has_pad_block)")
        if not sizes:
            raise ValueError("CUDA graphs need at least one capture size")
        self.sizes = sorted(sizes)
        self._forward, self._kv_cache, self._capture = forward, kv_cache, capture
        self._pad_block_id: int = kv_cache.pad_block_id
        self.max_blocks_per_seq = max_blocks_per_seq
        device, max_size = kv_cache.data.device, self.sizes[-1]
        self._input_ids = torch.zeros((1, max_size), dtype=torch.int64, device=device)
        self._positions = torch.zeros((1, max_size), dtype=torch.int64, device=device)
        self._slots = torch.zeros(max_size, dtype=torch.int64, device=device)
        self._context_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        self._block_tables = torch.full((max_size, max_blocks_per_seq), self._pad_block_id, dtype=torch.int32, device=device)
        self._graphs: dict[int, CapturedStep] = {}

    @property
    def is_captured(self) -> bool:
        return bool(self._graphs)

    def try_capture(self, backend_name: str) -> bool:
        """:meth:`capture_all` under inference mode, logged as ``cuda_graphs_captured`` with its
        seconds (``capture_s``); a failure of any kind logs ``cuda_graphs_unavailable`` and
        returns False (the runner then decodes eagerly)."""
        started = time.perf_counter()
        try:
            with torch.inference_mode(), GUARD.module_calls():  # a capture runs modules as a step does
                self.capture_all()
        except Exception as exc:  # noqa: BLE001 - a forward that cannot be captured runs eagerly
            log.warning("cuda_graphs_unavailable", backend=backend_name, error=f"{type(exc).__name__}: {exc}", running="eager")
            self._graphs.clear()
            return False
        log.info("cuda_graphs_captured", backend=backend_name, sizes=self.sizes, capture_s=round(time.perf_counter() - started, 3))
        return True

    def capture_all(self) -> None:
        """Capture a graph per size, the largest first, every row a padding row (so warm-up and
        capture write the pad block only).

        Raises:
            whatever the capture raises (the runner then decodes eagerly).
        """
        for size in reversed(self.sizes):
            self._copy_in(pad_decode_inputs([], self._kv_cache.block_size, size, self._pad_block_id))
            step = PackedStep(
                kv_cache=self._kv_cache, slot_mapping=self._slots[:size], num_decode_tokens=size,
                block_tables=self._block_tables[:size], context_lens=self._context_lens[:size], prefills=[],
            )
            forward = functools.partial(self._forward, self._input_ids[:, :size], self._positions[:, :size], step)
            self._graphs[size] = self._capture.capture(forward)

    def fits(self, sequences: Sequence[SequenceInput]) -> bool:
        """Whether the step of ``sequences`` can replay a graph: decodes only, no LoRA, at most
        the largest size, every table within ``max_blocks_per_seq``."""
        return (
            self.is_captured
            and 0 < len(sequences) <= self.sizes[-1]
            and all(len(s.token_ids) == 1 and s.lora_slot is None and len(s.block_table) <= self.max_blocks_per_seq for s in sequences)
        )

    def run(self, sequences: Sequence[SequenceInput]) -> torch.Tensor:
        """Replay the smallest graph that holds ``sequences`` (which :meth:`fits`); returns the
        real rows' last hidden states ``[1, len(sequences), hidden_size]``, a view that the next
        replay overwrites."""
        size = self.sizes[bisect.bisect_left(self.sizes, len(sequences))]
        padded = pad_decode_inputs(sequences, self._kv_cache.block_size, size, self._pad_block_id)
        self._copy_in(padded)
        return self._graphs[size].replay()[:, : padded.num_real]

    def _copy_in(self, padded: PaddedDecode) -> None:
        """Copy ``padded`` into the first rows of the static buffers (block tables: the first
        ``width`` columns; the columns past them are never read for these rows)."""
        size, width = len(padded.token_ids), len(padded.block_tables[0])
        self._input_ids[0, :size].copy_(torch.tensor(padded.token_ids, dtype=torch.int64))
        self._positions[0, :size].copy_(torch.tensor(padded.positions, dtype=torch.int64))
        self._slots[:size].copy_(torch.tensor(padded.slots, dtype=torch.int64))
        self._context_lens[:size].copy_(torch.tensor(padded.context_lens, dtype=torch.int32))
        self._block_tables[:size, :width].copy_(torch.tensor(padded.block_tables, dtype=torch.int32))
