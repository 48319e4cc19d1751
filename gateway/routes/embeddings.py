"""The embeddings route's parts: inputs as token ids, Matryoshka dimensions, base64 floats,
and one input's request through its bucket."""

from __future__ import annotations

import base64
import math
import struct
import uuid

from buckets.request import EmbeddingEvent, EmbeddingRequest
from gateway.engine import ServedModel
from gateway.errors import invalid_request
from gateway.router import Router
from gateway.routes.bodies import check_num_inputs, check_token_ids
from gateway.routes.generation import finish, first_event
from gateway.schemas import EmbeddingBody
from gateway.streams import EventChannel, RequestWatch
from gateway.tenants import Tenant


async def input_token_lists(router: Router, served: ServedModel, body: EmbeddingBody) -> list[list[int]]:
    """The token ids of each embeddings input: strings tokenized, token ids checked.

    Raises:
        APIError: 400 ``too_many_inputs`` over the model's ``max_embedding_inputs``; 400 naming
            the position (``input.3``, ``input.1.3``) of a token id outside the vocabulary.
    """
    inputs = body.inputs()
    check_num_inputs(served, len(inputs))
    texts = [item for item in inputs if isinstance(item, str)]
    if texts:
        return await router.tokenize_all(served, texts)
    token_lists = [item for item in inputs if isinstance(item, list)]
    vocab_size = (await router.encoder(served)).vocab_size
    for i, ids in enumerate(token_lists):
        check_token_ids(ids, vocab_size, "input" if body.is_flat_ids() else f"input.{i}")
    return token_lists


def check_dimensions(served: ServedModel, dimensions: int | None) -> None:
    """Raises APIError 400 (``dimensions``): ``unsupported_parameter`` for a model whose config
    declares no ``matryoshka_dimensions``, ``invalid_dimensions`` for a size it does not declare."""
    if dimensions is None:
        return
    declared = served.config.matryoshka_dimensions
    if declared is None:
        raise invalid_request(
            f"The model '{served.config.name}' declares no Matryoshka dimensions, so Sluice does not implement "
            "'dimensions' for it; leave it out (or null)",
            param="dimensions",
            code="unsupported_parameter",
        )
    if dimensions not in declared:
        raise invalid_request(
            f"dimensions is {dimensions}; the model '{served.config.name}' takes one of {declared}",
            param="dimensions",
            code="invalid_dimensions",
        )


def matryoshka(embedding: list[float], dimensions: int) -> list[float]:
    """The first ``dimensions`` components of a Matryoshka embedding, L2-renormalised (as
    sentence-transformers' ``truncate_dim`` followed by normalising does)."""
    head = embedding[:dimensions]
    norm = math.sqrt(sum(x * x for x in head))
    return [x / norm for x in head] if norm > 0 else head


def base64_floats(values: list[float]) -> str:
    """OpenAI's ``encoding_format: base64``: little-endian float32 bytes, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def submit_embedding(
    router: Router, served: ServedModel, token_ids: list[int], priority: int, arrival_s: float, deadline_s: float | None,
    tenant: Tenant,
) -> tuple[EmbeddingRequest, EventChannel]:
    """Queue one input's request (``tenant``: who sent it, for fair share) in its bucket.

    Raises:
        APIError: the refusals of :meth:`Router.enqueue` (429 for a full queue).
    """
    channel = EventChannel()
    request = EmbeddingRequest(
        request_id=f"emb-{uuid.uuid4().hex}",
        prompt_token_ids=token_ids,
        sink=channel.sink,
        priority=priority,
        deadline_s=deadline_s,
        tenant=tenant.name,
        tenant_weight=tenant.weight,
    )
    request.timeline["arrival"] = arrival_s
    router.enqueue(served, request, 0, "input")
    return request, channel


async def embed_one(served: ServedModel, request: EmbeddingRequest, channel: EventChannel, watch: RequestWatch) -> list[float]:
    """One input's embedding.

    Raises:
        APIError: 504 past the deadline, 499 after a hang-up, 500 when the batch failed.
    """
    event = await first_event(served, request, channel, watch)
    assert isinstance(event, EmbeddingEvent)
    finish(served, request, 0, event, watch)
    return event.embedding

