"""Cascades (vc, hc, vc+hc, tree+vc) and the DyTC router: lossless against AR, and the router's parts in isolation."""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from casspec.runtime.engine import Request
from dsia.errors import CasspecError
from dytc.acceptance import LEARNED, AcceptanceConfig, AcceptanceTracker
from dytc.cascade import CascadeConfig
from dytc.latency import TARGET_LEVEL, FeatureSpec, LatencyModel, Point
from dytc.ngram import PromptLookup
from dytc.policies import ChainConfig, ChainPolicy, DraftContext, TreeConfig, TreePolicy
from dytc.router import DyTC, RouterConfig
from dytc.sources import BOTTOMS, MAXGRAM, PLD
from dytc.sampling import SamplingParams
from dytc.verify import Noise
from tiny import ARCHS, KERNELS, tiny_engine

LEVEL_SETS = [("int4",), ("int8", "int4"), ("skip0.3",), ("exit2", "int8"), ("int8+sparse0.5", "vocab"),
              ("int4", "skip0.3")]
HC_SETS = [("int8*2", "int4*2", "pld*3"), ("skip0.3*3", "pld*4"), ("pld*2", "int4*3"), ("exit2*2", "int8*3"),
           ("int8*2", "maxgram*3"), ("maxgram*2", "pld*2", "int4*2")]


@functools.lru_cache(maxsize=None)
def engine(arch: str, seed: int, kernels: str = "blas", fused: bool = False):
    return tiny_engine(arch, seed, kernels=kernels, fuse_projections=fused)


@settings(max_examples=40, deadline=None)
@given(arch=st.sampled_from(ARCHS), seed=st.integers(0, 2),
       method=st.sampled_from(["vc", "dytc", "hc", "vc+hc", "tree+vc"]), which=st.integers(0, 5),
       bottom=st.sampled_from(sorted(BOTTOMS)), prompt=st.lists(st.integers(3, 40), min_size=1, max_size=24),
       n=st.integers(1, 40), kernels=st.sampled_from(KERNELS), fused=st.booleans())
