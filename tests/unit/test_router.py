"""Router.route: the limits a request meets before it is queued, each a 400 naming the limit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from buckets.bucket import BucketTable
from gateway.errors import APIError
from gateway.router import Router
from tests.unit.test_bucket_table import make_bucket


def make_served(max_model_len: int = 4096, pool_tokens: tuple[int | None, ...] = (None, None)) -> SimpleNamespace:
    buckets = [make_bucket(limit, kv_capacity_tokens=pool) for limit, pool in zip((64, 512), pool_tokens)]
    return SimpleNamespace(config=SimpleNamespace(name="m", max_model_len=max_model_len), table=BucketTable(buckets))


def route_error(served: SimpleNamespace, num_prompt_tokens: int, max_tokens: int) -> APIError:
    with pytest.raises(APIError) as caught:
        Router.route(served, num_prompt_tokens, max_tokens, param="prompt")  # type: ignore[arg-type]
    return caught.value


def test_the_smallest_bucket_that_holds_the_prompt_is_picked() -> None:
    served = make_served()
    assert Router.route(served, 64, 100, "prompt").name == "le64"  # type: ignore[arg-type]
    assert Router.route(served, 65, 100, "prompt").name == "le512"  # type: ignore[arg-type]


def test_a_prompt_over_the_largest_bucket_is_refused() -> None:
    error = route_error(make_served(), 513, 1)
    assert (error.status_code, error.code, error.param) == (400, "prompt_too_long", "prompt")
    assert "512" in error.message


def test_prompt_plus_max_tokens_over_max_model_len_is_refused() -> None:
    error = route_error(make_served(max_model_len=600), 100, 501)
    assert (error.status_code, error.code, error.param) == (400, "context_length_exceeded", "max_tokens")
    assert "600" in error.message


def test_a_request_larger_than_the_whole_kv_pool_is_refused_at_admission() -> None:
    served = make_served(pool_tokens=(128, 1024))
    assert Router.route(served, 60, 68, "prompt").name == "le64"  # type: ignore[arg-type]  # exactly fits
    error = route_error(served, 60, 69)
    assert (error.status_code, error.code, error.param) == (400, "kv_cache_capacity_exceeded", "max_tokens")
    assert "128 tokens" in error.message and "le64" in error.message
