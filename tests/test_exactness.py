"""Float32 exactness, all of it against plain `ar`: every draft strategy's levels under sd and tree, every method
at the end of the context window, and EOS tokens and stop strings that fall inside an accepted block."""
from __future__ import annotations

import functools

import pytest

from casspec.runtime import stats as stats_module
from casspec.runtime.engine import Request
from casspec.runtime.method_table import METHODS
from dsia.qkernels import w8a8_available
from dytc.router import RouterConfig
from tiny import tiny_engine

LEVELS = ("int8", "int4", "nf4", "w8a8", "bf16", "skip0.3", "exit2", "sparse0.5", "vocab", "int4+vocab", "int8+skip0.2")
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 10, 11, 5, 6, 7]  # repeats, so that the lookups find matches


@functools.lru_cache(maxsize=None)
def engine(max_context: int | None = None):
    return tiny_engine("llama", 3, max_context=max_context)


# dytc with constant costs: its routing (and so where its blocks fall) must not depend on this machine's timings
FIXED_COSTS = RouterConfig(constant_cost=0.3)


def request(method: str, n: int, **kw) -> Request:
    """(sd and tree: their default level; dytc: constant costs)"""
    fixed = {"router": FIXED_COSTS} if method == "dytc" else {}
    return Request(max_new_tokens=n, method=method, **fixed, **kw)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("method", ["sd", "tree"])
def test_every_strategy_drafts_losslessly(method, level):
    if level.startswith("nf4"):
        pytest.importorskip("bitsandbytes")
    if level == "w8a8" and not w8a8_available():
        pytest.skip("needs torch's fbgemm kernels")
    e = engine()
    ar = e.generate_ids(PROMPT, Request(method="ar", max_new_tokens=40))
    spec = e.generate_ids(PROMPT, Request(max_new_tokens=40, method=method, level=level))
    assert spec.token_ids == ar.token_ids
    assert spec.stats.draft_forwards > 0  # the level really drafted


@pytest.mark.parametrize("method", METHODS)
def test_every_method_at_the_context_end(method):
    e = engine(max_context=48)
    ar = e.generate_ids(PROMPT, Request(method="ar", max_new_tokens=200))
    spec = e.generate_ids(PROMPT, request(method, 200))
    assert ar.stats.finish_reason == "context"
    assert spec.token_ids == ar.token_ids and spec.stats.finish_reason == "context"


def blocks_of(e, prompt: list[int], req: Request, monkeypatch) -> tuple[list[int], list[int]]:
    """(tokens, block ends): the end index (exclusive) of each step's emitted block, from the engine's stats."""
    ends = [1]  # the prefill emits the first token
    real = stats_module.Stats.record_step

    def record(self, draft_nodes, accepted, *a, **kw):
        ends.append(ends[-1] + accepted + 1)
        return real(self, draft_nodes, accepted, *a, **kw)

    monkeypatch.setattr(stats_module.Stats, "record_step", record)
    res = e.generate_ids(prompt, req)
    monkeypatch.setattr(stats_module.Stats, "record_step", real)
    return res.token_ids, ends


def inside_block(ends: list[int], k: int) -> bool:
    """Whether token k was emitted in a block that went on past it (not the block's last token)."""
    return any(start <= k < end - 1 for start, end in zip([0] + ends, ends))


# (pld's blocks on a tiny random model come from its output cycling, where every token has occurred before: an EOS
# there would have ended the generation earlier; its EOS handling is the same code as every other method's)
DRAFTING = [m for m in METHODS if m not in ("ar", "pld")]


@pytest.mark.parametrize("method", DRAFTING)
def test_eos_inside_an_accepted_block_ends_where_ar_ends(method, monkeypatch):
    inside = 0
    for seed in (3, 4, 5, 6):  # (the EOS may change the drafts: try until one lands inside a block)
        e = tiny_engine("llama", seed)
        free, ends = blocks_of(e, PROMPT, request(method, 40), monkeypatch)
        for k in [k for k in range(1, len(free)) if inside_block(ends, k) and free[k] not in free[:k]][:8]:
            e.eos_ids = frozenset({free[k]})
            ar = e.generate_ids(PROMPT, Request(method="ar", max_new_tokens=40))
            tokens, ends_eos = blocks_of(e, PROMPT, request(method, 40), monkeypatch)
            assert ar.token_ids == free[:k + 1] and tokens == ar.token_ids
            inside += ends_eos[-1] > k + 1  # the last step's block went past the EOS (its tail was dropped)
        if inside:
            break
    assert inside, "no EOS fell inside an accepted block"


@pytest.mark.parametrize("method", DRAFTING)
def test_stop_string_inside_an_accepted_block_ends_where_ar_ends(method, monkeypatch):
    e = engine()
    free, ends = blocks_of(e, PROMPT, request(method, 40), monkeypatch)
    text = e.decode  # (special tokens decode to nothing: a stop string is made of two visible tokens)
    candidates = [k for k in range(1, len(free)) if inside_block(ends, k) and text(free[k - 1:k]).strip()
                  and text(free[k:k + 1]).strip() and text(free[k - 1:k + 1]) not in text(free[:k])]
    assert candidates, "no multi-token block to put a stop string in"
    k = candidates[0]
    stop = text(free[k - 1:k + 1])  # first completed by token k, inside a block
    ar = e.generate_ids(PROMPT, Request(method="ar", max_new_tokens=40, stop=(stop,)))
    res = e.generate_ids(PROMPT, request(method, 40, stop=(stop,)))
    assert ar.stats.finish_reason == "stop" == res.stats.finish_reason
    assert ar.token_ids == free[:k + 1]
    assert res.token_ids == ar.token_ids and res.text == ar.text
