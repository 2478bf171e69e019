"""Drafting policies: who drafts the tree the target verifies each step.

A policy sees a DraftContext (the runtime, the KV cache, the token history whose last token is the root) and
returns a DraftTree. Every policy runs its levels through `DraftContext.run_level`, the one place a draft forward
is counted, timed and learned by the latency model. Draft forwards write only scratch slots: node i of the tree
lives at slot cache.length + i, so a forward over a contiguous range of new nodes passes their rows of the
ancestor mask.

  ar    the root alone (plain autoregressive decoding)
  pld   a chain copied by prompt lookup (n-gram match over prompt + output)
  sd    a chain drafted by one level, as long as its cumulative top-1 confidence stays above a threshold
  tree  a tree drafted by one level: each depth expands the most probable frontier nodes with their top-k
        tokens in one batched forward (EAGLE-2 / SWIFT style), then the best nodes by cumulative draft
        probability are kept (a prefix-closed set, since probabilities only shrink down a path)

Both stop early when another draft forward cannot pay for itself. A forward costing c target steps (the level's
predicted cost ratio, from the latency model, which learns the level's timings as it drafts) can add at most
P accepted tokens, P the draft probability that the accepted path reaches the nodes it extends (the chain's
cumulative confidence; the sum over the frontier for a tree); one target step yields one token, so drafting on
pays only while P > c. For cheap levels this changes little (the confidence threshold binds first); a level
nearly as slow as the target drafts only what it is sure of. The first forward of a step always runs, so the
level's timings keep being measured (a slow first call cannot shut it off for good).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from dsia.kvcache import KVCache
from dsia.levels import Level
from dsia.model import Transformer
from dsia.topk import top_k_logsumexp

from .batchcost import BatchCost
from .latency import TARGET_LEVEL, LatencyModel
from .ngram import PLD_MAX_NGRAM, PLD_NUM_TOKENS, Lookup, PromptLookup
from .sampling import SamplingParams, coupled_top, sample, warp
from .recycle import TargetTop
from .shared import SharedDrafts, new_lookup
from .sources import FREE
from .tree import DraftTree, ancestor_mask, position_ids
from .verify import Noise


@dataclass(frozen=True)
class Load:
    """What a batched step verifies besides this generation's tree (continuous batching, casspec/runtime/batch.py):
    dytc weighs its drafts against the whole step's throughput."""
    rows: int  # the other generations' rows in the step's target forward (not joining prompts' chunks: batch.py)
    tokens: float  # the tokens they are expected to emit
    draft_ms: float  # their drafting time (the step waits for it)
    generations: int = 0  # how many they are
    cost: BatchCost | None = None  # the batch's steps' measured cost (batchcost.py), where it keeps one
    drafts: bool = True  # False: the batch's measured goodput says verify the root alone (SpeculationSwitch)

    def step_table(self, n_max: int) -> list[float] | None:
        """[n_max + 1]: the step's measured cost where this generation's tree has N = 1 .. n_max nodes beside the
        others' (index 0 unused); None until the batch has measured enough steps."""
        if self.cost is None or not self.cost.ready:
            return None
        return self.cost.table(self.generations + 1, self.rows - self.generations, n_max)


