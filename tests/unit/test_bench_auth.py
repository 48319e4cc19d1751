"""``sluice bench auth`` measures every configuration it names (tiny counts: behaviour, not speed)."""

from __future__ import annotations

from bench.auth_cost import key_ring, measure
from gateway.tenants import Tenant


def test_the_last_key_of_the_ring_resolves_to_its_tenant() -> None:
    ring, key = key_ring(5)
    tenant = ring.resolve(f"Bearer {key}")
    assert isinstance(tenant, Tenant) and tenant.name == "tenant-4"


def test_every_configuration_gets_a_positive_median() -> None:
    medians = measure([1, 3], rounds=1, calls=5)
    assert set(medians) == {
        "key check, 1 keys: /v1/completions", "pass-through, 1 keys: /health",
        "key check, 3 keys: /v1/completions", "pass-through, 3 keys: /health",
        "quota: admit, 17 charges, headers, release",
    }
    assert all(v > 0 for v in medians.values())
