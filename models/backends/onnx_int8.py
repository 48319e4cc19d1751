"""INT8 for the ``onnx`` encoder backend: the quantization recipe, SmoothQuant and the
measurements that chose them.

INT8 (:data:`INT8_RECIPE`): ``quantize_dynamic`` of the MatMuls only, per-channel weights, after
SmoothQuant (alpha 0.7, calibrated on :data:`CALIBRATION_TEXTS`), with the FFN-output MatMul of
the first two layers kept in FP32. Measured on all-MiniLM-L6-v2, 64 sentences of 3 to 230
tokens, mean-pooled and L2-normalised, cosine to eager; ms per batch on 2 shared CPU cores
(interleaved, medians; ORT FP32 took 207 ms at 8x64 and 196 ms at 32x16, eager 948 and 910;
(*) is the recipe):

==================================  =======  ========  =======  ========
recipe                              min cos  mean cos  8x64 ms  32x16 ms
==================================  =======  ========  =======  ========
ORT default (all ops, per-tensor)    0.870    0.9544     155      104
MatMul only                          0.856    0.9538     151      103
MatMul, per-channel                  0.959    0.9917     150      104
  + reduce_range                     0.967    0.9909     156      107
  FP32 ffn_out, all layers           0.981    0.9956     179      135
  FP32 ffn_in and ffn_out            0.994    0.9984     196      148
  FP32 first and last layer          0.976    0.9943     184      132
  SmoothQuant alpha 0.5              0.969    0.9896     155      109
  SmoothQuant alpha 0.7              0.989    0.9958     154      109
  alpha 0.7, FP32 ffn_out            0.997    0.9993     181      131
  alpha 0.7, FP32 ffn_out layer 0    0.993    0.9976     158      113
  alpha 0.7, FP32 ffn_out 0-1 (*)    0.994    0.9980     163      116
MatMulNBits 8-bit, block 32, int8    0.998    0.9996     232      189
==================================  =======  ========  =======  ========

SmoothQuant alpha 0.3 fell to 0.66, 0.8 to 0.970, 0.9 to 0.920. The errors come from the
per-tensor dynamic scale of the MatMul inputs (8-bit weights alone, MatMulNBits without int8
compute, keep 0.9995), worst on the shortest inputs. Static QDQ (``quantize_static``, MinMax over
32 of the sentences, per-channel) reached only 0.752 min / 0.913 mean at 164 / 113 ms; the
Percentile calibrator fails on batches of different lengths. On a quiet machine ORT FP32 took
90 / 77 ms, the recipe 83 / 44 ms, eager 136 / 86 ms: INT8 pays off most on many short sequences.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.backends.base import BackendUnavailableError

@dataclass(frozen=True)
class Int8Recipe:
    """How the FP32 graph becomes INT8 with ``onnxruntime.quantization.quantize_dynamic``.

    ``op_types``: the operator types quantized (``Gather`` would quantize the embedding table).
    ``per_channel``: one weight scale per output column instead of one per matrix.
    ``reduce_range``: 7-bit weights (avoids u8s8 saturation on CPUs without VNNI).
    ``fp32_roles``: MatMul roles kept in FP32, out of ``qkv``, ``attn_out``, ``ffn_in``,
    ``ffn_out`` (see :func:`matmul_roles`); ``fp32_layers`` limits that to some layer indices
    (negative counts from the end; ``None`` means every layer).
    ``smooth_alpha``: SmoothQuant migration strength (see :func:`smooth_activations`), calibrated
    on :data:`CALIBRATION_TEXTS`; ``None`` skips smoothing.
    """

    op_types: tuple[str, ...] = ("MatMul",)
    per_channel: bool = True
    reduce_range: bool = False
    fp32_roles: tuple[str, ...] = ()
    fp32_layers: tuple[int, ...] | None = None
    smooth_alpha: float | None = None

    def describe(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


INT8_RECIPE = Int8Recipe(per_channel=True, fp32_roles=("ffn_out",), fp32_layers=(0, 1), smooth_alpha=0.7)

# Calibration inputs for activation smoothing: varied in topic, register and length (none of
# them is in the tests' sentence sets).
CALIBRATION_TEXTS = (
    "What time does the pharmacy on Elm Street close on Sundays?",
    "Refunds are issued to the original payment method within ten business days.",
    "lol same",
    "The enzyme binds its substrate at the active site and lowers the activation energy of the reaction.",
    "Set the environment variable before starting the worker, otherwise the default port is used.",
    "In 1869 the Suez Canal opened, shortening the sea route between Europe and Asia by thousands of kilometres.",
    "Our team is looking for a backend engineer with experience in distributed systems and on-call rotations.",
    "Gently fold the whipped egg whites into the batter so that the cake stays light.",
    "The striker curled the free kick into the top corner in the ninetieth minute to win the derby.",
    "Warning: the file system is almost full; delete old snapshots or extend the volume.",
    "Tenants must give sixty days' written notice before leaving, and the deposit is returned after an "
    "inspection of the flat. Damage beyond ordinary wear is deducted at cost, and the landlord must send an "
    "itemised list within thirty days. Disputes go first to the housing mediation service, whose decision "
    "either party may appeal to the county court within a month. Pets are allowed with written consent, "
    "subletting is not, and the rent is reviewed once a year in line with the consumer price index.",
    "Migrating birds navigate using the Earth's magnetic field, the position of the sun and the stars, and "
    "familiar landmarks such as coastlines and mountain ranges, and young birds on their first journey "
    "often follow older ones, learning routes that they will repeat for the rest of their lives.",
)


def matmul_roles(onnx_path: Path) -> list[tuple[str, int, str]]:
    """``(node name, layer index, role)`` of every MatMul with a constant 2-D weight, in graph order.

    Roles come from the weight shapes, so no exporter's naming is assumed: per layer, square
    weights are ``qkv`` (the first three) and ``attn_out`` (the fourth, which depends on them);
    the wide one (``hidden -> intermediate``) is ``ffn_in``, the tall one ``ffn_out``, which
    closes the layer.
    """
    import onnx

    graph = onnx.load(str(onnx_path)).graph
    shapes = {t.name: list(t.dims) for t in graph.initializer}
    roles: list[tuple[str, int, str]] = []
    layer, num_square = 0, 0
    for node in graph.node:
        shape = shapes.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if shape is None or len(shape) != 2:
            continue
        rows, cols = shape
        if rows == cols:
            num_square += 1
            roles.append((node.name, layer, "qkv" if num_square <= 3 else "attn_out"))
        elif rows < cols:
            roles.append((node.name, layer, "ffn_in"))
        else:
            roles.append((node.name, layer, "ffn_out"))
            layer, num_square = layer + 1, 0
    return roles


def fp32_nodes(onnx_path: Path, recipe: Int8Recipe) -> list[str]:
    """The MatMul node names ``recipe`` keeps in FP32."""
    roles = matmul_roles(onnx_path)
    num_layers = 1 + max((layer for _, layer, _ in roles), default=-1)
    layers = set(range(num_layers))
    if recipe.fp32_layers is not None and num_layers:
        layers = {index % num_layers for index in recipe.fp32_layers}
    return [name for name, layer, role in roles if role in recipe.fp32_roles and layer in layers]


def quantize_int8(fp32_path: Path, path: Path, recipe: Int8Recipe, calibration: list[dict[str, Any]] | None = None) -> None:
    """Quantize the FP32 file at ``fp32_path`` into ``path`` following ``recipe``;
    ``calibration`` (ONNX Runtime feeds) is needed when the recipe smooths activations.

    Raises:
        BackendUnavailableError: onnxruntime's quantizer failed.
    """
    try:
        import onnx
        from onnxruntime.quantization import QuantType, quantize_dynamic

        source: Any = fp32_path
        if recipe.smooth_alpha is not None:
            source = onnx.load(str(fp32_path))
            smooth_activations(source, calibration or [], recipe.smooth_alpha)
        quantize_dynamic(
            source,
            path,
            op_types_to_quantize=list(recipe.op_types),
            per_channel=recipe.per_channel,
            reduce_range=recipe.reduce_range,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=fp32_nodes(fp32_path, recipe),
        )
    except Exception as error:
        raise BackendUnavailableError(f"onnx backend: INT8 quantization of {fp32_path} failed: {error}") from error


def calibration_feeds(folder: Path, has_token_types: bool) -> list[dict[str, Any]]:
    """:data:`CALIBRATION_TEXTS` tokenized by the model folder's tokenizer, four per batch, as
    ONNX Runtime feeds."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    feeds = []
    for start in range(0, len(CALIBRATION_TEXTS), 4):
        encoded = tokenizer(list(CALIBRATION_TEXTS[start : start + 4]), padding=True, truncation=True, max_length=256, return_tensors="np")
        feed = {name: encoded[name].astype(np.int64) for name in ("input_ids", "attention_mask")}
        if has_token_types:
            feed["token_type_ids"] = np.zeros_like(feed["input_ids"])
        feeds.append(feed)
    return feeds


