"""Speculation sized to the load from the batch's own steps (dytc/batchcost.py): the steps' cost fitted by
generations and drafted nodes, the switch that stops drafting where steps without drafts measured more tokens per
ms, and dytc weighing its tree against them (router.new_step, Load)."""
from __future__ import annotations

import random

import pytest

from dytc.acceptance import AcceptanceTracker
from dytc.batchcost import EXPLORE_EVERY, MIN_STEPS, BatchCost, SpeculationSwitch
from dytc.policies import DraftContext, Load
from dytc.router import DyTC, RouterConfig
from dytc.sampling import SamplingParams
from tiny import tiny_engine


def test_the_fit_recovers_a_steps_cost_by_generations_and_drafted_nodes():
    """Steps timed as 3 ms + 1.2 ms a generation + 0.8 ms a drafted node (with 1% noise) give back those costs; its
    table prices a tree of N nodes beside the others' at the whole step's time."""
    rng = random.Random(0)
    cost = BatchCost()
    for _ in range(200):
        g = rng.randint(2, 8)
        extra = rng.randint(0, 12)
        cost.observe(g, g + extra, (3.0 + 1.2 * g + 0.8 * extra) * rng.uniform(0.99, 1.01))
    assert cost.ready
    a, b, c = cost.coefficients()
    assert (a, b, c) == pytest.approx((3.0, 1.2, 0.8), abs=0.15)
    table = cost.table(generations=8, others_extra=5, n_max=4)
    assert len(table) == 5 and table[0] == 0.0
    assert table[1] == pytest.approx(cost.step_ms(8, 5))
    assert [table[n + 1] - table[n] for n in (1, 2, 3)] == pytest.approx([c] * 3)


def test_the_fit_waits_for_steps_that_differ_in_their_drafts():
    """Until the window holds MIN_STEPS steps with different numbers of drafted nodes, a node's cost is not
    measured: not ready (the router keeps the latency model's table). Bad timings are not taken."""
    cost = BatchCost()
    for _ in range(3 * MIN_STEPS):
        cost.observe(8, 8, 11.0)  # every root alone: a node's cost unknown
    assert not cost.ready
    cost.observe(8, 12, 14.0)
    assert cost.ready
    before = list(cost.points)
    for bad in (float("nan"), 0.0, -1.0):
        cost.observe(8, 9, bad)
    cost.observe(8, 7, 10.0)  # fewer rows than generations
    assert list(cost.points) == before


def test_the_switch_drafts_where_its_steps_measured_faster_and_still_tries_the_other_mode():
    switch = SpeculationSwitch()
    assert switch.drafts(8)  # nothing measured: draft first
    switch.observe(8, True, 9, 15.0)  # 0.6 tokens/ms drafting
    assert not switch.drafts(8)  # then the roots alone, to measure them
    switch.observe(8, False, 8, 10.0)  # 0.8 tokens/ms
    modes = [switch.drafts(8) for _ in range(4 * EXPLORE_EVERY)]
    assert modes.count(True) == 4 and modes.count(False) == 4 * EXPLORE_EVERY - 4  # explored 1 in EXPLORE_EVERY
    assert switch.drafts(2)  # another width learns apart
    for _ in range(40):  # drafting turns faster (copies to make): the switch follows
        switch.observe(8, True, 20, 15.0)
    assert sum(switch.drafts(8) for _ in range(EXPLORE_EVERY)) == EXPLORE_EVERY - 1


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", seed=5, kernels="casspec", reuse_prefix=False)


def _router_step(engine, load: Load | None) -> tuple[int, list[float], float]:
    """A dytc router that copies freely (prompt lookup over a repeating prompt); its tree's size, its step's
    verification table and its time spent at the start."""
    dytc = DyTC([], AcceptanceTracker(), RouterConfig(levels=(), lookups=("pld",)))
    prompt = [5, 6, 7, 8, 9] * 4
    engine.cache.rollback(0)
    engine.extend_prefix(prompt)
    ctx = DraftContext(engine.model, engine.cache, prompt + [5], SamplingParams(), None, engine.eos_ids, budget=40,
                       latency=engine.latency, load=load)
    dytc.begin(ctx)
    size = len(dytc.draft(ctx))
    engine.forget_prefix()
    return size, dytc.step.verify_ms, dytc.step.spent