def test_greedy_cascades_and_dytc_equal_ar(arch, seed, method, which, bottom, prompt, n, kernels, fused):
    e = engine(arch, seed, kernels, fused)  # (fused: the target's q|k|v and gate|up as one product each)
    prompt = prompt + prompt[: len(prompt) // 2]  # some repetition, so that the lookups find matches
    levels = HC_SETS[which % len(HC_SETS)] if method in ("hc", "vc+hc") else LEVEL_SETS[which]
    ar = e.generate_ids(prompt, Request(method="ar", max_new_tokens=n))
    spec = e.generate_ids(prompt, Request(max_new_tokens=n, method=method, levels=levels, bottom=bottom))
    assert spec.token_ids == ar.token_ids
    assert spec.stats.new_tokens <= n


def test_dytc_near_the_context_end_and_with_eos():
    e = tiny_engine("llama", 1, max_context=40)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    ar = e.generate_ids(prompt, Request(method="ar", max_new_tokens=100))
    for method in ("dytc", "vc", "hc", "tree+vc"):
        spec = e.generate_ids(prompt, Request(max_new_tokens=100, method=method))
        assert spec.token_ids == ar.token_ids, method
        assert spec.stats.finish_reason == ar.stats.finish_reason


def test_tree_vc_adds_the_top_levels_alternatives_as_siblings():
    """tree+vc verifies vc's chain plus sibling leaves: the same tokens as vc, more nodes verified (its trees
    branch), never more than tree_nodes per step."""
    e = tiny_engine("llama", 2)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    vc = e.generate_ids(prompt, Request(max_new_tokens=30, method="vc", levels=("int8",)))
    tv = e.generate_ids(prompt, Request(max_new_tokens=30, method="tree+vc", levels=("int8",)))
    assert tv.token_ids == vc.token_ids
    assert tv.stats.tree_nodes > vc.stats.tree_nodes  # siblings were verified too
    assert tv.stats.tree_nodes <= (CascadeConfig.tree_nodes - 1) * tv.stats.target_forwards


def test_bad_levels_get_clear_errors():
    with pytest.raises(CasspecError, match="SOURCE\\*K"):
        Request(method="hc", levels=("int4",))
    with pytest.raises(CasspecError, match="without \\*K"):
        Request(method="dytc", levels=("int4*3",))
    with pytest.raises(CasspecError, match="--bottom"):
        Request(method="vc", levels=("int4", "pld"))
    with pytest.raises(CasspecError, match="--bottom"):
        Request(method="dytc", levels=("maxgram",))
    with pytest.raises(CasspecError, match="unknown bottom"):
        Request(method="vc", bottom="trigram")
    with pytest.raises(CasspecError, match="one level"):
        Request(method="sd", levels=("int4",))
    with pytest.raises(CasspecError):
        Request(method="dytc", levels=("int5",))


# ---------------------------------------------------------------------------------------------- moving averages
def test_moving_average_follows_lambda():
    cfg = AcceptanceConfig(lam=0.7, window=3, shrink=10.0)
    tr = AcceptanceTracker(cfg)
    key = ("int4", tr.bucket("int4", 0.95))
    a0 = tr.estimate("int4", 0.95)  # the prior: the bucket's mid-point
    tr.update([("int4", 0.95, True), ("int4", 0.95, False)])  # this step: 1 of 2
    assert tr.rates[key] == pytest.approx(0.7 * a0 + 0.3 * 0.5)
    assert tr.overall["int4"] == pytest.approx(0.7 * cfg.prior_level + 0.3 * 0.5)
    # a bucket's estimate is shrunk toward the source average by `shrink` pseudo-tokens
    assert tr.estimate("int4", 0.95) == pytest.approx((2 * tr.rates[key] + 10 * tr.overall["int4"]) / 12)
    assert tr.estimate("int4", 0.05) == tr.overall["int4"]  # an unseen bucket starts from the source average
    # the recent rate is counted over the last `window` steps: 1 of 2, then 2 of 2 -> 3 of 4
    prev = tr.rates[key]
    tr.update([("int4", 0.95, True), ("int4", 0.95, True)])
    assert tr.rates[key] == pytest.approx(0.7 * prev + 0.3 * 0.75)
    for _ in range(40):
        tr.update([("int4", 0.95, False)])
    assert tr.rates[key] == pytest.approx(cfg.floor)
    assert tr.estimate(PLD, 3) == pytest.approx(0.75)  # prior: match length n -> n / (n + 1)
    assert tr.counts["int4"] == [44, 3]


def test_a_measured_agreement_seeds_a_levels_average_until_verifications_move_it():
    tr = AcceptanceTracker()
    tr.seed({"int4": 0.99, "int4+vocab": 0.6}, "levels plane 2026-11-27")
    assert tr.mean("int4") == pytest.approx(0.99) and tr.mean("int4+vocab") == pytest.approx(0.6)
    assert tr.estimate("int4", 0.5) == pytest.approx(0.99)  # an unseen bucket starts from the source's average
    assert tr.origins == {"int4": "levels plane 2026-11-27", "int4+vocab": "levels plane 2026-11-27"}
    tr.update([("int4", 0.9, False)])
    assert tr.mean("int4") == pytest.approx(0.7 * 0.99) and tr.origins["int4"] == LEARNED
    tr.seed({"int4": 0.99, "int8": 2.0}, "a later plane")  # a learned average stays; a rate is clamped
    assert tr.mean("int4") == pytest.approx(0.7 * 0.99) and tr.mean("int8") == tr.cfg.ceil
    back = AcceptanceTracker.from_json(json.loads(json.dumps(tr.to_json())))
    assert back.origins == tr.origins and back.overall == tr.overall


@pytest.mark.parametrize("better", ["int4", "int8"])
def test_the_router_drafts_first_with_the_level_measured_to_agree_more(better):
    """Two levels of the same cost: blind priors cannot tell them apart; the measured agreements can."""
    e = tiny_engine("llama", 0)
    pts = [Point(name, t, c, tree, base + (t - 1)) for name, base in ((TARGET_LEVEL, 50.0), ("int4", 5.0),
                                                                       ("int8", 5.0))
           for t in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) for c in (64, 128) for tree in (False, True)]
    tracker = AcceptanceTracker()
    tracker.seed({"int4": 0.95 if better == "int4" else 0.5, "int8": 0.95 if better == "int8" else 0.5}, "plane")
    router = DyTC([e.levels.get("int4"), e.levels.get("int8")], tracker, RouterConfig(levels=("int4", "int8"),
                                                                                     lookups=()))
    e.cache.rollback(0)
    e.extend_prefix([5, 6, 7, 8, 9, 10])
    ctx = DraftContext(e.model, e.cache, [5, 6, 7, 8, 9, 10, 11], SamplingParams(), None, e.eos_ids, budget=50,
                       latency=LatencyModel.fit(FeatureSpec(), pts))
    router.begin(ctx)
    assert router.best_action(ctx, router.new_step(ctx, 32), 32).source == better


