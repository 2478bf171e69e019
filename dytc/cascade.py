"""CS Drafting's cascades (arXiv 2312.11462) over dsia levels, with statistical lookups as the zero-cost bottom.

Both draft a chain (deterministic tokens: q one-hot, lossless under sampling too); the target verifies it once.

  vc     vertical cascade over sources [S_1, ..., S_m, bottom] (strongest first). S_i drafts its tokens by
         reviewing a proposal of the next source down: one S_i forward over its pending chain tokens plus the
         proposal gives S_i's own next token after each of them; the proposal's tokens are kept while they
         equal S_i's (greedy review, no lenience), and S_i's token after the last kept one is appended. So
         each S_i forward yields 1 + (matched proposal tokens) tokens. The bottom is prompt lookup, Max-Gram, or
         both (prompt lookup's proposal, else Max-Gram's; no forward); when it has nothing, S_i just drafts its
         next token. The top source's chain is the draft.
  hc     horizontal cascade: the chain is cut into segments (CS Drafting's k-matrix, one row): the first k_1
         tokens from S_1, the next k_2 from S_2, ..., stronger sources first since early tokens matter most; a
         segment may be a lookup (`pld*3`, `maxgram*3`).
  vc+hc  both: each neural segment of hc is drafted vertically with the bottom beneath it.
  tree+vc  vc's chain grown into a tree: the top level's forwards that drafted and reviewed the chain also give
         its distribution after every chain token, so its next most probable tokens become sibling leaves
         there at no extra forward; the chain and the most probable leaves (cumulative top-level probability)
         are verified.

A level's forward writes the KV of the chain tokens it runs into their scratch slots (token j at slot
cache.length + j). A level reads the chain's earlier slots when they were written by itself or by a level that
writes every layer (quantized, sparse, vocabulary levels); otherwise it runs them again (skip and exit levels
leave the skipped layers' slots unwritten).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsia.levels import Level, reads_kv_of
from dsia.topk import argmax_rows

from .ngram import Lookup
from .policies import DraftContext, Policy, prune
from .recycle import RECYCLE_K, learn
from .sources import LOOKUPS, PLD, RECYCLE
from .tree import DraftTree


@dataclass(frozen=True)
class CascadeConfig:
    vc_tokens: int = 8  # vc: tokens the top source drafts per step
    proposal_tokens: int = 4  # most tokens a lower source proposes to the one above per review
    tree_top_k: int = 3  # tree+vc: the top level's most probable tokens after each chain token (chain's included)
    tree_nodes: int = 16  # tree+vc: most nodes verified (root included)


class ChainBuilder:
    """One step's chain under construction, with per-token record of which level's KV sits in its slot."""

    def __init__(self, ctx: DraftContext, levels: dict[str, Level], alts_of: str | None = None,
                 top_k: int = 0) -> None:
        self.ctx = ctx
        self.tokens = [ctx.history[-1]]  # chain tokens; [0] is the root
        self.kv: list[str | None] = [None]  # level whose KV is in each token's slot
        self.levels = levels  # name -> Level, for who wrote each slot
        self.alts_of = alts_of  # tree+vc: the level whose top_k next tokens are recorded after each position it runs
        self.top_k = top_k
        self.alts: dict[int, dict[int, float]] = {}  # chain index -> {token: probability} of level alts_of

    def readable(self, j: int, name: str) -> bool:
        return reads_kv_of(name, self.levels.get(self.kv[j]))

    def run(self, level: Level, upto: int, extra: list[int]) -> list[int]:
        """Run `level` over the chain tokens it cannot read yet (up to index `upto`, inclusive) plus `extra`
        (tokens proposed after index upto; their slots follow). Returns the level's next token after each
        position from `upto` on, [1 + len(extra)]: its argmax (greedy), or its coupled draft (sampling,
        `DraftContext.draft_top`)."""
        ctx, dev = self.ctx, self.ctx.model.device
        # from the first token it cannot read (at the latest `upto` itself, whose logits are needed)
        start = next((j for j in range(upto + 1) if not self.readable(j, level.name)), upto)
        toks = self.tokens[start:upto + 1] + extra
        L = ctx.cache.length
        logits, _ = ctx.run_level(level, toks, torch.arange(L + start, L + start + len(toks), device=dev),
                                  L + start)  # [T, V]
        for j in range(start, upto + 1):
            self.kv[j] = level.name
        rows = logits[upto - start:]  # [1 + E, V]
        if level.name == self.alts_of or ctx.coupled:
            top_p, top_i = ctx.draft_top(rows, list(range(L + upto, L + upto + len(rows))), self.top_k)  # [1+E, k]
            if level.name == self.alts_of:
                for r, (p, i) in enumerate(zip(top_p.tolist(), top_i.tolist())):
                    self.alts[upto + r] = dict(zip(i, p))
            if ctx.coupled:
                return top_i[:, 0].tolist()
        return argmax_rows(rows).tolist()

    def forget_after(self, j: int) -> None:
        """Drop the alternatives recorded after chain index j (they followed proposal tokens not kept)."""
        for r in [r for r in self.alts if r > j]:
            del self.alts[r]

    def push(self, tokens: list[int], kv: str | None) -> None:
        self.tokens += tokens
        self.kv += [kv] * len(tokens)

    def tree(self) -> DraftTree:
        return DraftTree.chain(self.tokens[0], self.tokens[1:])

    def tree_with_siblings(self, max_nodes: int) -> DraftTree:
        """The chain plus, after each chain token, level alts_of's other top-k tokens as leaves: the whole chain
        (what vc verifies) and the most probable of those leaves (cumulative probability under alts_of),
        max_nodes in all. In vc the top level runs every chain token's parent, so each has its alternatives."""
        tree, score = self.tree(), [1.0] * len(self.tokens)  # score: cumulative probability per node
        for j in range(len(self.tokens) - 1):
            probs = self.alts[j]  # {token: probability} after chain token j
            score[j + 1] = score[j] * probs.get(self.tokens[j + 1], 0.0)
            for tok, p in probs.items():
                if tok != self.tokens[j + 1]:
                    tree.add(j, tok)
                    score.append(score[j] * p)
        n = len(self.tokens)
        keep = [2.0 - j / n for j in range(n)] + score[n:]  # chain first (> 1 >= any leaf), then leaves
        return prune(tree, keep, max_nodes)


