"""oneDNN-prepacked linear layers for CPU decoding.

A decode step multiplies a few dozen rows by every weight matrix. For those short, wide
products on CPU, oneDNN with weights reordered once into its blocked layout (what
``torch.utils.mkldnn.MkldnnLinear`` holds) is about a quarter faster per step than the default
sgemm path on our 2-vCPU machines, measured side by side (see the engine benchmark). vLLM's
CPU backend takes the same route through oneDNN. Results differ from the dense path only by
float reduction order.
"""

from __future__ import annotations

import structlog
import torch

log = structlog.get_logger(__name__)

PREPACK_DTYPES = (torch.float32, torch.bfloat16)


def prepack_linears(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of a CPU model by a oneDNN-prepacked one, in place.

    Returns the number of layers replaced (0 when oneDNN is unavailable, the model is not on
    the CPU, or its dtype is not float32/bfloat16). The model stays usable by Hugging Face code:
    only the layers' weight storage and kernels change.
    """
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype not in PREPACK_DTYPES or not torch.backends.mkldnn.is_available():
        return 0
    from torch.utils.mkldnn import MkldnnLinear

    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, MkldnnLinear(child, param.dtype))
                replaced += 1
    log.info("linears_prepacked", num_layers=replaced, dtype=str(param.dtype))
    return replaced
