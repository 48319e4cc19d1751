"""models.quant_kernels: the C++ weight-only int4 / int8 products on every ISA path this CPU has
(both AVX-512 and AVX2 on an AVX-512 machine) against a float64 product of the dequantized
weights, on odd row counts and in_features that are multiples of 32 but not of 64."""

from __future__ import annotations

import pytest
import torch

from models import quant_kernels as qk

# (out_features, in_features, rows): odd rows around the kernel's row chunks and channel blocks.
SHAPES = [(7, 96, 1), (33, 160, 3), (64, 576, 5), (129, 64, 9), (70, 32, 2)]


@pytest.fixture(scope="module")
def isas() -> list[qk.Isa]:
    if qk.kernel() is None:
        pytest.skip(f"C++ kernel unavailable: {qk.kernel_unavailable_reason()}")
    supported = qk.supported_isas()
    if not supported:
        pytest.skip("the CPU has no AVX2")
    return supported


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double().t()).float()


def test_int4_matches_the_dequantized_product_on_every_isa(isas: list[qk.Isa]) -> None:
    generator = torch.Generator().manual_seed(0)
    for n, k, rows in SHAPES:
        q = torch.randint(0, 16, (n, k), generator=generator)
        d = torch.rand(n, k // 32, generator=generator) * 0.02
        m = -torch.rand(n, k // 32, generator=generator) * 0.1
        weight = d.repeat_interleave(32, dim=1) * q + m.repeat_interleave(32, dim=1)
        x = torch.randn(rows, k, generator=generator)
        for isa in isas:
            got = qk.int4_linear(x, qk.pack_int4(q), d, m, isa)
            torch.testing.assert_close(got, reference(x, weight), atol=1e-5, rtol=1e-5, msg=f"{isa.name} {n}x{k} rows={rows}")


def test_int8_matches_the_dequantized_product_per_group_and_per_channel(isas: list[qk.Isa]) -> None:
    generator = torch.Generator().manual_seed(1)
    for n, k, rows in SHAPES:
        q = torch.randint(-128, 128, (n, k), generator=generator).to(torch.int8)
        x = torch.randn(rows, k, generator=generator)
        for group in (32, k):
            scales = torch.rand(n, k // group, generator=generator) * 0.01
            weight = scales.repeat_interleave(group, dim=1) * q
            for isa in isas:
                got = qk.int8_linear(x, q, scales, isa)
                torch.testing.assert_close(got, reference(x, weight), atol=1e-5, rtol=1e-5, msg=f"{isa.name} group {group}")


def test_bad_shapes_and_dtypes_are_refused(isas: list[qk.Isa]) -> None:
    q = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="in_features=64"):
        qk.int8_linear(torch.zeros(1, 32), q, torch.ones(4, 1), isas[0])
    with pytest.raises(TypeError, match="float32"):
        qk.int8_linear(torch.zeros(1, 64, dtype=torch.float64), q, torch.ones(4, 1), isas[0])
    with pytest.raises(ValueError, match="power-of-two multiple of 32"):
        qk.int8_linear(torch.zeros(1, 96), torch.zeros(4, 96, dtype=torch.int8), torch.ones(4, 32), isas[0])
    with pytest.raises(ValueError, match="divisible by 32"):
        qk.pack_int4(torch.zeros(4, 48))


def test_the_isa_switch_forces_a_path_and_names_itself_when_wrong(isas: list[qk.Isa]) -> None:
    assert qk.chosen_isa({}) == isas[-1]
    assert qk.chosen_isa({qk.ISA_ENV: "avx2"}) == qk.Isa.AVX2
    with pytest.raises(ValueError, match=qk.ISA_ENV):
        qk.chosen_isa({qk.ISA_ENV: "sse9"})


def test_rms_norm_and_the_residual_add_before_it_match_torch(isas: list[qk.Isa]) -> None:
    generator = torch.Generator().manual_seed(2)
    for rows, hidden in ((1, 576), (37, 100)):
        x, delta = torch.randn(rows, hidden, generator=generator), torch.randn(rows, hidden, generator=generator)
        weight = torch.randn(hidden, generator=generator)
        want = torch.nn.functional.rms_norm(x, (hidden,), weight, 1e-5)
        torch.testing.assert_close(qk.rms_norm(x, weight, 1e-5), want)
        residual = x.clone()
        got = qk.add_rms_norm_(residual, delta, weight, 1e-5)
        torch.testing.assert_close(residual, x + delta)
        torch.testing.assert_close(got, torch.nn.functional.rms_norm(x + delta, (hidden,), weight, 1e-5))


# (out_features, in_features, rows) of the int8-activation GEMM: rows around its 4-row tiles,
# SmolLM2's K (576, 1536) and one with an odd group count (96), N not a multiple of the
# 32-channel block or of the 4-channel tile.
Q8_SHAPES = [(n, k, rows) for rows in (1, 3, 17, 64) for n, k in ((45, 576), (70, 1536))] + [(100, 96, 5), (33, 96, 64)]


def quantize_rows_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` as the kernel quantizes it (llama.cpp's Q8_1, same float32 operations):
    ``q`` ``[M, K]`` int64 in ``[-127, 127]`` and ``d`` ``[M, K // 32]`` float32."""
    groups = x.reshape(x.shape[0], -1, 32)
    d = groups.abs().amax(dim=-1) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(groups * inverse[..., None]).to(torch.int64)
    return q.reshape(x.shape), d


def q8_reference(x: torch.Tensor, qw: torch.Tensor, dw: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """sum over groups of dw * dx * (integer dot, int64) + m * dx * sum(qx), in float64."""
    qx, dx = quantize_rows_q8(x)
    rows, k = qx.shape
    dots = torch.einsum("rgj,cgj->rcg", qx.reshape(rows, k // 32, 32), qw.to(torch.int64).reshape(-1, k // 32, 32))
    out = (dots.double() * dx.double()[:, None, :] * dw.double()[None, :, :]).sum(-1)
    if m is not None:
        sums = (dx.double() * qx.reshape(rows, k // 32, 32).sum(-1).float().double())
        out += sums @ m.double().t()
    return out.float()


def test_int4_q8_gemm_matches_the_integer_reference_on_every_path(isas: list[qk.Isa]) -> None:
    generator = torch.Generator().manual_seed(3)
    for n, k, rows in Q8_SHAPES:
        q = torch.randint(0, 16, (n, k), generator=generator)
        d = torch.rand(n, k // 32, generator=generator) * 0.02
        m = -torch.rand(n, k // 32, generator=generator) * 0.1
        x = torch.randn(rows, k, generator=generator)
        x[0, :32] = 0  # an all-zero group: d = 0
        want = q8_reference(x, q, d, m)
        for isa, vnni in qk.q8_paths():
            got = qk.int4_linear_q8(x, qk.pack_int4(q), d, m, isa, vnni)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{isa.name} vnni={vnni} {n}x{k} rows={rows}")


def test_int8_q8_gemm_matches_the_integer_reference_per_group_and_per_channel(isas: list[qk.Isa]) -> None:
    generator = torch.Generator().manual_seed(4)
    for n, k, rows in Q8_SHAPES:
        q = torch.randint(-128, 128, (n, k), generator=generator).to(torch.int8)
        x = torch.randn(rows, k, generator=generator)
        for group in (32, k):
            scales = torch.rand(n, k // group, generator=generator) * 0.01
            want = q8_reference(x, q, scales.repeat_interleave(group // 32, dim=1), None)
            for isa, vnni in qk.q8_paths():
                got = qk.int8_linear_q8(x, q, scales, isa, vnni)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{isa.name} vnni={vnni} group {group}")


def test_the_q8_gemm_stays_close_to_the_float_product(isas: list[qk.Isa]) -> None:
    generator = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (64, 576), generator=generator)
    d, m = torch.rand(64, 18, generator=generator) * 0.02, -torch.rand(64, 18, generator=generator) * 0.1
    weight = d.repeat_interleave(32, dim=1) * q + m.repeat_interleave(32, dim=1)
    x = torch.randn(16, 576, generator=generator)
    want = reference(x, weight)
    for isa, vnni in qk.q8_paths():
        got = qk.int4_linear_q8(x, qk.pack_int4(q), d, m, isa, vnni)
        assert float((got - want).norm() / want.norm()) < 0.01, f"{isa.name} vnni={vnni}"


def test_the_q8_gemm_refuses_bad_inputs(isas: list[qk.Isa]) -> None:
    q4, d = torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2)
    with pytest.raises(TypeError, match="float32"):
        qk.int4_linear_q8(torch.zeros(2, 64, dtype=torch.float64), q4, d, d, isas[0])
    with pytest.raises(ValueError, match="in_features=64"):
        qk.int4_linear_q8(torch.zeros(2, 32), q4, d, d, isas[0])
    with pytest.raises(TypeError, match="q4 must be uint8"):
        qk.int4_linear_q8(torch.zeros(2, 64), q4.to(torch.int8), d, d, isas[0])
    with pytest.raises(ValueError, match=r"d and m must be \[N=4"):
        qk.int4_linear_q8(torch.zeros(2, 64), q4, torch.ones(4, 3), torch.ones(4, 3), isas[0])
    with pytest.raises(TypeError, match="q8 must be int8"):
        qk.int8_linear_q8(torch.zeros(2, 64), q4, d, isas[0])
    with pytest.raises(ValueError, match="vnni needs"):
        qk.int8_linear_q8(torch.zeros(2, 64), torch.zeros(4, 64, dtype=torch.int8), d, qk.Isa.AVX2, True)
    assert qk.int4_linear_q8(torch.zeros(0, 64), q4, d, d, isas[0]).shape == (0, 4)
