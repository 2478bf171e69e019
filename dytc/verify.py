"""Verification of a draft tree against one target forward over the whole tree.

Greedy: the longest root-to-leaf path whose tokens equal the target's argmax at each step, plus the target's
next token after it (the bonus token). Sampling: lossless multi-draft speculative sampling (SpecInfer /
Sequoia-style recursive rejection): at a node with target distribution p and children x_1..x_m drawn from
q_1..q_m, accept x_i with probability min(1, p(x_i) / q_i(x_i)); on rejection p <- normalize(max(p - q_i, 0))
and try the next child; if every child is rejected, sample from what is left of p. The emitted tokens are then
distributed exactly as if the target had sampled them one by one, provided each q_i is exactly the
distribution x_i was drawn from given the earlier siblings (for siblings drawn without replacement the drafter
passes q with the earlier siblings removed and renormalized) and p and q are warped by the same function.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from dsia.cxx import build_error
from dsia.topk import argmax_rows

from .tree import DraftTree

SEED_MODULUS = 2**63  # casspec's noise ops take a seed reduced modulo this (an int64 >= 0)
POSITION_STRIDE = 1_000_003  # a prime above any context length: (seed, position) pairs map to distinct noise seeds


def verify_greedy(tree: DraftTree, logits: Tensor) -> tuple[list[int], int]:
    """logits [N, V] of the target at every node -> (accepted path of nodes from the root, bonus token)."""
    best = argmax_rows(logits).tolist()  # [N]
    children = tree.children()
    node, path = 0, [0]
    while True:
        nxt = next((c for c in children[node] if tree.tokens[c] == best[node]), None)
        if nxt is None:
            return path, best[node]
        path.append(nxt)
        node = nxt


def verify_sampling(tree: DraftTree, probs: Tensor, generator: torch.Generator | None) -> tuple[list[int], int]:
    """probs [N, V]: the target's warped distribution at every node -> (accepted path, token sampled after it)."""
    children = tree.children()
    node, path = 0, [0]
    while True:
        p = probs[node]
        accepted = None
        for c in children[node]:
            x = tree.tokens[c]
            q = tree.q[c] if tree.q and tree.q[c] is not None else None
            q_x = 1.0 if q is None else float(q[x])
            u = float(torch.rand((), generator=generator))
            if q_x > 0 and u * q_x < float(p[x]):  # u < p(x) / q(x), without dividing
                accepted = c
                break
            if q is None:
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = torch.clamp(p - q, min=0.0)
            total = float(residual.sum())
            if total <= 0.0:  # p == q on the support: rejection had probability 0; keep p as it was
                continue
            p = residual / total
        if accepted is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(accepted)
        node = accepted


def gumbel_noise(seed: int, position: int, vocab: int, tokens: Tensor | None = None) -> Tensor:
    """Standard Gumbel noise owned by one sequence position, a pure function of (seed, position, token), float64:
    at tokens [n] (int64 in 0..vocab-1), or the whole row [V] (None). casspec's op where its library is built
    (csrc/gumbel.cpp: a counter-based draw, so the few tokens a sampler can pick cost microseconds, where a row cost
    270 us); elsewhere a row of torch's generator seeded by (seed, position), indexed (one process draws all its
    noise one way)."""
    if own_noise():
        return torch.ops.casspec.gumbel(seed % SEED_MODULUS, position, tokens, vocab)
    gen = torch.Generator().manual_seed((seed * POSITION_STRIDE + position) % (2**63 - 1))
    u = torch.rand(vocab, generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0)
    row = -torch.log(-torch.log(u))
    return row if tokens is None else row[tokens]


def own_noise() -> bool:
    """Whether gumbel_noise draws with casspec's op (its library built)."""
    return build_error() is None


class Noise:
    """The position-owned noise of one generation, read by both the drafting levels (coupled drafting) and the
    verifier: the verifier's values are the reference, and these are they. A position's whole row, once drawn, is
    kept until the position is emitted; a few tokens' values are drawn on their own (the same values) where casspec's
    op draws them, else read from the row."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.seed, self.vocab = seed, vocab
        self._rows: dict[int, Tensor] = {}  # position -> [V] float64
        self.seconds = 0.0  # time spent drawing

    def __call__(self, position: int, tokens: Tensor | None = None) -> Tensor:
        """The noise of position at tokens [n] (None: its whole row [V])."""
        row = self._rows.get(position)
        if row is None:
            t0 = time.perf_counter()
            if tokens is not None and own_noise():
                values = gumbel_noise(self.seed, position, self.vocab, tokens)
                self.seconds += time.perf_counter() - t0
                return values
            row = self._rows[position] = gumbel_noise(self.seed, position, self.vocab)
            self.seconds += time.perf_counter() - t0
        return row if tokens is None else row[tokens]

    def forget_before(self, position: int) -> None:
        """Drop the noise of positions already emitted (nothing reads it again)."""
        for p in [p for p in self._rows if p < position]:
            del self._rows[p]


def verify_coupled(tree: DraftTree, targets: list[int]) -> tuple[list[int], int]:
    """Sampling verification of deterministic drafts (q one-hot) by position-owned noise: targets[n] is the
    target's token after node n, argmax(log p + g) with g the noise of the node's position (root position + depth
    + 1; `sampling.coupled_top` with k = 1). Greedy verification against those tokens emits, at every position, a
    fresh sample of the target's distribution given the prefix (the noise of a position is independent of every
    other position's), so the output is distributed exactly as the target's own samples; and since the noise does
    not depend on the tree, the same seed gives the same tokens whatever was drafted: every deterministic-draft
    method reproduces `ar` token for token. A draft that is its level's plain argmax is accepted with probability
    p(x), as in recursive rejection with one-hot q; a coupled draft (`DraftContext.draft_top`: the argmax of log q
    + the same g) is accepted wherever the two perturbed argmaxes agree."""
    children = tree.children()
    node, path = 0, [0]
    while True:
        t = targets[node]
        nxt = next((c for c in children[node] if tree.tokens[c] == t), None)
        if nxt is None:
            return path, t
        path.append(nxt)
        node = nxt
