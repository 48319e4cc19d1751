"""The runner's LoRA slots and the per-row batched LoRA product of a step.

Many adapters over one base model run in one packed forward, as Punica's SGMV (Chen et al.,
2023, "Punica: Multi-Tenant LoRA Serving") and S-LoRA (Sheng et al., 2023) do: each target
product ``y = x W^T`` of the base runs once for every row, and each row ``t`` whose sequence runs
adapter ``i`` adds ``scaling_i * (x_t A_i^T) B_i^T`` (Hu et al., 2021, "LoRA"). On the CPU a
segmented gather kernel buys nothing over dense products this small, so the rows are batched by
a mask instead of a gather:

- :class:`LoraSlots` holds, per target product ``(layer, projection)``, a stack of
  ``max_loras`` slots of width ``R = max_lora_rank``: ``A`` rows ``[max_loras * R, in]`` and
  ``scaling * B^T`` rows ``[max_loras * R, out]``, zeros where no adapter (or a lower rank)
  fills them. A stack is allocated at the first load of an adapter that targets its product.
- :class:`LoraBatch`, built once per step from each row's slot, adds the LoRA term to a
  product's output in three torch ops whatever the mix of adapters:
  ``h = x @ A[:m R]^T`` (``[T, m R]``, ``m`` the highest slot used plus one),
  ``h *= mask`` (one-hot by the row's slot, repeated ``R`` times; zero for base rows),
  ``y += h @ (scaling B^T)[:m R]``. When every row runs the same slot the mask is skipped and
  only that slot's ``r`` rows are read (two ops).

A step where no row has an adapter builds no :class:`LoraBatch`, so it runs no extra op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from models.lora import LoraAdapter


@dataclass
class _Stack:
    """One target product's slots: ``a`` ``[max_loras * R, in]``, ``bt`` (``scaling * B^T``)
    ``[max_loras * R, out]``; ``loaded``: the slots whose adapter targets this product."""

    a: torch.Tensor
    bt: torch.Tensor
    loaded: set[int] = field(default_factory=set)


class LoraSlots:
    """The slot stacks of one runner (:class:`models.causal_lm.CausalLMRunner` with
    ``max_loras > 0``). Called only from the runner's thread: :meth:`load` before a step's
    forward, :meth:`batch` once per step.

    Args:
        shapes: ``(in_features, out_features)`` per projection (:func:`models.lora.projection_shapes`).
        num_layers: decoder layers; an adapter's layer indices must be below it.
        max_loras: slots (``0 .. max_loras - 1``), at least 1.
        max_lora_rank: ``R``, the width of every slot; lower ranks are padded with zeros.
        dtype, device: of the stacks (the model's).

    Raises:
        ValueError: ``max_loras`` or ``max_lora_rank`` below 1.
    """

    def __init__(
        self, shapes: dict[str, tuple[int, int]], num_layers: int, max_loras: int, max_lora_rank: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ):
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {max_lora_rank}")
        self.shapes, self.num_layers = shapes, num_layers
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.dtype, self.device = dtype, torch.device(device)
        self.stacks: dict[tuple[int, str], _Stack] = {}
        # The rank of the adapter each slot holds (None: empty).
        self.slot_ranks: list[int | None] = [None] * max_loras

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated stacks."""
        return sum(s.a.numel() * s.a.element_size() + s.bt.numel() * s.bt.element_size() for s in self.stacks.values())

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy ``adapter`` into ``slot``, replacing what it held: its ``A`` rows as they are,
        ``scaling * B^T``, zeros past its rank and in the products it does not target.

        Raises:
            ValueError: ``slot`` outside ``0 .. max_loras - 1``, the adapter's rank above
                ``max_lora_rank``, or a weight whose layer, projection or shape does not fit the
                model (the message names it). Nothing is changed then.
        """
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot must be in 0..{self.max_loras - 1}, got {slot} (adapter {adapter.name!r})")
        if not 1 <= adapter.rank <= self.max_lora_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}; this runner's max_lora_rank is {self.max_lora_rank}")
        for key, (a, b) in adapter.weights.items():
            self._check(adapter, key, a, b)
        width = self.max_lora_rank
        rows = slice(slot * width, (slot + 1) * width)
        for key, stack in self.stacks.items():
            if key not in adapter.weights and slot in stack.loaded:
                stack.a[rows].zero_()
                stack.bt[rows].zero_()
                stack.loaded.discard(slot)
        for key, (a, b) in adapter.weights.items():
            stack = self._stack(key)
            stack.a[rows].zero_()
            stack.bt[rows].zero_()
            stack.a[slot * width : slot * width + adapter.rank].copy_(a)
            stack.bt[slot * width : slot * width + adapter.rank].copy_(b.t() * adapter.scaling)
            stack.loaded.add(slot)
        self.slot_ranks[slot] = adapter.rank

    def batch(self, row_slots: Sequence[int | None]) -> "LoraBatch | None":
        """The step's :class:`LoraBatch` for the packed rows' slots (``None``: base model);
        ``None`` when no row has an adapter.

        Raises:
            ValueError: a slot out of range or holding no adapter.
        """
        used = frozenset(s for s in row_slots if s is not None)
        if not used:
            return None
        for slot in used:
            if not 0 <= slot < self.max_loras or self.slot_ranks[slot] is None:
                raise ValueError(f"lora_slot {slot} holds no adapter (max_loras {self.max_loras}, loaded {self.loaded_slots})")
        return LoraBatch(self, row_slots, used)

    @property
    def loaded_slots(self) -> list[int]:
        """The slots holding an adapter."""
        return [i for i, rank in enumerate(self.slot_ranks) if rank is not None]

    def _check(self, adapter: LoraAdapter, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor) -> None:
        layer, projection = key
        shape = self.shapes.get(projection)
        if shape is None or not 0 <= layer < self.num_layers:
            raise ValueError(f"adapter {adapter.name!r} targets layer {layer} {projection!r}, not in this model")
        in_features, out_features = shape
        if tuple(a.shape) != (adapter.rank, in_features) or tuple(b.shape) != (out_features, adapter.rank):
            raise ValueError(
                f"adapter {adapter.name!r} layer {layer} {projection}: A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"want ({adapter.rank}, {in_features}) and ({out_features}, {adapter.rank})"
            )

    def _stack(self, key: tuple[int, str]) -> _Stack:
        stack = self.stacks.get(key)
        if stack is None:
            in_features, out_features = self.shapes[key[1]]
            rows = self.max_loras * self.max_lora_rank
            stack = self.stacks[key] = _Stack(
                torch.zeros(rows, in_features, dtype=self.dtype, device=self.device),
                torch.zeros(rows, out_features, dtype=self.dtype, device=self.device),
            )
        return stack


class LoraBatch:
    """One step's LoRA rows over a :class:`LoraSlots` (built by :meth:`LoraSlots.batch`),
    carried on the step's :class:`models.attention.PackedStep` as ``lora``; the backends call
    :meth:`apply` after each target product (the lean forward directly, eager through the
    forward hooks of :mod:`models.lora_hooks`). Valid for that step only: a later load may
    change the slots.

    Args:
        slots: the runner's slots.
        row_slots: ``[T]``, each packed row's slot (``None``: base model), in packed order.
        used: the slots among them.
    """

    def __init__(self, slots: LoraSlots, row_slots: Sequence[int | None], used: frozenset[int]):
        self.slots, self.used = slots, used
        width = slots.max_lora_rank
        self.single_slot: int | None = None
        self.mask: torch.Tensor | None = None
        if len(used) == 1 and None not in row_slots:
            self.single_slot = next(iter(used))
            rank = slots.slot_ranks[self.single_slot] or width
            self.rows = slice(self.single_slot * width, self.single_slot * width + rank)
            return
        num_slots = max(used) + 1
        self.rows = slice(0, num_slots * width)
        index = torch.tensor([num_slots if s is None else s for s in row_slots], device=slots.device)
        one_hot = F.one_hot(index, num_slots + 1)[:, :num_slots].to(slots.dtype)  # [T, m]
        self.mask = one_hot.repeat_interleave(width, dim=1)  # [T, m * R]

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += mask * (x A^T) (scaling B^T)`` for the product ``projection`` of ``layer``, in
        place (Punica's ``add_lora``): ``x`` ``[T, in]``, ``y`` ``[T, out]`` (a view of the
        product's output is fine), rows in packed order. A product no used adapter targets is
        left as it is."""
        stack = self.slots.stacks.get((layer, projection))
        if stack is None or stack.loaded.isdisjoint(self.used):
            return
        h = torch.mm(x, stack.a[self.rows].t())
        if self.mask is not None:
            h.mul_(self.mask)
        y.addmm_(h, stack.bt[self.rows])

    def apply_fused(self, layer: int, projections: Sequence[str], x: torch.Tensor, y: torch.Tensor) -> None:
        """:meth:`apply` for a fused product whose output ``y`` ``[T, sum of out]`` holds
        ``projections``' outputs side by side, in that order (lean's QKV and gate/up)."""
        start = 0
        for projection in projections:
            end = start + self.slots.shapes[projection][1]
            self.apply(layer, projection, x, y[:, start:end])
            start = end
