"""Lossless verification: greedy speculative methods equal AR token for token (float32, random tiny models);
sampled tokens follow the target's distribution (chi-square over >= 20,000 draws), and a wrong q is caught."""
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from casspec.runtime.engine import Request
from dytc.router import RouterConfig
from dsia.cxx import build_error
from dytc import sampling
from dytc.sampling import DRAFT_CANDIDATES, NUCLEUS_CANDIDATES, SamplingParams, _outside_nucleus, coupled_top, warp
from dytc.tree import DraftTree, ancestor_mask, depths
from dytc.verify import Noise, gumbel_noise, own_noise, verify_greedy, verify_sampling
from tiny import ARCHS, KERNELS, chi2_p, joint_chi2_p, tiny_engine

V = 6  # tiny vocabulary for the distribution tests
DRAWS = 20_000


@functools.lru_cache(maxsize=None)
def engine(arch: str, seed: int, kernels: str = "blas"):
    return tiny_engine(arch, seed, kernels=kernels)


@settings(max_examples=30, deadline=None)
@given(arch=st.sampled_from(ARCHS), seed=st.integers(0, 2),
       method=st.sampled_from(["pld", "sd", "tree"]),
       level=st.sampled_from(["int8", "int4", "skip0.3", "exit2", "sparse0.5", "vocab", "int8+sparse0.5+vocab"]),
       prompt=st.lists(st.integers(3, 40), min_size=1, max_size=24), n=st.integers(1, 40),
       kernels=st.sampled_from(KERNELS))
def test_greedy_methods_equal_ar(arch, seed, method, level, prompt, n, kernels):
    e = engine(arch, seed, kernels)
    prompt = prompt + prompt[: len(prompt) // 2]  # some repetition, so that pld finds matches
    ar = e.generate_ids(prompt, Request(method="ar", max_new_tokens=n))
    spec = e.generate_ids(prompt, Request(max_new_tokens=n, method=method, level=level))
    assert spec.token_ids == ar.token_ids
    assert spec.stats.new_tokens <= n


def test_verify_greedy_longest_path():
    tree = DraftTree.root(0)
    a = tree.add(0, 1)
    tree.add(0, 2)
    c = tree.add(a, 3)
    tree.add(c, 4)
    logits = torch.full((5, 8), -1.0)
    best = {0: 1, 1: 3, 2: 5, 3: 7, 4: 0}  # node -> target argmax
    for node, tok in best.items():
        logits[node, tok] = 1.0
    assert verify_greedy(tree, logits) == ([0, 1, 3], 7)  # 4 != 7: stops after node 3, bonus 7


# ------------------------------------------------------------------ distribution tests
PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
          SamplingParams(temperature=1.3, top_p=0.85), SamplingParams(temperature=0.9, top_k=5, top_p=0.9)]


def draw_without_replacement(q: torch.Tensor, m: int, g: torch.Generator) -> tuple[list[int], list[torch.Tensor]]:
    """m distinct tokens drawn one by one from q; each with the distribution it was drawn from."""
    toks, qs = [], []
    q = q.clone()
    for _ in range(min(m, int((q > 0).sum()))):
        qs.append(q.clone())
        t = int(torch.multinomial(q, 1, generator=g))
        toks.append(t)
        q[t] = 0
        q = q / q.sum()
    return toks, qs


def build(shape: str, p_draft: torch.Tensor, g: torch.Generator, lie: bool = False) -> DraftTree:
    """A draft tree over the root whose first-level children follow `shape`; node n's draft distribution is
    p_draft[n]. lie=True records a q different from the distribution the token was really drawn from."""
    tree = DraftTree.root(0)
    if shape == "chain":  # depth 2, sampled
        q = p_draft[0]
        t = int(torch.multinomial(q, 1, generator=g))
        n1 = tree.add(0, t, torch.full_like(q, 1 / V) if lie else q)
        q2 = p_draft[1]
        tree.add(n1, int(torch.multinomial(q2, 1, generator=g)), q2)
    elif shape == "siblings":  # 3 children drawn without replacement, one grandchild
        toks, qs = draw_without_replacement(p_draft[0], 3, g)
        for t, q in zip(toks, qs):
            tree.add(0, t, q.roll(1) if lie else q)
        tree.add(1, int(torch.multinomial(p_draft[1], 1, generator=g)), p_draft[1])
    elif shape == "topk":  # deterministic: the draft's top-3 tokens, q one-hot (None)
        for t in p_draft[0].topk(3).indices.tolist():
            tree.add(0, t)
        tree.add(1, int(p_draft[1].argmax()))
    return tree


