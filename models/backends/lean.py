"""The ``lean`` decoder backends: Sluice's own Llama forward (:mod:`models.llama_lean`), float32,
int8 or int4 weights.

Kinds:
    ``lean``: float32, fused QKV and gate/up products (new concatenated copies: 279 MB for
        SmolLM2-135M), the O, down and LM-head products sharing the eager modules' oneDNN
        prepacked weights. Greedy tokens equal eager's up to near-ties (float order only).
    ``lean-int8``: every product, the LM head included, weight-only int8 per output channel
        (:class:`models.lean_linear.Int8Linear`); lossy.
    ``lean-int4``: the products int4 group-wise (:class:`models.lean_linear.Int4Linear`). From a
        GGUF model whose projections are Q4_1, the file's own blocks (:mod:`models.gguf_blocks`)
        and, where the LM head (SmolLM2's tied embedding) is Q8_0, its blocks as group-wise int8:
        all their weights equal the eager path's float32 weights exactly (checked at build;
        greedy tokens equal eager's up to near-ties). From a float folder, round-to-nearest int4,
        group 32, the LM head included; lossy.
    ``lean-int8-bf16``, ``lean-int4-bf16``: the same weights through torch's weight-only ops with
        bfloat16 activations and scales (the result back in float32); lossy, int4 too (Q4_1's
        float16 ``d`` does not survive bfloat16), and ``lean-int4-bf16``'s LM head is int8 per
        channel.
    ``lean-int4-q8a``, ``lean-int8-q8a``: ``lean-int4`` and ``lean-int8`` whose layer products of
        prefill size (at least as many rows as pay, measured at build: 16 to 64 on the AVX-512
        machine; a packed decode step of that many sequences too) quantize their activations
        to int8 per row and group of 32 and multiply in integers (:mod:`models.quant_kernels`,
        ``csrc/quant_gemm_q8.h``: VNNI on AVX-512); products of few rows keep the exact
        float32-activation GEMV. Lossy (both); opt-in gate candidates.

With float32 activations the quantized products run Sluice's kernel
(:mod:`models.quant_kernels`, AVX-512 or AVX2, exact on the dequantized weights). A product of
more rows than pay on this machine (measured when the backend is built:
:mod:`models.backends.row_crossover`; :data:`TORCH_OP_MAX_ROWS` for torch's ops) runs on the
eager modules' float32 prepacked weights, unfused: no extra memory, since the eager
fallback keeps those modules anyway (so prefill needs them, and no bytes are saved by the
quantized kinds; ``lean-int4``'s Q8_0 head adds 31.8 MB beside eager's float32 embedding).

Figures, side by side in one run (``python -m bench.decode_split --repeats 3 --threads 1,2``) on
this project's AVX-512 machine (2 cores, load 2.8-3.5 from other work), SmolLM2-135M, context
128; ``@avx2`` forces the kernel's AVX2 path (oneDNN's float32 products still run AVX-512). Whole
steps, ms (step = matmul + attention + other):

    threads  kind            decode1 (mm / attn / other)   decode32   prefill512
    1        eager           26.8 (20.4 / 1.2 / 5.1)       89.3       716
    1        lean            21.5 (17.7 / 1.2 / 2.6)       85.1       836
    1        lean-int8       12.1 (8.5 / 1.1 / 2.6)        84.0       (noise)
    1        lean-int4       10.3 (7.5 / 1.1 / 1.8)        85.3       869
    1        lean-int4@avx2  12.5 (9.6 / 1.0 / 1.9)        84.4       722
    1        lean-int4-bf16   9.6 (6.5 / 1.2 / 1.9)        84.7       754
    2        eager           21.3 (14.1 / 1.2 / 5.9)       57.5       377
    2        lean            14.7 (12.2 / 1.2 / 1.3)       56.7       381
    2        lean-int8        7.8 (5.2 / 1.1 / 1.5)        53.2       399
    2        lean-int4        7.5 (4.4 / 1.0 / 2.1)        50.8       397
    2        lean-int4@avx2   8.6 (5.5 / 1.1 / 2.1)        55.6       383
    2        lean-int4-bf16   7.7 (4.6 / 1.0 / 2.1)        52.7       387

(Measured before the lean step's RMSNorm became one C++ call, which saved about 1 ms more per
decode1 step at 1 thread: 14.3 vs 15.3 ms, A/B in one process at load 5.6.) At 32 sequences and
in prefill every kind runs float32 products, within noise of ``lean``. Each
product alone, one thread, random weights, ms at 1 / 4 / 8 / 32 / 512 rows:

    gate_up [3072, 576]  float32 0.149 / 0.109 / 0.157 / 0.516 / 7.1
                         int4@avx512 0.052 / 0.082 / 0.158 / 0.629 / 10.8   int8@avx512 0.046 / 0.080 / 0.159
                         int4@avx2 0.087 / 0.203 / 0.401 / 1.64 / 26.9     int4-bf16 0.052 / 0.086 / 0.167
    LM head [49152, 576] float32 3.44 / 3.37 / 5.13 / 10.2
                         int8@avx512 (the Q8_0 head) 1.65 / 1.85 / 6.64   int8@avx2 2.90 / 3.14 / 7.85

So the kernel's AVX-512 path is 2.9x (gate_up) and 2.1x (head) faster than float32 at one row,
as fast at 4-8, slower beyond; its AVX2 path, against AVX-512 oneDNN, about 1.7x at one row and
2x slower at 4 (on an AVX2-only machine oneDNN runs AVX2 too: not measured here). A tiled GEMM
(128 dequantized channels per tile through ``at::mm``) lost to oneDNN's float32 product at every
row count and was dropped. Torch's weight-only ops with float32 activations are 8-25x slower
than float32 (no longer used where the kernel runs).

Every kind runs LoRA adapters (:mod:`models.lora_stacks`): :class:`models.llama_lean.LeanLlama`
adds the step's LoRA terms after each product; the eager modules' LoRA hooks
(:mod:`models.lora_hooks`) never run here, since the lean products share the modules' weights
without calling the modules.

Built from the folder's safetensors (the float32 weights the eager path loaded, before
:func:`models.cpu_linear.prepack_linears` reordered them), so the backend needs a CPU float32
``LlamaModel`` loaded from a folder.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.attention import PackedStep
from models.backends.base import BackendUnavailableError, DecoderBackend, DecoderParts
from models.cpu_linear import PackedLinear
from models.gguf_blocks import gguf_source, q4_1_dequantized, q4_1_linear, q4_1_projections, q8_0_head
from models.lean_linear import DenseLinear, Int4Linear, Int8Linear, Q8ActivationLinear, int4_round_to_nearest, kernel_isa
from models.backends.row_crossover import SwitchedLinear, set_max_quantized_rows, set_min_prefill_rows
from models.llama_lean import LeanGeometry, LeanLayer, LeanLlama, Linear
from models.lora import TARGET_MODULE_OWNERS

SUPPORTED_DECODERS = ("LlamaModel",)
# Rows up to which a product of torch's ops runs quantized; above, on the float32 weights
# (bfloat16 activations: on a par with float32 at 4 rows, 1.1-1.5x slower at 8 and 16, in cache,
# 1 thread). Our kernel's figure is measured at build (models.backends.row_crossover).
TORCH_OP_MAX_ROWS = 4
PROJECTIONS = TARGET_MODULE_OWNERS  # projection -> the layer submodule that holds it
# (layer, projection, float32 weight [out, in]) -> its quantized product, or None to keep float32.
QuantizeFn = Callable[[int, str, torch.Tensor], Linear | None]


class LeanDecoder:
    """A :class:`models.llama_lean.LeanLlama` as a decoder backend; it owns the LM head
    (:meth:`logits`), which the runner calls instead of the model's while this backend serves.
    ``switched``: its products that choose by row count (quantized kinds; empty for ``lean``)."""

    def __init__(self, name: str, model: LeanLlama, switched: list[SwitchedLinear] | None = None):
        self.name = name
        self.model = model
        self.switched = switched or []

    @contextlib.contextmanager
    def int8_activations_from(self, rows: int) -> Iterator[None]:
        """While open, every product with an int8-activation path (the -q8a kinds) takes it
        from ``rows`` rows on (those up to its ``max_rows`` still run the GEMV). For the gate's
        accuracy check (:mod:`models.backends.decoder_gate`), whose prompts are shorter than
        the threshold measured at build: a row's int8 rounding does not depend on the rows
        beside it, so short prefills then show what long ones would."""
        saved = [product.min_prefill_rows for product in self.switched]
        for product in self.switched:
            if product.prefill is not None:
                product.min_prefill_rows = rows
        try:
            yield
        finally:
            for product, min_rows in zip(self.switched, saved):
                product.min_prefill_rows = min_rows

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, step: PackedStep) -> torch.Tensor:
        """Last hidden states ``[1, T, hidden_size]`` of the packed tokens."""
        return self.model.hidden_states(input_ids, position_ids, step)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, hidden_size]`` -> ``[R, vocab_size]`` float32."""
        return self.model.logits(hidden)


