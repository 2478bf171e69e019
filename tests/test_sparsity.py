"""Activation-sparse MLP kernels (dsia.sparsity): exactness of the gathers, calibration, plans, no weight mutation."""
import pytest
import torch
import torch.nn.functional as F

from dsia.errors import CasspecError
from dsia.model import Transformer
from dsia.plan import TARGET, Plan
from dsia.sparsity import (INPUT_RATIO, MlpRecorder, Sparse, SparseMlpWeights, SparsityConfig, calibrate_sparse_mlps,
                           record_prompt)
from tiny import tiny_model

V = 97
CONFIGS = {
    "teal": SparsityConfig(0.5, 0.3, weighted=False),
    "teal-weighted": SparsityConfig(0.6, 0.4),
    "teal-bf16": SparsityConfig(0.5, 0.3, weight_dtype=torch.bfloat16),
    "dense-input": SparsityConfig(0.5),  # input_sparsity 0: every input dim kept, h still sparse
    "level": Sparse(0.5).config,  # what sparse0.5 runs: 20% of the input dropped, bf16 copies, weighted
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: a second thread only adds synchronisation (seconds of it on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer.from_hf(tiny_model("llama", seed=3, layers=3, dim=64))  # D = 64, I = 128


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(3, V, (48,), generator=torch.Generator().manual_seed(0))


def mlp_inputs(model: Transformer, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """The normed MLP input x [T, D] of every layer, over a target forward."""
    xs: dict[int, torch.Tensor] = {}

    def grab(i: int):
        def mlp(x: torch.Tensor) -> torch.Tensor:
            xs[i] = x.clone()
            return model._mlp(i, model.layers[i], x, TARGET)
        return mlp

    n = tokens.shape[0]
    model.forward(model.new_cache(n), tokens, torch.arange(n), 0, plan=Plan(mlps={i: grab(i) for i in range(3)}))
    return xs


def masked_dense(model: Transformer, i: int, x: torch.Tensor, cfg: SparsityConfig, tx, t) -> torch.Tensor:
    """The dense MLP with the entries the kernel drops set to zero (what the gathers must compute), with the
    weights the kernel reads rounded to its copies' dtype."""
    lw = model.layers[i]
    r = (lambda w: w.to(cfg.weight_dtype).float()) if cfg.weight_dtype else (lambda w: w)
    x = torch.where(x.abs() > tx, x, 0.0)
    h = F.silu(F.linear(x, r(lw.w_gate))) * F.linear(x, r(lw.w_up))
    h = torch.where(h.abs() > t, h, 0.0)
    return F.linear(h, r(lw.w_down))


def assert_close(out: torch.Tensor, ref: torch.Tensor, cfg: SparsityConfig) -> None:
    if cfg.weight_dtype is None:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # bf16 activations inside the kernels (and an entry at its threshold may flip)
        assert (out - ref).norm() <= 0.03 * ref.norm()


def weights_of(model: Transformer) -> list[torch.Tensor]:
    return [t for lw in model.layers for t in vars(lw).values() if isinstance(t, torch.Tensor)]


@torch.no_grad()
@pytest.mark.parametrize("weighted", [False, True])
def test_sparsity_zero_equals_dense(model, prompt, weighted):
    cfg = SparsityConfig(0.0, 0.0, weighted=weighted)  # thresholds that keep every entry
    sp = calibrate_sparse_mlps(model, prompt, cfg)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    for i, mlp in sp.mlps.items():
        dense = model._mlp(i, model.layers[i], x, TARGET)
        torch.testing.assert_close(mlp(x), dense, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mlp(x[2:3]), dense[2:3], rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("name", list(CONFIGS))
def test_dropped_fraction_on_calibration_data(model, prompt, name):
    cfg = CONFIGS[name]
    rec = record_prompt(model, prompt, cfg)
    sp = calibrate_sparse_mlps(model, rec, cfg)
    assert rec.tokens == prompt.shape[0]
    for i, (tx, t) in sp.thresholds.items():
        dropped = (torch.cat(rec.h[i]) <= t).float().mean().item()  # |h| of the prompt
        assert abs(dropped - cfg.sparsity) < 0.01, (i, dropped)
        dropped_x = (torch.cat(rec.x[i]) <= tx).float().mean().item()  # |x| of the prompt
        assert abs(dropped_x - cfg.input_sparsity) < 0.01, (i, dropped_x)


@torch.no_grad()
@pytest.mark.parametrize("name", list(CONFIGS))
def test_sparse_mlp_equals_dense_with_the_same_entries_zeroed(model, prompt, name):
    cfg = CONFIGS[name]
    sp = calibrate_sparse_mlps(model, prompt, cfg)
    xs = mlp_inputs(model, torch.randint(3, V, (40,), generator=torch.Generator().manual_seed(2)))
    for i, mlp in sp.mlps.items():
        tx, t = sp.thresholds[i]
        for rows in (slice(7, 8), slice(3, 8), slice(0, 40)):  # one token, a short draft, a long window
            x = xs[i][rows]
            ref = masked_dense(model, i, x, cfg, tx, t)
            out = mlp(x)
            assert out.shape == ref.shape and torch.isfinite(out).all()
            assert_close(out, ref, cfg)
        # each token keeps its own entries: its output does not depend on the other tokens of the forward
        x = xs[i][:6]
        assert_close(torch.cat([mlp(x[j:j + 1]) for j in range(6)]), mlp(x), cfg)


@torch.no_grad()
@pytest.mark.parametrize("name", ["teal", "level"])
def test_plan_runs_in_forward_and_weights_are_untouched(model, prompt, name):
    before = [t.clone() for t in weights_of(model)]
    sp = calibrate_sparse_mlps(model, prompt, CONFIGS[name])
    plan = sp.plan()
    assert not plan.is_target and set(plan.mlps) == {0, 1, 2}
    n = prompt.shape[0]
    cache = model.new_cache(n + 8)
    model.forward(cache, prompt, torch.arange(n), 0)
    cache.length = n
    draft = torch.randint(3, V, (4,), generator=torch.Generator().manual_seed(3))
    logits = model.forward(cache, draft, torch.arange(n, n + 4), n, plan=plan)  # a chain draft in scratch
    target = model.forward(cache, draft, torch.arange(n, n + 4), n)
    assert logits.shape == (4, V) and torch.isfinite(logits).all()
    assert (logits.argmax(-1) == target.argmax(-1)).float().mean() >= 0.5  # a draft, not noise
    for a, b in zip(before, weights_of(model)):
        assert torch.equal(a, b)
    own = {t.data_ptr() for t in weights_of(model)}
    assert not own & {t.data_ptr() for t in sp.weights.down_t.values()}  # the copies are copies


@torch.no_grad()
def test_recorder_prefill_is_the_target_and_calibrates_the_same(model, prompt):
    cfg = SparsityConfig(0.5)
    n = prompt.shape[0]
    rec = MlpRecorder(model, cfg)
    c1, c2 = model.new_cache(n), model.new_cache(n)
    out = model.forward(c1, prompt, torch.arange(n), 0, plan=rec.plan)
    ref = model.forward(c2, prompt, torch.arange(n), 0)
    assert torch.equal(out, ref) and torch.equal(c1.k[:, :, :n], c2.k[:, :, :n])
    a = calibrate_sparse_mlps(model, rec, cfg)
    b = calibrate_sparse_mlps(model, prompt, cfg, weights=a.weights)  # reuses the weight copies
    assert b.weights is a.weights
    for i in a.thresholds:
        torch.testing.assert_close(a.thresholds[i][1], b.thresholds[i][1])


def test_calib_tokens_caps_what_is_recorded(model, prompt):
    rec = record_prompt(model, prompt, SparsityConfig(0.5, calib_tokens=10))
    assert rec.tokens == 10


def test_bad_configs_are_rejected(model, prompt):
    for kw in (dict(sparsity=1.0), dict(sparsity=-0.1), dict(input_sparsity=1.5), dict(calib_tokens=0)):
        with pytest.raises(CasspecError):
            SparsityConfig(**kw)
    with pytest.raises(CasspecError):
        SparseMlpWeights(model, SparsityConfig(layers=(5,)))
    w = SparseMlpWeights(model, SparsityConfig(0.5))
    for other in (SparsityConfig(0.5, 0.3, layers=(1,)), SparsityConfig(0.5, 0.3, weight_dtype=torch.bfloat16)):
        with pytest.raises(CasspecError):  # copies of other layers or another dtype cannot serve it
            calibrate_sparse_mlps(model, prompt, other, weights=w)
    assert calibrate_sparse_mlps(model, prompt, SparsityConfig(0.3, 0.1), weights=w).weights is w  # any sparsity


def test_layer_subset_and_memory(model, prompt):
    sp = calibrate_sparse_mlps(model, prompt, SparsityConfig(0.5, weighted=False, layers=(1,)))
    assert set(sp.mlps) == {1}
    lw = model.layers[1]
    inter, dim = lw.w_gate.shape  # I, D
    assert sp.nbytes == 3 * inter * dim * 4 + (inter + dim) * 4  # w_down^T, [w_gate^T | w_up^T] copies + norms


def test_the_level_strategy_maps_its_sparsity():
    cfg = Sparse(0.5).config
    assert cfg == SparsityConfig(0.5, 0.5 / INPUT_RATIO, weighted=True, weight_dtype=torch.bfloat16)
    assert cfg.input_sparsity == 0.2 and Sparse(0.25).config.input_sparsity == 0.1
    with pytest.raises(CasspecError, match="the sparsity must be in"):
        Sparse(1.0)
