"""casspec's block-quantized product (dsia/blockq.py, csrc/blockq.cpp) in every GGUF block format: the stored codes
times activations quantized per row and block to 8 bits, exactly as that arithmetic says (float64 reference); every
instruction set this CPU has gives the same bits; a row's result is the same bits whatever the rows beside it."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsia.blockq import FORMATS, BlockFormat, BlockLinear
from dsia.cxx import build_error

pytestmark = pytest.mark.skipif(build_error() is not None, reason=f"the C++ ops did not build: {build_error()}")


def random_blocks(fmt: BlockFormat, N: int, K: int, g: torch.Generator) -> dict:
    """Random codes, multipliers, mins and float16 scales of the format for an [N, K] weight."""
    subs, supers = K // fmt.subblock, K // (32 * fmt.super)
    half = lambda *shape: ((torch.rand(*shape, generator=g) - 0.3) * 0.02).half().float()  # noqa: E731
    return {"u": torch.randint(0, 1 << fmt.bits, (N, K), generator=g), "D": half(N, supers),
            "Dm": half(N, supers) if fmt.mins else None,
            "a": torch.randint(-128, 128, (N, subs), generator=g) if fmt.scaled else None,
            "b": torch.randint(-128, 128, (N, subs), generator=g) if fmt.mins == 2 else None}


def reference(x: torch.Tensor, fmt: BlockFormat, u, D, Dm, a, b, magnitude: bool = False) -> torch.Tensor:
    """sum over blocks and sub-blocks of D dx a (u . xq + offset sum(xq)) + Dm dx b sum(xq), xq = x / dx rounded
    (half to even), dx = max|x| / 127 per block of 32, in float64 (magnitude: the sum of the terms' magnitudes, what
    float32's rounding is relative to)."""
    T, K = x.shape
    N, sub = u.shape[0], fmt.subblock
    xb = x.reshape(T, K // 32, 32)
    dx = xb.abs().amax(-1) / 127  # [T, nb] float32, as the kernel computes it
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    xq = torch.round(xb * inv[..., None]).double().reshape(T, K // sub, sub)  # [T, subs, sub]
    dot = torch.einsum("tsj,osj->tos", xq, u.double().reshape(N, K // sub, sub))  # [T, N, subs]
    xs = xq.sum(-1)[:, None]  # [T, 1, subs]
    per_super = 32 * fmt.super // sub
    scale = (dx.double().repeat_interleave(32 // sub, 1)[:, None]  # [T, 1, subs]
             * D.double().repeat_interleave(per_super, 1)[None])  # [T, N, subs]
    f = torch.abs if magnitude else (lambda t: t)
    y = f(scale * (a.double()[None] if a is not None else 1) * (dot + fmt.offset * xs)).sum(-1)
    if fmt.mins:
        mult = b.double()[None] if b is not None else 1
        y = y + f(dx.double().repeat_interleave(32 // sub, 1)[:, None] * Dm.double().repeat_interleave(per_super, 1)
                  * mult * xs).sum(-1)
    return y


def close(y: torch.Tensor, x: torch.Tensor, fmt: BlockFormat, w: dict) -> bool:
    """y within float32's rounding of the reference: a few units of 2^-24 of its terms' magnitudes."""
    err = (y.double() - reference(x, fmt, **w)).abs()
    return bool((err <= 1e-6 * reference(x, fmt, **w, magnitude=True) + 1e-30).all())


def isas() -> list[int]:
    """The instruction sets this CPU runs (0 plain, 1 AVX2, 2 AVX-512 VNNI)."""
    k = BlockLinear(torch.zeros(1, 32, dtype=torch.int32), FORMATS["Q4_0"], torch.ones(1, 1))
    out = []
    for isa in (0, 1, 2):
        try:
            torch.ops.casspec.block_linear(torch.randn(1, 32), k.codes, k.scales, k.out_features, k.format, isa)
            out.append(isa)
        except RuntimeError:
            pass
    return out


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(FORMATS)), st.integers(1, 3), st.integers(1, 40), st.integers(1, 18),
       st.integers(0, 2**31 - 1))
def test_the_product_is_its_arithmetic_on_every_instruction_set_and_row_by_row(kind, supers, N, T, seed):
    fmt, g = FORMATS[kind], torch.Generator().manual_seed(seed)
    K = 32 * fmt.super * (supers if fmt.super > 1 else 3 * supers)  # (odd block counts too)
    w = random_blocks(fmt, N, K, g)
    k = BlockLinear(w["u"], fmt, w["D"], w["Dm"], w["a"], w["b"])
    x = torch.randn(T, K, generator=g) * 3
    x[0, :32] = 0  # (an all-zero block: dx = 0)
    y = k(x)
    assert close(y, x, fmt, w)
    for isa in isas():
        assert torch.equal(torch.ops.casspec.block_linear(x, k.codes, k.scales, k.out_features, k.format, isa), y)
    for t in range(T):
        assert torch.equal(k(x[t:t + 1])[0], y[t])


def test_extreme_codes_and_multipliers_do_not_overflow_or_saturate():
    """The largest codes with the largest activations and multipliers, in every format and path (AVX2's u8 x s8
    pairs saturate over 2^15: 8-bit codes go through the sign trick)."""
    for kind, fmt in FORMATS.items():
        K, N = 256 * 2, 16
        u = torch.full((N, K), (1 << fmt.bits) - 1)
        u[1::2] = 0
        a = torch.full((N, K // fmt.subblock), -128) if fmt.scaled else None
        b = torch.full((N, K // fmt.subblock), 127) if fmt.mins == 2 else None
        D = torch.full((N, K // 32 // fmt.super), 0.5)
        k = BlockLinear(u, fmt, D, D if fmt.mins else None, a, b)
        x = torch.full((3, K), 7.0)
        x[1] = -7.0
        x[2, ::2] = -7.0
        y = k(x)
        assert close(y, x, fmt, {"u": u, "D": D, "Dm": D if fmt.mins else None, "a": a, "b": b}), kind
        for isa in isas():
            assert torch.equal(torch.ops.casspec.block_linear(x, k.codes, k.scales, N, k.format, isa), y), (kind, isa)


def test_it_holds_the_stored_bits_and_keeps_other_dtypes():
    u = torch.randint(0, 16, (64, 576))
    k = BlockLinear(u, FORMATS["Q4_1"], torch.rand(64, 18).half().float(), torch.rand(64, 18).half().float())
    assert k.codes.dtype == torch.uint8 and k.codes.numel() == 64 * 576 // 2  # two weights a byte, as stored
    assert k.scales.dtype == torch.float16 and k.nbytes == 64 * 576 // 2 + 2 * 64 * 18 * 2  # (float16 d and m)
    assert BlockLinear(u, FORMATS["Q8_0"], torch.rand(64, 18).half().float()).codes.numel() == 64 * 576  # a byte each
    q6 = random_blocks(FORMATS["Q6_K"], 64, 512, torch.Generator().manual_seed(0))
    k6 = BlockLinear(q6["u"], FORMATS["Q6_K"], q6["D"], None, q6["a"])
    assert k6.nbytes == 64 * 512 * 6 // 8 + 64 * 32 + 64 * 2 * 2  # 6 bits a weight, an int8 a per 16, float16 D
    with pytest.raises(AssertionError):  # scales that are not float16 values
        BlockLinear(u, FORMATS["Q4_0"], torch.full((64, 18), 0.1))
    with pytest.raises(AssertionError):  # codes wider than the format's bits
        BlockLinear(u + 16, FORMATS["Q4_0"], torch.rand(64, 18).half().float())
    x = torch.randn(3, 576)
    assert k(x.bfloat16()).dtype == torch.bfloat16 and torch.equal(k(x.bfloat16()), k(x.bfloat16().float()).bfloat16())


@pytest.mark.parametrize("bits", [3, 2])
@pytest.mark.parametrize("n_in", [512, 576])  # (whole super-blocks of 256, and not: per-block scales)
def test_lower_bit_requantization_is_its_arithmetic_and_close_to_the_weight(bits, n_in):
    """int3 / int2 levels (q3_blocks, q2_blocks): the kernel multiplies what they hold (float64 reference of their
    own codes, every instruction set), and they hold the weight to within 3-bit / 2-bit round-to-nearest's error."""
    from dsia.blockq import q2_blocks, q3_blocks

    g = torch.Generator().manual_seed(bits)
    w = torch.randn(48, n_in, generator=g) * 0.05  # (whole tiles of 16 outputs: no padding in the bytes)
    k = (q3_blocks if bits == 3 else q2_blocks)(w)
    fmt = BlockFormat.from_code(k.format)
    assert fmt.bits == bits and fmt.super == (8 if n_in % 256 == 0 else 1)
    assert k.nbytes * 8 / w.numel() < bits + 1.6  # (its multipliers, mins and scales beside the codes)
    err = ((k.dequantize() - w).norm() / w.norm()).item()
    assert err < (0.21 if bits == 3 else 0.42)
    x = torch.randn(5, n_in, generator=g)
    y = k(x)
    assert torch.allclose(y, x @ k.dequantize().T, rtol=0.05, atol=0.05 * y.abs().max().item())  # (8-bit activations)
    for isa in isas():
        assert torch.equal(torch.ops.casspec.block_linear(x, k.codes, k.scales, k.out_features, k.format, isa), y)
    assert all(BlockFormat.from_code(f.code) == f for f in FORMATS.values())