class Cascade(Policy):
    """`vc`, `tree+vc`, `hc` or `vc+hc` over named sources (levels and lookups)."""

    def __init__(self, name: str, levels: dict[str, Level], segments: list[tuple[str, int]], below: list[str],
                 cfg: CascadeConfig = CascadeConfig(), siblings: bool = False) -> None:
        self.name = name
        self.levels = levels  # name -> Level, every neural source used
        self.segments = segments  # (source, tokens) in chain order
        self.below = below  # sources proposing to a neural segment's level, next one down first; lookups last
        self.cfg = cfg
        self.siblings = siblings  # tree+vc: add the first segment level's alternatives as sibling leaves
        self.lookups: dict[str, Lookup] = {}  # the lookups used, over this generation's history
        self.target_top_k = RECYCLE_K if RECYCLE in below or any(s == RECYCLE for s, _ in segments) else 0

    @staticmethod
    def vc(levels: list[Level], bottom: tuple[str, ...] = (PLD,), cfg: CascadeConfig = CascadeConfig(),
           tree: bool = False) -> "Cascade":
        """Vertical: the strongest level drafts cfg.vc_tokens, reviewing the next level's proposals, down to the
        bottom lookups (tree=True: tree+vc, the chain with the strongest level's alternatives as siblings)."""
        return Cascade("tree+vc" if tree else "vc", {lv.name: lv for lv in levels}, [(levels[0].name, cfg.vc_tokens)],
                       [lv.name for lv in levels[1:]] + list(bottom), cfg, siblings=tree)

    @staticmethod
    def hc(levels: dict[str, Level], segments: list[tuple[str, int]], bottom: tuple[str, ...] | None = None,
           cfg: CascadeConfig = CascadeConfig()) -> "Cascade":
        """Horizontal over the segments; with a bottom, each neural segment is drafted vertically over it (vc+hc)."""
        return Cascade("hc" if bottom is None else "vc+hc", levels, segments, list(bottom or ()), cfg)

    def begin(self, ctx: DraftContext) -> None:
        for lv in self.levels.values():
            lv.begin(ctx.model, ctx.cache, ctx.history)
        names = {s for s, _ in self.segments if s in LOOKUPS} | {s for s in self.below if s in LOOKUPS}
        self.lookups = {n: ctx.lookup(n) for n in sorted(names)}

    def observe(self, ctx: DraftContext, tree: DraftTree, path: list[int], emitted: list[int]) -> None:
        for lv in self.levels.values():
            lv.observe(ctx.model, ctx.cache, ctx.history, emitted)
        for lookup in self.lookups.values():
            lookup.extend(emitted)
        learn(self.lookups, not ctx.coupled, ctx.target_top)

    def finish(self, ctx: DraftContext) -> None:
        for lookup in self.lookups.values():
            lookup.finish()

    def draft(self, ctx: DraftContext) -> DraftTree:
        chain = ChainBuilder(ctx, self.levels, self.segments[0][0] if self.siblings else None, self.cfg.tree_top_k)
        room = ctx.room - 1  # draft tokens that fit
        for source, k in self.segments:
            k = min(k, room - (len(chain.tokens) - 1))
            if k <= 0:
                break
            before = len(chain.tokens)
            if source in LOOKUPS:
                chain.push(self.lookups[source].propose_after(chain.tokens[1:], k)[0], None)
            else:
                self._extend(chain, source, k, self.below)
            if len(chain.tokens) == before or chain.tokens[-1] in ctx.eos_ids:
                break
        if self.siblings:
            return chain.tree_with_siblings(min(self.cfg.tree_nodes, ctx.room))
        return chain.tree()

    def _propose(self, chain: ChainBuilder, below: list[str], k: int) -> list[int]:
        """Up to k tokens continuing the chain from the next source down (recursively vertical); at the bottom,
        the first lookup that has a proposal."""
        if not below or k <= 0:
            return []
        if below[0] in LOOKUPS:
            for name in below:
                tokens = self.lookups[name].propose_after(chain.tokens[1:], k)[0]
                if tokens:
                    return tokens
            return []
        n0 = len(chain.tokens)
        self._extend(chain, below[0], k, below[1:])
        out = chain.tokens[n0:]
        del chain.tokens[n0:], chain.kv[n0:]  # a proposal only: the level above decides what stays
        return out
    def _extend(self, chain: ChainBuilder, name: str, k: int, below: list[str]) -> None:
        """Append k tokens drafted by level `name`, each of its forwards reviewing a proposal from below."""
        level, eos = self.levels[name], chain.ctx.eos_ids
        goal = len(chain.tokens) + k
        while len(chain.tokens) < goal:
            want = goal - len(chain.tokens)
            prop = self._propose(chain, below, min(self.cfg.proposal_tokens, want - 1))
            nxt = chain.run(level, len(chain.tokens) - 1, prop)  # [1 + len(prop)]
            kept = 0
            while kept < len(prop) and prop[kept] == nxt[kept]:
                kept += 1
            new = (prop[:kept] + [nxt[kept]])[:want]
            chain.forget_after(len(chain.tokens) - 1 + kept)
            chain.push(new[:kept], name)  # reviewed tokens: the level ran them (their KV is the level's)
            chain.push(new[kept:], None)  # its own next token: not run yet
            if any(t in eos for t in new):  # nothing is drafted past an EOS
                cut = next(i for i in range(len(chain.tokens) - len(new), len(chain.tokens)) if chain.tokens[i] in eos)
                del chain.tokens[cut + 1:], chain.kv[cut + 1:]
                return
