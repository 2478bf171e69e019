"""The batch-invariant mode (dsia/invariant.py): in bfloat16 a row's logits do not depend on the other rows of its
forward, so every method's greedy tokens are `ar`'s; the attention it computes is the model's. Where casspec's
library builds the mode runs its own products and attention (row-invariant by construction, on every CPU); without
it, torch's kernels, where the self-check finds them row-invariant (elsewhere the mode refuses)."""
from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn.functional as F

from casspec.runtime.engine import Request
from casspec.runtime.method_table import METHODS
from dsia.cxx import build_error
from dsia.errors import CasspecError
from dsia.fastloop import cxx_pointwise
from dsia.invariant import KEYS_PER_BLOCK, RowKeys, block_attention, rows_independent
from dsia.kernels import DenseKernels
from dsia.model import Transformer
from dytc.router import RouterConfig
from dytc.tree import ancestor_mask, position_ids
from tiny import tiny_engine, tiny_model

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 10, 11, 5, 6, 7]  # repeats, so that the lookups find matches


OWN = build_error() is None  # casspec's library built: the mode runs its own kernels


@functools.lru_cache(maxsize=None)
def premise() -> bool:
    """Whether this machine's bf16 kernels (torch's) give each row the same result whatever the row count (the mode
    over them refuses to run where they do not: `test_over_torchs_kernels_the_mode_runs_or_refuses`)."""
    m = Transformer.from_hf(tiny_model("llama", 0, dtype=torch.bfloat16))
    return rows_independent(m.dense, m.product_shapes(), m.spec.head_dim, m.dtype, m.device)


def needs_premise() -> None:
    if not premise():
        pytest.skip("casspec's library did not build and this machine's bfloat16 kernels are not row-invariant: the "
                    "mode refuses to run here")


@functools.lru_cache(maxsize=None)
def model(invariant: bool, own: bool = OWN) -> Transformer:
    m = Transformer.from_hf(tiny_model("llama", 0, dtype=torch.bfloat16))
    if not invariant:
        return m
    if own:  # casspec's products and attention, as the engine runs them where its library is built
        return m.with_dense(DenseKernels.forced("casspec")).with_pointwise(cxx_pointwise()).with_batch_invariant(
            own_attention=True)
    needs_premise()
    return m.with_batch_invariant()


