"""DyTC: the Dynamic Tree Cascade router (`dytc`). Grows one token tree per step from several draft sources (dsia
levels and statistical lookups: prompt lookup, Max-Gram), choosing where to grow, with which source and how far,
from online acceptance estimates (acceptance.py) and predicted latencies (latency.py); the target then verifies the
tree once.

The objective (derived here; CAS-Spec's own formula is known only second-hand). One step drafts a tree and
verifies it. Let p_n be the probability that node n is accepted: the product, along its path, of each token's
acceptance estimate given its parent is accepted. Greedy verification accepts at most one child per node, so
the expected number of tokens the step emits is E = 1 + sum_{n != root} p_n (accepted drafts plus the bonus
token), and its time is D + V(N): the draft time spent D plus the predicted verification of the N-node tree at
this context. The step's throughput is E / (D + V(N)); AR is the one-node tree, 1 / V(1). D starts at the router's
own time per step (O, measured: a step's drafting time less its level forwards, a running mean): a step costs it
whatever it drafts, so a tree that emits more tokens spreads it over more.

Growth is greedy on that ratio. Each round considers the most probable nodes (`expand_candidates`) and, at
each, every source:
  - a level S extending node n by a segment of k tokens: the first token costs S's forward over the path nodes
    whose KV S cannot read yet (pending: at least n itself; nothing when S already ran n, whose distribution is
    then known and whose best token not yet a child is offered), every later token one more 1-token forward;
    value p_n * (a_1 + a_1 a + a_1 a^2 + ...) with a_1 the estimate of the first token (its draft probability's
    bucket, when known) and a the level's mean acceptance (A*-like lookahead: the later tokens are not drafted
    yet), cost c_S(pending) + (k - 1) c_S(1) + V(N + k) - V(N);
  - a lookup (prompt lookup, Max-Gram) at a leaf n: the tokens it proposes after (history + path to n), valued
    by its match-length bucket's estimate (apart, and up to `held_lookup_tokens`, after a step over which its
    proposal at the root held: a copy under way), costing only verification: V(N + k) - V(N).
The action with the best resulting throughput (E + dE) / (D + dD + V(N + dN)) is taken if it beats the current
E / (D + V(N)) (the marginal tokens per marginal millisecond exceed the tree's throughput); only its first token
is drafted (a whole lookup proposal at once), then the round repeats with the new estimates. The tree stops
growing when no action pays, at `max_nodes`, or at the step's room. Sibling candidates come for free: after S
runs node n, its next-best tokens are offered at n, valued by their own draft probability's bucket.

Vertical cascade inside the tree: when S runs a path that contains lookup tokens (its pending nodes), its
distribution at each of them reviews the copied token after it: a copied token S agrees with becomes an S token
(estimate of S's bucket), one it disagrees with is marked overruled (source "pld!" or "maxgram!", learned
separately) and S's own token is offered beside it. S's first forward may also take a lookup's proposal at a leaf
along (the review variants of a level action), so that one forward drafts and reviews.

A skip or early-exit level writes no KV for the layers it skips, so another level reading those nodes must run
them again; quantized, sparse and vocabulary levels write every layer and are readable by all.

Fallback: when even the best first action does not beat AR, the step verifies the root alone (counted as a
fallback step). After `explore_every` fallbacks in a row one tree is drafted anyway, so that the estimates keep
learning; a level not drafted with for `explore_level_after` steps takes a step's first action (`stale_level`).
Sampling: every drafted token is deterministic (q one-hot), verified by `verify.verify_coupled` (lossless whatever
was drafted). Batched (`new_step`): the rate is the whole step's, so a wide batch drafts less, down to the root.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Iterator

import torch

from dsia.levels import Level, reads_kv_of

from .acceptance import AcceptanceTracker
from .costs import COST_REFRESH_STEPS, cost_tables
from .latency import TARGET_LEVEL
from .policies import DraftContext, Policy
from .proposals import Lookups
from .recycle import RECYCLE_K
from .router_step import (Action, Node, RouterConfig, Step, consecutive_runs, geometric, held_lookups, stale_level,
                          unused_proposals)
from .sources import OVERRULED, RECYCLE, is_lookup, overruled, sibling
from .tree import DraftTree, ancestor_rows, is_chain

WORSE_K_STOP = 3  # a segment's length k stops growing after its predicted rate fell this many times in a row
REVIEW_MIN_GAIN = 0.05  # a review stops taking more copied tokens once the next adds fewer expected tokens
OVERHEAD_WEIGHT = 0.1  # weight of a step's measured router time in the running mean O (about the last ten steps)


class DyTC(Policy):
    name = "dytc"

    def __init__(self, levels: list[Level], tracker: AcceptanceTracker, cfg: RouterConfig = RouterConfig()) -> None:
        self.levels = {lv.name: lv for lv in levels}
        self.tracker = tracker  # shared across generations: estimates carry over
        self.cfg = cfg
        self.lookups: Lookups | None = None  # this generation's zero-cost sources (begin)
        self.step: Step | None = None  # the step drafted last, which `observe` learns from
        self.fallbacks_in_row = 0
        self.fallback_steps, self.steps = 0, 0  # (this and what follows: the per-generation report)
        self.tree_sizes = [0, 0, 0]  # the trees drafted: their nodes in all, the most in one, their number
        self.drafted: dict[str, int] = {}  # source -> tokens in the verified trees
        self.outcomes: dict[str, list[int]] = {}  # source -> [tested, accepted] in this generation
        self.predicted_draft_ms, self.measured_draft_ms = 0.0, 0.0
        self.last_drafted: dict[str, int] = {name: 0 for name in self.levels}  # level -> the step it last drafted in
        self.explore_steps, self.explore_loss = 0, 0.0  # steps a level was forced into; throughput they gave up
        self.free_tests = 0  # lookup tokens tested without being drafted (router_step.unused_proposals)
        self.overhead_ms = 0.0  # O: the router's own ms per step (its drafting time less level forwards), running mean
        # the cost tables alone and batched (by the forward's rows in all, for every load: one a load was 1314
        # predictions for the 26 dev turns natively 8 at a time, AMD EPYC): (step predicted at, verify ms, level ms),
        # predicted again every COST_REFRESH_STEPS steps or when too short
        self.tables: dict[bool, tuple[int, list[float], dict[str, list[float]]]] = {}
        self.target_top_k = RECYCLE_K if RECYCLE in cfg.lookups else 0  # recycle learns the target's candidates

    # ------------------------------------------------------------------ lifecycle
    def begin(self, ctx: DraftContext) -> None:
        for lv in self.levels.values():
            lv.begin(ctx.model, ctx.cache, ctx.history)
        self.lookups = Lookups(ctx, self.cfg.lookups, self.cfg.lookup_tokens, self.cfg.held_lookup_tokens)

    def finish(self, ctx: DraftContext) -> None:
        self.lookups.finish()

    def observe(self, ctx: DraftContext, tree: DraftTree, path: list[int], emitted: list[int]) -> None:
        assert self.step is not None and self.step.tree is tree, "observe the tree this router drafted last"
        nodes, on_path, outcomes = self.step.nodes, set(path), []
        for n in range(1, len(tree)):
            self.drafted[nodes[n].source] = self.drafted.get(nodes[n].source, 0) + 1
            if tree.parents[n] in on_path:  # tested: the target looked at this token
                outcomes.append((nodes[n].source, nodes[n].belief, n in on_path))
                o = self.outcomes.setdefault(nodes[n].source, [0, 0])
                o[0], o[1] = o[0] + 1, o[1] + int(n in on_path)
        free = unused_proposals(self.step, emitted, self.lookups.held)
        self.free_tests += len(free)
        self.tracker.update(outcomes + free)
        for lv in self.levels.values():
            lv.observe(ctx.model, ctx.cache, ctx.history, emitted)
        level_rows = [(tree.tokens[n], *nd.dists[name]) for n, nd in enumerate(nodes) for name in nd.dists
                      ] if RECYCLE in self.lookups else []  # (the levels' rows at the nodes they ran: recycle's)
        self.lookups.observe(ctx, emitted, held_lookups(self.step, emitted), level_rows)

    def report(self) -> dict:
        nodes, most, steps = self.tree_sizes
        return {"steps": self.steps, "fallback_steps": self.fallback_steps, "drafted_by_source": dict(self.drafted),
                "mean_tree_nodes": nodes / steps if steps else 1.0, "max_tree_nodes": most or 1,
                "acceptance_by_source": {s: (k / n if n else 0.0) for s, (n, k) in self.outcomes.items()},
                "tested_by_source": {s: n for s, (n, _) in self.outcomes.items()},
                "accepted_by_source": {s: k for s, (_, k) in self.outcomes.items()},
                "predicted_draft_ms": round(self.predicted_draft_ms, 1), "explore_steps": self.explore_steps,
                "free_tests": self.free_tests, "overhead_ms": round(self.overhead_ms, 2),
                **(self.lookups.report() if self.lookups is not None else {}),
                "measured_draft_ms": round(self.measured_draft_ms, 1),
                "explore_loss": round(self.explore_loss / max(self.explore_steps, 1), 4),
                "estimate_origins": {s: self.tracker.origins[s] for s in self.levels if s in self.tracker.origins}}

    def new_step(self, ctx: DraftContext, n_max: int) -> Step:
        """A step holding the root alone, with the cost tables (predicted again where COST_REFRESH_STEPS have passed
        or they are too short for n_max nodes); its time spent starts at O. Batched (ctx.load): the whole step's
        throughput, its time the batch's measured steps' (Load.step_table) or the others' rows and drafting added."""
        load = ctx.load if self.cfg.constant_cost is None else None
        batched = (others := load.rows if load is not None else 0) > 0
        t = self.tables.get(batched)
        if t is None or self.steps - t[0] >= COST_REFRESH_STEPS or len(t[1]) <= others + n_max:
            rows = 2 * (others + n_max) if batched else n_max  # (room for the load to grow before it is predicted)
            verify_ms, level_ms = cost_tables(ctx.latency, list(self.levels), ctx.cache.length, rows,
                                              self.cfg.constant_cost, batched)
            measured = ctx.latency is not None and all(map(ctx.latency.known, [TARGET_LEVEL, *self.levels]))
            t = self.tables[batched] = (self.steps if measured else -COST_REFRESH_STEPS,  # (guesses: again next)
                                        verify_ms.tolist(), {name: ms.tolist() for name, ms in level_ms.items()})
        verify = [0.0, *t[1][others + 1:others + n_max + 1]] if batched else t[1]  # (by node count)
        overhead = self.overhead_ms if self.cfg.step_overhead and self.cfg.constant_cost is None else 0.0
        measured = load.step_table(n_max) if batched else None  # (the batch's steps: everyone's drafting in them)
        return Step(DraftTree.root(ctx.history[-1]), [Node("root", 1.0, 1.0, 0)], measured or verify, t[2],
                    spent=0.0 if measured else overhead + (load.draft_ms if load else 0.0),
                    base=load.tokens if load else 0.0)

    # ------------------------------------------------------------------ drafting
    def draft(self, ctx: DraftContext) -> DraftTree:
        started, forwards_ms = time.perf_counter(), self.measured_draft_ms
        tree = self._grow(ctx)
        own = (time.perf_counter() - started) * 1e3 - (self.measured_draft_ms - forwards_ms)
        weight = OVERHEAD_WEIGHT if self.steps > 1 else 1.0  # (the first step's time is the first estimate)
        self.overhead_ms += weight * (own - self.overhead_ms)
        return tree

    def _grow(self, ctx: DraftContext) -> DraftTree:
        """This step's tree, grown greedily on the step's predicted throughput (module docstring)."""
        cfg = self.cfg
        n_max = max(1, min(cfg.max_nodes, ctx.room)) if ctx.load is None or ctx.load.drafts else 1
        step = self.step = self.new_step(ctx, n_max)
        self.steps += 1
        forced = stale_level(self.cfg, step, self.last_drafted, self.steps)
        while len(step.tree) < n_max:
            first = len(step.tree) == 1
            act = self.best_action(ctx, step, n_max)
            if act is None:
                break
            if first and forced is not None:  # explore: the stale level's best first action, its cost counted
                mine = self.best_action(ctx, step, n_max, only=forced)
                if mine is not None and mine.source != act.source:
                    self.explore_steps += 1
                    self.explore_loss += max(0.0, 1.0 - mine.rate / act.rate)
                    act = replace(mine, rate=max(mine.rate, step.rate + 1e-12))  # (even below AR's)
            if act.rate <= step.rate:
                if not first:
                    break
                if cfg.fallback and self.fallbacks_in_row < cfg.explore_every:
                    self.fallbacks_in_row += 1  # AR is predicted to be faster: verify the root alone
                    break
            if first:
                self.fallbacks_in_row = 0
            size = len(step.tree)
            if act.source in self.levels:
                self.last_drafted[act.source] = self.steps
            self._execute(ctx, step, act)
            if len(step.tree) <= size:  # no growth (every candidate token already a child): stop here
                break
        if len(step.tree) == 1:
            self.fallback_steps += 1
        sizes = self.tree_sizes
        sizes[0], sizes[1], sizes[2] = sizes[0] + len(step.tree), max(sizes[1], len(step.tree)), sizes[2] + 1
        return step.tree

    def best_action(self, ctx: DraftContext, step: Step, n_max: int, only: str | None = None) -> Action | None:
        """The action with the best resulting throughput over the most probable nodes (None: no node can grow);
        only: the best action of that level alone."""
        tree, max_depth = step.tree, ctx.room - 1
        children: list[set[int]] = [set() for _ in range(len(tree))]  # per node: its children's tokens
        for c in range(1, len(tree)):
            children[tree.parents[c]].add(tree.tokens[c])
        has_child = [bool(c) for c in children]
        best: Action | None = None
        expected = step.expected  # E of the tree as it is (every action below is valued against it)
        seen = {True: 0, False: 0}  # expandable leaves / inner nodes (sibling offers) considered so far
        for n in sorted(range(len(tree)), key=lambda i: -step.nodes[i].p):
            node = step.nodes[n]
            if node.depth >= max_depth or tree.tokens[n] in ctx.eos_ids and n != 0:
                continue
            if self.lookups and not has_child[n] and node.proposals is None:
                path = [tree.tokens[i] for i in tree.path_to(n)[1:]]
                node.proposals = self.lookups.at(path)
            considered = False
            for act in self._level_actions(step, expected, n, children[n], n_max, max_depth):
                considered = True
                if only is None or act.source == only:
                    best = act if best is None or act.rate > best.rate else best
            if only is None and (not has_child[n] or n == 0 and RECYCLE in self.lookups):
                if has_child[n] and node.branch_for != len(children[n]):  # the recycled tree's next branch at the
                    # root (its best successor not drafted yet; asked again once a child was added)
                    node.branch = self.lookups.branch([], children[n])
                    node.branch_for = len(children[n])
                for act in self._lookup_actions(step, expected, n, n_max, max_depth, has_child[n]):
                    considered = True
                    best = act if best is None or act.rate > best.rate else best
            seen[has_child[n]] += considered
            if min(seen.values()) >= self.cfg.expand_candidates:
                break
        return best

    def _level_actions(self, step: Step, expected: float, n: int, taken: set[int], n_max: int,
                       max_depth: int) -> Iterator[Action]:
        """Each level extending node n (whose children hold the tokens `taken`) by k tokens (module docstring): from
        its known distribution at n (no forward), or at a leaf by a forward over the pending path, optionally
        reviewing a lookup's proposal."""
        node, N, verify_ms, leaf = step.nodes[n], len(step.tree), step.verify_ms, not taken
        limit = min(self.cfg.lookahead, n_max - N, max_depth - node.depth)
        for name in self.levels:
            cost_ms, accept = step.level_ms[name], self.tracker.mean(name)
            offer = self._offer(step, n, name, taken)
            if offer is not None:  # the first token is known already: no forward
                variants = [(0, "", 1.0, self.tracker.estimate(offer[2], offer[1]), 0.0)]
            elif leaf:
                variants = self._first_forwards(step, n, name, n_max)
            else:
                continue
            for review, reviewed, first_tokens, first_accept, first_cost in variants:
                # the best segment length k (one Action per variant: the router's own time stays small). The
                # segment's expected tokens t = first_tokens + k - 1 grow by one a step, so geometric(accept, t)
                # grows by accept^(int(t) + 1) (1 - f + f accept), f the fraction of t (a multiple of accept each)
                best_rate, best_k = 0.0, 0
                scale = node.p * first_accept / accept
                geo = geometric(accept, first_tokens)
                frac = first_tokens - int(first_tokens)
                grow = accept ** (int(first_tokens) + 1) * (1 - frac + frac * accept)
                spent = step.spent + first_cost - cost_ms[1]  # (the k-th token's forward added below)
                nodes = N + int(round(first_tokens)) - 1  # tree size after the segment, less k
                worse = 0
                for k in range(1, math.floor(limit - first_tokens) + 2):  # t = first + k - 1 <= limit (first >= 1)
                    rate = (expected + scale * geo) / (spent + k * cost_ms[1] + verify_ms[nodes + k])
                    if rate > best_rate:
                        best_rate, best_k, worse = rate, k, 0
                    elif (worse := worse + 1) >= WORSE_K_STOP:
                        break
                    geo += grow
                    grow *= accept
                if best_k:
                    yield Action(best_rate, n, name, best_k, review, reviewed)

    def _first_forwards(self, step: Step, n: int, name: str,
                        n_max: int) -> list[tuple[int, str, float, float, float]]:
        """The ways level `name`'s first forward at leaf n can run: over its pending path alone, or also over the
        first r tokens a lookup proposes after n (each one it agrees with is kept, so the forward yields 1 +
        (expected agreed prefix) tokens, at the cost of a longer forward). Each: (r, lookup, expected first
        tokens, acceptance of its own token, ms)."""
        cost_ms, accept = step.level_ms[name], self.tracker.mean(name)
        pending = len(self._pending(step, n, name))
        variants = [(0, "", 1.0, accept, cost_ms[min(pending, len(cost_ms) - 1)])]
        for lookup, (tokens, match) in (step.nodes[n].proposals or {}).items():
            agree, reviewed = self.tracker.estimate(self.lookups.source(lookup), match), 0.0
            for r in range(1, min(len(tokens), self.cfg.review_tokens, n_max - len(step.tree) - 1) + 1):
                if agree ** r < REVIEW_MIN_GAIN:
                    break
                reviewed += agree ** r
                variants.append((r, lookup, 1.0 + reviewed, accept, cost_ms[min(pending + r, len(cost_ms) - 1)]))
        return variants

    def _lookup_actions(self, step: Step, expected: float, n: int, n_max: int, max_depth: int,
                        inner: bool = False) -> Iterator[Action]:
        """Each lookup's proposal at leaf n attached k tokens deep (inner: the recycled branch at the root): no
        forward, only a larger verification."""
        node, N = step.nodes[n], len(step.tree)
        proposals = ({RECYCLE: node.branch} if node.branch else {}) if inner else node.proposals or {}
        for lookup, (tokens, match) in proposals.items():
            accept = self.tracker.estimate(self.lookups.source(lookup), match)
            gain, prob, best_rate, best_k = 0.0, node.p, 0.0, 0
            for k in range(1, min(len(tokens), n_max - N, max_depth - node.depth) + 1):
                prob *= accept
                gain += prob
                rate = (expected + gain) / (step.spent + step.verify_ms[N + k])
                if rate > best_rate:
                    best_rate, best_k = rate, k
            if best_k:
                yield Action(best_rate, n, lookup, best_k, branch=inner)

    def _pending(self, step: Step, n: int, level: str) -> list[int]:
        """Nodes on the path to n whose KV `level` cannot read (they need its forward first)."""
        return [i for i in step.tree.path_to(n) if not reads_kv_of(level, self.levels.get(step.nodes[i].kv))]

    def _offer(self, step: Step, n: int, level: str, taken: set[int] | None = None) -> tuple[int, float, str] | None:
        """The best token of level's known distribution at n that is not yet a child of n (taken: the tokens of
        n's children, where the caller has them): (token, its draft probability, its source: the level for its
        top-1 token, sibling(level) for the others)."""
        dist, tree = step.nodes[n].dists.get(level), step.tree
        if dist is None:
            return None
        taken = {tree.tokens[c] for c in range(1, len(tree)) if tree.parents[c] == n} if taken is None else taken
        for rank, (tok, prob) in enumerate(zip(*dist)):
            if tok not in taken:
                return tok, prob, level if rank == 0 else sibling(level)
        return None

    # ------------------------------------------------------------------ growing the tree
    def _execute(self, ctx: DraftContext, step: Step, act: Action) -> None:
        n, tracker = act.node, self.tracker
        if act.source in self.lookups:
            node, source = step.nodes[n], self.lookups.source(act.source)
            tokens, match = node.branch if act.branch else node.proposals[act.source]
            accept = tracker.estimate(source, match)
            for tok in tokens[:act.k]:
                n = step.add(n, tok, source, match, step.nodes[n].p * accept)
            return
        name = act.source
        if act.review:  # attach the copied tokens, run the level over them, drop those it disagrees with
            first_new = len(step.tree)
            tokens, match = step.nodes[n].proposals[act.reviewed]
            leaf, source = n, self.lookups.source(act.reviewed)
            for tok in tokens[:act.review]:
                leaf = step.add(leaf, tok, source, match, step.nodes[leaf].p * tracker.estimate(source, match))
            self._run(ctx, step, name, self._pending(step, leaf, name))
            cut = next((i for i in range(first_new, len(step.tree)) if step.nodes[i].source.endswith(OVERRULED)),
                       len(step.tree))
            step.truncate(cut)
            n = cut - 1 if cut > first_new else n  # the last copied token it agreed with, else where it grew from
        elif self._offer(step, n, name) is None:
            self._run(ctx, step, name, self._pending(step, n, name))
        offer = self._offer(step, n, name)
        if offer is not None:
            tok, prob, source = offer
            step.add(n, tok, source, prob, step.nodes[n].p * tracker.estimate(source, prob))

    def _run(self, ctx: DraftContext, step: Step, name: str, pending: list[int]) -> None:
        """Level `name` runs the pending nodes (runs of consecutive ids, one forward each), keeps its top tokens at
        each, and reviews the copied tokens below them."""
        level, tree, dev = self.levels[name], step.tree, ctx.model.device
        L, cost_ms = ctx.cache.length, step.level_ms[name]
        for a, b in consecutive_runs(pending):
            mask = None if is_chain(tree.parents[:b]) else ancestor_rows(tree.parents[:b], a, dev)  # [T, b]; None:
            # causal (every earlier slot an ancestor)
            positions = [L + step.nodes[i].depth for i in range(a, b)]  # [T]
            logits, ms = ctx.run_level(level, tree.tokens[a:b], torch.tensor(positions, device=dev), L + a,
                                       mask)  # [T, V]
            top_p, top_i = ctx.draft_top(logits, positions, self.cfg.top_k)  # [T, k]
            top_p, top_i = top_p.tolist(), top_i.tolist()
            predicted = float(cost_ms[min(b - a, len(cost_ms) - 1)])
            self.measured_draft_ms += ms
            if self.cfg.constant_cost is None:
                self.predicted_draft_ms += predicted
            step.spent += predicted
            for j, i in enumerate(range(a, b)):
                step.nodes[i].kv = name
                step.nodes[i].dists[name] = (top_i[j], top_p[j])
                self._review(step, i, name)

    def _review(self, step: Step, n: int, name: str) -> None:
        """Level `name` now knows its distribution at n: re-estimate n's copied children (vertical cascade)."""
        tokens, probs = step.nodes[n].dists[name]
        for c in range(n + 1, len(step.tree)):
            node = step.nodes[c]
            if step.tree.parents[c] != n or not is_lookup(node.source) or node.source.endswith(OVERRULED):
                continue
            if step.tree.tokens[c] == tokens[0]:
                node.source, node.belief = name, probs[0]
            else:
                node.source = overruled(node.source)
            step.rescale(c, step.nodes[n].p * self.tracker.estimate(node.source, node.belief)
                          / max(node.p, 1e-12))
