"""The model runners the batchers drive, as protocols: the seam between batching and models.

The batching core never imports torch or a model class; it calls these methods on whatever the
gateway built (:class:`models.causal_lm.CausalLMRunner`, :class:`models.encoder.EmbeddingRunner`,
or a test's fake). Both are called on the slice's worker thread only.
"""

from __future__ import annotations

from typing import Protocol

from models.step_io import ForwardInput, ForwardOutput


class KVPool(Protocol):
    """The geometry of a decoder's paged KV pool, which sizes the batcher's block manager."""

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool (>= 1)."""

    @property
    def block_size(self) -> int:
        """Tokens per block (>= 1)."""

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host pool swapped-out KV goes to (0: none); read only by a batcher with
        swap preemption (``preemption`` ``swap`` or ``auto``)."""


class ModelRunner(Protocol):
    """A decoder the :class:`~buckets.continuous.ContinuousBatcher` runs once per step."""

    @property
    def kv_cache(self) -> KVPool:
        """The KV pool the block tables of :meth:`run`'s input point into."""

    def run(self, forward: ForwardInput) -> ForwardOutput:
        """One packed forward of every sequence in ``forward.sequences`` (their ``token_ids`` at
        their ``position``, KV read from and written to their ``block_table``), then one sampled
        token for each sequence with ``do_sample`` and for each of its ``forks`` (from the same
        logits row, each fork with its own sampler state). First drops the sampler state of
        ``forward.released_seq_ids``, runs ``forward.block_copies``, copies ``forward.swap_out``
        to the host pool, then ``forward.swap_in`` back (an input with no sequences only does
        that). Never changes queues or block tables.

        Raises:
            Exception: any failure of the forward; the batcher fails the step's requests with
                :class:`~buckets.errors.BatchFailedError` and goes on.
        """


class EmbeddingRows(Protocol):
    """A ``[batch, hidden_size]`` float tensor, as the dynamic batcher reads it."""

    def tolist(self) -> list[list[float]]:
        """One list of ``hidden_size`` floats per input, in input order."""


class EncoderRunner(Protocol):
    """An encoder the :class:`~buckets.dynamic.DynamicBatcher` runs once per batch."""

    def embed(self, batch_token_ids: list[list[int]]) -> tuple[EmbeddingRows, int]:
        """Embed a batch of token id lists (padded together); return the rows (one per input,
        L2-normalised when the model says so) and how many padding tokens the batch held.

        Raises:
            Exception: any failure of the forward; the batcher fails the batch's requests with
                :class:`~buckets.errors.BatchFailedError` and goes on.
        """