@pytest.mark.parametrize("after,int4_ms", [(3, 5.0), (None, 5.0), (3, 60.0)], ids=["explores", "off", "too-dear"])
def test_a_level_a_wrong_estimate_keeps_out_is_tried_within_a_generation(after, int4_ms):
    """int4 seeded far too low (0.2) never wins on value, so it would never be tested; forced after `after` steps
    without it, it drafts (its tokens then meet the target's verification, which moves its estimate) -- unless its
    forward costs more than a target step (it could never pay)."""
    e = tiny_engine("llama", 0)
    pts = [Point(name, t, c, tree, base + (t - 1)) for name, base in ((TARGET_LEVEL, 50.0), ("int4", int4_ms),
                                                                       ("int8", 5.0))
           for t in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) for c in (64, 128) for tree in (False, True)]
    tracker = AcceptanceTracker()
    tracker.seed({"int4": 0.2, "int8": 0.95}, "a wrong plane")
    cfg = RouterConfig(levels=("int8", "int4"), lookups=(), explore_level_after=after)
    router = DyTC([e.levels.get("int8"), e.levels.get("int4")], tracker, cfg)
    prompt = [5, 6, 7, 8, 9, 10]
    ar = e.generate_ids(prompt, Request(method="ar", max_new_tokens=24)).token_ids
    e.cache.rollback(0)
    e.extend_prefix(prompt)
    ctx = DraftContext(e.model, e.cache, prompt + [11], SamplingParams(), None, e.eos_ids, budget=50,
                       latency=LatencyModel.fit(FeatureSpec(), pts))
    router.begin(ctx)
    sources = []
    for _ in range(8):
        router.draft(ctx)
        sources += [node.source for node in router.step.nodes[1:]]
    report = router.report()
    if after is None or int4_ms > 50.0:
        assert "int4" not in sources and report["explore_steps"] == 0
    else:
        assert "int4" in sources and 1 <= report["explore_steps"] <= 8 // after + 1
        assert 0.0 <= report["explore_loss"] <= 1.0
    # and whatever it explores, the output stays the target's own
    req = Request(max_new_tokens=24, method="dytc", levels=("int8", "int4"))
    assert e.generate_ids(prompt, req).token_ids == ar


def _lookup_reference(hist: list[int], extra: list[int], k: int, eos: int, max_ngram: int = 3) -> list[int]:
    """Brute force: the longest suffix n-gram of hist + extra with an occurrence in hist followed by a hist token;
    copy after its leftmost occurrence, cut before EOS (an empty cut proposes nothing, as in HF)."""
    full, L = hist + extra, len(hist)
    for n in range(min(max_ngram, len(full)), 0, -1):
        for start in range(L - n):
            if hist[start:start + n] == full[-n:]:
                out = hist[start + n:start + n + k]
                return out[:out.index(eos)] if eos in out else out
    return []


@settings(max_examples=100, deadline=None)
@given(hist=st.lists(st.integers(0, 5), min_size=1, max_size=40), extra=st.lists(st.integers(0, 5), max_size=4))
def test_propose_after_matches_a_brute_force_lookup(hist, extra):
    lookup = PromptLookup(hist, eos_ids={0})
    out, n = lookup.propose_after(extra, 5)
    assert out == _lookup_reference(hist, extra, 5, eos=0)
    assert (n > 0) == bool(out)
    if not extra:
        assert out == lookup.propose(5)[0]


