"""The OpenAI-compatible API against a real server, through the official client and raw HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.conftest import EMBED_MODEL, GENERATE_MODEL

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_health_and_models(server_url: str, openai_client) -> None:
    assert httpx.get(f"{server_url}/health").json()["status"] == "ok"
    assert {m.id for m in openai_client.models.list().data} == {GENERATE_MODEL, EMBED_MODEL}


def test_chat_answers_paris(openai_client) -> None:
    out = openai_client.chat.completions.create(model=GENERATE_MODEL, messages=FRANCE, temperature=0, max_tokens=20)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens > 0 and out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_stream_matches_non_stream(openai_client) -> None:
    whole = openai_client.chat.completions.create(model=GENERATE_MODEL, messages=FRANCE, temperature=0, max_tokens=12)
    chunks = list(
        openai_client.chat.completions.create(
            model=GENERATE_MODEL, messages=FRANCE, temperature=0, max_tokens=12, stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_usage_counts_tokens_exactly(openai_client, hf_causal_lm) -> None:
    _, tokenizer = hf_causal_lm
    prompt = "The three primary colours are"
    out = openai_client.completions.create(model=GENERATE_MODEL, prompt=prompt, max_tokens=7, temperature=0)
    assert out.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"


def test_sse_wire_format(server_url: str) -> None:
    body = {"model": GENERATE_MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server_url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "length"


def test_stop_string_ends_generation_and_is_not_returned(openai_client) -> None:
    free = openai_client.completions.create(model=GENERATE_MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0)
    text = free.choices[0].text
    stop = text.strip()[2:4] if len(text.strip()) > 4 else text.strip()[:1]
    cut = openai_client.completions.create(
        model=GENERATE_MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text
    assert text.startswith(cut.choices[0].text)


def test_embeddings_shape_and_usage(openai_client) -> None:
    out = openai_client.embeddings.create(model=EMBED_MODEL, input=["hello world", "a second input"])
    assert [d.index for d in out.data] == [0, 1]
    assert all(len(d.embedding) == 384 for d in out.data)
    norm = sum(x * x for x in out.data[0].embedding) ** 0.5
    assert abs(norm - 1.0) < 1e-4
    assert out.usage.prompt_tokens == out.usage.total_tokens > 0


def test_unknown_model_is_404(openai_client) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        openai_client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"


def test_prompt_over_largest_bucket_is_400(openai_client) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.completions.create(model=GENERATE_MODEL, prompt="word " * 400, max_tokens=1)
    assert "320" in err.value.body["message"]


def test_prompt_plus_max_tokens_over_max_model_len_is_400(openai_client) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.completions.create(model=GENERATE_MODEL, prompt="word " * 100, max_tokens=300)
    assert err.value.body["code"] == "context_length_exceeded" and "320" in err.value.body["message"]


def test_embedding_input_over_largest_bucket_is_400(openai_client) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.embeddings.create(model=EMBED_MODEL, input="word " * 400)
    assert err.value.body["param"] == "input"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": GENERATE_MODEL, "prompt": "x", "temperature": 3}, "temperature"),
        ({"model": GENERATE_MODEL, "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": GENERATE_MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": GENERATE_MODEL, "prompt": "x", "n": 9}, "n"),
        ({"model": GENERATE_MODEL, "prompt": "x", "n": 2, "best_of": 3}, "best_of"),
        ({"model": GENERATE_MODEL, "prompt": [[1, 2], [3, 10**9]]}, "prompt.1.1"),
        ({"model": GENERATE_MODEL, "prompt": ""}, "prompt"),
        ({"model": GENERATE_MODEL}, "prompt"),
        ({"model": GENERATE_MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_bad_fields_are_400_naming_the_param(server_url: str, body: dict, param: str) -> None:
    response = httpx.post(f"{server_url}/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_malformed_json_is_400(server_url: str) -> None:
    response = httpx.post(f"{server_url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_wrong_task_is_400(openai_client) -> None:
    with pytest.raises(openai.BadRequestError):
        openai_client.embeddings.create(model=GENERATE_MODEL, input="hi")