def node_of(tree: DraftTree, parent: int, token: int) -> int | None:
    return next((c for c in tree.children()[parent] if tree.tokens[c] == token), None)


def run_trials(shape: str, params: SamplingParams, seed: int, lie: bool = False) -> float:
    """p-value of the chi-square test of the first emitted token (x1) and, where x1 landed in the tree, the
    second one (x2), against the target's own sequential distribution."""
    g = torch.Generator().manual_seed(seed)
    logits_root = torch.randn(V, generator=g) * 1.5
    logits_child = torch.randn(V, V, generator=g) * 1.5  # target logits after first token t: logits_child[t]
    p_root = warp(logits_root[None], params)[0]
    p_child = warp(logits_child, params)  # [V, V]
    draft_logits = torch.randn(2, V, generator=g) * 1.5 + 0.5 * torch.stack([logits_root, logits_root])
    p_draft = warp(draft_logits, params)  # [2, V]
    counts: dict[tuple, int] = {}
    for _ in range(DRAWS):
        tree = build(shape, p_draft, g, lie)
        probs = torch.empty(len(tree), V)
        probs[0] = p_root
        for n in range(1, len(tree)):
            depth1 = tree.path_to(n)[1]
            probs[n] = p_child[tree.tokens[depth1]] if n == depth1 else p_root  # deeper nodes: any valid dist
        path, bonus = verify_sampling(tree, probs, g)
        emitted = [tree.tokens[i] for i in path[1:]] + [bonus]
        x1 = emitted[0]
        key = (x1, emitted[1]) if len(emitted) > 1 else (x1, None)
        if len(emitted) > 1 and node_of(tree, 0, x1) is None:
            raise AssertionError("a second token after a token that is not a tree node")
        counts[key] = counts.get(key, 0) + 1
    # expected: x1 ~ p_root; if x1 was accepted as a node, x2 ~ p_child[x1]. Whether x1 lands in the tree is
    # random, so test the marginal of x1 and, separately, x2 given x1 over the draws where x2 exists.
    obs_x1 = torch.zeros(V)
    for (x1, _), c in counts.items():
        obs_x1[x1] += c
    cells_obs, cells_exp = list(obs_x1[p_root > 0].tolist()), list((p_root[p_root > 0] * DRAWS).tolist())
    for x1 in range(V):
        row = torch.zeros(V)
        for (a, b), c in counts.items():
            if a == x1 and b is not None:
                row[b] += c
        n = row.sum()
        if n >= 200:
            support = p_child[x1] > 0
            cells_obs += row[support].tolist()
            cells_exp += (p_child[x1][support] * n).tolist()
            assert row[~support].sum() == 0, "a token outside the target's support was emitted"
    # x1 cells sum to DRAWS and each x2 row to its own n: test the two parts on a common scale
    n1 = int(sum(cells_obs[:int((p_root > 0).sum())]))
    assert n1 == DRAWS
    return chi2_p(cells_obs, cells_exp)


@pytest.mark.parametrize("shape", ["chain", "siblings", "topk"])
@pytest.mark.parametrize("pi", range(len(PARAMS)))
def test_sampling_matches_target_distribution(shape, pi):
    assert run_trials(shape, PARAMS[pi], seed=100 + pi) > 0.001


@pytest.mark.parametrize("shape", ["chain", "siblings"])
def test_wrong_q_is_detected(shape):
    assert run_trials(shape, PARAMS[0], seed=7, lie=True) < 0.001


ENGINE_WARPS = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0, top_k=6),
                SamplingParams(temperature=0.9, top_k=8, top_p=0.95)]


