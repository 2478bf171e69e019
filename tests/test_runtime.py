"""The functional runtime equals HF's own forward: per architecture, incremental, chunked and tree-masked."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsia.errors import CasspecError
from dsia.model import Transformer
from dsia.plan import Plan
from dytc.tree import ancestor_mask, position_ids
from tiny import ARCHS, tiny_model

V = 97


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    hf = tiny_model(request.param, seed=1)
    return hf, Transformer.from_hf(hf)


@torch.no_grad()
def test_logits_parity_full_forward(pair):
    hf, rt = pair
    ids = torch.randint(0, V, (24,), generator=torch.Generator().manual_seed(0))
    ref = hf(ids[None]).logits[0]
    out = rt.forward(rt.new_cache(64), ids, torch.arange(24), 0)
    assert rel_err(out, ref) <= 1e-4


@torch.no_grad()
def test_fused_projections_compute_the_same_forward(pair):
    hf, rt = pair
    fused = rt.with_fused_projections()
    lw, lf = rt.layers[0], fused.layers[0]
    assert lw.wqkv is None and lf.wqkv is not None and lf.w_gate_up is not None
    assert lf.wk.data_ptr() == lf.wqkv.data_ptr() + lw.wq.numel() * lw.wq.element_size()  # views: one copy
    assert torch.equal(lf.wv, lw.wv) and torch.equal(lf.w_up, lw.w_up)
    assert len(fused.dense_weights()) == 4 * len(rt.layers) + 1 and fused.weight_bytes() == rt.weight_bytes()
    ids = torch.randint(0, V, (24,), generator=torch.Generator().manual_seed(0))
    out = []
    for model in (rt, fused):
        cache = model.new_cache(64)
        out.append(model.forward(cache, ids, torch.arange(24), 0))
    assert rel_err(out[1], out[0]) < 1e-5 and torch.equal(out[1].argmax(-1), out[0].argmax(-1))


@torch.no_grad()
def test_logits_parity_incremental_and_chunked(pair):
    hf, rt = pair
    ids = torch.randint(0, V, (24,), generator=torch.Generator().manual_seed(1))
    ref = hf(ids[None]).logits[0]
    cache = rt.new_cache(64)
    rows = [rt.forward(cache, ids[:10], torch.arange(10), 0)]
    cache.commit(list(range(10)))
    for t in range(10, 16):  # one token at a time
        rows.append(rt.forward(cache, ids[t:t + 1], torch.tensor([t]), t))
        cache.commit([0])
    rows.append(rt.forward(cache, ids[16:], torch.arange(16, 24), 16))  # a causal chunk on top of the prefix
    assert rel_err(torch.cat(rows), ref) <= 1e-4


def random_tree(draw_parents: list[int]) -> list[int]:
    return [-1] + [min(p, i) for i, p in enumerate(draw_parents)]


@settings(max_examples=25, deadline=None)
@given(arch=st.sampled_from(ARCHS), prefix=st.integers(1, 12),
       parents=st.lists(st.integers(0, 20), min_size=1, max_size=14), seed=st.integers(0, 10_000))
@torch.no_grad()
def test_tree_mask_parity(arch, prefix, parents, seed):
    """A tree-masked forward gives, at every node, the logits of running its root-to-node path alone."""
    hf = tiny_model(arch, seed=2)
    rt = Transformer.from_hf(hf)
    g = torch.Generator().manual_seed(seed)
    par = random_tree(parents)
    n = len(par)
    prompt = torch.randint(0, V, (prefix,), generator=g)
    tokens = torch.randint(0, V, (n,), generator=g)
    cache = rt.new_cache(64)
    rt.forward(cache, prompt, torch.arange(prefix), 0)
    cache.commit(list(range(prefix)))
    committed_k = cache.k[:, :, :prefix].clone()
    tree_logits = rt.forward(cache, tokens, position_ids(par, prefix), prefix, ancestor_mask(par))
    assert torch.equal(cache.k[:, :, :prefix], committed_k)  # the committed prefix is untouched
    for node in range(n):
        path = [node]
        while par[path[-1]] >= 0:
            path.append(par[path[-1]])
        path = path[::-1]
        ref = hf(torch.cat([prompt, tokens[path]])[None]).logits[0, -1]
        assert rel_err(tree_logits[node], ref) <= 1e-4


@torch.no_grad()
def test_commit_gathers_tree_path_and_rollback():
    hf = tiny_model("llama", seed=3)
    rt = Transformer.from_hf(hf)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, V, (6,), generator=g)
    par = [-1, 0, 0, 1, 2, 4]
    tokens = torch.randint(0, V, (6,), generator=g)
    cache = rt.new_cache(64)
    rt.forward(cache, prompt, torch.arange(6), 0)
    cache.commit(list(range(6)))
    rt.forward(cache, tokens, position_ids(par, 6), 6, ancestor_mask(par))
    path = [0, 2, 4, 5]
    cache.commit(path)
    assert cache.length == 10
    # the gathered KV equals the KV of running the accepted path as a plain sequence
    ref = rt.new_cache(64)
    seq = torch.cat([prompt, tokens[path]])
    rt.forward(ref, seq, torch.arange(10), 0)
    assert torch.allclose(cache.k[:, :, :10], ref.k[:, :, :10], atol=1e-5)
    assert torch.allclose(cache.v[:, :, :10], ref.v[:, :, :10], atol=1e-5)
    # rollback, then continuing gives the same logits as the reference continuing
    cache.rollback(8)
    nxt = torch.tensor([7])
    a = rt.forward(cache, nxt, torch.tensor([8]), 8)
    full = hf(torch.cat([seq[:8], nxt])[None]).logits[0, -1]
    assert rel_err(a[0], full) <= 1e-4


@torch.no_grad()
def test_empty_plan_is_target_and_weights_untouched():
    hf = tiny_model("qwen2", seed=4)
    rt = Transformer.from_hf(hf)
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    ids = torch.arange(10) + 3
    a = rt.forward(rt.new_cache(32), ids, torch.arange(10), 0)
    b = rt.forward(rt.new_cache(32), ids, torch.arange(10), 0, plan=Plan())
    assert torch.equal(a, b) and Plan().is_target
    # a plan that skips sublayers changes the output but never the model
    c = rt.forward(rt.new_cache(32), ids, torch.arange(10), 0, plan=Plan(skip_attn=frozenset({1}),
                                                                           skip_mlp=frozenset({0})))
    assert not torch.allclose(a, c)
    assert all(torch.equal(v, hf.state_dict()[k]) for k, v in before.items())


@torch.no_grad()
def test_logits_rows_and_bfloat16():
    hf = tiny_model("llama", seed=5, dtype=torch.bfloat16)
    rt = Transformer.from_hf(hf)
    assert rt.dtype == torch.bfloat16
    ids = torch.arange(12) + 3
    ref = hf(ids[None]).logits[0].float()
    out = rt.forward(rt.new_cache(32), ids, torch.arange(12), 0)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) <= 2e-2  # bf16 rounding differs slightly
    last = rt.forward(rt.new_cache(32), ids, torch.arange(12), 0, logits_rows=slice(11, 12))
    assert torch.equal(last[0], out[11])


def test_cache_full_is_a_clear_error():
    from dsia.errors import CasspecError

    rt = Transformer.from_hf(tiny_model("llama"))
    cache = rt.new_cache(8)
    with pytest.raises(CasspecError, match="context window full"):
        rt.forward(cache, torch.arange(9), torch.arange(9), 0)


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}])
@torch.no_grad()
def test_static_rope_scalings_equal_hf_past_the_original_context(rope):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, rope_scaling=dict(rope, rope_theta=10000.0))
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    rt = Transformer.from_hf(hf)
    ids = torch.randint(0, 97, (100,))  # past the original 32 positions
    ref = hf(ids[None]).logits[0]
    out = rt.forward(rt.new_cache(128), ids, torch.arange(100), 0)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rope_scalings_that_change_with_length_are_refused(rope_type):
    from transformers import LlamaConfig

    from dsia.spec import ModelSpec

    extra = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 32}
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256,
                      rope_scaling={"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0,
                                    **(extra if rope_type == "longrope" else {})})
    with pytest.raises(CasspecError, match=f"RoPE scaling '{rope_type}' is not supported"):
        ModelSpec.from_hf_config(cfg)
