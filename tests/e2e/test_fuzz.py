"""Fuzz the served OpenAPI document with schemathesis against a real server: no 5xx.

A dedicated server runs here with ``max_tokens_cap`` 4 and short embedding batch delays, so
valid generated bodies stay cheap. Each POST operation gets schema-valid bodies (positive mode)
and schema-violating ones (negative mode); the GET operations get what they take. Hypothesis
runs derandomized, without shrinking or an example database, so the run is reproducible and
bounded: about 1,200 requests (at least 1,000, as issue 4 asks), all to 127.0.0.1. The bodies
include content-part arrays, token-id inputs, ``dimensions`` and the tokenizer endpoints' bodies.
The server has an ``auth`` section and every request carries its one API key (issue 36).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
import schemathesis
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.core import NotSet

from gateway.auth import key_sha256
from tests.e2e.conftest import CONFIG, EMBED_MODEL, GENERATE_MODEL, run_server

MAX_TOKENS_CAP = 4
MAX_EMBEDDING_INPUTS = 8
NUM_POSITIVE_PER_POST = 150
NUM_NEGATIVE_PER_POST = 80
NUM_EXAMPLES_PER_GET = 20
MIN_NUM_REQUESTS = 1000
REQUEST_TIMEOUT_S = 60
# The fuzz server's one API key: every request sends it.
FUZZ_KEY = "sk-sluice-fuzz"
# The served model each POST route takes; a generated ``model`` string is almost never one.
POST_MODELS = {
    "/v1/completions": GENERATE_MODEL, "/v1/chat/completions": GENERATE_MODEL, "/v1/embeddings": EMBED_MODEL,
    "/tokenize": GENERATE_MODEL, "/detokenize": EMBED_MODEL,
}
POST_PATHS = tuple(POST_MODELS)
# A small valid body per POST route: each must be served by the fuzz server, before and after
# the fuzz. Schema-valid generated bodies are mostly refused for what the schema cannot say (an
# empty prompt, a token id outside the vocabulary), and which few of one route's are served
# varies between runs (schemathesis' draws follow set order, so the process's hash seed).
MINIMAL_BODIES = {
    "/v1/completions": {"model": GENERATE_MODEL, "prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": GENERATE_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/embeddings": {"model": EMBED_MODEL, "input": "Hi"},
    "/tokenize": {"model": GENERATE_MODEL, "prompt": "Hi"},
    "/detokenize": {"model": EMBED_MODEL, "tokens": [101, 102]},
}

Send = Callable[[schemathesis.Case], None]


@dataclass
class FuzzServer:
    """The dedicated server's base URL and the file its log goes to."""

    url: str
    log_path: Path


@dataclass
class FuzzRecord:
    """What the fuzz sent and got: status counts per operation, and every 5xx in full."""

    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    # The error messages of the schema-valid bodies that were refused, per operation and status.
    refusals: Counter[tuple[str, int, str]] = field(default_factory=Counter)

    @property
    def num_requests(self) -> int:
        return sum(self.statuses.values())


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzServer]:
    """The test config with ``max_tokens_cap`` 4, at most 8 embedding inputs, 1 ms batch delays
    and one API key, :data:`FUZZ_KEY`."""
    config = yaml.safe_load(CONFIG.read_text())
    config["auth"] = {"api_keys": [{"name": "fuzz", "key_sha256": key_sha256(FUZZ_KEY)}]}
    models = {m["name"]: m for m in config["models"]}
    models[GENERATE_MODEL]["max_tokens_cap"] = MAX_TOKENS_CAP
    models[EMBED_MODEL]["max_embedding_inputs"] = MAX_EMBEDDING_INPUTS
    for bucket in models[EMBED_MODEL]["buckets"]:
        bucket["batcher"]["max_queue_delay_ms"] = 1
    folder: Path = tmp_path_factory.mktemp("fuzz")
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = folder / "server.log"
    with run_server(path, log_path) as url:
        yield FuzzServer(url, log_path)


def _served_model_half_the_time(
    strategy: st.SearchStrategy[schemathesis.Case], model: str
) -> st.SearchStrategy[schemathesis.Case]:
    """``strategy`` with the body's ``model`` set to ``model`` in about half the cases, so valid
    bodies reach the batchers; the other half keep the generated name (a 404)."""

    def set_model(case: schemathesis.Case, is_served: bool) -> schemathesis.Case:
        if is_served and isinstance(case.body, dict):
            case.body["model"] = model
        return case

    return st.tuples(strategy, st.booleans()).map(lambda pair: set_model(*pair))