def smooth_activations(model: Any, feeds: list[dict[str, Any]], alpha: float) -> None:
    """SmoothQuant (Xiao et al. 2023, arXiv:2211.10438) on an ONNX model, in place.

    Dynamic INT8 quantizes each MatMul input with one scale per tensor, so a few outlier
    channels (BERT's LayerNorm outputs have some) leave the other channels a handful of levels.
    For every input ``X`` of constant-weight MatMuls, channel ``j`` is divided by
    ``s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)`` (a ``Mul`` inserted before the MatMuls)
    and the weights' row ``j`` multiplied by it, so ``X @ W`` is unchanged in exact arithmetic.
    ``max|X_j|`` comes from running ``feeds``; ``max|W_j|`` is taken over all MatMuls sharing ``X``.
    """
    from onnx import NodeProto, helper, numpy_helper

    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    groups: dict[str, list[int]] = {}
    for position, node in enumerate(graph.node):
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if weight is not None and len(weight.dims) == 2 and uses[weight.name] == 1:
            groups.setdefault(node.input[0], []).append(position)
    amax = _activation_amax(model, list(groups), feeds)
    nodes = []
    for node in graph.node:
        nodes.append(NodeProto())
        nodes[-1].CopyFrom(node)
    inserts: dict[int, Any] = {}
    for index, (name, positions) in enumerate(groups.items()):
        matrices = [numpy_helper.to_array(weights[nodes[p].input[1]]) for p in positions]
        wmax = np.max([np.abs(m).max(axis=1) for m in matrices], axis=0)
        scale = (np.maximum(amax[name], 1e-5) ** alpha / np.maximum(wmax, 1e-5) ** (1 - alpha)).astype(np.float32)
        for position, matrix in zip(positions, matrices):
            weight_name = nodes[position].input[1]
            weights[weight_name].CopyFrom(numpy_helper.from_array((matrix * scale[:, None]).astype(matrix.dtype), weight_name))
            nodes[position].input[0] = f"{name}_smoothed"
        graph.initializer.append(numpy_helper.from_array((1.0 / scale).astype(np.float32), f"{name}_smooth_inv_scale"))
        inserts[positions[0]] = helper.make_node("Mul", [name, f"{name}_smooth_inv_scale"], [f"{name}_smoothed"], name=f"smooth_{index}")
    graph.ClearField("node")
    for position, node in enumerate(nodes):
        if position in inserts:
            graph.node.append(inserts[position])
        graph.node.append(node)


def _activation_amax(model: Any, names: list[str], feeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-channel (last axis) max of ``|x|`` of each named tensor over ``feeds``."""
    import onnx
    import onnxruntime as ort

    if not feeds:
        raise ValueError("activation smoothing needs calibration feeds")
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    outputs = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names if n not in outputs)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    amax: dict[str, Any] = {}
    for feed in feeds:
        for name, value in zip(names, session.run(names, feed)):
            channel_max = np.abs(value).reshape(-1, value.shape[-1]).max(axis=0)
            amax[name] = np.maximum(amax[name], channel_max) if name in amax else channel_max
    return amax
