"""The OpenAI edge against a real server: refused and null fields, content parts and roles,
embeddings from token ids and Matryoshka dimensions, the tokenizer endpoints, compressed
bodies, request ids and model cards."""

from __future__ import annotations

import gzip
import json
import math
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.schemas import ChatCompletionBody, CompletionBody, EmbeddingBody
from tests.e2e.conftest import EMBED_MODEL, GENERATE_MODEL, Server

COMPLETION = {"model": GENERATE_MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
CHAT = {"model": GENERATE_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
EMBEDDING = {"model": EMBED_MODEL, "input": "Paris is the capital of France."}
BODIES = {"/v1/completions": (COMPLETION, CompletionBody), "/v1/chat/completions": (CHAT, ChatCompletionBody),
          "/v1/embeddings": (EMBEDDING, EmbeddingBody)}


@pytest.fixture(scope="module")
def client(server_url: str) -> Any:
    with httpx.Client(base_url=server_url, timeout=120) as http:
        yield http


def error_of(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", BODIES)
def test_each_refused_field_is_a_400_naming_it(client: httpx.Client, path: str) -> None:
    body, schema = BODIES[path]
    for name in sorted(schema.refused_fields):
        error = error_of(client.post(path, json={**body, name: {"unsupported": True}}))
        assert (error["param"], error["code"]) == (name, "unsupported_parameter"), name


@pytest.mark.parametrize("path", BODIES)
def test_null_optional_fields_mean_their_defaults(client: httpx.Client, path: str) -> None:
    body, schema = BODIES[path]
    nulls = {name: None for name, info in schema.model_fields.items() if not info.is_required() and name not in body}
    nulls.update({name: None for name in schema.refused_fields | schema.ignored_fields})
    response = client.post(path, json={**body, **nulls})
    assert response.status_code == 200, response.text


def test_neutral_values_of_refused_fields_are_accepted(client: httpx.Client) -> None:
    neutral = {"n": 1, "logprobs": False, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "tools": [],
               "tool_choice": "none", "response_format": {"type": "text"}}
    assert client.post("/v1/chat/completions", json={**CHAT, **neutral}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_is_a_400(client: httpx.Client, path: str) -> None:
    body = {**BODIES[path][0], "stream_options": {"include_usage": True}}
    assert error_of(client.post(path, json=body))["param"] == "stream_options"


def prompt_ids(client: httpx.Client, messages: list[dict[str, Any]]) -> list[int]:
    response = client.post("/v1/chat/completions", json={**CHAT, "messages": messages, "max_tokens": 1, "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["prompt_token_ids"]  # type: ignore[no-any-return]


def test_text_parts_read_as_their_concatenation(client: httpx.Client) -> None:
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    as_parts = prompt_ids(client, [{"role": "user", "content": parts}])
    assert as_parts == prompt_ids(client, [{"role": "user", "content": "What is the capital of France?"}])


def test_a_media_part_is_a_400_naming_its_type(client: httpx.Client) -> None:
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    error = error_of(client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": content}]}))
    assert error["param"] == "messages.0.content.1.type"


def test_developer_is_system_and_every_role_renders(client: httpx.Client, hf_causal_lm: Any) -> None:
    _, tokenizer = hf_causal_lm
    user = {"role": "user", "content": "Hi", "name": "ann"}
    assert prompt_ids(client, [{"role": "developer", "content": "Be brief."}, user]) == prompt_ids(
        client, [{"role": "system", "content": "Be brief."}, user]
    )
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}
    turns = [user, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    rendered = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}, {"role": "tool", "content": "42"}]
    expected = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert prompt_ids(client, turns) == list(expected)


def embedding(client: httpx.Client, **fields: Any) -> list[list[float]]:
    response = client.post("/v1/embeddings", json={**EMBEDDING, **fields})
    assert response.status_code == 200, response.text
    return [item["embedding"] for item in response.json()["data"]]


def test_embeddings_from_token_ids_equal_those_from_text(client: httpx.Client) -> None:
    ids = client.post("/tokenize", json={"model": EMBED_MODEL, "prompt": EMBEDDING["input"]}).json()["tokens"]
    (from_text,) = embedding(client)
    (from_ids,) = embedding(client, input=ids)
    assert from_ids == pytest.approx(from_text, abs=1e-5)
    assert embedding(client, input=[ids, ids[:3]])[0] == pytest.approx(from_text, abs=1e-5)
    error = error_of(client.post("/v1/embeddings", json={**EMBEDDING, "input": [ids, [1, 10**6]]}))
    assert (error["param"], error["code"]) == ("input.1.1", "invalid_token_id")


def test_dimensions_without_matryoshka_dimensions_is_refused(client: httpx.Client) -> None:
    error = error_of(client.post("/v1/embeddings", json={**EMBEDDING, "dimensions": 64}))
    assert (error["param"], error["code"]) == ("dimensions", "unsupported_parameter")


def test_matryoshka_dimensions_cut_and_renormalise(matryoshka_server: Server) -> None:
    with httpx.Client(base_url=matryoshka_server.url, timeout=120) as matryoshka:
        (full,) = embedding(matryoshka)
        (cut,) = embedding(matryoshka, dimensions=64)
        norm = math.sqrt(sum(x * x for x in full[:64]))
        assert len(cut) == 64 and cut == pytest.approx([x / norm for x in full[:64]], abs=1e-6)
        error = error_of(matryoshka.post("/v1/embeddings", json={**EMBEDDING, "dimensions": 100}))
        assert (error["param"], error["code"]) == ("dimensions", "invalid_dimensions")


def test_tokenize_and_detokenize_as_vllm(client: httpx.Client, hf_causal_lm: Any) -> None:
    _, tokenizer = hf_causal_lm
    out = client.post("/tokenize", json={"model": GENERATE_MODEL, "prompt": "Hello world", "return_token_strs": True}).json()
    assert out["tokens"] == tokenizer("Hello world").input_ids and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 320 and out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    chat = client.post("/tokenize", json={"model": GENERATE_MODEL, "messages": CHAT["messages"]}).json()
    assert chat["tokens"] == prompt_ids(client, CHAT["messages"]) and chat["token_strs"] is None
    back = client.post("/detokenize", json={"model": GENERATE_MODEL, "tokens": out["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    error = error_of(client.post("/detokenize", json={"model": GENERATE_MODEL, "tokens": [1, 10**7]}))
    assert (error["param"], error["code"]) == ("tokens.1", "invalid_token_id")
    assert error_of(client.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404)["code"] == "model_not_found"


@pytest.mark.parametrize(("encoding", "compress"), [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_compressed_bodies_are_inflated(client: httpx.Client, encoding: str, compress: Callable[[bytes], bytes]) -> None:
    headers = {"content-type": "application/json", "content-encoding": encoding}
    response = client.post("/v1/completions", content=compress(json.dumps(COMPLETION).encode()), headers=headers)
    assert response.status_code == 200, response.text


def test_a_zip_bomb_is_a_413_and_an_unknown_encoding_a_415(client: httpx.Client) -> None:
    bomb = gzip.compress(b'{"model": "' + b"a" * (64 * 1024 * 1024) + b'"}', compresslevel=9)  # 64 MiB inflated
    assert len(bomb) < 2 * 1024 * 1024
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    assert error_of(client.post("/v1/completions", content=bomb, headers=headers), 413)["code"] == "request_too_large"
    headers["content-encoding"] = "br"
    assert error_of(client.post("/v1/completions", content=b"{}", headers=headers), 415)["code"] == "unsupported_content_encoding"
    headers["content-encoding"] = "gzip"
    assert error_of(client.post("/v1/completions", content=b"not gzip", headers=headers))["code"] == "invalid_content_encoding"


@pytest.mark.parametrize("content_type", ["text/plain", "multipart/form-data; boundary=x", "application/x-www-form-urlencoded", None])
def test_a_body_declared_as_another_type_is_read_as_json(client: httpx.Client, content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    assert client.post("/v1/completions", content=json.dumps(COMPLETION).encode(), headers=headers).status_code == 200
    assert client.post("/v1/completions", content=b"a=1&b=2", headers=headers).status_code == 400


def access_log_ids(log_path: Path, request_id: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
        found = [e for e in lines if e.get("event") == "http_request" and e.get("request_id") == request_id]
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no http_request line for {request_id}")


def test_request_ids_are_echoed_or_made_and_logged(client: httpx.Client, server_log: Path) -> None:
    own = client.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "client-id-42"})
    assert own.headers["x-request-id"] == "client-id-42" and own.json()["id"] == "cmpl-client-id-42"
    assert [e["status"] for e in access_log_ids(server_log, "client-id-42")] == [200]
    made = {client.post("/v1/chat/completions", json=CHAT).headers["x-request-id"] for _ in range(2)}
    assert len(made) == 2
    for bad in ["x" * 129, "tab\there"]:
        response = client.post("/v1/completions", json=COMPLETION, headers={"x-request-id": bad})
        assert response.headers["x-request-id"] != bad and response.json()["id"] == f"cmpl-{response.headers['x-request-id']}"
    for response in (client.get("/no-such-path"), client.post("/v1/completions", content=b"{"), client.get("/health")):
        assert response.headers["x-request-id"]
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "s-1"}) as stream:
        assert stream.headers["x-request-id"] == "s-1"
        assert any('"id":"chatcmpl-s-1"' in line.replace(" ", "") for line in stream.iter_lines())


def test_models_are_retrieved_with_created_max_model_len_and_task(client: httpx.Client) -> None:
    listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    for name, task, max_model_len in [(GENERATE_MODEL, "generate", 320), (EMBED_MODEL, "embed", 256)]:
        card = client.get(f"/v1/models/{name}").json()
        assert card == listed[name]
        assert (card["task"], card["max_model_len"], card["object"]) == (task, max_model_len, "model")
        assert 0 < card["created"] <= time.time()
    assert error_of(client.get("/v1/models/no-such-model"), 404)["code"] == "model_not_found"
