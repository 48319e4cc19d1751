"""RMSNorm through torch's fused kernel for Hugging Face decoders.

Llama-family decoders (Llama, Qwen2, Mistral, SmolLM2) normalise with a Python RMSNorm of five
elementwise passes (upcast, ``pow``, ``mean``, ``rsqrt`` multiply, weight multiply). On CPU,
``torch.nn.functional.rms_norm`` does the same in one fused kernel: on a ``[2048, 576]`` float32
input it was 6x faster side by side and bit-identical, and a decoder runs ``2 * layers + 1`` of
them per forward. Formula (Zhang & Sennrich, 2019): ``y = x / sqrt(mean(x^2) + eps) * weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FUSED_DTYPES = (torch.float32,)


class FusedRMSNorm(torch.nn.Module):
    """Drop-in for a Hugging Face ``*RMSNorm`` with ``weight`` ``[hidden]`` and ``variance_epsilon``.

    Shapes: ``x`` ``[..., hidden]`` -> same shape and dtype.
    """

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)
        self.normalized_shape = (self.weight.shape[0],)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.variance_epsilon)


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Replace the model's Llama-style RMSNorms by :class:`FusedRMSNorm`, in place.

    Only float32 models (where the result is identical); a norm of another form (for example
    Gemma's ``1 + weight``, which has no ``variance_epsilon``) is left alone. Returns how many
    were replaced.
    """
    if next(model.parameters()).dtype not in FUSED_DTYPES:
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_llama_rms_norm(child):
                setattr(parent, name, FusedRMSNorm(child))
                replaced += 1
    return replaced


def _is_llama_rms_norm(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return (
        name.endswith("RMSNorm")
        and name != "FusedRMSNorm"
        and hasattr(module, "variance_epsilon")
        and isinstance(getattr(module, "weight", None), torch.nn.Parameter)
        and module.weight.dim() == 1
    )
