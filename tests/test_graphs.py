"""The CUDA-graph path on the CPU: the static-shape forward over every cache slot (the graphs' body) gives the
eager forward's logits, padding rows touch only spare slots, and every method decodes the same tokens through it."""
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from casspec.runtime.engine import Request
from dsia.graphs import GRAPH_TOKENS, Graphs, capturable
from dsia.model import Transformer
from dsia.plan import Plan
from dytc.sampling import SamplingParams
from dytc.tree import ancestor_mask, position_ids
from tiny import ARCHS, tiny_engine, tiny_model

PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6, 7]


@functools.lru_cache(maxsize=None)
def runtime(arch: str) -> Transformer:
    return Transformer.from_hf(tiny_model(arch, seed=3))


@functools.lru_cache(maxsize=None)
def engine(graphs: bool):
    return tiny_engine("qwen2", seed=2, graphs=graphs)


@st.composite
def trees(draw, max_nodes: int = 20) -> list[int]:
    """parents of a random token tree: node 0 is the root, every other node's parent comes before it."""
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@settings(max_examples=20, deadline=None)
@given(arch=st.sampled_from(ARCHS), parents=trees(), prefix=st.integers(1, 30), chain=st.booleans())
@torch.no_grad()
def test_graph_forward_equals_eager_forward(arch, parents, prefix, chain):
    rt = runtime(arch)
    if chain:
        parents = list(range(-1, len(parents) - 1))
    g = torch.Generator().manual_seed(prefix)
    ids = torch.randint(3, 97, (prefix,), generator=g)
    nodes = torch.randint(3, 97, (len(parents),), generator=g)
    caches = []
    for graphs in (False, True):
        cache = rt.new_cache(128, spare=GRAPH_TOKENS[-1] if graphs else 0)
        model = rt.with_graphs(Graphs(rt, cache, capture_after=1) if graphs else None)
        model.forward(cache, ids, torch.arange(prefix), 0)
        cache.commit(list(range(prefix)))
        mask = None if chain else ancestor_mask(parents)
        out = model.forward(cache, nodes, position_ids(parents, prefix), prefix, mask, logits_rows=slice(1, None))
        caches.append((out, cache))
        if graphs:  # the prefill and the tree, each from a graph
            assert model.graphs.stats.replays == 2 and model.graphs.stats.eager == 0
    (ref, c0), (out, c1) = caches
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    end = prefix + len(parents)  # the written slots agree; padding went to spare slots only
    torch.testing.assert_close(c1.k[:, :, :end], c0.k[:, :, :end], rtol=1e-5, atol=1e-5)
    assert not c1.k[:, :, end:c1.capacity].any()


@torch.no_grad()
def test_graphs_capture_on_second_use_and_skip_long_or_stateful_forwards():
    rt = Transformer.from_hf(tiny_model("llama", seed=1))
    cache = rt.new_cache(200, spare=GRAPH_TOKENS[-1])
    graphs = Graphs(rt, cache, capture_after=2)
    model = rt.with_graphs(graphs)
    model.forward(cache, torch.randint(3, 97, (70,)), torch.arange(70), 0)  # longer than the largest bucket
    cache.commit(list(range(70)))
    assert graphs.stats.eager == 1 and graphs.stats.captures == 0
    skip = Plan(skip_mlp=frozenset({1}))
    for step in range(3):
        model.forward(cache, torch.tensor([5, 6, 7]), torch.arange(70, 73), 70, plan=skip)
        # an equal plan rebuilt (a skip search) replays the same graph
        skip = Plan(skip_mlp=frozenset({1}))
    assert graphs.stats.captures == 1 and graphs.stats.replays == 2
    assert not capturable(Plan(head=lambda h: h)) and not capturable(Plan(mlps={0: lambda h: h}))
    model.forward(cache, torch.tensor([5]), torch.tensor([70]), 70, plan=Plan(head=lambda h: h @ rt.lm_head.T))
    assert graphs.stats.captures == 1


@pytest.mark.parametrize("method,level", [("ar", "int4"), ("pld", "int4"), ("sd", "skip0.3"), ("tree", "exit2"),
                                          ("sd", "int8"), ("tree", "int4+vocab"), ("dytc", "-"), ("vc", "-"),
                                          ("hc", "-"), ("tree+vc", "-")])
def test_methods_through_graph_forwards_equal_ar(method, level):
    graphed = engine(graphs=True)
    ar = engine(graphs=False).generate_ids(PROMPT, Request(method="ar", max_new_tokens=40))
    req = Request(max_new_tokens=40, method=method) if level == "-" else \
        Request(max_new_tokens=40, method=method, level=level)
    res = graphed.generate_ids(PROMPT, req)
    assert res.token_ids == ar.token_ids
    assert graphed.graphs.stats.replays > 0
    assert "CUDA graphs" in res.stats.kernels


def test_sampling_through_graph_forwards_equals_eager():
    eager, graphed = engine(graphs=False), engine(graphs=True)
    req = Request(max_new_tokens=30, method="dytc", seed=7,
                  sampling=SamplingParams(0.8, 0, 0.9))
    assert graphed.generate_ids(PROMPT, req).token_ids == eager.generate_ids(PROMPT, req).token_ids


def test_the_latency_model_does_not_learn_from_forwards_that_captured_a_graph():
    from dytc.latency import TARGET_LEVEL

    e = tiny_engine("llama", seed=5, graphs=True)
    fits = e.latency.levels
    before = fits[TARGET_LEVEL].n if TARGET_LEVEL in fits else 0
    res = e.generate_ids(PROMPT, Request(method="ar", max_new_tokens=20))
    verifies = res.stats.target_forwards - 1  # the prefill is not observed
    assert e.latency.known(TARGET_LEVEL)  # (absorbs the observations still pending)
    assert e.graphs.stats.captures >= 1
    assert fits[TARGET_LEVEL].n - before == verifies - 1  # the first one-token verification captured


def test_compiled_rope_kv_equals_the_eager_steps():
    """The slot-addressed forward's RoPE plus both cache writes, compiled into one kernel (as on a GPU), gives the
    eager result and writes the same cache slots in place."""
    import shutil

    from dsia.pointwise import compiled_pointwise, rope_kv
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler for torch.compile on the CPU")
    g = torch.Generator().manual_seed(0)
    qk, v = torch.randn(12, 3, 16, generator=g), torch.randn(3, 3, 16, generator=g)  # H=9, Hkv=3, T=3, hd=16
    cos, sin = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    slots = torch.tensor([4, 9, 2])
    caches = [(torch.zeros(2, 3, 12, 16), torch.zeros(2, 3, 12, 16)) for _ in range(2)]
    out = [fn(qk, v, cos, sin, k[1], vv[1], slots, 9)
           for fn, (k, vv) in zip((rope_kv, compiled_pointwise().rope_kv), caches)]
    assert torch.allclose(out[0], out[1], atol=1e-6)
    for a, b in zip(caches[0], caches[1]):
        assert torch.allclose(a, b, atol=1e-6) and a[1, :, slots].abs().sum() > 0 and a[0].abs().sum() == 0
