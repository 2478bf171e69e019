"""The zero-cost sources that remember earlier generations (issue 35): Token Recycling's adjacency table
(dytc/recycle.py), SuffixDecoding's suffix trees (dytc/suffix.py), one memory per client (dytc/shared.py), and
dytc / vc drafting with them: token for token `ar`'s in float32 (greedy and sampled with a seed), their drafts
verified, one client's text never drafting for another's."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from casspec.runtime.engine import Request
from dytc.recycle import RECYCLE_MIN_PROB, Recycled, RecycleLookup
from dytc.router import RouterConfig
from dytc.sampling import SamplingParams
from dytc.shared import SharedDrafts, new_lookup
from dytc.sources import BOTTOMS, FREE
from dytc.suffix import KEY, SuffixConfig, SuffixIndex, SuffixLookup
from dytc.verify import Noise
from tiny import tiny_engine

FIXED_COSTS = RouterConfig(constant_cost=0.3)  # routing independent of this machine's timings


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", seed=3)


# ---------------------------------------------------------------------------------------------- the suffix tree
def substring_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """How often each token string of up to `depth` tokens occurs in the sequences (brute force)."""
    out: dict[tuple[int, ...], int] = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                out[tuple(s[i:j])] = out.get(tuple(s[i:j]), 0) + 1
    return out


def tree_counts(index: SuffixIndex) -> dict[tuple[int, ...], int]:
    """Each node's string and count, read from the tree's edges; and (checked on the way) each node's most frequent
    child is one of the children with the highest count."""
    parent = {c: (key // KEY, key % KEY) for key, c in index.edges.items()}

    def string(c: int) -> tuple[int, ...]:
        return () if c == 0 else string(parent[c][0]) + (parent[c][1],)

    children: dict[int, list[int]] = {}
    for c, (v, _) in parent.items():
        children.setdefault(v, []).append(c)
    for v in range(len(index.count)):
        kids = children.get(v, [])
        assert index.kids[v] == len(kids) or v in index.free
        if kids:
            assert index.count[index.top[v]] == max(index.count[c] for c in kids) and index.top[v] in kids
    return {string(c): index.count[c] for c in parent}


@settings(max_examples=40, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 5), max_size=30), min_size=1, max_size=5), depth=st.integers(2, 6),
       chunk=st.integers(1, 7))
def test_the_suffix_tree_counts_every_string_up_to_its_depth(seqs, depth, chunk):
    index = SuffixIndex(depth)
    for s in seqs:
        seq = index.new_sequence()
        for i in range(0, len(s), chunk):  # appended in pieces, as a generation's steps do
            index.append(seq, s[i:i + chunk])
    assert tree_counts(index) == substring_counts(seqs, depth)
    assert index.nodes == 1 + len(tree_counts(index))


@settings(max_examples=30, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=25), min_size=2, max_size=6),
       budget=st.integers(5, 80))
def test_the_global_tree_evicts_its_oldest_sequences_past_its_node_budget(seqs, budget):
    index = SuffixIndex(5, max_nodes=budget)
    for s in seqs:
        seq = index.new_sequence()
        index.append(seq, s)
        index.close(seq)
    kept = list(index.sequences.values())
    assert kept == seqs[len(seqs) - len(kept):]  # the newest, in order
    assert index.nodes <= budget or len(kept) == 1
    assert tree_counts(index) == substring_counts(kept, 5)  # (what eviction took back is gone, the rest exact)
    assert index.evicted == len(seqs) - len(kept)


def test_the_suffix_source_copies_the_most_frequent_continuation():
    text = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 9, 1, 2]
    lookup = SuffixLookup(text)
    tokens, match = lookup.propose_after([], 4)
    assert tokens[:2] == [3, 4] and match == 2  # after "1 2": "3" thrice, then "4" twice against "5" once
    assert lookup.propose_after([3], 1) == ([4], 3)
    assert lookup.propose_after([7], 3) == ([], 0)  # "7" never occurred


def test_the_suffix_source_cuts_rare_continuations():
    text = [1, 2]
    seqs = [[1, 2, i] for i in range(20)]  # after "1 2" each of 20 tokens once: 1/20 < the cut
    assert 1 / 20 < SuffixConfig().min_prob
    index = SuffixIndex()
    for s in seqs:
        index.append(index.new_sequence(), s)
    assert SuffixLookup(text, index).propose_after([], 4) == ([], 0)
    assert SuffixLookup(text, index).propose_after([5], 4) == ([], 0)  # ("2 5" never continues)


def test_the_clients_tree_drafts_an_earlier_generations_text():
    index = SuffixIndex()
    earlier = SuffixLookup([40, 41, 42], index)
    earlier.extend([10, 11, 12, 13, 14, 15])
    earlier.finish()
    assert index.stats()["sequences"] == 1 and index.stats()["tokens"] == 9 and not index.open
    now = SuffixLookup([40, 41, 42, 10, 11], index)
    assert now.propose_after([], 4) == ([12, 13, 14, 15], 5)
    assert SuffixLookup([40, 41, 42, 10, 11]).propose_after([], 4) == ([], 0)  # (its own tree alone)


def test_a_growing_sequence_is_never_evicted():
    index = SuffixIndex(4, max_nodes=10)
    old = SuffixLookup([1, 2, 3], index)
    old.finish()
    now = SuffixLookup(list(range(20, 40)), index)  # (far past the budget: only the closed sequence can go)
    assert list(index.sequences) == [now.seq] and index.evicted == 1
    assert now.propose_after([], 3) == ([], 0)  # (nothing repeats in it)


# ------------------------------------------------------------------------------------------------ recycling
def test_recycled_rows_follow_the_target_and_levels_fill_only_the_rest():
    table = Recycled(k=3)
    logp = np.log(np.array([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05]], dtype=np.float32)).tolist()
    table.update([5, 6], [[7, 8, 9], [1, 2, 3]], logp, from_target=False)
    table.update([5], [[11, 12, -1]], np.log([[0.7, 0.2, 0.1]]).tolist(), from_target=True)
    table.update([5], [[20, 21, 22]], logp[:1], from_target=False)  # (the target's row stays)
    assert table.rows[5][0] == [11, 12] and table.rows[6][0] == [1, 2, 3]
    lookup = RecycleLookup([0, 5], table, eos_ids={2})
    assert lookup.propose_after([], 5) == ([11], 3)  # 0.7: belief 1 + its quartile; 11 has no row: stop
    assert lookup.propose_after([6], 5) == ([1], 1)  # a level's row: belief 1
    assert lookup.alternative([], {11}, 5) == ([12], 1)  # the next branch at the root
    assert lookup.alternative([6], {1}, 5) == ([], 0)  # 2 is an EOS: nothing after 6 but 1


def test_a_recycled_chain_stops_below_its_minimum_probability():
    table = Recycled(k=2)
    p = RECYCLE_MIN_PROB / 2
    table.update([1, 2], [[2, 3], [3, 4]], np.log([[0.9, 0.1], [p, p]]).tolist())
    assert RecycleLookup([1], table).propose_after([], 5) == ([2], 4)


def test_a_coupled_recycled_draft_is_the_argmax_of_its_log_probabilities_plus_the_noise():
    table = Recycled(k=4)
    cand, probs = [10, 11, 12, 13], [0.4, 0.3, 0.2, 0.1]
    table.update([3], [cand], np.log([probs]).tolist())
    noise, T = Noise(seed=5, vocab=64), 0.7
    history = [1, 2, 3]
    g = noise(len(history), torch.tensor(cand)).tolist()
    want = cand[int(np.argmax([math.log(p) / T + gi for p, gi in zip(probs, g)]))]
    assert RecycleLookup(history, table, noise=noise, temperature=T).propose_after([], 1)[0] == [want]


def test_each_client_has_its_own_memory_and_the_oldest_is_dropped():
    shared = SharedDrafts(max_clients=2)
    a, b = shared.memory("a"), shared.memory("b")
    assert a is not b and shared.memory("a") is a
    shared.memory("c")  # "b" was used least recently
    assert set(shared.clients) == {"a", "c"}
    a.table(True).remember(True, ([4], [[5]], [[0.0]]))
    assert a.table(True).rows[4][0] == [5] and not a.table(False).rows


def test_the_memories_total_is_bounded_and_the_asking_clients_is_kept():
    one = SharedDrafts()
    SuffixLookup(list(range(300)), one.memory("x").suffix_index()).finish()
    size = one.nbytes()  # (a client's tree of 300 tokens)
    shared = SharedDrafts(max_bytes=int(2.5 * size))
    for name in ("a", "b", "c"):  # (each checked as its generation starts, then filled)
        SuffixLookup(list(range(300)), shared.memory(name).suffix_index()).finish()
    assert list(shared.clients) == ["a", "b", "c"] and shared.nbytes() == 3 * size
    shared.memory("b")  # (the next generation's start: past the total, the least recently used goes)
    assert list(shared.clients) == ["c", "b"] and shared.nbytes() == 2 * size
    shared.memory("d")
    assert list(shared.clients) == ["c", "b", "d"]
    alone = SharedDrafts(max_bytes=1)
    SuffixLookup(list(range(100)), alone.memory("x").suffix_index()).finish()
    assert list(alone.clients) == ["x"] and alone.memory("x").suffixes.stats()["sequences"] == 1


# ------------------------------------------------------------------------------------------------- lossless
PROMPTS = st.lists(st.integers(3, 90), min_size=1, max_size=24)


@settings(max_examples=10, deadline=None)
@given(prompts=st.lists(PROMPTS, min_size=1, max_size=4), bottom=st.sampled_from(["recycle", "suffix", "free", "all"]),
       no_levels=st.booleans(), n=st.integers(1, 40))
def test_dytc_with_the_new_sources_is_ar_token_for_token(engine, prompts, bottom, no_levels, n):
    prompts = prompts + prompts[:1]  # (a question again: the global tree holds its answer)
    for p in prompts:
        ar = engine.generate_ids(p, Request(max_new_tokens=n, method="ar")).token_ids
        req = Request(max_new_tokens=n, method="dytc", bottom=bottom, router=FIXED_COSTS, tenant="lossless",
                      levels=("none",) if no_levels else ())
        assert engine.generate_ids(p, req).token_ids == ar


@pytest.mark.parametrize("method", ["dytc", "vc"])
@pytest.mark.parametrize("bottom", list(FREE) + ["maxgram+free"])
def test_sampled_drafts_from_the_new_sources_are_verified_and_keep_ars_tokens(engine, method, bottom):
    """Sampled with a seed, every method gives ar's tokens (position-owned noise); the new sources' drafts were
    verified: drafted, tested, and where the tiny model agrees accepted."""
    engine.shared.forget()
    rng = random.Random(7)
    drafted = new = 0
    for i in range(4):
        p = ([rng.randrange(3, 40) for _ in range(5)] * 3)[:rng.randrange(6, 15)]
        kw = dict(max_new_tokens=40, sampling=SamplingParams(0.7, 0, 1.0), seed=100 + i)
        ar = engine.generate_ids(p, Request(method="ar", **kw)).token_ids
        res = engine.generate_ids(p, Request(method=method, bottom=bottom, tenant="s", **kw,
                                             **({"router": FIXED_COSTS} if method == "dytc" else {})))
        assert res.token_ids == ar
        drafted += res.stats.speculative()["num_draft_tokens"]
        if method == "dytc":  # (its sources: the bottom's and the default levels)
            by_source = res.stats.policy["drafted_by_source"]
            known = {s + x for s in BOTTOMS[bottom] + ("int4", "int4+vocab", "int8") for x in ("", "=", "!", "#sib")}
            assert set(by_source) <= known
            new += sum(k for s, k in by_source.items() if s.rstrip("=!") in FREE)
    assert drafted > 0
    assert method != "dytc" or new > 0  # (dytc's drafts from the new sources among them)
    if "recycle" in BOTTOMS[bottom]:  # (sampling's table learned from the verifications)
        assert engine.shared.memory("s").table(False).rows


def test_one_clients_text_never_drafts_for_another(engine):
    """The engine files a generation under its request's tenant: alice's answer drafts for alice's next request,
    and bob, asking the same, gets nothing of it."""
    engine.shared.forget()
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    res = engine.generate_ids(prompt, Request(max_new_tokens=30, method="dytc", bottom="free", tenant="alice",
                                              router=FIXED_COSTS))
    answer = res.token_ids
    alice = engine.shared.memory("alice")
    assert alice.suffixes is not None and alice.suffixes.stats()["tokens"] == len(prompt) + len(answer)
    assert alice.table(True).rows  # (the target's rows of its verifications)
    bob = engine.shared.memory("bob")
    assert bob.suffixes is None and not bob.recycled
    asked_again = prompt + answer[:1]
    mine = new_lookup("suffix", asked_again, (), engine.shared.memory("alice"))
    theirs = new_lookup("suffix", asked_again, (), engine.shared.memory("bob"))
    assert mine.propose_after([], 8)[0] == answer[1:9]
    assert theirs.propose_after([], 8) == ([], 0) or theirs.propose_after([], 8)[0] != answer[1:9]
    assert new_lookup("recycle", asked_again, (), engine.shared.memory("bob")).propose_after([], 4) == ([], 0)


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 4), max_size=30), max_size=3),
       text=st.lists(st.integers(0, 4), max_size=30), extra=st.lists(st.integers(0, 4), max_size=8),
       depth=st.integers(3, 8), max_len=st.integers(1, 10))
def test_matching_from_the_open_suffixes_equals_matching_the_whole_text(seqs, text, extra, depth, max_len):
    index = SuffixIndex(depth)
    for s in seqs:
        seq = index.new_sequence()
        index.append(seq, s)
        index.close(seq)
    seq = index.new_sequence()
    index.append(seq, text)
    want = index.match(text + extra, max_len)
    got = index.match_after(seq, extra, max_len)
    assert got[1] == want[1] and (want[1] == 0 or got[0] == want[0])