def test_dytc_weighs_its_tree_against_the_batchs_measured_steps(engine):
    """Beside 7 others whose measured steps make a node cheap, the copy is drafted; where a node costs as much as a
    whole step of 8 roots, the root alone; the table is the fit's, everyone's drafting already in it (spent 0)."""
    def measured(node_ms: float) -> BatchCost:
        cost = BatchCost()
        for extra in range(MIN_STEPS + 4):
            cost.observe(8, 8 + extra % 4, 10.0 + node_ms * (extra % 4))
        return cost

    cheap = Load(rows=7, tokens=7.0, draft_ms=0.0, generations=7, cost=measured(0.05))
    size, verify, spent = _router_step(engine, cheap)
    assert size > 1 and spent == 0.0
    assert verify[1:4] == pytest.approx(cheap.cost.table(8, 0, 3)[1:])
    dear = Load(rows=7, tokens=7.0, draft_ms=0.0, generations=7, cost=measured(10.0))
    assert _router_step(engine, dear)[0] == 1


def test_dytc_verifies_the_root_alone_when_the_switch_says_so(engine):
    """The same cheap batch with the switch off: no drafts (the root alone), and with it on the copy again."""
    cost = BatchCost()
    for extra in range(MIN_STEPS + 4):
        cost.observe(8, 8 + extra % 4, 10.0 + 0.05 * (extra % 4))
    on = Load(rows=7, tokens=7.0, draft_ms=0.0, generations=7, cost=cost)
    off = Load(rows=7, tokens=7.0, draft_ms=0.0, generations=7, cost=cost, drafts=False)
    assert _router_step(engine, on)[0] > 1
    assert _router_step(engine, off)[0] == 1


def test_a_batch_measures_both_modes_at_its_width_and_keeps_each_requests_tokens(engine):
    """Three generations of a real batch: its first step at width 3 drafts, its second verifies the roots alone
    (both modes then measured at that width, and the steps' cost observed); every request's tokens are still the
    ones it gets alone."""
    from casspec.runtime.batch import Batch
    from casspec.runtime.request import Request

    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11, 9, 10, 11], [12, 13, 14, 15, 12, 13]]
    alone = [engine.generate_ids(p, Request(max_new_tokens=20, method="dytc")).token_ids for p in prompts]
    batch = Batch(engine, 3)
    for p in prompts:
        batch.join(p, Request(max_new_tokens=20, method="dytc"))
    got = []
    while batch.running:
        batch.step()
        for run in [r for r in batch.running if r.done]:
            got.append(batch.leave(run)[0].token_ids)
    assert {(3, True), (3, False)} <= set(batch.switch.goodput) and batch.stats.undrafted >= 1
    assert len(batch.cost.points) >= 2
    assert sorted(got) == sorted(alone)


@pytest.mark.parametrize("method", ["dytc", "pld"])
def test_undrafted_counts_the_steps_that_drafted_nothing(engine, monkeypatch, method):
    """With the switch always off, dytc verifies every root alone (each step of several counted undrafted); prompt
    lookup does not read the switch and still drafts its copies (those steps not counted)."""
    from casspec.runtime.batch import Batch
    from casspec.runtime.request import Request

    monkeypatch.setattr(SpeculationSwitch, "drafts", lambda self, width: False)
    batch = Batch(engine, 3)
    for p in ([5, 6, 7, 8] * 4, [9, 10, 11] * 4, [12, 13, 14, 15] * 3):
        batch.join(p, Request(max_new_tokens=16, method=method))
    wide = 0
    while batch.running:
        wide += len([r for r in batch.running if not r.done]) > 1
        batch.step()
        for run in [r for r in batch.running if r.done]:
            batch.leave(run)
    if method == "dytc":
        assert batch.stats.drafted == 0 and batch.stats.undrafted == wide > 0
    else:
        assert batch.stats.drafted > 0 and batch.stats.undrafted < wide