class ConcatLinear:
    """Several products of one input side by side (the eager modules' Q, K, V or gate, up)."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.mm(x) for part in self.parts], dim=1)


def build_lean(
    parts: DecoderParts, name: str, quantize: QuantizeFn | None, max_quantized_rows: int | None = None,
    is_q8_prefill: bool = False,
) -> LeanDecoder:
    """The lean backend over ``parts.decoder``'s weights; ``quantize(layer, projection, weight)``
    (``layer`` -1 for the LM head) makes the quantized product of each float32 weight
    ``[out, in]``, run for products of at most ``max_quantized_rows`` rows (``None``: as many as
    pay on this machine, measured now by :func:`models.backends.row_crossover.set_max_quantized_rows`);
    ``quantize`` ``None`` for the float32 kind. With ``is_q8_prefill`` the layers' quantized
    weights also run with int8 activations (:class:`models.lean_linear.Q8ActivationLinear`) for
    products of at least as many rows as pay here (measured now:
    :func:`models.backends.row_crossover.set_min_prefill_rows`); the LM head keeps float32
    activations.

    Raises:
        BackendUnavailableError: not a CPU float32 Llama decoder loaded from a folder with
            safetensors, the model has projection biases, torch has no oneDNN, or (int4 from a
            GGUF file) the file's Q4_1 weights differ from the folder's.
    """
    decoder = parts.decoder
    weights = _float_weights(decoder)
    config = decoder.config
    layers: list[LeanLayer] = []
    switched: list[SwitchedLinear] = []
    for i in range(config.num_hidden_layers):
        modules = {p: getattr(getattr(decoder.layers[i], owner), p) for p, owner in PROJECTIONS.items()}

        def product(*names: str) -> Linear:
            float_weights = [weights[f"layers.{i}.{PROJECTIONS[n]}.{n}.weight"] for n in names]
            if quantize is None:
                return _dense([modules[n] for n in names], float_weights)
            # Beside quantized weights the float32 product is the eager modules' own, unfused.
            unfused = [_dense([modules[n]], [w]) for n, w in zip(names, float_weights)]
            dense = unfused[0] if len(unfused) == 1 else ConcatLinear(unfused)
            quantized = quantize(i, "+".join(names), torch.cat(float_weights))
            if quantized is None:
                return dense
            prefill = _q8_activation(quantized) if is_q8_prefill else None
            switched.append(SwitchedLinear(quantized, dense, max_quantized_rows or 0, prefill))
            return switched[-1]

        layers.append(LeanLayer(
            input_norm=decoder.layers[i].input_layernorm.weight.detach(),
            post_attention_norm=decoder.layers[i].post_attention_layernorm.weight.detach(),
            qkv=product("q_proj", "k_proj", "v_proj"), o=product("o_proj"),
            gate_up=product("gate_proj", "up_proj"), down=product("down_proj"),
        ))  # fmt: skip
    head_weight = weights.get("lm_head.weight", weights["embed_tokens.weight"])
    head: Linear = _dense([parts.lm_head], [head_weight])
    quantized_head = None if quantize is None else quantize(-1, "lm_head", head_weight)
    if quantized_head is not None:
        switched.append(SwitchedLinear(quantized_head, head, max_quantized_rows or 0))
        head = switched[-1]
    if switched and max_quantized_rows is None:
        set_max_quantized_rows(switched, name)
    if is_q8_prefill:
        set_min_prefill_rows(switched, name)
    model = LeanLlama(
        LeanGeometry.from_config(config), decoder.embed_tokens.weight.detach(), layers, decoder.norm.weight.detach(),
        decoder.rotary_emb, head,
    )
    return LeanDecoder(name, model, switched)


def _q8_activation(quantized: Linear) -> Linear | None:
    """The int8-activation product of ``quantized``'s weights, where the kernel runs it."""
    if isinstance(quantized, (Int4Linear, Int8Linear)) and quantized.isa is not None:
        return Q8ActivationLinear(quantized)
    return None


