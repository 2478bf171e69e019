"""casspec's C++ ops for a float32 or bfloat16 forward's small steps (dsia/csrc/ops.cpp, `cxx_pointwise`): the same
math as the eager steps (RoPE bit for bit; bfloat16 rounded where the eager ops round), an attention whose every row
is the same bits whatever the rows beside it and wherever its keys lie in the cache, and the choice of attention per
forward (`Transformer._attention_of`)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dsia.cxx import build_error
from dsia.fastloop import cxx_pointwise
from dsia.pointwise import EAGER, rope
from dsia.plan import TARGET
from tiny import tiny_engine

pytestmark = pytest.mark.skipif(build_error() is not None, reason=f"the C++ ops did not build: {build_error()}")


def sdpa_rows(q, keys, values, end, mask):
    """The reference: SDPA over slots [0, end) (mask None: causal by slot), as [T, H*hd]."""
    H, T, hd = q.shape
    if mask is None:
        mask = torch.ones(T, end, dtype=torch.bool).tril(end - T)
    o = F.scaled_dot_product_attention(q[None], keys[None, :, :end], values[None, :, :end], attn_mask=mask,
                                       enable_gqa=H != keys.shape[0])[0]
    return o.transpose(0, 1).reshape(T, H * hd)


@pytest.mark.parametrize("D", [8, 24, 64, 576, 100])
def test_rms_norm_and_the_residual_add_are_the_eager_math(D):
    torch.manual_seed(D)
    x, delta, w = torch.randn(5, D), torch.randn(5, D), torch.randn(D)
    ops = cxx_pointwise()
    assert torch.allclose(ops.rms_norm(x, w, 1e-5), EAGER.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    total, normed = ops.add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(total, x + delta)
    assert torch.allclose(normed, EAGER.rms_norm(x + delta, w, 1e-6), rtol=1e-5, atol=1e-6)
    assert torch.equal(ops.rms_norm(x[2:3], w, 1e-5)[0], ops.rms_norm(x, w, 1e-5)[2])  # a row alone: the same bits


@pytest.mark.parametrize("D", [8, 24, 64, 576, 100])
def test_bfloat16_norms_round_where_the_eager_ops_round(D):
    """A bfloat16 op computes in float32 and rounds each result where the eager bfloat16 ops round it: the residual
    add exactly theirs, the norm (the normalized row rounded, then scaled and rounded) within one bfloat16 step of
    theirs (only its mean of squares is summed in another order), a row alone the same bits."""
    torch.manual_seed(D)
    x, delta, w = (torch.randn(5, D).bfloat16(), torch.randn(5, D).bfloat16(), torch.randn(D).bfloat16())
    ops = cxx_pointwise()
    total, normed = ops.add_rms_norm(x, delta, w, 1e-6)
    assert total.dtype == normed.dtype == torch.bfloat16
    assert torch.equal(total, x + delta)
    ref = EAGER.rms_norm(x + delta, w, 1e-6)
    step = (ref.float().abs() * 2 ** -7).clamp_min(1e-30)  # a bfloat16 step at each value, and one more at ties
    assert ((normed.float() - ref.float()).abs() <= 2 * step).all()
    assert (normed == ref).float().mean() > 0.95
    assert torch.equal(ops.rms_norm(x[2:3], w, 1e-5)[0], ops.rms_norm(x, w, 1e-5)[2])
    # the same bits as the float32 op's steps on the widened values, rounded where bfloat16 rounds
    xf = (x + delta).float()
    r = 1 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(normed.float(), (w.float() * (xf * r).bfloat16().float()).bfloat16().float(),
                          rtol=2 ** -7, atol=0)


def test_bfloat16_silu_mul_rounds_silu_then_the_product():
    torch.manual_seed(1)
    gate, up = torch.randn(3, 1000).bfloat16() * 4, torch.randn(3, 1000).bfloat16()
    out = cxx_pointwise().silu_mul(gate, up)
    assert out.dtype == torch.bfloat16
    ref = F.silu(gate) * up  # (eager: silu rounded to bfloat16, then the product)
    assert (out == ref).float().mean() > 0.99  # (silu's exp differs from torch's in the last float32 bits)
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-30).all()
    assert torch.equal(cxx_pointwise().silu_mul(gate[1:2], up[1:2])[0], out[1])


def test_rope_is_the_eager_bits_and_other_dtypes_run_eagerly():
    torch.manual_seed(0)
    qk = torch.randn(7, 6, 64).transpose(0, 1)  # [heads, T, hd], strided as the q|k product's reshape leaves it
    cos, sin = torch.randn(7, 64), torch.randn(7, 64)
    assert torch.equal(cxx_pointwise().rope(qk, cos, sin), rope(qk, cos, sin))
    half = qk.to(torch.bfloat16)
    assert torch.equal(cxx_pointwise().rope(half, cos.bfloat16(), sin.bfloat16()),
                       rope(half, cos.bfloat16(), sin.bfloat16()))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(4, 4, 8), (4, 2, 16), (9, 3, 64), (14, 2, 64), (4, 1, 24), (8, 2, 128)]),
       st.integers(1, 20), st.integers(0, 70), st.booleans(), st.integers(0, 2**31 - 1))
def test_attention_is_sdpas_and_each_row_is_the_same_bits_alone(heads, T, prefix, masked, seed):
    """Every row of a forward gets the bits it gets alone (the batch invariance a native target's tree verification
    needs); masked keys are skipped, not summed as zeros."""
    H, Hkv, hd = heads
    gen = torch.Generator().manual_seed(seed)
    end = prefix + T
    q = torch.randn(T, H, hd, generator=gen).transpose(0, 1)  # [H, T, hd]
    keys, values = torch.randn(Hkv, end + 5, hd, generator=gen), torch.randn(Hkv, end + 5, hd, generator=gen)
    mask = None
    if masked:  # a tree's: the prefix, then some of the scratch rows (itself always)
        mask = torch.cat((torch.ones(T, prefix, dtype=torch.bool),
                          (torch.rand(T, T, generator=gen) < 0.5).tril() | torch.eye(T, dtype=torch.bool)), 1)
    out = cxx_pointwise().attention(q, keys, values, end, mask, hd ** -0.5)  # [T, H*hd]
    torch.testing.assert_close(out, sdpa_rows(q, keys, values, end, mask), rtol=1e-5, atol=2e-6)
    for t in range(T):
        if mask is None:  # row t alone, at its own slot: the slots before it
            alone = cxx_pointwise().attention(q[:, t:t + 1], keys, values, prefix + t + 1, None, hd ** -0.5)
        else:
            alone = cxx_pointwise().attention(q[:, t:t + 1], keys, values, end, mask[t:t + 1], hd ** -0.5)
        assert torch.equal(alone[0], out[t])
    if mask is None:  # causal by slot is the chain's mask spelt out (forwards over a chain pass none)
        chain = torch.ones(T, end, dtype=torch.bool).tril(diagonal=prefix)
        assert torch.equal(cxx_pointwise().attention(q, keys, values, end, chain, hd ** -0.5), out)


def test_a_tree_rows_keys_moved_to_the_committed_slots_give_the_same_bits():
    """A tree's row whose ancestors sit at scattered scratch slots, and the one-token step after its path is
    committed to consecutive slots: the same keys in the same order, the same output."""
    torch.manual_seed(1)
    H, Hkv, hd, prefix = 9, 3, 64, 37
    keys, values = torch.randn(Hkv, 80, hd), torch.randn(Hkv, 80, hd)
    q = torch.randn(H, 1, hd)
    path = [prefix + 1, prefix + 4, prefix + 6]  # the row's ancestors and itself, in the scratch slots
    end = prefix + 7
    mask = torch.zeros(1, end, dtype=torch.bool)
    mask[0, :prefix] = True
    mask[0, path] = True
    tree_row = cxx_pointwise().attention(q, keys, values, end, mask, hd ** -0.5)
    committed_k, committed_v = keys.clone(), values.clone()
    committed_k[:, prefix:prefix + 3], committed_v[:, prefix:prefix + 3] = keys[:, path], values[:, path]
    step = cxx_pointwise().attention(q, committed_k, committed_v, prefix + 3, None, hd ** -0.5)
    assert torch.equal(tree_row, step)


def test_each_forward_picks_its_attention():
    """Its own wherever the ops run, over every forward (a step, a tree, a prompt); without the ops: SDPA, and block
    by block for a batch-invariant target."""
    eng = tiny_engine("llama", seed=0)
    m = eng.model
    assert m.pointwise.attention is not None  # (the engine runs the C++ loop and its ops)
    assert m._attention_of(TARGET) == "own"
    inv = copy.copy(m)  # (the mode takes float32 for a native target only: its flag alone, here)
    inv.batch_invariant = True
    assert inv._attention_of(TARGET) == "own"
    eager = m.with_pointwise(EAGER)
    assert eager._attention_of(TARGET) == "sdpa"
    eager.batch_invariant = True
    assert eager._attention_of(TARGET) == "rows"
    bf = tiny_engine("llama", seed=0, dtype=torch.bfloat16).model
    assert bf._attention_of(TARGET) == "own"  # (it takes bfloat16 too)


def test_a_forward_with_the_ops_is_the_eager_forwards_math():
    """The whole model with casspec's ops against the eager steps: the same logits to float32's last bits."""
    eng = tiny_engine("llama", seed=4)
    own, eager = eng.model.with_stacks(None), eng.model.with_stacks(None).with_pointwise(EAGER)
    outs = []
    for model in (own, eager):
        cache = model.new_cache(64)
        prompt = [5, 9, 17, 23, 4, 8, 31]
        first = model.forward(cache, torch.tensor(prompt), torch.arange(7), 0)
        cache.commit(list(range(7)))
        step = model.forward(cache, torch.tensor([12]), torch.tensor([7]), 7)
        outs.append((first, step))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_silu_mul_is_silu_times_up_to_float32s_last_bits():
    """The MLP's silu(gate) * up (both loops' on a CPU): F.silu(gate) * up within a few float32 ulps, over gate and up
    as the halves of one gate|up product (strided rows), at the extremes (no overflow: e^-|g|), with a row's tail."""
    gen = torch.Generator().manual_seed(5)
    gu = torch.randn(4, 2 * 45, generator=gen) * 6
    gu[0, :9] = torch.tensor([-100.0, -88.0, -20.0, 0.0, 1e-30, 20.0, 88.0, 100.0, -1e-3])
    gate, up = gu.chunk(2, dim=-1)  # [4, 45] each, rows 90 floats apart
    got = torch.ops.casspec.silu_mul(gate, up)
    want = (F.silu(gate.double()) * up.double()).float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=4e-7 * 8, atol=1e-30)
