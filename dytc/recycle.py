"""Token Recycling (arXiv 2408.08696) as a draft source: the target's own candidates, recycled at no model cost.

Every verification computes the target's distribution at each tree node anyway; its k best next tokens after a
node's token are a good guess of what follows that token the next time it appears. `Recycled` keeps them in an
adjacency table, token -> its k most likely successors and their log-probabilities: the latest verification's row
for a token replaces the earlier one (as in the paper). Of each verification the rows of the accepted path are kept
(the target's distribution in the text's own context; the paper keeps every node's, but the top-k of a row costs
about 15 us on the Intel Xeon here, 0.7 ms for a 48-node tree against a 5 ms step). A draft level's rows (its top
tokens at the nodes it ran) fill only tokens the target has given no row yet, and are marked as such: their tokens
draft in the lowest belief bucket, and a target row always replaces them.

`RecycleLookup` drafts from the table like a lookup (dytc/ngram.py's `Lookup`): after history + extra it follows
each token's best successor, one table row per token, while the successor's recycled probability stays above
`RECYCLE_MIN_PROB`. Its belief (the acceptance estimates' bucket, dytc/acceptance.py) is 1 + the quartile of the
first token's recycled probability (a level's row: 1). The router (dytc/router.py) values its chain like any
lookup's, from the latency model, and offers the next-best successors at the root (`alternative`): the paper's
tree, as wide and deep as it pays on the machine. (Not deeper: next-best successors below the root were accepted 4
times in 653 tested beside float32 int4 chains on the Intel Xeon, and asking them cost ~1 ms a step.)

Sampling: the verifier draws the target's token at position i as argmax_x log q(x) / T + g_i(x), g_i the
position-owned Gumbel noise (dytc/verify.py); the coupled recycled draft takes the argmax of the same sum over the
row's candidates with the recycled log-probabilities, so it is the target's own sample wherever that lies among
them and the recycled row is close to the target's row there. Drafts are deterministic and verified by
`verify_coupled`: lossless whatever the table holds.
"""
from __future__ import annotations

import bisect
import math
from typing import Collection, Mapping, Sequence

import torch

from .ngram import Lookup
from .sources import RECYCLE
from .verify import Noise

RECYCLE_K = 8  # successors kept per token (the paper's matrix keeps 8)
RECYCLE_MIN_PROB = 0.05  # a chain stops before a successor whose recycled probability is below this
BELIEF_EDGES = (0.25, 0.5, 0.75)  # recycled probability -> belief 1 + bisect (levels' rows: 1)
ORIGIN_NONE, ORIGIN_LEVEL, ORIGIN_TARGET = 0, 1, 2  # where a token's row came from
TargetTop = tuple[list[int], list[list[int]], list[list[float]]]  # a verification's accepted tokens [P], the
# target's top successors after each [P][k] and their log-probabilities [P][k] (DraftContext.target_top)


class Recycled:
    """The adjacency table: token -> (its successors, best first; their log-probabilities; where the row came from).
    Plain Python rows (a step reads a few dozen of them, each in microseconds), for the tokens seen so far."""

    def __init__(self, k: int = RECYCLE_K) -> None:
        self.k = k
        self.rows: dict[int, tuple[list[int], list[float], int]] = {}

    @property
    def nbytes(self) -> int:
        """About what the rows hold: per row a dict entry, two lists of k and their numbers."""
        return len(self.rows) * (100 + self.k * 2 * (8 + 28))

    def update(self, tokens: Sequence[int], top: Sequence[Sequence[int]], logp: Sequence[Sequence[float]],
               from_target: bool = True) -> None:
        """Rows for `tokens` [N] from one forward: their top successors top [N][j] (best first; -1: none) and the
        log-probabilities logp [N][j]; a level's rows (from_target False) only where the target gave none."""
        origin = ORIGIN_TARGET if from_target else ORIGIN_LEVEL
        for tok, nxt, lp in zip(tokens, top, logp):
            if not from_target and self.rows.get(tok, (None, None, ORIGIN_NONE))[2] == ORIGIN_TARGET:
                continue
            keep = [i for i, t in enumerate(nxt[:self.k]) if t >= 0]
            self.rows[int(tok)] = ([int(nxt[i]) for i in keep], [float(lp[i]) for i in keep], origin)

    def remember(self, greedy: bool, target_top: TargetTop | None,
                 level_rows: Sequence[tuple[int, list[int], list[float]]] = ()) -> None:
        """A verification's rows: the target's top successors after each accepted token (target_top: tokens [P],
        top [P][k], log-probabilities [P][k]), and a draft level's top tokens at the nodes it ran (level_rows:
        (token, its successors, their draft probabilities) each; greedy only: a coupled level's probabilities are
        of perturbed scores), which fill only tokens the target has given no row."""
        if greedy and level_rows:
            self.update([r[0] for r in level_rows], [r[1] for r in level_rows],
                        [[math.log(max(p, 1e-30)) for p in r[2]] for r in level_rows], from_target=False)
        if target_top is not None:
            self.update(*target_top)


