"""Who sent a request: the tenant an API key belongs to, with what it may use and its quotas.

The API-key middleware (:mod:`gateway.auth`) resolves the ``Authorization`` header to a
:class:`Tenant` and leaves it in the ASGI scope under :data:`SCOPE_KEY`; routes read it with
:func:`tenant_of`. Without ``auth`` in the config every request is :data:`ANONYMOUS`: all models,
no quotas, weight 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.config import ApiKeyConfig

SCOPE_KEY = "sluice.tenant"
ANONYMOUS_NAME = "anonymous"


@dataclass(frozen=True)
class Tenant:
    """One tenant as this gateway enforces it.

    Fields:
        name: the tenant's name (log field, ``tenant`` metric label, fair-share key).
        weight: its share of a bucket by tokens served when tenants compete (> 0).
        priority: the priority of its requests that name none (``None``: the API's default 0).
        max_priority: the most urgent (lowest) priority its requests may ask (``None``: any).
        models: model and adapter ids it may use (``None``: all).
        requests_per_minute, tokens_per_minute, max_concurrent_requests: this gateway's share
            of the key's quotas (the configured value over ``auth.num_gateways``, rounded up);
            ``None``: no limit.
    """

    name: str
    weight: float = 1.0
    priority: int | None = None
    max_priority: int | None = None
    models: frozenset[str] | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None

    @classmethod
    def from_config(cls, key: ApiKeyConfig, num_gateways: int = 1) -> Tenant:
        """The tenant of a configured key; each quota becomes ``ceil(limit / num_gateways)``.

        Raises:
            ValueError: ``num_gateways`` below 1.
        """
        if num_gateways < 1:
            raise ValueError(f"num_gateways must be at least 1, got {num_gateways}")

        def share(limit: int | None) -> int | None:
            return None if limit is None else math.ceil(limit / num_gateways)

        return cls(
            name=key.name,
            weight=key.weight,
            priority=key.priority,
            max_priority=key.max_priority,
            models=None if key.models is None else frozenset(key.models),
            requests_per_minute=share(key.requests_per_minute),
            tokens_per_minute=share(key.tokens_per_minute),
            max_concurrent_requests=share(key.max_concurrent_requests),
        )

    def may_use(self, model_id: str) -> bool:
        """Whether this tenant may name ``model_id`` (a model or adapter id)."""
        return self.models is None or model_id in self.models

    @property
    def has_quotas(self) -> bool:
        return (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent_requests) != (None, None, None)


ANONYMOUS = Tenant(ANONYMOUS_NAME)


def tenant_of(scope: Mapping[str, Any]) -> Tenant:
    """The tenant the auth middleware found for this ASGI ``scope``; :data:`ANONYMOUS` without auth."""
    tenant = scope.get(SCOPE_KEY, ANONYMOUS)
    assert isinstance(tenant, Tenant)
    return tenant