# ---------------------------------------------------------------------------------------------- the router
def _latency(target_ms: float, level_ms: float, per_token: float = 1.0) -> LatencyModel:
    """A predictor fitted on exact synthetic timings: ms = base + per_token * (T - 1)."""
    pts = [Point(name, t, c, tree, base + per_token * (t - 1)) for name, base in ((TARGET_LEVEL, target_ms),
                                                                                   ("int4", level_ms))
           for t in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) for c in (64, 128) for tree in (False, True)]
    return LatencyModel.fit(FeatureSpec(), pts)


def _router(e, latency: LatencyModel, cfg: RouterConfig = RouterConfig(levels=("int4",), lookups=())):
    router = DyTC([e.levels.get("int4")], AcceptanceTracker(), cfg)
    prompt = [5, 6, 7, 8, 9, 10]
    e.cache.rollback(0)
    e.extend_prefix(prompt)
    ctx = DraftContext(e.model, e.cache, prompt + [11], SamplingParams(), None, e.eos_ids, budget=50, latency=latency)
    router.begin(ctx)
    return router, ctx


class _FixedCost:
    """A latency model whose every level costs `ratio` target steps (and which learns nothing)."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio

    def known(self, level: str) -> bool:
        return True

    def cost_ratio(self, level: str, tokens: int, context: int, tree: bool = False) -> tuple[float, float]:
        return self.ratio, 0.0

    def observe(self, *args, **kwargs) -> None:
        pass


@pytest.mark.parametrize("method", ["sd", "tree"])
def test_sd_and_tree_stop_when_another_forward_cannot_pay(method):
    """A level predicted to cost more than a target step drafts one forward per step (its first, which keeps its
    timings measured); a cheap one drafts on while its confidence allows; both stay lossless."""
    e = tiny_engine("llama", 0)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    depths = {}
    for name, ratio in (("slow", 1.2), ("cheap", 1e-4)):
        lat = _FixedCost(ratio)
        level = e.levels.get("int4")  # a random tiny model is unsure: no confidence / probability floor here
        policy = (ChainPolicy(level, ChainConfig(min_confidence=0.0)) if method == "sd" else
                  TreePolicy(level, TreeConfig(min_probability=0.0)))
        e.cache.rollback(0)
        e.extend_prefix(prompt)
        ctx = DraftContext(e.model, e.cache, prompt + [5], SamplingParams(), None, e.eos_ids, budget=50,
                           latency=lat)
        policy.begin(ctx)
        tree = policy.draft(ctx)
        depths[name] = max(len(tree.path_to(n)) - 1 for n in range(len(tree)))
        assert ctx.draft_forwards == (1 if name == "slow" else depths[name])
    assert depths["slow"] == 1 and depths["cheap"] > 1
    ar = e.generate_ids(prompt, Request(method="ar", max_new_tokens=20))
    assert e.generate_ids(prompt, Request(max_new_tokens=20, method=method, level="int4")).token_ids == ar.token_ids


def test_objective_picks_the_best_throughput_segment():
    e = tiny_engine("llama", 0)
    lat = _latency(50.0, 10.0)
    router, ctx = _router(e, lat)
    step = router.new_step(ctx, 32)
    act = router.best_action(ctx, step, 32)
    a = router.tracker.mean("int4")
    V, c = step.verify_ms, step.level_ms["int4"]
    rates = []
    for k in range(1, RouterConfig.lookahead + 1):
        gain = sum(a ** i for i in range(1, k + 1))
        rates.append((1 + gain) / (c[1] * k + V[1 + k]))  # root pending (1 token), then k - 1 more forwards
    assert act.source == "int4" and act.node == 0
    assert act.k == int(np.argmax(rates)) + 1
    assert act.rate == pytest.approx(max(rates), rel=1e-9)


def test_the_routers_own_time_per_step_counts_in_every_steps_cost():
    """O, the router's measured time per step (drafting less level forwards), starts each step's time spent, so a
    segment that emits more tokens spreads it over more: the best k with O is the objective's argmax with O in every
    denominator, and longer than the best k without it; step_overhead=False leaves it out."""
    e = tiny_engine("llama", 0)
    router, ctx = _router(e, _latency(50.0, 10.0))
    router.draft(ctx)
    assert router.overhead_ms > 0 and router.report()["overhead_ms"] == round(router.overhead_ms, 2)
    ctx.latency = _latency(50.0, 10.0)  # (the draft's forward was learned: the synthetic costs again)
    a = router.tracker.mean("int4")
    best_k = {}
    for own in (0.0, 200.0):
        router.overhead_ms = own
        step = router.new_step(ctx, 32)
        assert step.spent == own
        act = router.best_action(ctx, step, 32)
        V, c = step.verify_ms, step.level_ms["int4"]
        rates = [(1 + sum(a ** i for i in range(1, k + 1))) / (own + c[1] * k + V[1 + k])
                 for k in range(1, RouterConfig.lookahead + 1)]
        assert act.k == int(np.argmax(rates)) + 1 and act.rate == pytest.approx(max(rates), rel=1e-9)
        best_k[own] = act.k
    assert best_k[200.0] > best_k[0.0]  # (4 and 8 tokens here)
    off, ctx = _router(e, _latency(50.0, 10.0), RouterConfig(levels=("int4",), lookups=(), step_overhead=False))
    off.overhead_ms = 200.0
    assert off.new_step(ctx, 32).spent == 0.0


def test_leaf_selection_takes_the_most_probable_node():
    e = tiny_engine("llama", 0)
    router, ctx = _router(e, _latency(50.0, 10.0), RouterConfig(levels=("int4",), lookups=(), expand_candidates=1))
    step = router.new_step(ctx, 32)
    for tok, p in ((12, 0.3), (13, 0.6)):
        step.add(0, tok, "int4", 0.5, p)
    step.add(1, 14, "int4", 0.5, 0.1)
    act = router.best_action(ctx, step, 32)
    assert act.node == 2  # leaves: 2 (p 0.6) and 3 (p 0.1); the root is no leaf and has no known distribution


def test_fallback_to_ar_when_drafting_cannot_pay():
    e = tiny_engine("llama", 0)
    cfg = RouterConfig(levels=("int4",), lookups=(), explore_every=2)
    router, ctx = _router(e, _latency(50.0, 80.0, per_token=20.0), cfg)  # a draft forward costs more than a step
    sizes = [len(router.draft(ctx)) for _ in range(3)]
    assert sizes[:2] == [1, 1] and sizes[2] > 1  # two fallbacks, then one exploring tree
    assert router.report()["fallback_steps"] == 2
    router2, ctx2 = _router(e, _latency(50.0, 5.0, per_token=0.1), cfg)  # a cheap level: it drafts
    assert len(router2.draft(ctx2)) > 1
    assert router2.report()["fallback_steps"] == 0


def test_no_fallback_option_always_drafts():
    e = tiny_engine("llama", 0)
    cfg = RouterConfig(levels=("int4",), lookups=(), fallback=False)
    router, ctx = _router(e, _latency(50.0, 80.0, per_token=20.0), cfg)
    assert all(len(router.draft(ctx)) > 1 for _ in range(3))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), prompt=st.lists(st.integers(3, 30), min_size=2, max_size=16),
       levels=st.sampled_from([("int8",), ("int8", "int4"), ("vocab", "int8")]))
def test_dytc_sampling_runs_to_its_budget(seed, prompt, levels):
    """Sampled decoding grows bushy trees (siblings, reviewed prompt-lookup tokens): every step must still end
    (a review that keeps nothing once left the router extending a node it had not run, forever)."""
    e = engine("llama", 0)
    prompt = prompt + prompt  # repetition: prompt lookup proposes, the levels review
    r = e.generate_ids(prompt, Request(max_new_tokens=40, method="dytc", levels=levels, seed=seed,
                                       sampling=SamplingParams(temperature=1.0)))
    assert 1 <= r.stats.new_tokens <= 40
    assert r.stats.finish_reason in ("eos", "length")


WARPS = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0),
         SamplingParams(temperature=0.6, top_k=5), SamplingParams(temperature=1.3, top_k=20, top_p=0.9)]


@settings(max_examples=30, deadline=None)
@given(arch=st.sampled_from(ARCHS), seed=st.integers(0, 10_000),
       method=st.sampled_from(["pld", "sd", "tree", "vc", "hc", "vc+hc", "dytc", "tree+vc"]),
       bottom=st.sampled_from(sorted(BOTTOMS)), sp=st.sampled_from(WARPS),
       prompt=st.lists(st.integers(3, 30), min_size=2, max_size=16), n=st.integers(1, 30))
def test_seeded_sampling_of_deterministic_drafts_equals_ar(arch, seed, method, bottom, sp, prompt, n):
    """Deterministic drafts (coupled to the verifier's noise) are checked against position-owned noise: with one
    seed, every such method emits exactly the tokens `ar` samples (and so the same distribution), whatever the
    tree, under every warp."""
    e = engine(arch, 0)
    prompt = prompt + prompt
    ar = e.generate_ids(prompt, Request(method="ar", max_new_tokens=n, sampling=sp, seed=seed))
    spec = e.generate_ids(prompt, Request(max_new_tokens=n, sampling=sp, seed=seed, method=method, level="int8",
                                          bottom=bottom if method in ("vc", "dytc", "tree+vc") else "pld"))
    assert spec.token_ids == ar.token_ids


def test_drafts_coupled_to_other_noise_stay_lossless_only_slower(monkeypatch):
    """Drafting with noise other than the verifier's still emits ar's sampled tokens (verification alone decides
    them); drafting with the verifier's own noise is accepted far more often."""
    e = tiny_engine("llama", 0)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    sp = SamplingParams(temperature=1.0)

    def run(seed: int) -> tuple[list[int], int]:
        r = e.generate_ids(prompt, Request(max_new_tokens=40, sampling=sp, seed=seed, method="vc", levels=("int8",),
                                           bottom="pld"))
        ar = e.generate_ids(prompt, Request(method="ar", max_new_tokens=40, sampling=sp, seed=seed))
        assert r.token_ids == ar.token_ids
        return r.token_ids, sum(r.stats.accepted_by_depth)

    coupled = sum(run(s)[1] for s in range(8))
    real = DraftContext.draft_top

    def other_noise(self, logits, positions, k):  # the draft sees a different generation's noise
        own = self.noise
        self.noise = Noise(12345, own.vocab)
        try:
            return real(self, logits, positions, k)
        finally:
            self.noise = own

    monkeypatch.setattr(DraftContext, "draft_top", other_noise)
    uncoupled = sum(run(s)[1] for s in range(8))
    assert coupled > 1.5 * uncoupled


# ---------------------------------------------------------------------------------------------- statistical bottom
def test_maxgram_drafts_at_the_bottom_of_vc_and_dytc():
    """With --bottom maxgram, Max-Gram's tokens are what the levels review (vc) and a source the router drafts
    with (dytc); with both, each lookup is its own source; all equal ar."""
    e = tiny_engine("llama", 2)
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]
    ar = e.generate_ids(prompt, Request(method="ar", max_new_tokens=40))
    for bottom in ("maxgram", "both"):
        for method in ("vc", "tree+vc", "vc+hc", "dytc"):
            r = e.generate_ids(prompt, Request(max_new_tokens=40, method=method, levels=(), bottom=bottom))
            assert r.token_ids == ar.token_ids, (method, bottom)
        # constant costs: a lookup's tokens cost nothing to attach, so the router's choice does not hang on timings
        dytc = e.generate_ids(prompt, Request(max_new_tokens=40, method="dytc", bottom=bottom,
                                              router=RouterConfig(constant_cost=0.3)))
        assert dytc.token_ids == ar.token_ids
        used = set(dytc.stats.policy["drafted_by_source"])
        assert {s.rstrip("!") for s in used} & {PLD, MAXGRAM} <= set(BOTTOMS[bottom])
        assert any(s.rstrip("!") == MAXGRAM for s in used) or bottom == "both"
    none = e.generate_ids(prompt, Request(max_new_tokens=40, method="dytc", bottom="none",
                                          router=RouterConfig(constant_cost=0.3)))
    assert not {s.rstrip("!") for s in none.stats.policy["drafted_by_source"]} & {PLD, MAXGRAM}