def _dense(modules: list[Any], weights: list[torch.Tensor]) -> Linear:
    """The float32 product of ``weights`` stacked by rows: a new fused prepacked copy when there
    are several, else the eager module's own prepacked weight (a new one when it is not a
    :class:`models.cpu_linear.PackedLinear`)."""
    if len(weights) > 1:
        return DenseLinear(torch.cat(weights))
    module = modules[0]
    if isinstance(module, PackedLinear) and module.bias is None:
        return DenseLinear.from_packed(module.packed_weight, module.out_features, module.in_features)
    return DenseLinear(weights[0])


def _float_weights(decoder: Any) -> dict[str, torch.Tensor]:
    """The decoder's float32 weights from its folder's safetensors, keyed without the base
    model prefix (``layers.0.self_attn.q_proj.weight``, ``embed_tokens.weight``;
    ``lm_head.weight`` when untied)."""
    from safetensors import safe_open

    is_llama = type(decoder).__name__ in SUPPORTED_DECODERS
    param = decoder.embed_tokens.weight if is_llama else None
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32:
        raise BackendUnavailableError(f"the lean backend runs CPU float32 {'/'.join(SUPPORTED_DECODERS)} decoders only")
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        raise BackendUnavailableError("the lean backend needs oneDNN (torch.backends.mkldnn) for its float32 products")
    if getattr(decoder.config, "attention_bias", False) or getattr(decoder.config, "mlp_bias", False):
        raise BackendUnavailableError("the lean backend runs decoders without projection biases only")
    files = sorted(Path(str(decoder.config._name_or_path)).glob("*.safetensors"))
    if not files:
        raise BackendUnavailableError(f"no safetensors in {decoder.config._name_or_path!r} to build the lean backend from")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                short = key.removeprefix("model.")
                if short.startswith(("layers.", "embed_tokens.")) or short == "lm_head.weight":
                    weights[short] = handle.get_tensor(key).float()
    return weights