@pytest.mark.parametrize("method", ["sd", "sd-rs", "tree", "vc", "hc", "dytc"])
@pytest.mark.parametrize("params", ENGINE_WARPS, ids=["T0.7-p0.9", "T1-k6", "T0.9-k8-p0.95"])
def test_engine_sampling_follows_the_target(method, params):
    """End to end through every drafting method: the first two emitted tokens of many seeded runs follow the
    target's own joint distribution, computed exactly, while drafts really are verified: the second token
    comes from the first verification step, whose tree holds drafts (sd-rs: drawn from q, rejection sampling; the
    others coupled to the verifier's noise), some accepted and some rejected."""
    e = tiny_engine("llama", 0, vocab=12, layers=2)
    prompt = [5, 6, 7, 5, 6]
    with torch.inference_mode():
        p1 = warp(e.hf_model(torch.tensor([prompt])).logits[0, -1:], params)[0]  # [V]
        seqs = torch.tensor([prompt + [t] for t in range(12)])
        p2 = warp(e.hf_model(seqs).logits[:, -1], params)  # [V, V]: second token given the first
    joint = (p1[:, None] * p2).flatten()  # [V * V]
    levels = ("int8*2", "pld*2") if method == "hc" else ("int8",) if method in ("vc", "dytc") else ()
    n, obs, drafted, accepted = 600, torch.zeros(12 * 12), 0, 0
    for s in range(n):
        r = e.generate_ids(prompt, Request(max_new_tokens=4, sampling=params, seed=s, method=method, level="int8",
                                           levels=levels, router=RouterConfig(constant_cost=0.3)
                                           if method == "dytc" else None))
        obs[r.token_ids[0] * 12 + r.token_ids[1]] += 1
        drafted += r.stats.tree_nodes
        accepted += sum(r.stats.accepted_by_depth)
    assert drafted > n and 0 < accepted < drafted  # drafts were verified: some accepted, some rejected
    assert obs[joint == 0].sum() == 0
    assert joint_chi2_p(obs, joint) > 0.001


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
def test_top_p_by_partial_sort_equals_the_full_sort(scale, top_p):
    """The nucleus looked for among the most likely NUCLEUS_CANDIDATES tokens (then more, then all) is the full
    sort's: peaked rows end within the first candidates, flatter ones within the next or only in the full sort."""
    g = torch.Generator().manual_seed(int(scale * 100 + top_p * 10))
    probs = torch.softmax(torch.randn(6, 20000, generator=g) * scale, -1)
    probs[0] = torch.softmax(torch.randn(20000, generator=g) * 8.0, -1)  # one peaked row beside flatter ones
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    expected = drop.scatter(-1, order, drop)
    assert torch.equal(_outside_nucleus(probs, top_p), expected)
    assert torch.equal(_outside_nucleus(probs[:1], top_p), expected[:1])
    if scale < 0.5:  # the flat rows' nucleus is larger than every candidate set: the full sort ran for them
        assert (~expected).sum(-1).max() > NUCLEUS_CANDIDATES[-1]


@pytest.mark.parametrize("own", [True, False])
@pytest.mark.parametrize("params", [SamplingParams(0.7, 0, 0.9), SamplingParams(1.0, 0, 1.0),
                                    SamplingParams(0.8, 20, 1.0), SamplingParams(1.0, 40, 0.8),
                                    SamplingParams(0.9, 500, 0.95), SamplingParams(1.3, 0, 0.99),
                                    SamplingParams(0.6, 64, 0.9), SamplingParams(1.0, 2, 1.0)])
def test_coupled_top_equals_the_whole_rows_warp(params, own, monkeypatch):
    """A coupled draft's top tokens and their probabilities, found among each row's DRAFT_CANDIDATES most likely
    tokens where they hold the warped support, equal those of the whole row's warp perturbed by the same noise:
    peaked rows (support within the candidates), flat ones (a nucleus wider: warped whole), one of each mixed; by
    casspec's op (own) and by ATen's ops. Past a support smaller than k (top-k 2) the probabilities are 0."""
    if own and not own_noise():
        pytest.skip(f"casspec's library is not built here: {build_error()}")
    monkeypatch.setattr(sampling, "own_noise", lambda: own)
    g = torch.Generator().manual_seed(int(params.temperature * 100 + params.top_k + params.top_p * 10))
    V, k = 8192, 4
    logits = torch.randn(6, V, generator=g) * torch.tensor([[9.0], [9.0], [6.0], [0.3], [9.0], [0.1]])
    positions = [7, 0, 3, 12, 5, 9]
    noise = torch.stack([gumbel_noise(3, p, V) for p in positions])  # [6, V]
    scores = warp(logits, params).log().double() + noise
    ref = scores.topk(k, dim=-1)
    probs, tokens = coupled_top(logits, params, Noise(3, V), positions, k)
    live = ref.values > float("-inf")  # (past the support every token scores -inf: any order)
    assert torch.equal(tokens[live], ref.indices[live])
    assert torch.allclose(probs, (ref.values - scores.logsumexp(-1, keepdim=True)).exp().float(), atol=1e-6)
    assert bool((probs[~live] == 0).all()) and bool(((tokens >= 0) & (tokens < V)).all())
    assert len(set(tokens[0].tolist())) == k  # (distinct tokens, past the support too)
    narrow = (0 < params.top_k <= DRAFT_CANDIDATES) or (params.top_k == 0 and params.top_p < 1)
    if narrow:  # the peaked rows' support lies within the candidates; the flat ones' may not
        assert int((warp(logits[:1], params) > 0).sum()) <= DRAFT_CANDIDATES


