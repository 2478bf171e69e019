"""DyTC: the Dynamic Tree Cascade router (`dytc`). Grows one token tree per step from several draft sources
(dsia levels and prompt lookup), choosing where to grow, with which source and how far, from online acceptance
estimates (acceptance.py) and predicted latencies (latency.py); the target then verifies the tree once.

The objective (derived here; CAS-Spec's own formula is known only second-hand). One step drafts a tree and
verifies it. Let p_n be the probability that node n is accepted: the product, along its path, of each token's
acceptance estimate given its parent is accepted. Greedy verification accepts at most one child per node, so
the expected number of tokens the step emits is E = 1 + sum_{n != root} p_n (accepted drafts plus the bonus
token), and its time is D + V(N): the draft time spent D plus the predicted verification of the N-node tree at
this context. The step's throughput is E / (D + V(N)); AR is the one-node tree, 1 / V(1).

Growth is greedy on that ratio. Each round considers the most probable nodes (`expand_candidates`) and, at
each, every source:
  - a level S extending node n by a segment of k tokens: the first token costs S's forward over the path nodes
    whose KV S cannot read yet (pending: at least n itself; nothing when S already ran n, whose distribution is
    then known and whose best token not yet a child is offered), every later token one more 1-token forward;
    value p_n * (a_1 + a_1 a + a_1 a^2 + ...) with a_1 the estimate of the first token (its draft probability's
    bucket, when known) and a the level's mean acceptance (A*-like lookahead: the later tokens are not drafted
    yet), cost c_S(pending) + (k - 1) c_S(1) + V(N + k) - V(N);
  - prompt lookup at a leaf n: the tokens copied after the longest match of (history + path to n), valued by
    the match-length bucket's estimate, costing only verification: V(N + k) - V(N).
The action with the best resulting throughput (E + dE) / (D + dD + V(N + dN)) is taken if it beats the current
E / (D + V(N)) (the marginal tokens per marginal millisecond exceed the tree's throughput); only its first token
is drafted (a whole prompt-lookup copy at once), then the round repeats with the new estimates. The tree stops
growing when no action pays, at `max_nodes`, or at the step's room. Sibling candidates come for free: after S
runs node n, its next-best tokens are offered at n, valued by their own draft probability's bucket.

Vertical cascade inside the tree: when S runs a path that contains prompt-lookup tokens (its pending nodes), its
distribution at each of them reviews the copied token after it: a copied token S agrees with becomes an S token
(estimate of S's bucket), one it disagrees with is marked overruled (source "pld!", learned separately) and S's
own token is offered beside it.

A skip or early-exit level writes no KV for the layers it skips, so another level reading those nodes must run
them again; quantized, sparse and vocabulary levels write every layer and are readable by all.

Fallback: when even the best first action does not beat AR, the step verifies the root alone (counted as a
fallback step). After `explore_every` fallbacks in a row one tree is drafted anyway, so that the estimates keep
learning. Sampling: every drafted token is deterministic (q one-hot), which verify_sampling handles losslessly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dsia.levels import Level, reads_kv_of

from .acceptance import OVERRULED, PLD, AcceptanceTracker, sibling
from .latency import TARGET, LatencyModel
from .ngram import PromptLookup
from .policies import DraftContext, Policy
from .tree import DraftTree, ancestor_mask, position_ids


@dataclass(frozen=True)
class RouterConfig:
    levels: tuple[str, ...] = ("int4", "int4+vocab")  # neural draft levels the router may use
    use_pld: bool = True  # prompt lookup as the zero-cost bottom source
    max_nodes: int = 32  # most tree nodes verified, root included
    lookahead: int = 10  # longest segment k valued when a level extends a node
    expand_candidates: int = 4  # most probable expandable leaves, and inner nodes, considered each round
    top_k: int = 4  # tokens of a level's distribution kept per node it ran (sibling candidates)
    pld_tokens: int = 10  # most prompt-lookup tokens attached at once
    review_tokens: int = 6  # most prompt-lookup tokens a level's forward reviews at once
    fallback: bool = True  # verify the root alone when no tree is predicted to beat AR
    explore_every: int = 16  # after this many fallbacks in a row, draft one tree anyway
    constant_cost: float | None = None  # ablation: no latency predictor; a verification costs one target step
    # whatever its size, a level forward this fraction of it whatever its tokens (None: the fitted predictor)


@dataclass
class _Node:
    source: str  # "root", a level name, "pld" or "pld!"
    belief: float  # draft probability (level) or match length (pld) of the token
    p: float  # estimated probability that the node is accepted
    depth: int
    kv: str | None = None  # level whose KV for this node is in scratch (None: no draft forward ran it)
    dists: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)  # level -> its top tokens/probs
    pld: tuple[list[int], int] | None = None  # prompt-lookup proposal after this node (tokens, match length)


@dataclass
class _Action:
    rate: float  # the tree's predicted throughput after the whole action (tokens per ms)
    node: int
    source: str  # a level name or PLD
    k: int  # tokens of the segment valued
    review: int = 0  # level actions: prompt-lookup tokens its first forward reviews (vertical cascade)


class DyTC(Policy):
    name = "dytc"

    def __init__(self, levels: list[Level], latency: LatencyModel, tracker: AcceptanceTracker,
                 cfg: RouterConfig = RouterConfig()) -> None:
        self.levels = {lv.name: lv for lv in levels}
        self.latency = latency
        self.tracker = tracker  # shared across generations: estimates carry over
        self.cfg = cfg
        self.fallbacks_in_row = 0
        # per-generation report
        self.fallback_steps = 0
        self.steps = 0
        self.tree_sizes: list[int] = []
        self.drafted: dict[str, int] = {}  # source -> tokens in the verified trees
        self.outcomes: dict[str, list[int]] = {}  # source -> [tested, accepted] in this generation
        self.predicted_draft_ms = 0.0
        self.measured_draft_ms = 0.0

    # ------------------------------------------------------------------ lifecycle
    def begin(self, ctx: DraftContext) -> None:
        for lv in self.levels.values():
            lv.begin(ctx.model, ctx.cache, ctx.history)
        self.lookup = PromptLookup(ctx.history, eos_ids=ctx.eos_ids) if self.cfg.use_pld else None

    def observe(self, ctx: DraftContext, tree: DraftTree, path: list[int], emitted: list[int]) -> None:
        on_path = set(path)
        outcomes = []
        for n in range(1, len(tree)):
            self.drafted[self.nodes[n].source] = self.drafted.get(self.nodes[n].source, 0) + 1
            if tree.parents[n] in on_path:  # tested: the target looked at this token
                nd = self.nodes[n]
                outcomes.append((nd.source, nd.belief, n in on_path))
                o = self.outcomes.setdefault(nd.source, [0, 0])
                o[0] += 1
                o[1] += int(n in on_path)
        self.tracker.update(outcomes)
        for lv in self.levels.values():
            lv.observe(ctx.model, ctx.cache, ctx.history, emitted)
        if self.lookup is not None:
            self.lookup.extend(emitted)

    def report(self) -> dict:
        sizes = self.tree_sizes or [1]
        return {"steps": self.steps, "fallback_steps": self.fallback_steps,
                "mean_tree_nodes": float(np.mean(sizes)), "max_tree_nodes": int(max(sizes)),
                "drafted_by_source": dict(self.drafted),
                "acceptance_by_source": {s: (k / n if n else 0.0) for s, (n, k) in self.outcomes.items()},
                "tested_by_source": {s: n for s, (n, _) in self.outcomes.items()},
                "predicted_draft_ms": round(self.predicted_draft_ms, 1),
                "measured_draft_ms": round(self.measured_draft_ms, 1)}

    # ------------------------------------------------------------------ costs
    def _costs(self, context: int, n_max: int) -> None:
        """Per-step tables: verify ms by node count [n_max + 1], each level's forward ms by token count."""
        T = np.arange(1, n_max + 1)
        lat = self.latency
        self.level_ms: dict[str, np.ndarray] = {}
        if self.cfg.constant_cost is not None:  # ablation: no predictor; costs in units of one target step
            self.verify_ms = np.concatenate([[0.0], np.ones(n_max)])
            for name in self.levels:
                self.level_ms[name] = np.concatenate([[0.0], np.full(n_max, self.cfg.constant_cost)])
            return
        if lat.known(TARGET):
            v = lat.predict_mean(TARGET, T, context, tree=True)
            v[0] = lat.predict_mean(TARGET, T[:1], context, tree=False)[0]
        else:  # nothing measured yet: a flat guess, replaced after the first verification
            v = 50.0 + 1.0 * (T - 1)
        self.verify_ms = np.concatenate([[0.0], np.maximum(v, 1e-3)])  # index = node count
        for name in self.levels:
            if lat.known(name):
                c = lat.predict_mean(name, T, context, tree=True)
            else:  # not profiled and not run yet: half a target step, until its first forward is timed
                c = 0.5 * self.verify_ms[T]
            self.level_ms[name] = np.concatenate([[0.0], np.maximum(c, 1e-3)])

    # ------------------------------------------------------------------ drafting
    def draft(self, ctx: DraftContext) -> DraftTree:
        cfg = self.cfg
        L = ctx.cache.length
        n_max = max(1, min(cfg.max_nodes, ctx.room))
        self._costs(L, n_max)
        self.tree = DraftTree.root(ctx.history[-1])
        self.nodes = [_Node("root", 1.0, 1.0, 0)]
        self.spent = 0.0  # predicted draft ms of the actions taken
        self.steps += 1
        while len(self.tree) < n_max:
            act = self._best_action(ctx, n_max)
            if act is None:
                break
            E = sum(nd.p for nd in self.nodes)
            first = len(self.tree) == 1
            if act.rate <= E / (self.spent + self.verify_ms[len(self.tree)]):
                if not first:
                    break
                if cfg.fallback and self.fallbacks_in_row < cfg.explore_every:
                    self.fallbacks_in_row += 1  # AR is predicted to be faster: verify the root alone
                    break
            if first:
                self.fallbacks_in_row = 0
            size = len(self.tree)
            self._execute(ctx, act)
            if len(self.tree) <= size:  # no growth (every candidate token already a child): stop here
                break
        if len(self.tree) == 1:
            self.fallback_steps += 1
        self.tree_sizes.append(len(self.tree))
        return self.tree

    def _path_tokens(self, n: int) -> list[int]:
        return [self.tree.tokens[i] for i in self.tree.path_to(n)[1:]]

    def _pending(self, n: int, level: str) -> list[int]:
        """Nodes on the path to n whose KV `level` cannot read (they need its forward first)."""
        return [i for i in self.tree.path_to(n) if not reads_kv_of(level, self.levels.get(self.nodes[i].kv))]

    def _offer(self, n: int, level: str) -> tuple[int, float, str] | None:
        """The best token of level's known distribution at n that is not yet a child of n: (token, its draft
        probability, its source: the level for its top-1 token, sibling(level) for the others)."""
        dist = self.nodes[n].dists.get(level)
        if dist is None:
            return None
        taken = {self.tree.tokens[c] for c in range(1, len(self.tree)) if self.tree.parents[c] == n}
        for rank, (tok, prob) in enumerate(zip(*dist)):
            if tok not in taken:
                return tok, prob, level if rank == 0 else sibling(level)
        return None

    def _best_action(self, ctx: DraftContext, n_max: int) -> _Action | None:
        cfg, tr = self.cfg, self.tracker
        N = len(self.tree)
        E = sum(nd.p for nd in self.nodes)
        V, D = self.verify_ms, self.spent
        max_depth = ctx.room - 1
        has_child = [False] * N
        for c in range(1, N):
            has_child[self.tree.parents[c]] = True
        order = sorted(range(N), key=lambda i: -self.nodes[i].p)
        best: _Action | None = None
        seen = {True: 0, False: 0}  # expandable leaves / inner nodes (sibling offers) considered so far
        for n in order:
            nd = self.nodes[n]
            if nd.depth >= max_depth or self.tree.tokens[n] in ctx.eos_ids and n != 0:
                continue
            options = 0
            if self.lookup is not None and not has_child[n] and nd.pld is None:
                nd.pld = self.lookup.propose_after(self._path_tokens(n), cfg.pld_tokens)
            for name in self.levels:
                c = self.level_ms[name]
                a = tr.mean(name)
                offer = self._offer(n, name)
                if offer is not None:  # the first token is known already: no forward
                    variants = [(0, 1.0, tr.estimate(offer[2], offer[1]), 0.0)]
                elif not has_child[n]:
                    P = len(self._pending(n, name))
                    variants = [(0, 1.0, a, c[min(P, len(c) - 1)])]
                    # the first forward may also review prompt-lookup tokens: each one it agrees with is kept,
                    # so the forward yields 1 + (expected agreed prefix) tokens, at the cost of a longer forward
                    toks, m = nd.pld if nd.pld is not None else ([], 0)
                    b, mu = tr.estimate(PLD, m), 0.0
                    for r in range(1, min(len(toks), cfg.review_tokens, n_max - N - 1) + 1):
                        mu += b ** r
                        variants.append((r, 1.0 + mu, a, c[min(P + r, len(c) - 1)]))
                else:
                    continue
                options += 1
                limit = min(cfg.lookahead, n_max - N, max_depth - nd.depth)
                for review, first_tokens, a1, first_cost in variants:
                    for k in range(1, limit + 1):
                        t = first_tokens + k - 1  # expected tokens of the segment
                        if t > limit:
                            break
                        gain = nd.p * a1 / a * _geometric(a, t)
                        cost = first_cost + (k - 1) * c[1]
                        rate = (E + gain) / (D + cost + V[N + int(round(t))])
                        if best is None or rate > best.rate:
                            best = _Action(rate, n, name, k, review)
            if self.lookup is not None and not has_child[n]:
                toks, m = nd.pld
                if toks:
                    options += 1
                    a = tr.estimate(PLD, m)
                    gain, prob = 0.0, nd.p
                    for k in range(1, min(len(toks), n_max - N, max_depth - nd.depth) + 1):
                        prob *= a
                        gain += prob
                        rate = (E + gain) / (D + V[N + k])
                        if best is None or rate > best.rate:
                            best = _Action(rate, n, PLD, k)
            seen[has_child[n]] += options > 0
            if min(seen.values()) >= cfg.expand_candidates:
                break
        return best

    def _add(self, parent: int, token: int, source: str, belief: float, p: float) -> int:
        n = self.tree.add(parent, token)
        self.nodes.append(_Node(source, belief, p, self.nodes[parent].depth + 1))
        return n

    def _execute(self, ctx: DraftContext, act: _Action) -> None:
        n, tr = act.node, self.tracker
        if act.source == PLD:
            toks, m = self.nodes[n].pld
            a = tr.estimate(PLD, m)
            for tok in toks[:act.k]:
                n = self._add(n, tok, PLD, m, self.nodes[n].p * a)
            return
        name = act.source
        if act.review:  # attach the copied tokens, run the level over them, drop those it disagrees with
            first_new = len(self.tree)
            toks, m = self.nodes[n].pld
            leaf = n
            for tok in toks[:act.review]:
                leaf = self._add(leaf, tok, PLD, m, self.nodes[leaf].p * tr.estimate(PLD, m))
            self._run(ctx, name, self._pending(leaf, name))
            cut = next((i for i in range(first_new, len(self.tree)) if self.nodes[i].source == OVERRULED),
                       len(self.tree))
            self._truncate(cut)
            n = cut - 1 if cut > first_new else n  # the last copied token it agreed with, else where it grew from
        elif self._offer(n, name) is None:
            self._run(ctx, name, self._pending(n, name))
        offer = self._offer(n, name)
        if offer is not None:
            tok, prob, source = offer
            self._add(n, tok, source, prob, self.nodes[n].p * tr.estimate(source, prob))

    def _run(self, ctx: DraftContext, name: str, pending: list[int]) -> None:
        """Level `name` runs the pending nodes (runs of consecutive ids, one forward each), keeps its top tokens at
        each, and reviews the copied tokens below them."""
        level, tree, dev = self.levels[name], self.tree, ctx.model.device
        L = ctx.cache.length
        runs: list[list[int]] = []
        for i in pending:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            a, b = run[0], run[-1] + 1
            mask = ancestor_mask(tree.parents[:b], dev)[a:b]  # [T, b]
            t0 = time.perf_counter()
            logits = level.forward(ctx.model, ctx.cache, torch.tensor(tree.tokens[a:b], device=dev),
                                   position_ids(tree.parents[:b], L, dev)[a:b], L + a, mask)  # [T, V]
            top_p, top_i = torch.softmax(logits, -1).topk(self.cfg.top_k, dim=-1)  # [T, k]
            top_p, top_i = top_p.tolist(), top_i.tolist()
            ms = (time.perf_counter() - t0) * 1e3
            ctx.draft_forwards += 1
            self.latency.observe(name, b - a, L + a, ms, tree=True)
            self.measured_draft_ms += ms
            if self.cfg.constant_cost is None:
                self.predicted_draft_ms += float(self.level_ms[name][min(b - a, len(self.level_ms[name]) - 1)])
            self.spent += float(self.level_ms[name][min(b - a, len(self.level_ms[name]) - 1)])
            for j, i in enumerate(run):
                self.nodes[i].kv = name
                self.nodes[i].dists[name] = (top_i[j], top_p[j])
                self._review(i, name)

    def _review(self, n: int, name: str) -> None:
        """Level `name` now knows its distribution at n: re-estimate n's copied children (vertical cascade)."""
        tokens, probs = self.nodes[n].dists[name]
        tr = self.tracker
        for c in range(n + 1, len(self.tree)):
            nd = self.nodes[c]
            if self.tree.parents[c] != n or nd.source != PLD:
                continue
            if self.tree.tokens[c] == tokens[0]:
                nd.source, nd.belief = name, probs[0]
            else:
                nd.source = OVERRULED
            self._rescale(c, self.nodes[n].p * tr.estimate(nd.source, nd.belief) / max(nd.p, 1e-12))

    def _truncate(self, size: int) -> None:
        """Drop the nodes from `size` on (the last ones added: nothing else hangs below them)."""
        del self.tree.tokens[size:], self.tree.parents[size:], self.nodes[size:]
        if self.tree.q:
            del self.tree.q[size:]

    def _rescale(self, n: int, factor: float) -> None:
        """Multiply the estimates of n and its subtree (the subtree's conditional estimates are unchanged)."""
        sub = {n}
        for c in range(n, len(self.tree)):
            if c == n or self.tree.parents[c] in sub:
                sub.add(c)
                self.nodes[c].p *= factor


def _geometric(a: float, t: float) -> float:
    """a + a^2 + ... + a^t, with a fractional last term for a fractional t (expected accepted tokens of a
    t-token segment whose tokens are each accepted with probability a given the previous one)."""
    whole = int(t)
    total = a * (1 - a ** whole) / (1 - a) if a < 1 else float(whole)
    return total + (t - whole) * a ** (whole + 1)