def learn(lookups: Mapping[str, Lookup], greedy: bool, target_top: TargetTop | None,
          level_rows: Sequence[tuple[int, list[int], list[float]]] = ()) -> None:
    """Where a policy's lookups hold the recycle source: a verification's rows into its table (Recycled.remember)."""
    recycle = lookups.get(RECYCLE)
    if isinstance(recycle, RecycleLookup):
        recycle.table.remember(greedy, target_top, level_rows)


class RecycleLookup:
    """Drafts from a `Recycled` table after the history (see the module docstring)."""

    name = RECYCLE

    def __init__(self, tokens: Sequence[int], table: Recycled, eos_ids: Collection[int] = (),
                 noise: Noise | None = None, temperature: float = 1.0) -> None:
        self.tokens: list[int] = [int(t) for t in tokens]
        self.table = table
        self.eos_ids = frozenset(eos_ids)
        self.noise, self.temperature = noise, temperature  # sampling: coupled drafts (None: greedy)

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def finish(self) -> None:
        """(The table is filled by the policy from verifications: `learn`.)"""

    def propose_after(self, extra: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing history + extra, and the belief of the first (0: nothing proposed)."""
        return self.alternative(extra, (), k)

    def alternative(self, extra: Sequence[int], taken: Collection[int], k: int) -> tuple[list[int], int]:
        """Like propose_after, but the first token is the best successor not in `taken` (the tokens already
        drafted after history + extra): the next branch of the recycled tree there."""
        prev = extra[-1] if extra else self.tokens[-1]
        position = len(self.tokens) + len(extra)  # the position of the first proposed token
        out: list[int] = []
        belief = 0
        skip = taken
        while len(out) < k:
            tok, prob, origin = self._best(prev, position + len(out), skip)
            if tok < 0 or prob < RECYCLE_MIN_PROB or tok in self.eos_ids:
                break
            if not out:
                belief = 1 if origin != ORIGIN_TARGET else 1 + bisect.bisect_right(BELIEF_EDGES, prob)
            out.append(tok)
            prev, skip = tok, ()
        return out, belief

    def _best(self, prev: int, position: int, skip: Collection[int]) -> tuple[int, float, int]:
        """The successor of `prev` drafted at `position` (not in skip): (token, its recycled probability, origin);
        token -1 when the row has none."""
        row = self.table.rows.get(prev)
        if row is None:
            return -1, 0.0, ORIGIN_NONE
        cand, logp, origin = row
        order: Sequence[int] = range(len(cand))
        if self.noise is not None and cand:  # coupled: argmax of log q / T + g over the candidates
            g = self.noise(position, torch.tensor(cand, dtype=torch.long)).tolist()
            score = [lp / self.temperature + gi for lp, gi in zip(logp, g)]
            order = sorted(order, key=lambda i: -score[i])
        for i in order:
            if cand[i] not in skip:
                return cand[i], math.exp(logp[i]), origin
        return -1, 0.0, ORIGIN_NONE
