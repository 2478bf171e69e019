"""Draft levels: names round-trip, each strategy changes exactly what it should, the target and the committed
KV prefix are never touched by a draft pass, and the skip search beats a contiguous skip."""
import itertools
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsia.errors import CasspecError
from dsia.exit import ExitSwitch
from dsia.levels import STRATEGIES, LevelConfig, LevelRegistry
from dsia.model import Transformer
from dsia.plan import Plan
from dsia.skip import (SkipSearch, SkipSearchConfig, SkipSwitch, contiguous_skips, score_window, skip_plan,
                       skippable)
from dsia.strategy import Resources, Strategy, Switch
from dsia.vocab import VocabConfig, VocabHead, VocabSwitch
from tiny import tiny_model

NAMES = ["int8", "int4", "nf4", "skip0.4", "exit24", "sparse0.5", "vocab", "int4+sparse0.5", "int4+vocab",
         "int4+skip0.2+vocab", "int8+exit12+sparse0.25"]


@pytest.mark.parametrize("name", NAMES)
def test_names_round_trip(name):
    cfg = LevelConfig.parse(name)
    assert cfg.name == name
    assert LevelConfig.parse("+".join(reversed(name.split("+")))).name == name  # any order, one canonical name


@pytest.mark.parametrize("bad", ["int5", "skip1.5", "skip0", "exit0", "sparse1", "int4+int8", "", "int4+",
                                 "vocab+vocab", "fast"])
def test_bad_names_get_a_clear_error(bad):
    with pytest.raises(CasspecError, match="unknown level"):
        LevelConfig.parse(bad)


# ---------------------------------------------------------------------- the registry
EXAMPLES = {"int8": "int8", "int4": "int4", "int3": "int3", "int2": "int2", "nf4": "nf4", "w8a8": "w8a8",
            "bf16": "bf16",
            "skipR (0 < R < 1)": "skip0.3", "exitL (1 <= L < layers)": "exit2", "sparseS (0 < S < 1)": "sparse0.5",
            "vocab": "vocab"}  # form -> name


def test_every_registered_form_parses_and_round_trips():
    assert [form for cls in STRATEGIES for form in cls.FORMS] == list(EXAMPLES)  # one example per form, in order
    for cls in STRATEGIES:
        for form in cls.FORMS:
            (strategy,) = LevelConfig.parse(EXAMPLES[form]).strategies
            assert type(strategy) is cls and strategy.name == EXAMPLES[form] and cls.parse(strategy.name) == strategy


def test_a_mix_in_any_order_gets_the_canonical_name():
    parts = ["int4", "skip0.2", "exit3", "sparse0.5", "vocab"]  # one per strategy, in canonical order
    for perm in itertools.permutations(parts):
        assert LevelConfig.parse(" + ".join(perm)).name == "+".join(parts)


def test_an_unknown_part_lists_the_registered_forms():
    with pytest.raises(CasspecError) as e:
        LevelConfig.parse("int4+fast")
    assert str(e.value) == ("unknown level 'int4+fast' ('fast' is not a level form): use int8, int4, int3, int2, "
                            "nf4, w8a8, bf16, skipR (0 < R < 1), exitL (1 <= L < layers), sparseS (0 < S < 1), vocab, "
                            "or mixes joined by '+', e.g. int4+sparse0.5")
    with pytest.raises(CasspecError, match=r"skip is given twice"):
        LevelConfig.parse("skip0.2+int8+skip0.3")