def test_a_lookups_proposal_at_the_root_is_tested_for_free_when_not_drafted():
    from dytc.router_step import Node, Step, unused_proposals
    from dytc.tree import DraftTree

    step = Step(DraftTree.root(4), [Node("root", 1.0, 1.0, 0)], [0.0, 1.0], {})
    step.nodes[0].proposals = {MAXGRAM: ([5, 6, 7], 3), PLD: ([5, 9], 2)}
    step.add(0, 5, "int4", 0.9, 0.9)  # the level drafted the same first token: the lookups were not drafted
    emitted = [5, 6, 8, 2]  # the step's emitted tokens, bonus included
    free = unused_proposals(step, emitted)
    # each proposal as a chain of drafts: tested while the tokens before it matched
    assert free == [(MAXGRAM, 3, True), (MAXGRAM, 3, True), (MAXGRAM, 3, False), (PLD, 2, True), (PLD, 2, False)]
    step.add(0, 9, PLD + "!", 2, 0.1)  # a lookup drafted at the root (overruled or not) is tested as drafted
    assert [o[0] for o in unused_proposals(step, emitted)] == [MAXGRAM] * 3
    # a low estimate of a lookup that is never drafted still moves with its free tests
    tr = AcceptanceTracker()
    for _ in range(3):
        tr.update([(MAXGRAM, 5, False)])
    low = tr.estimate(MAXGRAM, 5)
    for _ in range(5):
        tr.update([(MAXGRAM, 5, True)] * 10)
    assert low < 0.2 < 0.8 < tr.estimate(MAXGRAM, 5)


