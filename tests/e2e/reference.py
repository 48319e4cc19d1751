"""Hugging Face references: greedy generation alone, logprobs, and the near-tie rule for float order."""

from __future__ import annotations

from typing import Any

import torch

NEAR_TIE_LOGPROB = 1e-3


@torch.inference_mode()
def greedy_reference(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """``model.generate(do_sample=False)`` of one prompt, alone; stops at EOS like the server."""
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=model.generation_config.eos_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def assert_greedy_close(model: Any, prompt_ids: list[int], got: list[int], want: list[int]) -> None:
    """Tokens must match; where they first differ, it must be a near-tie in the reference
    (log-probabilities of the two picks within ``NEAR_TIE_LOGPROB``), as vLLM's
    ``check_logprobs_close`` allows. After a near-tie the continuations may diverge."""
    if got == want:
        return
    pos = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert pos < min(len(got), len(want)), f"lengths differ without a differing token: {got} vs {want}"
    logits = model(torch.tensor([prompt_ids + want[:pos]])).logits[0, -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    gap = abs(float(logprobs[got[pos]] - logprobs[want[pos]]))
    assert gap < NEAR_TIE_LOGPROB, f"token {pos} differs ({got[pos]} vs {want[pos]}) with logprob gap {gap:.2e}"


@torch.inference_mode()
def reference_logprobs(model: Any, token_ids: list[int]) -> torch.Tensor:
    """``log_softmax`` of HF's float32 logits of ``token_ids`` run alone: ``[len, vocab_size]``,
    row ``i`` the distribution of the token after position ``i``."""
    logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)