@dataclass(frozen=True)
class Halve(Strategy):
    """A test-only strategy, `half`: exit after half of the layers."""

    FORMS: ClassVar[tuple[str, ...]] = ("half",)
    KEY: ClassVar[str] = "half"

    @classmethod
    def parse(cls, part: str) -> "Halve | None":
        return cls() if part == "half" else None

    @property
    def name(self) -> str:
        return "half"

    def bind(self, resources: Resources) -> Switch:
        return ExitSwitch(resources.model.spec.n_layers // 2)


@torch.no_grad()
def test_a_new_strategy_is_one_class_and_one_registry_line(rt):
    strategies = STRATEGIES + (Halve,)  # a copy: the default registry is untouched
    assert LevelConfig.parse("half+int8", strategies).name == "int8+half"
    with pytest.raises(CasspecError, match="'half' is not a level form"):
        LevelConfig.parse("half")
    with pytest.raises(CasspecError, match="vocab, half, or mixes"):
        LevelConfig.parse("fast", strategies)
    level = LevelRegistry(rt, strategies).get("half+vocab")
    assert level.name == "vocab+half" and level.plan.exit_after == 3 and not level.writes_all_layers
    cache, ids = prefilled(rt)
    level.begin(rt, cache, ids)
    L = cache.length
    tok, pos = torch.tensor(ids[-1:]), torch.tensor([L])
    ref = rt.forward(cache, tok, pos, L, plan=Plan(exit_after=3, head=level.switch(VocabSwitch).head))
    assert torch.equal(level.forward(rt, cache, tok, pos, L), ref)


@pytest.fixture(scope="module")
def rt():
    return Transformer.from_hf(tiny_model("llama", seed=3, layers=6, dim=128, heads=4, kv_heads=2, vocab=101))


def prefilled(rt, n=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 101, (n,), generator=g).tolist()
    cache = rt.new_cache(128)
    rt.forward(cache, torch.tensor(ids[:-1]), torch.arange(n - 1), 0)
    cache.commit(list(range(n - 1)))
    return cache, ids


@torch.no_grad()
def test_level_with_nothing_switched_on_equals_target(rt):
    cache, ids = prefilled(rt)
    L = cache.length
    tok, pos = torch.tensor(ids[-1:]), torch.tensor([L])
    assert torch.equal(rt.forward(cache, tok, pos, L), rt.forward(cache, tok, pos, L, plan=Plan()))


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(["int8", "int4", "nf4", "skip0.3", "exit3", "sparse0.5", "vocab", "int4+vocab",
                             "int8+skip0.2+sparse0.5"]), seed=st.integers(0, 50), T=st.integers(1, 6))
@torch.no_grad()
def test_draft_pass_never_touches_the_committed_prefix_or_weights(rt, name, seed, T):
    pytest.importorskip("bitsandbytes") if "nf4" in name else None
    reg = LevelRegistry(rt)
    level = reg.get(name)
    cache, ids = prefilled(rt, seed=seed)
    level.begin(rt, cache, ids)
    L = cache.length
    k_before, v_before = cache.k[:, :, :L].clone(), cache.v[:, :, :L].clone()
    weights = [t.clone() for t in (rt.embed, rt.lm_head, rt.layers[1].wq, rt.layers[2].w_down)]
    logits = level.forward(rt, cache, torch.tensor(ids[-T:]), torch.arange(L, L + T), L)
    assert logits.shape == (T, 101)
    level.observe(rt, cache, ids, ids[-2:])
    assert torch.equal(cache.k[:, :, :L], k_before) and torch.equal(cache.v[:, :, :L], v_before)
    assert cache.length == L
    assert all(torch.equal(a, b) for a, b in zip(weights, (rt.embed, rt.lm_head, rt.layers[1].wq,
                                                           rt.layers[2].w_down)))
    assert level.extra_bytes >= 0


@torch.no_grad()
def test_each_strategy_switches_exactly_its_part(rt):
    reg = LevelRegistry(rt)
    assert reg.get("exit3").plan.exit_after == 3 and not reg.get("exit3").plan.linears
    int8 = reg.get("int8")
    assert set(int8.plan.linears) == {(i, p) for i in range(6) for p in ("o", "down")}
    assert set(int8.plan.fused) == {(i, g) for i in range(6) for g in ("qkv", "gate_up")}
    assert not int8.plan.skip_attn and not int8.plan.mlps and int8.plan.exit_after is None
    assert reg.get("int8+vocab").plan.linears is int8.plan.linears  # the quantized copy is shared
    sparse = reg.get("sparse0.5")
    cache, ids = prefilled(rt)
    sparse.begin(rt, cache, ids)
    assert set(sparse.plan.mlps) == set(range(6)) and not sparse.plan.linears
    skip = reg.get("skip0.25")
    assert len(skip.plan.skip_attn) + len(skip.plan.skip_mlp) == 3  # 25% of 12 sublayers
    assert 0 not in skip.plan.skip_attn | skip.plan.skip_mlp and 5 not in skip.plan.skip_attn | skip.plan.skip_mlp
    vocab = reg.get("vocab")
    vocab.begin(rt, cache, ids)
    L = cache.length
    logits = vocab.forward(rt, cache, torch.tensor(ids[-1:]), torch.tensor([L]), L)
    allowed = vocab.switch(VocabSwitch).head.member
    assert torch.isinf(logits[0, ~allowed]).all() and torch.isfinite(logits[0, allowed]).all()


@torch.no_grad()
def test_the_skip_search_scores_over_the_other_switches(rt):
    level = LevelRegistry(rt).get("int8+skip0.2+vocab")
    search = level.switch(SkipSwitch).search
    seen = []
    search.step = lambda model, cache, history, base=None: seen.append(base)  # record what it is scored over
    cache, ids = prefilled(rt)
    level.begin(rt, cache, ids)
    level.observe(rt, cache, ids, ids[-2:])
    (base,) = seen
    assert base.linears is level.plan.linears and base.head is level.switch(VocabSwitch).head
    assert not base.skip_attn and not base.skip_mlp and level.plan.skip_attn | level.plan.skip_mlp


