"""Log-probabilities of chosen tokens and their most likely alternatives, from raw logits.

The numbers are ``log_softmax`` of the model's logits as the forward produced them, before
temperature, top-k / top-p or any logits processor: what vLLM returns by default
(``logprobs_mode="raw_logprobs"``) and what a loglikelihood evaluation needs. They do not
depend on the request's sampling parameters.

Rows are computed together, one ``log_softmax`` and one ``topk`` over every row that asked;
only the ``k`` (at most 20) alternatives of each row are read back into Python.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from models.step_io import TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprobs]:
    """The logprob of ``token_ids[i]`` under row ``i`` of ``logits``, with its ``num_top[i]``
    most likely tokens.

    Args:
        logits: ``[num_rows, vocab_size]`` raw logits (any float dtype; computed in float32).
        token_ids: ``num_rows`` token ids, one per row.
        num_top: ``num_rows`` counts of alternatives (each ``>= 0``).
    Returns:
        ``num_rows`` :class:`TokenLogprobs`, in row order.
    """
    if logits.shape[0] != len(token_ids) or len(token_ids) != len(num_top):
        raise ValueError(f"{logits.shape[0]} rows, {len(token_ids)} token ids and {len(num_top)} counts must agree")
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    max_top = min(max(num_top), logprobs.shape[-1])
    top_values: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if max_top > 0:
        top = torch.topk(logprobs, max_top, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        TokenLogprobs(token_id, value, tuple(zip(top_ids[row][:k], top_values[row][:k])))
        for row, (token_id, value, k) in enumerate(zip(token_ids, chosen, num_top))
    ]
