"""casspec's block-quantized product (dsia/blockq.py, csrc/blockq.cpp): the stored codes times activations quantized
per row and block to 8 bits, exactly as that arithmetic says (float64 reference); every instruction set this CPU has
gives the same bits; a row's result is the same bits whatever the rows beside it."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsia.blockq import BlockLinear
from dsia.cxx import build_error

pytestmark = pytest.mark.skipif(build_error() is not None, reason=f"the C++ ops did not build: {build_error()}")


def reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """y = sum over blocks of d dx (q . xq) + m dx sum(xq), xq = x / dx rounded (half to even), dx = max|x| / 127,
    in float64."""
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32)
    dx = xb.abs().amax(-1) / 127  # [T, nb] float32, as the kernel computes it
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    xq = torch.round(xb * inv[..., None]).double()  # [T, nb, 32]
    isum = torch.einsum("tbj,obj->tob", xq, q.double().reshape(q.shape[0], -1, 32))  # [T, N, nb]
    y = (isum * dx.double()[:, None] * d.double()[None]).sum(-1)
    if m is not None:
        y = y + (m.double()[None] * (dx.double() * xq.sum(-1))[:, None]).sum(-1)
    return y


def isas() -> list[int]:
    """The instruction sets this CPU runs (0 plain, 1 AVX2, 2 AVX-512 VNNI)."""
    x, k = torch.randn(1, 32), BlockLinear(torch.zeros(1, 32, dtype=torch.int32), torch.ones(1, 1), None, 4)
    out = []
    for isa in (0, 1, 2):
        try:
            torch.ops.casspec.block_linear(x, k.codes, k.scales, k.out_features, isa)
            out.append(isa)
        except RuntimeError:
            pass
    return out


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["Q4_0", "Q4_1", "Q8_0"]), st.integers(1, 9), st.integers(1, 40), st.integers(1, 18),
       st.integers(0, 2**31 - 1))
def test_the_product_is_its_arithmetic_on_every_instruction_set_and_row_by_row(kind, blocks, N, T, seed):
    g = torch.Generator().manual_seed(seed)
    K = 32 * blocks  # (odd block counts too: the kernel pairs blocks)
    lo, hi = (-128, 128) if kind == "Q8_0" else (0, 16)
    q = torch.randint(lo, hi, (N, K), generator=g)
    d = (torch.rand(N, blocks, generator=g) * 0.02).half().float()  # (float16 scales, as GGUF stores them)
    m = {"Q4_0": -8 * d, "Q4_1": (-torch.rand(N, blocks, generator=g) * 0.1).half().float(), "Q8_0": None}[kind]
    k = BlockLinear(q, d, m, 8 if kind == "Q8_0" else 4)
    x = torch.randn(T, K, generator=g) * 3
    x[0, :32] = 0  # (an all-zero block: dx = 0)
    y = k(x)
    ref = reference(x, q, d, m)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for isa in isas():
        assert torch.equal(torch.ops.casspec.block_linear(x, k.codes, k.scales, k.out_features, isa), y)
    for t in range(T):
        assert torch.equal(k(x[t:t + 1])[0], y[t])


def test_it_reads_the_stored_bytes_and_keeps_other_dtypes():
    q = torch.randint(0, 16, (64, 576))
    k = BlockLinear(q, torch.rand(64, 18).half().float(), torch.rand(64, 18).half().float(), 4)
    assert k.codes.dtype == torch.uint8 and k.codes.numel() == 64 * 576 // 2  # two weights a byte, as stored
    assert k.scales.dtype == torch.float16 and k.nbytes == 64 * 576 // 2 + 2 * 64 * 18 * 2  # (float16 d and m)
    assert BlockLinear(q - 8, torch.rand(64, 18).half().float(), None, 8).codes.numel() == 64 * 576  # a byte each
    with pytest.raises(AssertionError):  # scales that are not float16 values
        BlockLinear(q, torch.full((64, 18), 0.1), None, 4)
    x = torch.randn(3, 576)
    assert k(x.bfloat16()).dtype == torch.bfloat16 and torch.equal(k(x.bfloat16()), k(x.bfloat16().float()).bfloat16())