def test_coupled_top_op_rejects_bad_arguments():
    """casspec's coupled-drafting op checks what it indexes and what its arithmetic needs: one clear error each."""
    if not own_noise():
        pytest.skip(f"casspec's library is not built here: {build_error()}")
    op, x, pos = torch.ops.casspec.coupled_top, torch.randn(2, 100), torch.tensor([1, 2])
    for args, what in [((x.double(), 0.7, 0, 0.9, 0, pos, 4, 64), "Float expected"),
                       ((x, 0.7, 0, 0.9, 0, pos[:1], 4, 64), "one position per row"),
                       ((x, 0.7, 0, 0.9, 0, torch.tensor([1, -1]), 4, 64), "positions must be >= 0"),
                       ((x, 0.0, 0, 0.9, 0, pos, 4, 64), "temperature > 0"),
                       ((x, float("nan"), 0, 0.9, 0, pos, 4, 64), "temperature > 0"),
                       ((x, 0.7, 0, 1.5, 0, pos, 4, 64), "top_p must lie"),
                       ((x, 0.7, 0, 0.9, 0, pos, 4, 101), "candidates must lie"),
                       ((x, 0.7, 65, 0.9, 0, pos, 4, 64), "top_k must lie"),
                       ((x, 0.7, 0, 0.9, 0, pos, 65, 64), "k must lie"),
                       ((x, 0.7, 0, 0.9, -1, pos, 4, 64), "seed >= 0")]:
        with pytest.raises(RuntimeError, match=what):
            op(*args)


@pytest.mark.parametrize("own", [True, False])
@pytest.mark.parametrize("params", [SamplingParams(0.7, 0, 0.9), SamplingParams(1.0, 0, 1.0),
                                    SamplingParams(1.0, 20, 1.0), SamplingParams(3.0, 0, 0.999)])
def test_target_sample_is_the_whole_rows_gumbel_max_and_each_rows_own(params, own, monkeypatch):
    """The target's token (coupled_top with k = 1, what every sampled method's verifier and ar draw) is the whole
    row's argmax of log warp(p) + g, for small and wide supports and two equal logits (a tie broken by the noise);
    and a row's token is the same computed alone as among other rows (so ar, one row a step, and a verifier of
    trees, many, emit the same tokens)."""
    if own and not own_noise():
        pytest.skip(f"casspec's library is not built here: {build_error()}")
    monkeypatch.setattr(sampling, "own_noise", lambda: own)
    g = torch.Generator().manual_seed(1)
    V = 8192
    logits = torch.randn(40, V, generator=g) * 6
    logits[0, 9] = logits[0, 5] = logits[0].max() + 30.0  # (the two alone in the support under top-k / top-p)
    positions = list(range(3, 43))
    tokens = coupled_top(logits, params, Noise(2, V), positions, 1)[1][:, 0]  # [40]
    probs = warp(logits, params)
    for i in range(len(logits)):
        assert int(tokens[i]) == int((probs[i].double().log() + gumbel_noise(2, positions[i], V)).argmax())
        assert int(coupled_top(logits[i:i + 1], params, Noise(2, V), positions[i:i + 1], 1)[1][0, 0]) == tokens[i]
    assert params.top_k == 0 and params.top_p == 1.0 or int(tokens[0]) in (5, 9)


def test_blocked_top_k_equals_torch_topk():
    """dsia.topk.top_k (the k best among the k blocks with the largest maxima) gives torch.topk's values and
    indices, including rows whose best values share one block and rows with -inf outside a vocabulary subset,
    with the default block and a smaller one."""
    from dsia.topk import TOPK_BLOCK, top_k
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8 * TOPK_BLOCK, generator=g, dtype=torch.float64)
    x[1, 5 * TOPK_BLOCK + 3: 5 * TOPK_BLOCK + 9] = 50.0 + torch.arange(6.0, dtype=torch.float64)  # one block
    x[2, TOPK_BLOCK:] = float("-inf")
    for k, block in ((1, TOPK_BLOCK), (4, TOPK_BLOCK), (7, TOPK_BLOCK), (16, 128)):
        values, idx = top_k(x, k, block)
        ref = x.topk(k, dim=-1)
        assert torch.equal(values, ref.values) and torch.equal(idx, ref.indices)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10 ** 6), min_size=0, max_size=40))
def test_ancestor_mask_marks_each_nodes_path_from_the_root(picks):
    parents = [-1] + [pick % (i + 1) for i, pick in enumerate(picks)]  # any tree, parents before children
    tree = DraftTree(list(range(len(parents))), parents)
    mask = ancestor_mask(parents)
    assert mask.dtype == torch.bool and mask.shape == (len(parents), len(parents))
    for i in range(len(parents)):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(tree.path_to(i))
    assert mask.sum(1).tolist() == [d + 1 for d in depths(parents)]
