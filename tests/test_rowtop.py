"""casspec's row top-k and log-sum-exp (dsia/csrc/rowtop.cpp, dsia/topk.py): torch.topk's values, the lower index
first among equal ones, the row's log-sum-exp, NaN ranked below every number, bad arguments one clear error; the
greedy token built on it is torch.argmax's on either path; and the draft probabilities built on it are the ones
ATen's softmax and top-k give."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsia.cxx import build_error
from dsia.topk import argmax_rows, top_k, top_k_logsumexp

pytestmark = pytest.mark.skipif(build_error() is not None, reason=f"the C++ ops did not build: {build_error()}")


@settings(max_examples=60, deadline=None)
@given(T=st.integers(1, 5), V=st.integers(1, 700), k=st.integers(1, 70), scale=st.floats(0.05, 4.0),
       ties=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_row_top_is_torch_topk_and_logsumexp(T, V, k, scale, ties, seed):
    k = min(k, V)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, V, generator=gen) * 6
    if ties:  # few distinct values: equal ones come lower index first
        x = x.round()
    values, indices, lse = torch.ops.casspec.row_top_lse(x, k, scale)
    ref = torch.sort(x, dim=-1, descending=True, stable=True)  # (stable: equal values keep index order)
    assert torch.equal(values, ref.values[:, :k])
    assert torch.equal(indices, ref.indices[:, :k])
    assert torch.allclose(lse, (x * scale).logsumexp(-1), rtol=1e-5, atol=1e-5)
    v2, i2 = torch.ops.casspec.row_top(x, k)
    assert torch.equal(v2, values) and torch.equal(i2, indices)
    for r in range(T):  # a row alone: the same bits
        alone = torch.ops.casspec.row_top_lse(x[r:r + 1].clone(), k, scale)
        assert torch.equal(alone[0][0], values[r]) and torch.equal(alone[2][0], lse[r])


def test_nan_ranks_below_every_number_and_infinities_give_theirs():
    """NaN is read as -inf by the top k; in the log-sum-exp a NaN entry gives NaN (as torch's)."""
    x = torch.tensor([[1.0, float("nan"), 3.0, -2.0],
                      [float("-inf"), float("-inf"), float("-inf"), float("-inf")],
                      [0.0, float("inf"), 1.0, 2.0]])
    values, indices, lse = torch.ops.casspec.row_top_lse(x, 3, 1.0)
    assert indices[0].tolist() == [2, 0, 3] and values[0].tolist() == [3.0, 1.0, -2.0]
    assert torch.isnan(lse[0])
    assert indices[1].tolist() == [0, 1, 2] and lse[1] == float("-inf")
    assert indices[2, 0] == 1 and lse[2] == float("inf")
    only_nan = torch.full((1, 40), float("nan"))
    assert set(torch.ops.casspec.row_top(only_nan, 5)[1][0].tolist()) <= set(range(40))  # (indices in the row)
    big = torch.full((2, 300), -1e4)  # every e^x below float's range but the maximum's: lse is the maximum
    big[:, 123] = 5.0
    assert torch.equal(torch.ops.casspec.row_top_lse(big, 1, 1.0)[2], torch.tensor([5.0, 5.0]))


@pytest.mark.parametrize("x, k, scale, message", [
    (torch.zeros(2, 5, dtype=torch.float64), 2, 1.0, "Float expected"),
    (torch.zeros(5), 2, 1.0, "2 dims expected"),
    (torch.zeros(2, 5), 0, 1.0, "k must lie in 1..5"),
    (torch.zeros(2, 5), 6, 1.0, "k must lie in 1..5"),
    (torch.zeros(2, 5), 2, 0.0, "a finite scale > 0"),
    (torch.zeros(2, 5), 2, float("inf"), "a finite scale > 0"),
])
def test_bad_arguments_are_one_clear_error(x, k, scale, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.casspec.row_top_lse(x, k, scale)


def test_a_strided_view_is_read_as_its_values():
    x = torch.randn(6, 400)
    view = x[::2, 100:]  # rows of stride 800, not contiguous
    values, indices = top_k(view, 5)
    ref = view.topk(5, dim=-1)
    assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices)


def test_the_draft_probabilities_are_the_softmax_at_the_top_tokens():
    """DraftContext.draft_top's greedy path: e^(values - lse) is softmax(x) at the top k."""
    x = torch.randn(4, 49152) * 4
    values, indices, lse = top_k_logsumexp(x, 4)
    probs = (values - lse[:, None]).exp()
    ref = torch.softmax(x, -1).topk(4, dim=-1)
    assert torch.equal(indices, ref.indices)
    assert torch.allclose(probs, ref.values, rtol=1e-5, atol=1e-7)


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 6), V=st.integers(1, 3000), ties=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_the_greedy_token_is_torch_argmax_on_either_path(T, V, ties, seed):
    """argmax_rows (the target's greedy token: casspec's op on rows of unit stride, ATen's argmax else): the index
    torch.argmax gives, the lowest of equal largest entries; a NaN read as -inf on both paths."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, V, generator=gen) * 6
    if ties:
        x = x.round()
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    strided = x.t().contiguous().t()  # (the same values, rows of stride T: ATen's path)
    assert torch.equal(argmax_rows(strided), x.argmax(-1))
    x[0, 0] = float("nan")
    expect = torch.nan_to_num(x, nan=float("-inf")).argmax(-1)
    assert torch.equal(argmax_rows(x), expect) and torch.equal(argmax_rows(x.t().contiguous().t()), expect)
