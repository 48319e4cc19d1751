"""``sluice bench auth``: what API keys and quotas cost one request, in microseconds.

In this process, no server, no model:

1. **Key check**: the :class:`gateway.auth.ApiKeys` ASGI wrapper in front of an app that answers
   at once, for a ``/v1/completions`` request with a valid ``Authorization: Bearer`` key, with
   ``--keys`` keys configured (the SHA-256 of the key is compared with every configured hash, so
   the cost grows with the keys), against the same wrapper passing ``/health`` through (no
   check): the difference is what the check adds.
2. **Quota**: :meth:`gateway.quotas.QuotaBook.admit` of a key with all three quotas (limits high
   enough never to refuse), a charge of the prompt, 16 charges as tokens stream, the
   ``x-ratelimit-*`` headers, and the release: one request's whole quota book-keeping, with the
   minute's log as full as a busy key's gets.

Configurations are interleaved, ``--rounds`` rounds of ``--calls`` calls each; printed: the
median microseconds per request of every configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

from gateway.auth import ApiKeys, KeyRing, key_sha256
from gateway.config import ApiKeyConfig, AuthConfig
from gateway.quotas import QuotaBook
from gateway.tenants import Tenant

STREAMED_TOKENS = 16


async def _answer(scope: Any, receive: Any, send: Any) -> None:
    """The app behind the wrapper: nothing (the cost measured is the wrapper's)."""


async def _noop_send(message: Any) -> None:
    """Where the wrapper's 401 would go (never: every key sent is valid)."""


def key_ring(num_keys: int) -> tuple[KeyRing, str]:
    """A ring of ``num_keys`` keys and the last one's plain text (found after every compare)."""
    keys = [f"sk-bench-{i:06d}" for i in range(num_keys)]
    entries = [ApiKeyConfig(name=f"tenant-{i}", key_sha256=key_sha256(k)) for i, k in enumerate(keys)]
    return KeyRing(AuthConfig(api_keys=entries), -1000, 1000), keys[-1]


async def _time_wrapper(wrapper: ApiKeys, path: str, key: str, calls: int) -> float:
    """Microseconds per call of ``wrapper`` for a GET of ``path`` with ``key``."""
    headers = [(b"host", b"127.0.0.1"), (b"authorization", f"Bearer {key}".encode())]
    start = time.perf_counter()
    for _ in range(calls):
        scope = {"type": "http", "path": path, "method": "POST", "headers": headers}
        await wrapper(scope, None, _noop_send)
    return (time.perf_counter() - start) / calls * 1e6


def _time_quota(book: QuotaBook, tenant: Tenant, calls: int) -> float:
    """Microseconds of one request's quota book-keeping (see the module docstring)."""
    start = time.perf_counter()
    for _ in range(calls):
        lease = book.admit(tenant)
        assert lease is not None
        for num_tokens in range(32, 32 + STREAMED_TOKENS):
            lease.charge_to(num_tokens)
        lease.headers()
        lease.release()
    return (time.perf_counter() - start) / calls * 1e6


def measure(num_keys_list: list[int], rounds: int, calls: int) -> dict[str, float]:
    """The median microseconds per request of each configuration, interleaved over ``rounds``."""
    wrappers = {n: (ApiKeys(_answer, ring), key) for n in num_keys_list for ring, key in [key_ring(n)]}
    tenant = Tenant("bench", requests_per_minute=10**9, tokens_per_minute=10**12, max_concurrent_requests=10**6)
    book = QuotaBook(lambda tenant, limit: None)
    samples: dict[str, list[float]] = {}

    async def one_round() -> None:
        for n, (wrapper, key) in wrappers.items():
            samples.setdefault(f"key check, {n} keys: /v1/completions", []).append(
                await _time_wrapper(wrapper, "/v1/completions", key, calls))
            samples.setdefault(f"pass-through, {n} keys: /health", []).append(
                await _time_wrapper(wrapper, "/health", key, calls))
        samples.setdefault("quota: admit, 17 charges, headers, release", []).append(_time_quota(book, tenant, calls))

    for _ in range(rounds):
        asyncio.run(one_round())
    return {name: statistics.median(values) for name, values in samples.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", type=int, nargs="+", default=[1, 10, 100, 1000], help="keys configured (default 1 10 100 1000)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per configuration and round (default 2000)")


def run(args: argparse.Namespace) -> int:
    from bench.peers_systems import cpu_flags, cpu_model_name

    print(f"CPU: {cpu_model_name()}; flags: {' '.join(cpu_flags())}")
    medians = measure(args.keys, args.rounds, args.calls)
    width = max(map(len, medians))
    for name, micros in medians.items():
        print(f"{name:<{width}}  {micros:8.1f} us")
    for n in args.keys:
        added = medians[f"key check, {n} keys: /v1/completions"] - medians[f"pass-through, {n} keys: /health"]
        print(f"the key check adds {added:.1f} us per request with {n} keys")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
