"""Which resident models make room for a model about to load, and which have idled out.

Budgets are scopes of bytes: the gateway's ``memory_budget_bytes`` and each slice's. A model
holds bytes in the scopes it lives in (its weights and KV pools). To load a model, every scope it
needs bytes in must have them free; the victims are taken least recently used first (as
llama.cpp's router, Ollama and Ray Serve's multiplexing evict), idle models before busy ones
(a busy victim is drained, not cut: its requests finish first, so it frees its bytes later), and
never a pinned model. Pure functions over plain numbers; the gateway does the unloading.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ResidentModel:
    """A loaded model as eviction sees it.

    Attributes:
        name: the model id.
        bytes_by_scope: bytes it holds in each budget scope (``"gateway"``, ``"slice:cpu0"`` ...).
        last_used_s: when a request last asked for it (any monotonic clock, one for all models).
        is_pinned: never evicted.
        is_busy: has requests queued, running or being routed.
    """

    name: str
    bytes_by_scope: Mapping[str, int] = field(default_factory=dict)
    last_used_s: float = 0.0
    is_pinned: bool = False
    is_busy: bool = False


def eviction_order(resident: Sequence[ResidentModel]) -> list[ResidentModel]:
    """The unpinned models in the order they are evicted: idle before busy, each least recently
    used first (ties by name, so the order is reproducible)."""
    candidates = [m for m in resident if not m.is_pinned]
    return sorted(candidates, key=lambda m: (m.is_busy, m.last_used_s, m.name))


def choose_victims(
    resident: Sequence[ResidentModel], needed_bytes: Mapping[str, int], free_bytes: Mapping[str, int]
) -> list[str] | None:
    """The models, taken in :func:`eviction_order` until their bytes free every scope enough
    for ``needed_bytes`` (bytes per scope the new model takes), given ``free_bytes`` (bytes free
    per scope now; a scope absent from it has no budget). A model is taken only when it holds
    bytes in a scope still short. Returns their names in eviction order (empty when it fits
    already), or ``None`` when even evicting every unpinned model leaves a scope short."""
    free = dict(free_bytes)
    short = {scope for scope, need in needed_bytes.items() if scope in free and free[scope] < need}
    victims: list[str] = []
    for model in eviction_order(resident):
        if not short:
            break
        if not any(model.bytes_by_scope.get(scope, 0) > 0 for scope in short):
            continue
        victims.append(model.name)
        for scope, held in model.bytes_by_scope.items():
            if scope in free:
                free[scope] += held
        short = {scope for scope in short if free[scope] < needed_bytes[scope]}
    return None if short else victims


def idled_out(resident: Sequence[ResidentModel], idle_unload_s: Mapping[str, float], now_s: float) -> list[str]:
    """The idle, unpinned models whose ``idle_unload_s`` (seconds, per model name; absent: never)
    has passed since their last use at ``now_s``, least recently used first."""
    return [
        m.name
        for m in eviction_order(resident)
        if not m.is_busy and m.name in idle_unload_s and now_s - m.last_used_s >= idle_unload_s[m.name]
    ]
