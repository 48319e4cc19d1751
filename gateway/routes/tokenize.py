"""vLLM's tokenizer endpoints: ``POST /tokenize`` and ``POST /detokenize``, for any served model.

Both run the model's tokenizer alone (no bucket, no queue): a client counts a prompt's tokens
against ``max_model_len`` before sending it, or reads back the text of ids it holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from litestar import Controller, Request, post

from gateway.engine import ServedModel
from gateway.errors import model_not_found
from gateway.residency import Residency
from gateway.prompts import Piece
from gateway.router import MAX_INLINE_PROMPT_TOKENS, Router
from gateway.routes.bodies import check_token_ids, parse_body
from gateway.schemas import DetokenizeBody, TokenizeBody
from gateway.tenants import tenant_of


@asynccontextmanager
async def _served(request: Request[Any, Any, Any], name: str) -> AsyncIterator[tuple[Router, ServedModel]]:
    """The router and the served model ``name`` (any task; a LoRA adapter's base, whose
    tokenizer it shares), loaded first when it is not.

    Raises:
        APIError: 404 for an unknown model, and for one the caller's API key may not use; the
            503s of a load (:meth:`Residency.acquire`).
    """
    if not tenant_of(request.scope).may_use(name):
        raise model_not_found(name)
    residency: Residency = request.app.state.residency
    adapter = request.app.state.adapters.find(name)
    if adapter is not None:
        name = adapter[0].base_name
    async with residency.serving(name, None) as served:
        yield request.app.state.router, served


class TokenizeController(Controller):
    path = ""

    @post("/tokenize", status_code=200)
    async def tokenize(self, request: Request[Any, Any, Any]) -> dict[str, Any]:
        """``{count, max_model_len, tokens, token_strs}`` (``token_strs``: ``null`` unless
        ``return_token_strs``), as vLLM answers.

        Raises:
            APIError: 400 for a body that fails validation or a model without a chat template
                (``messages``); 404 for an unknown model.
        """
        body = await parse_body(request, TokenizeBody)
        async with _served(request, body.model) as (router, served):
            encoder = await router.encoder(served)
        if body.messages is not None:
            pieces = encoder.chat_pieces(body.messages, served.config.name, body.add_generation_prompt)
        else:
            pieces = [Piece(body.prompt or "", is_user_text=True, add_special_tokens=body.add_special_tokens)]
        if encoder.max_num_tokens(pieces) <= MAX_INLINE_PROMPT_TOKENS:
            ids = encoder.encode(pieces)
        else:
            ids = await asyncio.to_thread(encoder.encode, pieces)
        token_strs = encoder.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": served.config.max_model_len, "tokens": ids, "token_strs": token_strs}

    @post("/detokenize", status_code=200)
    async def detokenize(self, request: Request[Any, Any, Any]) -> dict[str, Any]:
        """``{prompt}``: the text of ``tokens``, special tokens included (as vLLM's).

        Raises:
            APIError: 400 naming ``tokens.<position>`` for an id outside the vocabulary; 404 for
                an unknown model.
        """
        body = await parse_body(request, DetokenizeBody)
        async with _served(request, body.model) as (router, served):
            encoder = await router.encoder(served)
        check_token_ids(body.tokens, encoder.vocab_size, "tokens")
        if len(body.tokens) <= MAX_INLINE_PROMPT_TOKENS:
            text = encoder.tokenizer.decode(body.tokens)
        else:
            text = await asyncio.to_thread(encoder.tokenizer.decode, body.tokens)
        return {"prompt": text}
