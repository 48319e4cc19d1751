"""LangChain's ``ChatOpenAI`` (package ``langchain-openai``) pointed at the server: invoke,
stream, batch and ``logprobs=True`` answer as the OpenAI SDK's own calls do."""

from __future__ import annotations

from typing import Any


from tests.e2e.conftest import GENERATE_MODEL

QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is two plus two?"]
MAX_TOKENS = 12


def chat_model(server_url: str, **options: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=GENERATE_MODEL, base_url=f"{server_url}/v1", api_key="unused", temperature=0, max_tokens=MAX_TOKENS,
        max_retries=0, timeout=300, **options,
    )


def sdk_answer(openai_client: Any, question: str) -> str:
    out = openai_client.chat.completions.create(
        model=GENERATE_MODEL, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, temperature=0
    )
    content: str = out.choices[0].message.content
    return content


def test_invoke_answers_as_the_sdk_does(server_url: str, openai_client: Any) -> None:
    message = chat_model(server_url).invoke(QUESTIONS[0])
    assert message.content == sdk_answer(openai_client, QUESTIONS[0])
    assert message.response_metadata["finish_reason"] in ("stop", "length")
    assert message.usage_metadata["output_tokens"] > 0


def test_stream_joins_to_the_invoked_answer(server_url: str) -> None:
    model = chat_model(server_url)
    chunks = list(model.stream(QUESTIONS[0]))
    assert len(chunks) > 1
    assert "".join(str(c.content) for c in chunks) == model.invoke(QUESTIONS[0]).content


def test_batch_answers_each_question_as_alone(server_url: str, openai_client: Any) -> None:
    answers = chat_model(server_url).batch(QUESTIONS)
    assert [a.content for a in answers] == [sdk_answer(openai_client, q) for q in QUESTIONS]


def test_logprobs_come_back_per_token(server_url: str) -> None:
    message = chat_model(server_url, logprobs=True).invoke(QUESTIONS[0])
    content = message.response_metadata["logprobs"]["content"]
    assert content and all(entry["logprob"] <= 0.0 for entry in content)
    assert "".join(entry["token"] for entry in content) == message.content