@dataclass
class DraftContext:
    model: Transformer
    cache: KVCache
    history: list[int]  # every token so far (prompt + output); history[-1] is the root, not yet in the cache
    sampling: SamplingParams
    generator: torch.Generator | None
    eos_ids: frozenset[int] = frozenset()
    budget: int = 1 << 30  # tokens the generation may still emit
    latency: LatencyModel | None = None  # learns every level forward's time (None: nothing learns)
    noise: Noise | None = None  # sampling: the verifier's position-owned noise, which coupled drafts use too
    draft_forwards: int = 0  # level forwards run by the policy in this generation
    draft_ms: float = 0.0  # their measured time
    load: Load | None = None  # a batched step's other generations (None: this one alone)
    forwards: list[tuple[str, int, bool]] | None = None  # every level forward (level, tokens, tree mask) when a
    # caller records them (the oracle replay); None: not recorded
    shared: SharedDrafts | None = None  # what the recycle and suffix sources remember of earlier generations, per
    # client: the memory of `tenant` is taken when one of them starts (None: each uses this generation's alone)
    tenant: str = ""  # the request's client (Request.tenant)
    target_top: TargetTop | None = None  # the last verification's accepted path's tokens (root first), the target's
    # top successors after each and their log-probabilities, where the policy asks for them (Policy.target_top_k)

    @property
    def room(self) -> int:
        """Most tree nodes (root included) worth verifying: what fits in the token budget (a path of d draft tokens
        emits d + 1) and in the cache, leaving the slot AR would leave (so every method stops where AR stops)."""
        return max(1, min(self.cache.capacity - self.cache.length - 1, self.budget))

    def run_level(self, level: Level, tokens: list[int], positions: torch.Tensor, start: int,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """The one way a policy runs a level: its logits [T, V] over `tokens` [T] at `positions` [T], written to
        scratch slots [start, start + T) (mask [T, start + T - cache.length]: which tree nodes each token sees;
        None: causal), and the forward's milliseconds, which the latency model learns (unless a CUDA graph was
        captured during it)."""
        captures, t0 = self.model.graph_captures, time.perf_counter()
        logits = level.forward(self.model, self.cache, torch.tensor(tokens, device=self.model.device), positions,
                               start, mask)  # [T, V]
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        ms = (time.perf_counter() - t0) * 1e3
        self.draft_forwards += 1
        self.draft_ms += ms
        if self.forwards is not None:
            self.forwards.append((level.name, len(tokens), mask is not None))
        if self.latency is not None and self.model.graph_captures == captures:
            self.latency.observe(level.name, len(tokens), start, ms, tree=mask is not None)
        return logits, ms

    @property
    def coupled(self) -> bool:
        """Whether the levels draft coupled to the verifier's noise (sampling; `draft_top`)."""
        return not self.sampling.greedy and self.noise is not None

    def draft_top(self, logits: Tensor, positions: list[int], k: int) -> tuple[Tensor, Tensor]:
        """A level's k best next tokens after each of T rows and their draft probabilities ([T, k] each; row j is
        the token at `positions[j]`, so it drafts position positions[j] + 1). Greedy: the top k of its softmax.
        Sampling (coupled drafting): the top k of log warp(q) + g, g the noise the verifier draws the target's
        token at that position with, so the first is the target's own sample wherever the two perturbed argmaxes
        agree (a good level's do at about its greedy agreement; its plain argmax would match with probability
        p(x) only); the probabilities are the softmax of those perturbed scores (q itself where g = 0)."""
        if not self.coupled:  # (the top k logits and the row's log-sum-exp in one pass: dsia/topk.py)
            values, tokens, lse = top_k_logsumexp(logits.float(), k)  # [T, k], [T, k], [T]
            return (values - lse[:, None]).exp(), tokens
        return coupled_top(logits.cpu(), self.sampling, self.noise, [p + 1 for p in positions], k)

    def lookup(self, name: str) -> Lookup:
        """A zero-cost source by name over this generation's history (dytc/shared.py)."""
        memory = self.shared.memory(self.tenant) if self.shared is not None and name in FREE else None
        return new_lookup(name, self.history, self.eos_ids, memory, self.noise if self.coupled else None,
                          self.sampling.temperature)

    def commit(self, emitted: list[int]) -> None:
        """After verification: the emitted tokens join the history (the last one is the next root)."""
        self.history.extend(emitted)
        self.budget -= len(emitted)


class Policy:
    name = "ar"
    target_top_k = 0  # the target's top successors per verified node the policy reads in observe (ctx.target_top)

    def finish(self, ctx: DraftContext) -> None:
        """The generation ended (whatever ended it): what the policy leaves for later generations."""

    def begin(self, ctx: DraftContext) -> None:
        """A new generation: ctx.history is the prompt plus the first token (the first root)."""

    def draft(self, ctx: DraftContext) -> DraftTree:
        return DraftTree.root(ctx.history[-1])

    def observe(self, ctx: DraftContext, tree: DraftTree, path: list[int], emitted: list[int]) -> None:
        """After verification: `path` (tree nodes) was committed and `emitted` appended to ctx.history."""

    def report(self) -> dict:
        """What the policy did in this generation, for Stats.policy (empty: nothing beyond the common stats)."""
        return {}


class PldPolicy(Policy):
    name = "pld"

    def __init__(self, num_tokens: int = PLD_NUM_TOKENS, max_ngram: int = PLD_MAX_NGRAM) -> None:
        self.num_tokens = num_tokens  # most tokens copied per step
        self.max_ngram = max_ngram  # longest n-gram matched

    def begin(self, ctx: DraftContext) -> None:
        self.lookup = PromptLookup(ctx.history, max_ngram=self.max_ngram, eos_ids=ctx.eos_ids)

    def draft(self, ctx: DraftContext) -> DraftTree:
        tokens, _ = self.lookup.propose(min(self.num_tokens, ctx.room - 1))
        return DraftTree.chain(ctx.history[-1], tokens)

    def observe(self, ctx: DraftContext, tree: DraftTree, path: list[int], emitted: list[int]) -> None:
        self.lookup.extend(emitted)


@dataclass(frozen=True)
class ChainConfig:
    max_tokens: int = 10  # longest chain drafted per step
    min_confidence: float = 0.4  # stop once the chain's cumulative draft probability falls below this
    cost_aware: bool = True  # also stop once it falls below the level's predicted cost ratio (module docstring)
    coupled: bool = True  # sampling: draft argmax(log warp(q) + g) with the verifier's noise (verify_coupled);
    # False: draw each token from q and check the chain by recursive rejection sampling (verify_sampling)


class LevelPolicy(Policy):
    """A policy drafting with one dsia level: the level calibrates on each prompt and learns after each step."""

    def __init__(self, level: Level) -> None:
        self.level = level

    def begin(self, ctx: DraftContext) -> None:
        self.level.begin(ctx.model, ctx.cache, ctx.history)

    def cost_ratio(self, ctx: DraftContext, tokens: int, context: int, tree: bool) -> float:
        """The level's predicted forward time over `tokens` tokens in target steps; 0 when nothing predicts it."""
        lat = ctx.latency
        if lat is None or not lat.known(self.level.name) or not lat.known(TARGET_LEVEL):
            return 0.0
        return lat.cost_ratio(self.level.name, tokens, context, tree)[0]

    def observe(self, ctx: DraftContext, tree: DraftTree, path: list[int], emitted: list[int]) -> None:
        self.level.observe(ctx.model, ctx.cache, ctx.history, emitted)


class ChainPolicy(LevelPolicy):
    """`sd`: one level drafts a chain token by token (one 1-token forward each) until its confidence drops."""
    name = "sd"

    def __init__(self, level: Level, cfg: ChainConfig = ChainConfig()) -> None:
        super().__init__(level)
        self.cfg = cfg

    def draft(self, ctx: DraftContext) -> DraftTree:
        L, dev = ctx.cache.length, ctx.model.device
        tree = DraftTree.root(ctx.history[-1])
        conf = 1.0  # the chain's cumulative draft probability
        for d in range(min(self.cfg.max_tokens, ctx.room - 1)):
            if d > 0 and conf < self.cfg.min_confidence:
                break
            if d > 0 and self.cfg.cost_aware and conf < self.cost_ratio(ctx, 1, L + d, False):
                break  # another forward would cost more than it can gain
            logits, _ = ctx.run_level(self.level, [tree.tokens[-1]], torch.tensor([L + d], device=dev), L + d)
            q = None  # a deterministic draft (greedy, or coupled to the verifier's noise)
            if ctx.sampling.greedy or self.cfg.coupled:
                top_p, top_i = ctx.draft_top(logits, [L + d], 1)  # [1, 1] each
                tok, p = int(top_i[0, 0]), float(top_p[0, 0])
            else:
                q = warp(logits.cpu(), ctx.sampling)[0]  # [V]: the distribution the token is drawn from (CPU)
                tok = int(sample(q[None], ctx.generator)[0])
                p = float(q[tok])
            conf *= p
            tree.add(len(tree) - 1, tok, q)
            if tok in ctx.eos_ids:
                break
        return tree


@dataclass(frozen=True)
class TreeConfig:
    max_depth: int = 6  # draft forwards per step (one per depth)
    top_k: int = 4  # children considered per expanded node
    width: int = 4  # nodes expanded per depth (the most probable frontier nodes)
    max_nodes: int = 16  # nodes verified (root included), the most probable ones
    min_probability: float = 0.02  # nodes whose cumulative draft probability is below this are not kept
    cost_aware: bool = True  # stop once the frontier's total probability is below the next forward's cost ratio


class TreePolicy(LevelPolicy):
    """`tree`: one level drafts a token tree, one batched forward per depth over the expanded nodes.

    Children are the level's top-k tokens (under sampling, coupled to the verifier's noise: `draft_top`),
    deterministic (q one-hot), so verification is `verify_coupled` and lossless.
    """
    name = "tree"

    def __init__(self, level: Level, cfg: TreeConfig = TreeConfig()) -> None:
        super().__init__(level)
        self.cfg = cfg

    def draft(self, ctx: DraftContext) -> DraftTree:
        cfg, cache, dev = self.cfg, ctx.cache, ctx.model.device
        L = cache.length
        tree = DraftTree.root(ctx.history[-1])
        score = [1.0]  # cumulative draft probability per node
        frontier = [0]  # nodes to expand at this depth: a contiguous range of node ids
        budget = min(cfg.max_nodes, ctx.room)
        for depth in range(cfg.max_depth):
            a, b = frontier[0], frontier[-1] + 1
            if depth > 0 and cfg.cost_aware and sum(score[a:b]) < self.cost_ratio(ctx, b - a, L + a, True):
                break  # the next depth would cost more than it can gain
            mask = ancestor_mask(tree.parents, dev)[a:b, :b]  # [F, b]
            logits, _ = ctx.run_level(self.level, tree.tokens[a:b], position_ids(tree.parents, L, dev)[a:b], L + a,
                                      mask)  # [F, V]
            top_p, top_i = ctx.draft_top(logits, [L + depth] * (b - a), cfg.top_k)  # [F, k]
            cand = [(score[f] * float(top_p[j, c]), f, int(top_i[j, c]))
                    for j, f in enumerate(frontier) for c in range(cfg.top_k)]
            cand.sort(key=lambda x: -x[0])
            frontier = []
            for s, parent, tok in cand[:cfg.width]:
                if s < cfg.min_probability:
                    break
                frontier.append(tree.add(parent, tok))
                score.append(s)
            if not frontier or len(tree) >= budget:
                break
            if all(tree.tokens[n] in ctx.eos_ids for n in frontier):
                break
        return prune(tree, score, budget)


def prune(tree: DraftTree, score: list[float], max_nodes: int) -> DraftTree:
    """Keep the root and the max_nodes - 1 best nodes by score (prefix-closed when scores shrink down paths)."""
    if len(tree) <= max_nodes:
        return tree
    keep = sorted(sorted(range(1, len(tree)), key=lambda n: -score[n])[:max_nodes - 1])
    keep_set = set(keep)
    keep = [n for n in keep if all(p in keep_set or p == 0 for p in tree.path_to(n)[1:-1])]
    new_id = {0: 0}
    out = DraftTree.root(tree.tokens[0])
    for n in keep:
        new_id[n] = out.add(new_id[tree.parents[n]], tree.tokens[n], tree.q[n] if tree.q else None)
    return out
