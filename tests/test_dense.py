"""casspec's own dense product (dsia/csrc/dense.cpp, the `casspec` kernel), float32 and bfloat16: close to F.linear,
each row the same bits whatever the rows beside it and the call's row count (by construction: every output summed in
input order), the same bits from its AVX-512, AVX2 and plain loops and over a weight's panels packed once, every
argument checked; and an engine running it decodes the target's tokens with every method."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dsia.cxx import build_error
from dsia.kernels import DenseKernels, candidates

pytestmark = pytest.mark.skipif(build_error() is not None, reason=f"the C++ library did not build: {build_error()}")

ops = torch.ops.casspec


def isas() -> list[int]:
    """The instruction-set paths this CPU runs (0 plain, 1 AVX2, 2 AVX-512): every one up to the best."""
    best = 0
    for isa in (1, 2):
        try:
            ops.dense_linear(torch.zeros(1, 16), torch.zeros(1, 16), None, isa)
            best = isa
        except RuntimeError:
            break
    return list(range(best + 1))


def test_it_is_a_candidate_wherever_the_library_builds():
    assert "casspec" in candidates(torch.float32, "cpu") and "casspec" in candidates(torch.bfloat16, "cpu")
    assert "casspec" not in candidates(torch.float16, "cpu")  # (other dtypes go to BLAS)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20), st.integers(1, 200), st.integers(1, 70), st.booleans(), st.integers(0, 2**31 - 1))
def test_each_row_is_the_same_bits_alone_on_every_path_and_close_to_f_linear(T, K, N, biased, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(T, K, generator=g), torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if biased else None
    y = ops.dense_linear(x, w, b, -1)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * K ** 0.5)
    for isa in isas():  # the same lane operations in every loop
        assert torch.equal(ops.dense_linear(x, w, b, isa), y)
    for t in range(T):  # a row alone, and any run of rows: the bits it gets among all of them
        assert torch.equal(ops.dense_linear(x[t:t + 1], w, b, -1)[0], y[t])
    lo = T // 3
    assert torch.equal(ops.dense_linear(x[lo:], w, b, -1), y[lo:])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 20), st.integers(1, 200), st.integers(1, 70), st.booleans(), st.integers(0, 2**31 - 1))
def test_bfloat16_is_the_float32_product_of_its_values_rounded_once(T, K, N, biased, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(T, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if biased else None
    y = ops.dense_linear(x, w, b, -1)
    assert y.dtype == torch.bfloat16
    wide = ops.dense_linear(x.float(), w.float(), None if b is None else b.float(), -1)  # the widened values' sums
    assert torch.equal(y, wide.bfloat16())
    for isa in isas():
        assert torch.equal(ops.dense_linear(x, w, b, isa), y)
    for t in range(T):
        assert torch.equal(ops.dense_linear(x[t:t + 1], w, b, -1)[0], y[t])


def test_large_products_split_between_threads_keep_their_bits():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 576, generator=g), torch.randn(4099, 576, generator=g)  # (a ragged last task)
    y = ops.dense_linear(x, w, None, -1)
    for rows in (1, 2, 3, 5, 8):
        assert torch.equal(ops.dense_linear(x[:rows], w, None, -1), y[:rows])
    assert torch.equal(ops.dense_linear(x[7:8], w[1000:3000], None, -1)[0], y[7, 1000:3000])


def test_its_arguments_are_checked():
    x, w, b = torch.randn(2, 32), torch.randn(8, 32), torch.randn(8)
    for args, needle in [((x, w[:, :16], b), r"w \[N, 32\]"),
                         ((x, w, b[:4]), "bias of 8"), ((x, w, b.double()), "Float expected"),
                         ((x.bfloat16(), w, b), "BFloat16 expected"), ((x.double(), w, b), "float32 or bfloat16 x"),
                         ((x.bfloat16(), w.bfloat16(), b), "BFloat16 expected"), ((x[None], w, b), "2 dims expected"),
                         ((x, torch.empty(8, 32, device="meta"), b), "CPU tensor expected")]:
        with pytest.raises(RuntimeError, match=needle):
            ops.dense_linear(*args, -1)
    with pytest.raises(RuntimeError, match="isa 9"):
        ops.dense_linear(x, w, b, 9)
    panels = ops.dense_pack(w)  # [1, 32, 64]
    for args, needle in [((x, panels, 65, None), r"panels \[2, 32, 64\] contiguous expected"),
                         ((x, panels[:, :16], 8, b), r"panels \[1, 32, 64\]"),
                         ((x, panels.transpose(1, 2).contiguous().transpose(1, 2), 8, b), "contiguous"),
                         ((x, panels, -1, b), "panels"), ((x, panels.double(), 8, b), "Float expected"),
                         ((x, panels[0], 8, b), "3 dims expected")]:
        with pytest.raises(RuntimeError, match=needle):
            ops.dense_panels(*args, -1)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 20), st.integers(1, 100), st.integers(1, 200), st.booleans(), st.integers(0, 2**31 - 1))
def test_the_product_over_a_weights_panels_is_the_product_of_the_weight(T, K, N, bf16, seed):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    x, w = torch.randn(T, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)
    panels = ops.dense_pack(w)  # outputs in groups of 64 as [K][64], zeros past N
    assert panels.shape == ((N + 63) // 64, K, 64) and panels.dtype == dtype
    assert torch.equal(panels.permute(0, 2, 1).reshape(-1, K)[:N], w)
    assert not panels.permute(0, 2, 1).reshape(-1, K)[N:].any()
    assert torch.equal(ops.dense_pack(w.t().contiguous().t()), panels)  # (a weight of any strides)
    for isa in isas():
        assert torch.equal(ops.dense_panels(x, panels, N, None, isa), ops.dense_linear(x, w, None, -1))


def test_a_weight_changed_in_place_is_packed_again():
    from dsia.kernels import casspec_panels
    w = torch.randn(70, 32)
    first = casspec_panels(w)
    assert casspec_panels(w) is first  # (packed once)
    w.mul_(2)
    assert torch.equal(casspec_panels(w), ops.dense_pack(w))
    x = torch.randn(3, 32)
    assert torch.equal(DenseKernels.forced("casspec")(x, w), ops.dense_linear(x, w, None, -1))


def test_the_engine_with_it_decodes_the_targets_tokens():
    from casspec.runtime.request import Request
    from tiny import tiny_engine

    ref = tiny_engine("llama", kernels="blas").generate_ids([5, 17, 9],
                                                            Request(method="ar", max_new_tokens=12)).token_ids
    for method in ("ar", "sd", "dytc"):
        engine = tiny_engine("llama", kernels="casspec")
        assert engine.generate_ids([5, 17, 9], Request(max_new_tokens=12, method=method)).token_ids == ref
    assert DenseKernels.forced("casspec").describe() == "casspec (T 1+)"