def random_tree(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def path_to(parents: list[int], i: int) -> list[int]:
    """The nodes from the root to node i."""
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@torch.inference_mode()
def differing_rows(m: Transformer, prompt: list[int], parents: list[int], tokens: list[int]) -> int:
    """Rows of a tree forward on top of `prompt` whose logits differ from the last one-token step over its path
    (as `ar` computes them), and rows of the prompt's prefill whose logits differ from one-token steps."""
    cache = m.new_cache(len(prompt) + len(tokens) + 1)
    L = len(prompt)
    prefill = m.forward(cache, torch.tensor(prompt), torch.arange(L), 0)  # [L, V]
    cache.commit(list(range(L)))
    tree = m.forward(cache, torch.tensor(tokens), position_ids(parents, L), L, ancestor_mask(parents))  # [N, V]
    cache.rollback(0)
    steps = []
    for tok in prompt:
        steps.append(m.forward(cache, torch.tensor([tok]), torch.tensor([cache.length]), cache.length)[0])
        cache.commit([0])
    bad = sum(not torch.equal(a, b) for a, b in zip(prefill, steps))
    for i in range(len(parents)):
        cache.rollback(L)
        for j in path_to(parents, i):
            step = m.forward(cache, torch.tensor([tokens[j]]), torch.tensor([cache.length]), cache.length)[0]
            cache.commit([0])
        bad += not torch.equal(tree[i], step)
    return bad


# prompts that end inside the first block, on block edges and inside the second; chains and trees of 2-16 nodes
B = KEYS_PER_BLOCK
CASES = [(1, 4, True), (B - 3, 8, False), (B - 3, 8, True), (B, 16, True), (B + 1, 2, False), (2 * B - 5, 16, True)]


@pytest.mark.parametrize("L,n,tree", CASES)
def test_a_rows_logits_are_its_one_token_steps(L, n, tree):
    rng = random.Random(L * 100 + n)
    V = model(True).spec.vocab_size
    prompt, tokens = [rng.randrange(V) for _ in range(L)], [rng.randrange(V) for _ in range(n)]
    parents = random_tree(n, rng) if tree else list(range(-1, n - 1))
    assert differing_rows(model(True), prompt, parents, tokens) == 0


def test_without_the_mode_rows_differ():
    """What the mode removes: SDPA's kernel and oneDNN's one-row product sum in orders that depend on the rows
    (if this fails, this machine's kernels are batch-invariant without the mode)."""
    rng = random.Random(0)
    V = model(False).spec.vocab_size
    prompt, tokens = [rng.randrange(V) for _ in range(KEYS_PER_BLOCK + 7)], [rng.randrange(V) for _ in range(16)]
    if differing_rows(model(False), prompt, random_tree(16, rng), tokens) == 0:
        pytest.skip("this machine's kernels are batch-invariant for these shapes without the mode")


@functools.lru_cache(maxsize=None)
def engine(seed: int, invariant: bool = True):
    if invariant and not OWN:
        needs_premise()
    # (kernels "auto": a batch-invariant engine then runs casspec's own, unmeasured, where its library is built;
    # without the mode: BLAS products and ATen's small steps and attention, the Python loop: casspec's own attention,
    # which a tree of up to 16 rows runs otherwise, gives a row the same bits whatever the rows beside it)
    return tiny_engine("llama", seed, dtype=torch.bfloat16, batch_invariant=invariant,
                       kernels="auto" if invariant and OWN else "blas", fast_layers=None if invariant else False)


SEEDS = (0, 3)  # tiny bfloat16 models whose near-ties make methods leave `ar` without the mode


@pytest.mark.parametrize("method", [m for m in METHODS if m != "ar"])
def test_every_method_gives_ar_tokens_in_bfloat16(method):
    fixed = {"router": RouterConfig(constant_cost=0.3)} if method == "dytc" else {}
    for seed in SEEDS:
        e = engine(seed)
        ar = e.generate_ids(PROMPT, Request(method="ar", max_new_tokens=60))
        spec = e.generate_ids(PROMPT, Request(max_new_tokens=60, method=method, **fixed))
        assert spec.token_ids == ar.token_ids, seed


def test_some_method_leaves_ar_without_the_mode():
    """The seeds above do test something: without the mode, their speculative methods' tokens leave `ar`'s."""
    left = 0
    for seed in SEEDS:
        e = engine(seed, invariant=False)
        ar = e.generate_ids(PROMPT, Request(method="ar", max_new_tokens=60)).token_ids
        left += sum(e.generate_ids(PROMPT, Request(max_new_tokens=60, method=m)).token_ids != ar
                    for m in ("sd", "vc", "hc"))
    if left == 0:
        pytest.skip("no near-tie of these tiny models flips on this machine's kernels without the mode")


@pytest.mark.parametrize("prefix", [0, 5, KEYS_PER_BLOCK, 2 * KEYS_PER_BLOCK + 9])
def test_block_attention_is_the_models_attention(prefix):
    """Against float32 SDPA over the same keys with the tree's mask: the error of bfloat16 rounding only."""
    gen = torch.Generator().manual_seed(prefix)
    H, Hkv, hd, parents = 6, 2, 16, [-1, 0, 0, 1, 2, 2, 4, 6]
    T, S = len(parents), prefix + len(parents)
    q = torch.randn(H, T, hd, generator=gen).bfloat16()
    keys = torch.randn(Hkv, S + KEYS_PER_BLOCK, hd, generator=gen).bfloat16()
    values = torch.randn(Hkv, S + KEYS_PER_BLOCK, hd, generator=gen).bfloat16()
    anc = ancestor_mask(parents)
    rows = RowKeys.tree(prefix, prefix, anc)
    out = block_attention(q, keys, values, rows, hd ** -0.5).float()  # [H, T, hd]
    mask = torch.cat((torch.ones(T, prefix, dtype=torch.bool), anc), dim=1)  # [T, S]
    ref = F.scaled_dot_product_attention(q.float()[None], keys[:, :S].float()[None], values[:, :S].float()[None],
                                         attn_mask=mask, enable_gqa=True)[0]
    assert (out - ref).abs().max() < 0.03
    # the causal layout (a chain) gives what the gathered one does, bit for bit
    chain = list(range(-1, T - 1))
    causal = block_attention(q, keys, values, RowKeys.causal(prefix, T, q.device), hd ** -0.5)
    gathered = block_attention(q, keys, values, RowKeys.tree(prefix, prefix, ancestor_mask(chain)), hd ** -0.5)
    assert torch.equal(causal, gathered)


def test_the_mode_is_for_bfloat16_on_a_cpu():
    with pytest.raises(CasspecError, match="bfloat16"):
        Transformer.from_hf(tiny_model("llama", 0)).with_batch_invariant()  # float32
    with pytest.raises(CasspecError, match="eagerly"):
        tiny_engine("llama", 0, dtype=torch.bfloat16, batch_invariant=True, graphs=True)


def test_over_torchs_kernels_the_mode_runs_or_refuses():
    """Without casspec's kernels the mode rests on torch's: where they give a row other bits at other row counts
    (as on an AMD EPYC) it refuses to run; where they do not, a tree's rows are the one-token steps'."""
    m = Transformer.from_hf(tiny_model("llama", 0, dtype=torch.bfloat16))
    if not premise():
        with pytest.raises(CasspecError, match="row count"):
            m.with_batch_invariant()
        return
    rng = random.Random(7)
    V = m.spec.vocab_size
    prompt, tokens = [rng.randrange(V) for _ in range(KEYS_PER_BLOCK + 3)], [rng.randrange(V) for _ in range(8)]
    assert differing_rows(model(True, own=False), prompt, random_tree(8, rng), tokens) == 0


def test_the_engine_runs_casspecs_kernels_in_the_mode():
    if not OWN:
        pytest.skip(f"casspec's library did not build: {build_error()}")
    e = engine(0)
    assert e.kernels.startswith("casspec (batch-invariant by construction)")
    assert e.model.dense.names == DenseKernels.forced("casspec").names and e.model.pointwise.attention is not None
    # its products need no padding, so the C++ layer loop runs the target, the same bits as the Python loop
    from dsia.fastloop import layer_stack
    from dsia.plan import TARGET

    assert e.model.dense_row_invariant() and layer_stack(e.model, TARGET) is not None
    rng = random.Random(3)
    V = e.model.spec.vocab_size
    prompt = [rng.randrange(V) for _ in range(KEYS_PER_BLOCK + 5)]
    tokens, parents = [rng.randrange(V) for _ in range(9)], random_tree(9, rng)
    with torch.inference_mode():
        outs = []
        for m in (e.model, e.model.with_stacks(None)):
            cache = m.new_cache(len(prompt) + len(tokens) + 1)
            m.forward(cache, torch.tensor(prompt), torch.arange(len(prompt)), 0)
            cache.commit(list(range(len(prompt))))
            outs.append(m.forward(cache, torch.tensor(tokens), position_ids(parents, len(prompt)), len(prompt),
                                  ancestor_mask(parents)))
    assert torch.equal(outs[0], outs[1])
    assert differing_rows(e.model, prompt, parents, tokens) == 0


def test_the_mode_refuses_where_rows_depend_on_the_row_count(monkeypatch):
    """The self-check catches a kernel whose rows depend on how many there are, and the mode then refuses."""
    import dsia.variants

    def uneven(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, w, b) + (x.shape[0] > 3) * 2.0 ** -6  # another result over more than 3 rows
    assert not rows_independent(uneven, {(64, 64)}, 16, torch.bfloat16, torch.device("cpu"))
    monkeypatch.setattr(dsia.variants, "rows_independent", lambda *a, **kw: False)
    with pytest.raises(CasspecError, match="row count"):
        Transformer.from_hf(tiny_model("llama", 0, dtype=torch.bfloat16)).with_batch_invariant()
