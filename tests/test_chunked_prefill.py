"""Prompts that join running generations a chunk a step (casspec/runtime/batch.py, `prefill_chunk`): the running
ones go on stepping meanwhile, every request gets its tokens alone (a chunk's rows the bits of the whole prompt's
forward: own attention and row-invariant products), a prompt whose cache holds its start runs only the rest, a
joining generation cancelled before its first token is given up and its cache freed, a target whose rows depend on
the split prefills whole, and casspec serve takes the setting. (Arrivals at random steps with random chunk sizes:
tests/test_batching.py's property test.)"""
from __future__ import annotations

import threading

import pytest
import torch

from casspec.runtime.batch import Batch
from casspec.runtime.request import Request
from dsia.errors import CasspecError
from dsia.model import BatchItem
from tiny import complete_at_once, tiny_engine

LONG = [3 + (7 * i) % 80 for i in range(57)]  # a prompt of 57 tokens: 8 chunks of 8


@pytest.fixture(scope="module")
def engine():
    """casspec's own dense kernel (each row's bits whatever the rows beside it), prefixes reused."""
    return tiny_engine("llama", seed=3, kernels="casspec")


def finish(batch: Batch, results: dict) -> None:
    while batch.busy:
        batch.step()
        for run in [r for r in batch.running if r.done]:
            results[run.owner] = batch.leave(run)[0]


def test_running_generations_step_while_a_long_prompt_joins_in_chunks(engine):
    assert engine.model.rows_split_alike()
    short = ([5, 6, 7, 8] * 3, Request(max_new_tokens=60, method="dytc"))
    long = (LONG, Request(max_new_tokens=12, method="ar"))
    alone = [engine.generate_ids(p, r).token_ids for p, r in (short, long)]
    batch, results = Batch(engine, 2, prefill_chunk=8), {}
    run, _ = batch.join(*short, owner=0)  # (nothing runs: its prompt whole, at once)
    assert batch.join(*long, owner=1) is None and len(batch.joining) == 1 and batch.full
    steps, started = 0, None
    while started is None:
        out = batch.step()
        steps += 1
        started = next((r for r, _ in out if r.owner == 1), None)
    assert steps == 8 and batch.stats.prompt_chunks == 8 and not batch.joining
    assert len(run.live.out) > 8  # (the short one emitted a block in each of those steps)
    stats = started.live.stats
    assert stats.reused_tokens == 0 and stats.prefill_seconds > 0 and stats.target_forwards == 1
    finish(batch, results)
    assert [results[j].token_ids for j in (0, 1)] == alone
    assert results[1].stats.first_token_seconds >= results[1].stats.prefill_seconds