def _int8_factory(activation_dtype: torch.dtype) -> QuantizeFn:
    """int8 products of every weight, computing in ``activation_dtype``."""

    def quantize(layer: int, projection: str, weight: torch.Tensor) -> Linear | None:
        return Int8Linear(weight, activation_dtype)

    return quantize


def _int4_factory(parts: DecoderParts, activation_dtype: torch.dtype) -> QuantizeFn:
    """int4 products: the GGUF file's own Q4_1 blocks where it has them (checked equal to the
    float32 weights), else round-to-nearest. The LM head where the file's is Q8_0: those blocks,
    exact, through our kernel (float32 activations), or per-channel int8 (bfloat16, lossy anyway);
    else float32. They compute in ``activation_dtype``."""
    config = parts.decoder.config
    source = gguf_source(Path(str(config._name_or_path)))
    blocks = {} if source is None else q4_1_projections(source, config.num_attention_heads, config.num_key_value_heads)

    def quantize(layer: int, projection: str, weight: torch.Tensor) -> Linear | None:
        if not blocks:
            return int4_round_to_nearest(weight, activation_dtype=activation_dtype)
        if layer < 0:
            return _gguf_head(source, weight, activation_dtype)
        names = [(layer, name) for name in projection.split("+")]
        if not all(key in blocks for key in names):
            return None  # not Q4_1 in the file: float32 keeps it exact
        rows = np.concatenate([blocks[key] for key in names])
        if not torch.equal(q4_1_dequantized(rows), weight):
            raise BackendUnavailableError(f"layer {layer} {projection}: the GGUF's Q4_1 weights differ from the float32 weights")
        return q4_1_linear(rows, activation_dtype)

    return quantize


