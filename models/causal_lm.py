"""The generation model runner: one packed forward per step, then sampling.

The runner owns tensors only: each live sequence's KV storage and sampler state. It never
changes queues; the scheduler tells it which sequences run and which were released.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from models.attention import PackedStep, Segment
from models.kv_cache import KVShape, SequenceKVCache
from models.sampling import make_generator, sample
from models.step_io import ForwardInput, ForwardOutput, SequenceInput


class _LiveSequence:
    __slots__ = ("kv", "generator")

    def __init__(self, kv: SequenceKVCache, generator: torch.Generator):
        self.kv = kv
        self.generator = generator


class CausalLMRunner:
    """Runs steps of a Hugging Face decoder loaded with :data:`models.attention.ATTENTION_NAME`.

    Called only from the bucket's worker thread, once per step, through :meth:`run`.
    """

    def __init__(self, model: Any):
        self.model = model
        self.decoder = getattr(model, model.base_model_prefix)
        self.lm_head = model.get_output_embeddings()
        self.kv_shape = KVShape.from_config(model.config)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._live: dict[int, _LiveSequence] = {}
        # A prepared 4D mask makes transformers skip building one; packed attention ignores it.
        self._dummy_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)

    @property
    def num_live_sequences(self) -> int:
        return len(self._live)

    @torch.inference_mode()
    def run(self, batch: ForwardInput) -> ForwardOutput:
        """Run one step: release ended sequences, forward all scheduled tokens packed, sample.

        Returns the sampled token for every sequence with ``do_sample``.
        """
        for seq_id in batch.released_seq_ids:
            self._live.pop(seq_id, None)
        if not batch.sequences:
            return ForwardOutput(sampled_token_ids={})
        hidden = self._forward(batch.sequences)
        sampling = [(i, s) for i, s in enumerate(batch.sequences) if s.do_sample]
        if not sampling:
            return ForwardOutput(sampled_token_ids={})
        offsets = list(itertools.accumulate(len(s.token_ids) for s in batch.sequences))
        ends = torch.tensor([offsets[i] - 1 for i, _ in sampling], device=self.device)
        logits = self.lm_head(hidden[0, ends]).float()
        tokens = sample(logits, [s.params for _, s in sampling], [self._live[s.seq_id].generator for _, s in sampling])
        return ForwardOutput(sampled_token_ids={s.seq_id: t for (_, s), t in zip(sampling, tokens)})

    def _forward(self, sequences: list[SequenceInput]) -> torch.Tensor:
        """The decoder's last hidden states for the packed tokens: ``[1, T, hidden_size]``."""
        token_ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        for seq in sequences:
            live = self._live.get(seq.seq_id) or self._admit(seq)
            segments.append(Segment(start=len(token_ids), num_tokens=len(seq.token_ids), position=seq.position, kv=live.kv))
            token_ids.extend(seq.token_ids)
            positions.extend(range(seq.position, seq.position + len(seq.token_ids)))
        out = self.decoder(
            input_ids=torch.tensor([token_ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            attention_mask=self._dummy_mask,
            use_cache=False,
            sluice_step=PackedStep(segments=segments),
        )
        return out.last_hidden_state

    def _admit(self, seq: SequenceInput) -> _LiveSequence:
        live = _LiveSequence(
            kv=SequenceKVCache(self.kv_shape, seq.capacity_tokens, self.dtype, self.device),
            generator=make_generator(seq.params, self.device),
        )
        self._live[seq.seq_id] = live
        return live
