"""oneDNN-prepacked linear layers for CPU inference.

Every weight matrix is reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the op TorchInductor's CPU backend uses for the
same purpose) and multiplied with ``torch.ops.mkldnn._linear_pointwise``, which takes and returns
ordinary dense tensors. Against the default sgemm path, side by side on our 2-vCPU machines, a
decode step's short, wide products (a few dozen rows) run about a third faster and a prefill's
long ones (thousands of rows) about a quarter faster; ``torch.utils.mkldnn.MkldnnLinear`` would
pack the same way but converts every input to a oneDNN tensor and every output back, which cost
a sixth of a prefill forward in a profile. vLLM's CPU backend takes the same oneDNN route.
Results differ from the dense path only by float reduction order.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import structlog
import torch

log = structlog.get_logger(__name__)

PREPACK_DTYPES = (torch.float32, torch.bfloat16)
# The row count oneDNN is told to expect when it picks the packed layout; any count runs.
PACK_FOR_ROWS = 64


class PackedLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` prepacked for oneDNN.

    Args:
        linear: the layer to replace (its weight is reordered, not shared).
    Shapes: ``x`` ``[..., in_features]`` -> ``[..., out_features]``, the dtype of the weight.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of a CPU model by a :class:`PackedLinear`, in place.

    Returns the number of layers replaced (0 when oneDNN or its packing ops are unavailable,
    the model is not on the CPU, or its dtype is not float32/bfloat16). The model stays usable
    by Hugging Face code: only the layers' weight storage and kernels change.
    """
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype not in PREPACK_DTYPES or not _packing_available():
        return 0
    found = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if type(child) is torch.nn.Linear
    ]
    # The reorders run side by side on torch's intra-op thread count (the op releases the GIL):
    # SmolLM2's 211 took 3.7-3.9 s one after another and 0.65-0.94 s on 2 threads, side by side
    # in one run on a loaded 2-vCPU machine; every start of a generation model pays this.
    with ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="prepack") as pool:
        packed = list(pool.map(lambda item: PackedLinear(item[2]), found))
    for (parent, name, _), layer in zip(found, packed):
        setattr(parent, name, layer)
    log.info("linears_prepacked", num_layers=len(found), dtype=str(param.dtype))
    return len(found)


def _packing_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
