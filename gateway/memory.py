"""KV and weight budgets: how a slice's memory is shared among its buckets, in plain numbers.

Everything here is arithmetic on config values and byte counts (no torch, no loaded model), so
the gateway and a slice worker compute the same KV pool, and the same KV capacity in tokens,
for every bucket, and tests check the figures with plain numbers.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Protocol

from gateway.config import ContinuousBatcherConfig, GatewayConfig
from gateway.errors import ConfigError

DEFAULT_CPU_KV_CACHE_MEMORY_BYTES = 2 * 1024**3
DEFAULT_GPU_KV_CACHE_MEMORY_FRACTION = 0.5

BucketName = tuple[str, str]  # (model name, bucket name), as in the config


class Tensor(Protocol):
    """What :func:`weight_bytes` reads of a tensor."""

    def numel(self) -> int: ...

    def element_size(self) -> int: ...


class Module(Protocol):
    """What :func:`weight_bytes` reads of a module."""

    def parameters(self) -> Iterable[Tensor]: ...

    def buffers(self) -> Iterable[Tensor]: ...


def default_kv_cache_memory_bytes(device: str, device_memory_bytes: int | None) -> int:
    """A slice's KV budget in bytes when its config sets none: 2 GiB on a CPU, half of
    ``device_memory_bytes`` (the GPU's total memory) on ``cuda:N``."""
    if device.startswith("cuda") and device_memory_bytes is not None:
        return int(device_memory_bytes * DEFAULT_GPU_KV_CACHE_MEMORY_FRACTION)
    return DEFAULT_CPU_KV_CACHE_MEMORY_BYTES


def slice_kv_budgets(config: GatewayConfig, device_memory_bytes: dict[str, int]) -> dict[str, int]:
    """Each slice's KV budget in bytes: its ``kv_cache_memory_bytes``, else the default for its
    device (``device_memory_bytes`` maps a CUDA device to its total memory; CPUs are absent)."""
    return {
        s.name: int(s.kv_cache_memory_bytes or default_kv_cache_memory_bytes(s.device, device_memory_bytes.get(s.device)))
        for s in config.slices
    }


def _fixed_share_bytes(batcher: ContinuousBatcherConfig, budget_bytes: int) -> int | None:
    """A bucket's own KV share in bytes (``kv_cache_memory_bytes``, else its fraction of the
    slice's budget); ``None`` when it asks for neither (it shares what is left)."""
    if batcher.kv_cache_memory_bytes:
        return int(batcher.kv_cache_memory_bytes)
    if batcher.kv_cache_memory_fraction:
        return int(budget_bytes * batcher.kv_cache_memory_fraction)
    return None


def split_kv_memory(config: GatewayConfig, slice_budgets: dict[str, int]) -> dict[BucketName, int]:
    """Each continuous bucket's KV pool in bytes, keyed by ``(model name, bucket name)``.

    On each slice, explicit ``kv_cache_memory_bytes`` come first, then fractions of the slice's
    budget (``slice_budgets``, bytes); buckets with neither share what is left equally.

    Raises:
        ConfigError: a slice's buckets ask for more than its budget (``kv_cache_memory_exceeded``).
    """
    shares: dict[BucketName, int] = {}
    for slice_name, budget in slice_budgets.items():
        owners = [(m.name, b) for m in config.models for b in m.buckets if b in config.continuous_buckets(slice_name)]
        fixed: dict[BucketName, int] = {}
        rest: list[BucketName] = []
        for name, bucket in owners:
            share = _fixed_share_bytes(bucket.batcher, budget)  # type: ignore[arg-type]
            if share is None:
                rest.append((name, bucket.bucket_name))
            else:
                fixed[(name, bucket.bucket_name)] = share
        left = budget - sum(fixed.values())
        if left < 0 or (rest and left == 0):
            index = [s.name for s in config.slices].index(slice_name)
            param = f"slices.{index}.kv_cache_memory_bytes"
            raise ConfigError(
                f"{param}: the continuous buckets of slice {slice_name!r} ask for "
                f"{sum(fixed.values())} bytes of KV memory, its kv_cache_memory_bytes is {budget}",
                param=param,
                code="kv_cache_memory_exceeded",
            )
        shares.update(fixed)
        shares.update({key: left // len(rest) for key in rest})
    return shares


def kv_num_blocks(memory_bytes: int, block_size_tokens: int, kv_bytes_per_token: int, where: str) -> int:
    """How many KV blocks of ``block_size_tokens`` tokens fit in ``memory_bytes``, one token
    taking ``kv_bytes_per_token`` (:meth:`models.kv_cache.KVShape.bytes_per_token_for`:
    ``2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)``, an int8 pool's
    scales included).

    Raises:
        ConfigError: not one block fits; the message names ``where`` (the bucket's config path).
    """
    num_blocks = memory_bytes // (block_size_tokens * kv_bytes_per_token)
    if num_blocks < 1:
        raise ConfigError(
            f"{where}: {memory_bytes} bytes of KV memory hold no block of {block_size_tokens} tokens",
            code="kv_cache_memory_exceeded",
        )
    return num_blocks


def kv_capacity_tokens(num_blocks: int, block_size_tokens: int) -> int:
    """The tokens a continuous bucket's KV pool holds: the most prompt + ``max_tokens`` one
    request may ask for."""
    return num_blocks * block_size_tokens


def weight_bytes(model: Module) -> int:
    """Bytes held by a module's parameters and buffers (its weights, as loaded)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


GATEWAY_SCOPE = "gateway"  # the gateway-wide memory_budget_bytes
DEFAULT_GATEWAY_MEMORY_FRACTION = 0.8


def slice_scope(slice_name: str) -> str:
    """The budget scope of slice ``slice_name`` (:mod:`policies.eviction`)."""
    return f"slice:{slice_name}"


def default_gateway_memory_bytes(physical_memory_bytes: int) -> int:
    """The gateway-wide budget when the config sets none: 80 % of the machine's RAM."""
    return int(physical_memory_bytes * DEFAULT_GATEWAY_MEMORY_FRACTION)


def budgets_by_scope(config: GatewayConfig, physical_memory_bytes: int) -> dict[str, int]:
    """Bytes each budget scope may hold: the gateway's ``memory_budget_bytes`` (default
    :func:`default_gateway_memory_bytes`) and each slice's that sets one."""
    gateway = int(config.memory_budget_bytes or default_gateway_memory_bytes(physical_memory_bytes))
    budgets = {GATEWAY_SCOPE: gateway}
    budgets.update({slice_scope(s.name): int(s.memory_budget_bytes) for s in config.slices if s.memory_budget_bytes})
    return budgets


def model_bytes_by_scope(config: GatewayConfig, name: str, kv_bytes: dict[BucketName, int], model_weight_bytes: int) -> dict[str, int]:
    """Bytes model ``name`` holds in each scope once loaded: its weights (``model_weight_bytes``),
    KV pools (``kv_bytes``, as :func:`split_kv_memory` gives them) and swap preemption's host
    pools (:attr:`~gateway.config.ContinuousBatcherConfig.host_swap_bytes`, in this process's
    memory) in the gateway scope; on each slice it has a bucket on, its weights (counted on every
    such slice, as :func:`check_slice_budgets` does) and the pools of its buckets there.

    Raises:
        KeyError: no model ``name`` in ``config``.
    """
    model = next(m for m in config.models if m.name == name)
    pools = {b.slice: 0 for b in model.buckets}
    for bucket in model.buckets:
        pools[bucket.slice] += kv_bytes.get((name, bucket.bucket_name), 0)
    host_pools = sum(b.batcher.host_swap_bytes for b in model.buckets if isinstance(b.batcher, ContinuousBatcherConfig))
    scopes = {GATEWAY_SCOPE: model_weight_bytes + sum(pools.values()) + host_pools}
    scopes.update({slice_scope(s): model_weight_bytes + pool for s, pool in pools.items()})
    return scopes


def check_slice_budgets(
    config: GatewayConfig,
    kv_bytes: dict[BucketName, int],
    weights: dict[str, int],
    draining_kv_bytes: dict[str, int] | None = None,
    resident: Collection[str] | None = None,
) -> None:
    """Every slice with a ``memory_budget_bytes`` holds the weights of the models with a bucket
    on it (those in ``weights``, bytes: loaded so far in this process), the KV pools of its
    continuous buckets (``kv_bytes``, bytes) and the pools still allocated beside them
    (``draining_kv_bytes``, bytes per slice name: the buckets a rebuild or a new layout replaced,
    which keep their pools until they have drained). With ``resident`` (model names), only those
    models count: the others are servable on demand and not loaded.

    Raises:
        ConfigError: naming the slice, its weights, KV and draining KV bytes, and its budget
            (``memory_budget_exceeded``).
    """
    for index, slice_config in enumerate(config.slices):
        budget = slice_config.memory_budget_bytes
        if budget is None:
            continue
        counted = [m for m in config.models if resident is None or m.name in resident]
        models = [m.name for m in counted if any(b.slice == slice_config.name for b in m.buckets)]
        weights_total = sum(weights.get(name, 0) for name in models)
        kv_total = sum(
            kv_bytes.get((m.name, b.bucket_name), 0) for m in counted for b in config.continuous_buckets(slice_config.name)
            if b in m.buckets
        )
        draining_total = (draining_kv_bytes or {}).get(slice_config.name, 0)
        if weights_total + kv_total + draining_total > budget:
            raise _over_budget(index, slice_config.name, int(budget), models, weights, kv_total, draining_total)


def _over_budget(
    index: int, slice_name: str, budget: int, models: list[str], weights: dict[str, int], kv_total: int, draining_total: int
) -> ConfigError:
    """The error of slice number ``index`` going over its ``memory_budget_bytes`` (``budget``)."""
    weights_total = sum(weights.get(name, 0) for name in models)
    loaded = ", ".join(f"{name} {weights[name]}" for name in models if name in weights)
    pending = [name for name in models if name not in weights]
    if pending:
        loaded += f"; not yet loaded, so not counted: {', '.join(pending)}"
    draining = f"; pools of replaced buckets still draining {draining_total}" if draining_total else ""
    param = f"slices.{index}.memory_budget_bytes"
    return ConfigError(
        f"{param}: slice {slice_name!r} needs {weights_total + kv_total + draining_total} bytes "
        f"(weights {weights_total}: {loaded or 'none loaded'}; KV pools {kv_total}{draining}), over its budget of {budget}",
        param=param,
        code="memory_budget_exceeded",
    )