@torch.no_grad()
def test_kv_writes_and_memory_follow_the_switches(rt):
    reg = LevelRegistry(rt)
    cache, ids = prefilled(rt)
    for name in ["int8", "skip0.3", "skip0.1", "exit3", "sparse0.5", "vocab", "int8+skip0.2+sparse0.5"]:
        level = reg.get(name)
        level.begin(rt, cache, ids)
        for _ in range(3):
            level.observe(rt, cache, ids, [])
        assert level.writes_all_layers == (not level.plan.skip_attn and level.plan.exit_after is None), name
    int8, mix = reg.get("int8"), reg.get("int8+vocab")
    assert int8.holds[0] is mix.holds[0]  # the quantized copy is shared: count it once
    assert mix.extra_bytes == int8.extra_bytes + reg.get("vocab").extra_bytes
    assert reg.get("sparse0.5").holds == reg.get("int8+skip0.2+sparse0.5").holds[1:]
    assert not reg.get("exit3").holds and reg.get("exit3").extra_bytes == 0
    with pytest.raises(CasspecError, match=r"^level exit6: exit layer must be in \[1, 5\] for this model$"):
        reg.get("exit6")


def test_vocab_head_scores_subset_exactly():
    head = torch.randn(50, 8)
    vh = VocabHead(lambda idx: head.index_select(0, idx), (50, 8), head.device,
                   VocabConfig(frequent=10, capacity=20, dtype=torch.float32))
    vh.add([30, 31, 30, 3])
    assert vh.n == 12
    h = torch.randn(2, 8)
    out = vh(h)
    full = h @ head.t()
    ids = list(range(10)) + [30, 31]
    assert torch.allclose(out[:, ids], full[:, ids], atol=1e-5)
    assert torch.isinf(out[:, 10:30]).all()
    vh.add(range(32, 50))  # capacity 20: only 8 more fit
    assert vh.n == 20
    vh.reset()
    assert vh.n == 10 and not vh.member[30]


@torch.no_grad()
def test_skip_search_beats_contiguous_skip():
    """On a tiny model whose middle layers are weak, the search finds them; the contiguous block does worse."""
    hf = tiny_model("llama", seed=4, layers=8, dim=64, vocab=61)
    with torch.no_grad():  # make layers 2..4 nearly identity: the right sublayers to skip
        for i in (2, 3, 4):
            hf.model.layers[i].self_attn.o_proj.weight.mul_(0.01)
            hf.model.layers[i].mlp.down_proj.weight.mul_(0.01)
    m = Transformer.from_hf(hf)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 61, (12,), generator=g).tolist()
    cache = m.new_cache(256)
    hist = list(prompt)
    m.forward(cache, torch.tensor(hist[:-1]), torch.arange(len(hist) - 1), 0)
    cache.commit(list(range(len(hist) - 1)))
    for _ in range(60):  # the target's greedy continuation
        L = cache.length
        nxt = int(m.forward(cache, torch.tensor(hist[-1:]), torch.tensor([L]), L).argmax())
        cache.commit([0])
        hist.append(nxt)
    search = SkipSearch(8, SkipSearchConfig(ratio=6 / 16, window=40, budget=12))
    while not search.done:
        search.step(m, cache, hist)
    assert search.evals <= len(skippable(8)) + 12
    found = score_window(m, cache, hist, 40, search.plan())[0]
    contiguous = score_window(m, cache, hist, 40, skip_plan(contiguous_skips(8, search.count)))[0]
    assert found > contiguous
    assert found >= 0.85


def test_drop_frees_what_only_the_dropped_levels_held():
    from dsia.quant import QuantSwitch

    reg = LevelRegistry(Transformer.from_hf(tiny_model("llama", seed=1, vocab=112, dim=64, layers=2)))
    int4, mix, int8 = reg.get("int4"), reg.get("int4+vocab"), reg.get("int8")
    copy4, copy8 = int4.switch(QuantSwitch).q, int8.switch(QuantSwitch).q
    assert mix.switch(QuantSwitch).q is copy4  # one int4 copy serves both
    built = lambda: {id(o) for o in reg.resources.built.values()}  # noqa: E731
    reg.drop(["int8"])
    assert set(reg.levels) == {"int4", "int4+vocab"} and id(copy8) not in built() and id(copy4) in built()
    reg.drop(["int4"])  # int4+vocab still holds the int4 copy
    assert set(reg.levels) == {"int4+vocab"} and id(copy4) in built()
    assert reg.get("int8").switch(QuantSwitch).q is not copy8  # built again on the next use