def test_a_lookup_whose_root_proposal_held_is_estimated_apart_in_the_next_step():
    from dytc.router_step import Node, Step, held_lookups, unused_proposals
    from dytc.sources import held, is_lookup
    from dytc.tree import DraftTree

    step = Step(DraftTree.root(4), [Node("root", 1.0, 1.0, 0)], [0.0, 1.0], {})
    step.nodes[0].proposals = {MAXGRAM: ([5, 6, 7], 4), PLD: ([5, 9], 2)}
    assert held_lookups(step, [5, 6]) == {MAXGRAM}  # (as far as the emitted tokens go)
    assert held_lookups(step, [5, 6, 7, 1]) == {MAXGRAM}  # (as far as the proposal goes)
    assert held_lookups(step, [5, 9, 3]) == {PLD}
    assert held_lookups(step, [1]) == set()
    step.add(0, 5, "int4", 0.9, 0.9)
    assert unused_proposals(step, [5, 6, 8], {MAXGRAM})[0] == (held(MAXGRAM), 4, True)  # its free tests are held's
    assert is_lookup(held(MAXGRAM)) and is_lookup(held(MAXGRAM) + "!")


def test_after_a_root_proposal_held_the_lookups_tokens_are_held_and_run_further():
    """A copy under way: the next step's Max-Gram tokens carry held(maxgram) and its proposal may run to
    held_lookup_tokens; a step whose emitted tokens the proposal missed ends it."""
    from dytc.sources import held

    e = tiny_engine("llama", 0)
    pts = [Point(name, t, c, tree, base + 0.01 * (t - 1)) for name, base in ((TARGET_LEVEL, 50.0), ("int4", 40.0))
           for t in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48) for c in (64, 128) for tree in (False, True)]
    cycle = list(range(20, 50))
    prompt = cycle * 2 + cycle[:5]  # Max-Gram proposes the cycle's next tokens, as many as asked
    router = DyTC([e.levels.get("int4")], AcceptanceTracker(), RouterConfig(levels=("int4",), lookups=(MAXGRAM,)))
    e.cache.rollback(0)
    e.extend_prefix(prompt[:-1])
    ctx = DraftContext(e.model, e.cache, list(prompt), SamplingParams(), None, e.eos_ids, budget=60,
                       latency=LatencyModel.fit(FeatureSpec(), pts))
    router.begin(ctx)
    tree = router.draft(ctx)
    plain = [nd.source for nd in router.step.nodes[1:]]
    proposal = router.step.nodes[0].proposals[MAXGRAM][0]
    assert MAXGRAM in plain and held(MAXGRAM) not in plain and len(proposal) == router.cfg.lookup_tokens
    router.observe(ctx, tree, [0], proposal[:1])  # (the first token emitted: the proposal held as far as it went)
    assert router.lookups.held == {MAXGRAM}
    ctx.commit(proposal[:1])
    e.extend_prefix(ctx.history[:-1])  # (the target's KV up to the new root, as a verification leaves it)
    tree = router.draft(ctx)
    copied = [nd.source for nd in router.step.nodes[1:]]
    assert held(MAXGRAM) in copied and MAXGRAM not in copied
    assert len(router.step.nodes[0].proposals[MAXGRAM][0]) == router.cfg.held_lookup_tokens
    router.observe(ctx, tree, [0], [7])  # a token the proposal missed: the copy is over
    assert router.lookups.held == set()