def test_a_prompt_whose_cache_holds_its_start_runs_the_rest_in_chunks(engine):
    """A follow-up of the long prompt's conversation (same client): the freed cache holds the long prompt and its
    answer, so only the rest runs, in chunks; its tokens are its tokens alone."""
    other = ([5, 6, 7, 8] * 3, Request(max_new_tokens=40, method="ar"))
    batch, results = Batch(engine, 2, prefill_chunk=4), {}
    batch.join(other[0], Request(max_new_tokens=3, method="ar"), owner="before")  # (its cache then takes `other`)
    batch.join(LONG, Request(max_new_tokens=6, method="ar"), owner="first")
    finish(batch, results)
    follow = LONG + results["first"].token_ids + [9, 10, 11, 12, 13, 14, 15, 16, 17]
    alone = engine.generate_ids(follow, Request(max_new_tokens=10, method="dytc")).token_ids
    batch.join(*other, owner="other")
    assert batch.join(follow, Request(max_new_tokens=10, method="dytc"), owner="follow") is None
    reused = batch.joining[0].reused
    assert reused >= len(LONG)
    chunks = batch.stats.prompt_chunks
    finish(batch, results)
    assert results["follow"].token_ids == alone and results["follow"].stats.reused_tokens == reused
    assert batch.stats.prompt_chunks - chunks == -(-(len(follow) - reused) // 4)


def test_a_joining_generation_cancelled_before_its_first_token_is_given_up(engine):
    batch = Batch(engine, 2, prefill_chunk=4)
    batch.join([5, 6, 7, 8] * 3, Request(max_new_tokens=40, method="ar"))
    cancel = threading.Event()
    assert batch.join(LONG, Request(max_new_tokens=5, method="ar"), cancel, owner="late") is None
    batch.step()
    cancel.set()
    batch.step()
    assert batch.take_given_up() == ["late"] and batch.take_given_up() == []
    assert not batch.joining and len(batch.free) == 1 and batch.free[0].left == []  # (its cache free, forgotten)


def test_a_target_whose_rows_depend_on_the_split_prefills_whole():
    eng = tiny_engine("llama", seed=3)  # (the library's float32 products: a row's bits depend on the rows beside it)
    assert not eng.model.rows_split_alike()
    batch = Batch(eng, 2, prefill_chunk=2)
    batch.join([5, 6, 7, 8] * 3, Request(max_new_tokens=5, method="ar"))
    assert batch.join(LONG, Request(max_new_tokens=5, method="ar")) is not None and not batch.joining


def test_a_batched_forward_gives_logits_of_the_rows_asked(engine):
    """head_rows: every row's logits (None), the last one's (1, as the whole forward's last row, bit for bit), none."""
    m = engine.model
    caches = [m.new_cache(128) for _ in range(3)]
    tokens, positions = torch.tensor(LONG[:9]), torch.arange(9)
    items = [BatchItem(c, tokens, positions, 0, head_rows=n) for c, n in zip(caches, (None, 1, 0))]
    full, last, none = m.forward_batch(items)
    assert full.shape == (9, m.lm_head.shape[0]) and last.shape == (1, full.shape[1]) and none.shape[0] == 0
    assert torch.equal(last[0], full[-1])


def test_serve_takes_the_chunk_size():
    """Concurrent clients with prompts that join in chunks of 3 get their texts alone; a negative size is refused."""
    httpx = pytest.importorskip("httpx")
    from casspec.serve.app import ServeConfig, background

    with pytest.raises(CasspecError, match="prefill_chunk must be an integer >= 0"):
        ServeConfig(prefill_chunk=-1)
    eng = tiny_engine("llama", seed=3, kernels="casspec", reuse_prefix=False)
    prompts = [" ".join(f"w{5 + (3 * i + k) % 40}" for k in range(14 + 3 * i)) for i in range(4)]
    alone = [eng.generate(p, max_new_tokens=16, chat=False).text for p in prompts]
    with background(eng, ServeConfig(model_name="tiny", max_batch=4, prefill_chunk=3)) as url:
        got = complete_at_once(url, prompts, 16)
        chunks = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                  if line.startswith("casspec:batch_prompt_chunks_total")]
    assert got == alone
    assert chunks and float(chunks[0].split()[1]) > 0


def test_a_call_whose_deadline_passes_while_its_prompt_runs_in_chunks_gets_503():
    """A call joins a running one (a continuation with no EOS for 2,000 tokens) with a 4,000-token prompt run a token
    a step (about 0.3 ms a step at the least, here): its deadline, 0.25 s, passes before its first token, so it is
    given up (503, timeout) and counted, where its prompt's forward whole would have answered in time."""
    httpx = pytest.importorskip("httpx")
    from casspec.serve.app import ServeConfig, background
    from casspec.serve.calls import Limits

    eng = tiny_engine("llama", seed=0, kernels="casspec", reuse_prefix=False, max_pos=8192)
    cfg = ServeConfig(model_name="tiny", max_batch=2, prefill_chunk=1,
                      limits=Limits(max_prompt_tokens=5000, request_timeout=0.25))
    with background(eng, cfg) as url:
        got: dict = {}
        first = threading.Thread(target=lambda: got.update(first=httpx.post(
            f"{url}/v1/completions", timeout=30, json={"prompt": "w10 w20 w30 w40", "max_tokens": 2000,
                                                       "temperature": 0})))
        first.start()
        while httpx.get(f"{url}/health").json()["running"] == 0:
            pass
        r = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "prompt": " ".join(f"w{5 + i % 80}" for i in range(4000)), "max_tokens": 4, "temperature": 0})
        first.join(timeout=30)
        timeouts = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                    if line.startswith("casspec:request_timeout_total")]
    assert r.status_code == 503 and r.json()["error"]["code"] == "timeout"
    assert "before its prompt's forward ended" in r.json()["error"]["message"]
    assert got["first"].json()["choices"][0]["finish_reason"] == "length"  # (at its own deadline)
    assert float(timeouts[0].split()[1]) == 2