def _gguf_head(source: Path | None, weight: torch.Tensor, activation_dtype: torch.dtype) -> Linear | None:
    """The LM head of a GGUF model's int4 kinds (see :func:`_int4_factory`); ``weight`` the
    float32 head ``[vocab, hidden]``.

    Raises:
        BackendUnavailableError: the file's Q8_0 head differs from ``weight``.
    """
    if activation_dtype != torch.float32:
        return Int8Linear(weight, activation_dtype)  # 1.7x faster than float32 at one row
    head = None if source is None or kernel_isa() is None else q8_0_head(source)
    if head is None:
        return None
    linear = Int8Linear.from_blocks(*head)
    if not torch.equal(linear.dequantized(), weight):
        raise BackendUnavailableError("the GGUF's Q8_0 LM head differs from the float32 weights")
    return linear


def _quantized_rows(activation_dtype: torch.dtype) -> int | None:
    """The most rows a product of ``activation_dtype`` runs quantized: :data:`TORCH_OP_MAX_ROWS`
    for torch's ops, ``None`` (measure at build) for our kernel.

    Raises:
        BackendUnavailableError: ``SLUICE_KERNEL_ISA`` is wrong (the message names it).
    """
    if activation_dtype != torch.float32:
        return TORCH_OP_MAX_ROWS
    try:
        isa = kernel_isa()
    except ValueError as exc:
        raise BackendUnavailableError(str(exc)) from None
    return TORCH_OP_MAX_ROWS if isa is None else None


def _lean(parts: DecoderParts) -> DecoderBackend:
    return build_lean(parts, "lean", None)


def _lean_int8(parts: DecoderParts) -> DecoderBackend:
    return build_lean(parts, "lean-int8", _int8_factory(torch.float32), _quantized_rows(torch.float32))


def _lean_int4(parts: DecoderParts) -> DecoderBackend:
    return build_lean(parts, "lean-int4", _int4_factory(parts, torch.float32), _quantized_rows(torch.float32))


def _lean_int8_bf16(parts: DecoderParts) -> DecoderBackend:
    return build_lean(parts, "lean-int8-bf16", _int8_factory(torch.bfloat16), _quantized_rows(torch.bfloat16))


def _lean_int4_bf16(parts: DecoderParts) -> DecoderBackend:
    return build_lean(parts, "lean-int4-bf16", _int4_factory(parts, torch.bfloat16), _quantized_rows(torch.bfloat16))


def _q8_prefill_rows() -> int | None:
    """:func:`_quantized_rows` of the -q8a kinds, which need the kernel.

    Raises:
        BackendUnavailableError: no kernel, or ``SLUICE_KERNEL_ISA`` is wrong.
    """
    max_rows = _quantized_rows(torch.float32)
    if max_rows is not None:
        raise BackendUnavailableError("the -q8a kinds need the quantized-product kernel (int8 activations)")
    return max_rows


def _lean_int8_q8a(parts: DecoderParts) -> DecoderBackend:
    return build_lean(parts, "lean-int8-q8a", _int8_factory(torch.float32), _q8_prefill_rows(), is_q8_prefill=True)


def _lean_int4_q8a(parts: DecoderParts) -> DecoderBackend:
    return build_lean(parts, "lean-int4-q8a", _int4_factory(parts, torch.float32), _q8_prefill_rows(), is_q8_prefill=True)


def _on_cpu_only(factory: Callable[[DecoderParts], DecoderBackend]) -> Callable[[DecoderParts], DecoderBackend]:
    """``factory``, refusing a decoder off the CPU before any work: the lean kinds' products and
    attention are C++ CPU kernels, so on a GPU a gate measures eager and compiled only.

    Raises (the factory returned):
        BackendUnavailableError: the decoder's weights are not on the CPU.
    """

    @functools.wraps(factory)
    def build(parts: DecoderParts) -> DecoderBackend:
        device = next(parts.decoder.parameters()).device
        if device.type != "cpu":
            raise BackendUnavailableError(f"the lean kinds run on a CPU only (C++ kernels); this decoder is on {device}")
        return factory(parts)

    return build


DECODER_FACTORIES: dict[str, Callable[[DecoderParts], DecoderBackend]] = {
    kind: _on_cpu_only(factory) for kind, factory in {
        "lean": _lean, "lean-int8": _lean_int8, "lean-int4": _lean_int4,
        "lean-int8-bf16": _lean_int8_bf16, "lean-int4-bf16": _lean_int4_bf16,
        "lean-int8-q8a": _lean_int8_q8a, "lean-int4-q8a": _lean_int4_q8a,
    }.items()
}  # fmt: skip