def test_dytc_reports_its_free_tests_of_the_lookups():
    e = tiny_engine("llama", 2)
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]
    ar = e.generate_ids(prompt, Request(method="ar", max_new_tokens=40))
    r = e.generate_ids(prompt, Request(max_new_tokens=40, method="dytc", bottom="maxgram"))
    assert r.token_ids == ar.token_ids
    assert r.stats.policy["free_tests"] > 0


def test_a_maxgram_segment_drafts_in_hc():
    e = tiny_engine("llama", 2)
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]
    ar = e.generate_ids(prompt, Request(method="ar", max_new_tokens=30))
    hc = e.generate_ids(prompt, Request(max_new_tokens=30, method="hc", levels=("maxgram*4",)))
    assert hc.token_ids == ar.token_ids
    assert hc.stats.draft_forwards == 0 and hc.stats.tree_nodes > 0  # a lookup alone: drafts without a forward


@pytest.mark.parametrize("method", ["sd", "tree", "vc", "hc", "dytc"])
def test_every_level_forward_feeds_the_latency_model(method):
    """One helper runs a level for every policy: its forwards are counted, timed and learned by the latency
    model (the cascades included)."""
    e = tiny_engine("llama", 3)
    assert not e.latency.known("int8")
    levels = ("int8*3", "pld*2") if method == "hc" else ("int8",) if method in ("vc", "dytc") else ()
    constant = RouterConfig(constant_cost=0.3)  # dytc drafts whatever the timings
    r = e.generate_ids([5, 6, 7, 8, 5, 6], Request(max_new_tokens=20, method=method, level="int8", levels=levels,
                                                   router=constant))
    assert r.stats.draft_forwards > 0
    assert e.latency.known("int8")


def test_sd_couples_its_chain_and_sd_rs_samples_it_from_q():
    """Under sampling `sd` drafts deterministic tokens coupled to the verifier's noise (no q: verify_coupled), and
    `sd-rs` draws them from the level's q (kept per node: recursive rejection sampling)."""
    e = tiny_engine("llama", 0)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8]
    sp = SamplingParams(temperature=0.8)
    level = e.levels.get("int4")
    for coupled in (True, False):
        e.cache.rollback(0)
        e.extend_prefix(prompt)
        ctx = DraftContext(e.model, e.cache, prompt + [5], sp, torch.Generator().manual_seed(0), e.eos_ids,
                           budget=50, noise=Noise(0, e.model.lm_head.shape[0]))
        policy = ChainPolicy(level, ChainConfig(min_confidence=0.0, cost_aware=False, coupled=coupled))
        policy.begin(ctx)
        tree = policy.draft(ctx)
        assert len(tree) > 2
        assert all((q is None) == coupled for q in tree.q[1:])