def _fuzz(strategy: st.SearchStrategy[schemathesis.Case], num_examples: int, send: Send) -> None:
    """Draw up to ``num_examples`` cases from ``strategy`` and pass each to ``send``."""

    @settings(
        max_examples=num_examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        send(case)

    run()


def _sender(server: FuzzServer, session: requests.Session, record: FuzzRecord, mode: str) -> Send:
    """Send each case to ``server``; count its status, and keep the request of any 5xx."""

    def send(case: schemathesis.Case) -> None:
        response = case.call(base_url=server.url, session=session, timeout=REQUEST_TIMEOUT_S)
        record.statuses[(case.operation.label, response.status_code)] += 1
        body = None if isinstance(case.body, NotSet) else case.body
        if mode == "positive" and 400 <= response.status_code < 500:
            record.refusals[(case.operation.label, response.status_code, _error_message(response))] += 1
        if response.status_code >= 500 and not _own_deadline(body, response):
            # The body itself, not a curl command: schemathesis masks fields like "max_tokens" there.
            record.server_errors.append(
                f"{mode} {case.operation.label} -> {response.status_code} {response.text[:500]}\n"
                f"  body: {json.dumps(body, default=repr)[:4000]}"
            )

    return send


def _error_message(response: requests.Response) -> str:
    """The OpenAI-style body's ``error.message``, cut to 120 characters (the text when not JSON)."""
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = response.text
    return message[:120]


def _own_deadline(body: object, response: requests.Response) -> bool:
    """A 504 ``timeout`` for a body that set its own ``timeout``: the client's deadline passed
    before the first token (a fuzzed ``timeout`` of 0.04 s does on a loaded machine). That is the
    answer the API promises such a request, not a server error."""
    if response.status_code != 504 or not isinstance(body, dict) or body.get("timeout") is None:
        return False
    try:
        return bool(response.json()["error"]["code"] == "timeout")
    except (ValueError, KeyError, TypeError):
        return False


def _log_excerpt(log_path: Path, num_lines: int = 12) -> str:
    lines = log_path.read_text().splitlines()
    errors = [line for line in lines if "error" in line.lower()]
    return "\n".join((errors or lines)[-num_lines:])


def test_served_schema_documents_post_bodies(fuzz_server: FuzzServer) -> None:
    document = requests.get(f"{fuzz_server.url}/schema/openapi.json", timeout=30).json()
    for path in POST_PATHS:
        body = document["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        schema = body["content"]["application/json"]["schema"]
        assert schema["type"] == "object" and "model" in schema["required"], schema
        assert "$ref" not in json.dumps(schema), schema


def test_fuzz_openapi_no_server_error(fuzz_server: FuzzServer) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/schema/openapi.json", timeout=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations if op.method.upper() == "POST" and op.path in POST_MODELS} == set(POST_PATHS)
    record = FuzzRecord()
    positive, negative = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
    with requests.Session() as session:
        assert session.post(f"{fuzz_server.url}/v1/completions", json=MINIMAL_BODIES["/v1/completions"]).status_code == 401
        session.headers["Authorization"] = f"Bearer {FUZZ_KEY}"
        _assert_minimal_bodies_served(fuzz_server, session)
        send_valid = _sender(fuzz_server, session, record, "positive")
        send_invalid = _sender(fuzz_server, session, record, "negative")
        for op in operations:
            if not (op.method.upper() == "POST" and op.path in POST_MODELS):
                # GETs, and the admin routes (off on this server without a token: 403s).
                _fuzz(op.as_strategy(positive), NUM_EXAMPLES_PER_GET, send_valid)
                continue
            valid = _served_model_half_the_time(op.as_strategy(positive), POST_MODELS[op.path])
            _fuzz(valid, NUM_POSITIVE_PER_POST, send_valid)
            _fuzz(op.as_strategy(negative), NUM_NEGATIVE_PER_POST, send_invalid)
        _assert_minimal_bodies_served(fuzz_server, session)
    summary = dict(sorted(record.statuses.items()))
    assert not record.server_errors, (
        f"{len(record.server_errors)} of {record.num_requests} responses were 5xx; the first ones:\n"
        + "\n".join(record.server_errors[:10])
        + f"\n--- server log ---\n{_log_excerpt(fuzz_server.log_path)}"
    )
    assert record.num_requests >= MIN_NUM_REQUESTS, summary
    assert not [label for (label, status) in record.statuses if status == 401], f"a request's key was refused: {summary}"
    # Generated bodies reach the batchers: some are served, over the POST routes together.
    num_ok = {path: record.statuses[(f"POST {path}", 200)] for path in POST_PATHS}
    print(f"generated bodies served per POST route: {num_ok}")
    assert sum(num_ok.values()) > 0, f"no generated body was served: {summary}; the valid bodies' refusals: {record.refusals.most_common(15)}"


def _assert_minimal_bodies_served(server: FuzzServer, session: requests.Session) -> None:
    for path, body in MINIMAL_BODIES.items():
        response = session.post(f"{server.url}{path}", json=body, timeout=REQUEST_TIMEOUT_S)
        assert response.status_code == 200, f"{path} {body}: {response.status_code} {response.text[:300]}"
