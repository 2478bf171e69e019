"""Continuous batching (casspec/runtime/batch.py): generations that join a running batch at random steps, each on
its own KV cache, verified together in one target forward per step, give each request the tokens it gets alone
(greedy, and sampled with its own seed: the coupled verification's position-owned noise), for every method; dytc
sizes its drafts to the batch's load; casspec serve answers concurrent clients from one batch."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dytc.acceptance import AcceptanceTracker
from dytc.latency import TARGET_LEVEL, FeatureSpec, LatencyModel, Point
from dytc.policies import DraftContext, Load
import dytc.router as router_module
from dytc.router import DyTC, RouterConfig
from dytc.sampling import SamplingParams
from casspec.runtime.batch import Batch
from casspec.runtime.request import Request
from tiny import complete_at_once, tiny_engine

METHODS = ("ar", "pld", "sd", "tree", "dytc", "vc")


@pytest.fixture(scope="module")
def engine():
    """casspec's own dense kernel (each row's bits whatever the rows beside it), no prefix reuse (each prompt
    prefilled whole, alone or batched: the same bits)."""
    return tiny_engine("llama", seed=3, kernels="casspec", reuse_prefix=False)


def request(rng: random.Random) -> tuple[list[int], Request]:
    prompt = [rng.randrange(3, 90) for _ in range(rng.randrange(1, 12))]
    if rng.random() < 0.5:  # a repetitive prompt: the lookups draft
        prompt = (prompt * 4)[:rng.randrange(8, 40)]
    sampled = rng.random() < 0.4
    req = Request(max_new_tokens=rng.randrange(1, 40), method=rng.choice(METHODS),
                  sampling=SamplingParams(0.8, 0, 0.95) if sampled else SamplingParams(),
                  seed=rng.randrange(2**32) if sampled else None)
    return prompt, req


def run_batched(engine, jobs: list[tuple[list[int], Request]], joins: list[int], max_batch: int,
                prefill_chunk: int = 0) -> list[list[int]]:
    """Each job joins at the step of its number in `joins` (or later, when the batch is full); its tokens."""
    batch = Batch(engine, max_batch, prefill_chunk=prefill_chunk)
    pending, tokens, step = list(range(len(jobs))), {}, 0
    while pending or batch.busy:
        for j in [j for j in pending if joins[j] <= step]:
            if batch.full:
                break
            pending.remove(j)
            batch.join(*jobs[j], owner=j)
        batch.step()
        for run in [r for r in batch.running if r.done]:
            tokens[run.owner] = batch.leave(run)[0].token_ids
        step += 1
    return [tokens[j] for j in range(len(jobs))]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), count=st.integers(1, 6), max_batch=st.integers(1, 4),
       prefill_chunk=st.sampled_from([0, 1, 3, 8]))
def test_each_request_in_a_batch_gets_its_tokens_alone(engine, seed, count, max_batch, prefill_chunk):
    """Whatever the arrival order, and with prompts that join running ones a chunk a step in their forwards."""
    rng = random.Random(seed)
    jobs = [request(rng) for _ in range(count)]
    alone = [engine.generate_ids(p, r).token_ids for p, r in jobs]
    joins = [rng.randrange(0, 12) for _ in jobs]
    assert run_batched(engine, jobs, joins, max_batch, prefill_chunk) == alone


def test_a_batch_steps_its_requests_together_and_frees_their_caches(engine):
    rng = random.Random(1)
    jobs = [([5, 6, 7, 8] * 3, Request(max_new_tokens=30, method="dytc")) for _ in range(3)]
    batch = Batch(engine, 3)
    for p, r in jobs:
        batch.join(p, r)
    batch.step()
    assert batch.stats.steps == 1 and batch.stats.sequences == 3 and len(batch.slots) == 3 and not batch.free
    while batch.running:
        batch.step()
        for run in [r for r in batch.running if r.done]:
            batch.leave(run)
    assert len(batch.free) == 3 and batch.stats.rows >= batch.stats.sequences
    with pytest.raises(ValueError, match="max_batch"):
        Batch(engine, 0)
    del rng


def _latency(target_ms: float, level_ms: float) -> LatencyModel:
    """Exact synthetic timings: base + 1 ms a token."""
    pts = [Point(name, t, c, tree, base + (t - 1)) for name, base in ((TARGET_LEVEL, target_ms), ("int4", level_ms))
           for t in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96) for c in (64, 128) for tree in (False, True)]
    return LatencyModel.fit(FeatureSpec(), pts)


def test_dytc_drafts_less_as_the_batch_around_it_widens(engine):
    """A cheap level pays alone (a 5 ms forward against a 50 ms step); in a step that already verifies 63 other
    rows expected to emit 60 tokens, a draft token adds at most one token for a level forward and a row: the root
    alone (a fallback step)."""
    def router(load: Load | None) -> int:
        dytc = DyTC([engine.levels.get("int4")], AcceptanceTracker(), RouterConfig(levels=("int4",), lookups=()))
        prompt = [5, 6, 7, 8, 9, 10]
        engine.cache.rollback(0)
        engine.extend_prefix(prompt)
        ctx = DraftContext(engine.model, engine.cache, prompt + [11], SamplingParams(), None, engine.eos_ids,
                           budget=50, latency=_latency(50.0, 5.0), load=load)
        dytc.begin(ctx)
        return len(dytc.draft(ctx))

    assert router(None) > 1
    assert router(Load(rows=63, tokens=60.0, draft_ms=0.0)) == 1
    engine.forget_prefix()


def test_one_batched_cost_table_serves_every_load(engine, monkeypatch):
    """A batched step's verification costs come from one table by the forward's rows in all: a tree of N nodes beside
    `others` rows costs the latency model's prediction for others + N rows; loads that change from step to step are
    served by the table predicted once (not one table a load)."""
    calls = []
    real = router_module.cost_tables
    monkeypatch.setattr(router_module, "cost_tables", lambda *a, **k: calls.append(a) or real(*a, **k))
    latency = _latency(50.0, 5.0)
    dytc = DyTC([engine.levels.get("int4")], AcceptanceTracker(), RouterConfig(levels=("int4",), lookups=()))
    prompt = [5, 6, 7, 8, 9, 10]
    engine.cache.rollback(0)
    engine.extend_prefix(prompt)
    ctx = DraftContext(engine.model, engine.cache, prompt + [11], SamplingParams(), None, engine.eos_ids, budget=50,
                       latency=latency)
    dytc.begin(ctx)
    for others in (5, 9, 3, 12):
        ctx.load = Load(rows=others, tokens=float(others), draft_ms=0.0)
        step = dytc.new_step(ctx, 16)
        assert len(step.verify_ms) == 17
        for n in (1, 2, 7, 16):
            predicted = latency.predict_mean(TARGET_LEVEL, np.array([others + n]), engine.cache.length, tree=True)[0]
            assert step.verify_ms[n] == pytest.approx(predicted, rel=1e-9), (others, n)
    assert len(calls) == 1
    engine.forget_prefix()


def test_serve_answers_concurrent_clients_from_one_batch():
    """Four clients at once against casspec serve (max_batch 4): each text the one it gets alone; /metrics counts
    batched steps wider than one."""
    httpx = pytest.importorskip("httpx")
    from casspec.serve.app import ServeConfig, background

    eng = tiny_engine("llama", seed=3, kernels="casspec", reuse_prefix=False)
    prompts = ["w5 w6 w7 w8 w5 w6 w7", "w9 w10 w11", "w12 w13 w12 w13 w12", "w20 w21 w22 w23"]
    alone = [eng.generate(p, max_new_tokens=24, chat=False).text for p in prompts]
    with background(eng, ServeConfig(model_name="tiny", max_batch=4)) as url:
        got = complete_at_once(url, prompts, 24)
        text = httpx.get(f"{url}/metrics").text
    assert got == alone
    counts = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("casspec:batch")}
    assert counts["casspec:batch_sequences_total"] > counts["casspec:batch_steps_total"] > 0
    assert 0 <= counts["casspec:batch_undrafted_total"] <= counts["casspec:batch_steps_total"]  # (the switch's)


def test_a_generation_through_the_engines_api_between_steps_leaves_the_batch_alone(engine):
    """The batch runs on caches of its own: another thread's generate between two steps (the engine's own cache)
    changes no running request's tokens."""
    prompt, req = [5, 6, 7, 8] * 3, Request(max_new_tokens=20, method="dytc")
    alone = engine.generate_ids(prompt, req).token_ids
    batch = Batch(engine, 2)
    run, _ = batch.join(prompt, req)
    assert all(slot.cache is not engine.cache for slot in batch.slots)
    while not run.done:
        batch.step()
        engine.generate_ids([9, 10, 11], Request(max_new_tokens=3, method="ar"))
    assert batch.leave(run)[0].token_ids == alone


def test_sampled_requests_in_a_batch_verify_drafts_and_keep_their_tokens(engine):
    """Sampled (seeded) pld and dytc requests on repetitive prompts, three at once: each prompt-lookup request's
    drafts are verified in the batched forwards (whether the tiny model accepts them varies), and each request's
    tokens are its tokens alone."""
    jobs = [((([5, 6, 7, 8] * 6)[:21 + i]), Request(max_new_tokens=30, method=m, seed=11 + i,
                                                    sampling=SamplingParams(0.7, 0, 1.0)))
            for i, m in enumerate(["pld", "dytc", "pld"])]
    alone = [engine.generate_ids(p, r).token_ids for p, r in jobs]
    batch, results = Batch(engine, 3), {}
    for j, (p, r) in enumerate(jobs):
        batch.join(p, r, owner=j)
    while batch.running:
        batch.step()
        for run in [r for r in batch.running if r.done]:
            results[run.owner] = batch.leave(run)[0]
    assert [results[j].token_ids for j in range(3)] == alone
    assert batch.stats.drafted > 0 and batch.stats.sequences > batch.stats.steps
    assert all(results[j].stats.speculative()["num_draft_tokens"] > 0 for j in (0, 2))  # (each pld request's)
