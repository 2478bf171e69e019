"""Prompt prefixes kept across generations (casspec/runtime/prefixes.py): a finished generation's KV is kept per
client, a later prompt of the same client that starts with its tokens copies it into whichever cache it runs on and
gets the tokens it gets with a fresh prefill; another client's prompt never finds it; the store holds at most its
byte budget, least recently used dropped."""
from __future__ import annotations

import pytest
import torch

from casspec.runtime.batch import Batch
from casspec.runtime.live import CacheSlot
from casspec.runtime.prefixes import PrefixStore, check_megabytes
from casspec.runtime.request import Request
from casspec.serve.app import ServeConfig
from dsia.errors import CasspecError
from dsia.kvcache import KVCache
from tiny import tiny_engine


@pytest.fixture(scope="module")
def engine():
    """casspec's own dense kernel: a row's bits whatever the rows beside it, so that a prompt's last token run alone
    after a copied prefix gives the logits its prefill gave."""
    return tiny_engine("llama", seed=3, kernels="casspec")


def run(batch: Batch, prompt: list[int], req: Request) -> tuple[list[int], int]:
    """One generation through the batch alone: its tokens and the prompt tokens it did not compute."""
    batch.join(prompt, req)
    while batch.running:
        batch.step()
        for r in [r for r in batch.running if r.done]:
            result = batch.leave(r)[0]
    return result.token_ids, result.stats.reused_tokens


def test_a_prompt_takes_its_clients_kept_prefix_after_its_cache_was_taken(engine):
    a, b = [5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44]
    req = Request(max_new_tokens=12, method="dytc", tenant="alice")
    fresh = engine.generate_ids(a, Request(max_new_tokens=12, method="ar")).token_ids
    for kept in (None, PrefixStore(64 << 20)):
        batch = Batch(engine, 1, prefixes=kept)  # one cache: b's generation overwrites what a left there
        first, reused = run(batch, a, req)
        assert first == fresh and reused == 0
        assert run(batch, b, req)[1] == 0
        again, reused = run(batch, a, req)
        assert again == fresh
        if kept is None:
            assert reused == 0 and batch.stats.prefix_hits == 0
        else:
            assert reused == len(a) - 1 and batch.stats.prefix_hits == 1 and batch.stats.prefix_tokens == len(a) - 1
            # a longer prompt of the same conversation (its prompt, answer, a new turn) takes all of it
            turn = a + first + [60, 61]
            assert run(batch, turn, req)[1] >= len(a) + len(first) - 1
            # another client's identical prompt finds nothing of alice's
            other, reused = run(batch, a, Request(max_new_tokens=12, method="dytc", tenant="bob"))
            assert other == fresh and reused == 0


def test_an_engine_that_reuses_no_prefix_keeps_none():
    e = tiny_engine("llama", seed=3, kernels="casspec", reuse_prefix=False)
    kept = PrefixStore(64 << 20)
    batch = Batch(e, 1, prefixes=kept)
    prompt, req = [5, 6, 7, 8, 9], Request(max_new_tokens=6, method="ar")
    assert run(batch, prompt, req)[1] == 0 and run(batch, prompt, req)[1] == 0
    assert not kept.entries and batch.stats.prefix_hits == 0


def cache_of(tokens: list[int]) -> KVCache:
    """A KV cache committed over `tokens`, each slot's values its token (so that a copy can be checked)."""
    cache = KVCache(2, 1, 4, 128, torch.float32)
    values = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None].expand(2, 1, len(tokens), 4)
    cache.load(values, -values)
    return cache


def test_the_store_keeps_at_most_its_budget_least_recently_used_first():
    per_token = 2 * 2 * 1 * 4 * 4  # k and v, 2 layers, 1 head, 4 floats
    store = PrefixStore(25 * per_token)
    store.keep("t", [1, 2, 3, 4, 5], cache_of([1, 2, 3, 4, 5]))
    store.keep("t", [1, 2, 3, 4, 5, 6, 7], cache_of([1, 2, 3, 4, 5, 6, 7]))  # extends it: replaces it
    store.keep("t", [1, 2, 3], cache_of([1, 2, 3]))  # held already
    assert [held for _, held in store.entries] == [(1, 2, 3, 4, 5, 6, 7)] and store.nbytes == 7 * per_token
    store.keep("t", list(range(10, 20)), cache_of(list(range(10, 20))))
    n, kept = store.longest("t", [1, 2, 3, 4, 9])
    assert n == 4 and kept.tokens[:4] == (1, 2, 3, 4)
    slot_cache = KVCache(2, 1, 4, 64, torch.float32)
    slot = CacheSlot(slot_cache)
    store.restore("t", kept, n, slot)
    assert slot_cache.length == 4 and slot.reusable([1, 2, 3, 4, 9]) == 4
    assert torch.equal(slot_cache.k[0, 0, :4, 0], torch.tensor([1.0, 2, 3, 4]))
    assert torch.equal(slot_cache.v[1, 0, :4, 3], -torch.tensor([1.0, 2, 3, 4]))
    store.keep("t", list(range(30, 40)), cache_of(list(range(30, 40))))  # 27 tokens held: the oldest goes
    assert store.nbytes <= store.max_bytes and len(store.entries) == 2
    assert store.longest("t", list(range(10, 20)))[1] is None  # (restoring the first kept it used)
    assert store.longest("t", [1, 2, 3])[0] == 2 and store.longest("u", [1, 2, 3])[1] is None
    store.keep("t", list(range(100)), cache_of(list(range(100))))  # larger than the budget: not kept
    assert len(store.entries) == 2


def test_a_bad_size_is_one_clear_error():
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(CasspecError, match="prefix cache size"):
            check_megabytes(bad)
    with pytest.raises(CasspecError, match="prefix cache size"):
        ServeConfig(prefix_cache_mb=-1)
    assert ServeConfig(prefix_cache_mb=0).prefix_cache_mb == 0
