"""SuffixDecoding (arXiv 2411.04975) as a draft source: frequency-scored continuations from suffix trees.

`SuffixIndex` is a depth-limited suffix tree (a trie of every suffix of each sequence, cut at `depth` tokens) with
a count per node: how many times that token string occurs, and the node's most frequent child (ties: the one counted
last). Appending a token extends the sequence's open suffixes (lengths 1 .. depth - 1) by one node each: O(depth)
per token, with no object per node (one dict of edges for the whole tree, plain lists per node). It holds several
sequences and a node budget: past it, the oldest closed sequences are evicted (their suffixes' counts taken back,
nodes at 0 freed), so its memory is bounded (`SuffixConfig.max_nodes`; `stats` reports nodes, sequences, tokens,
evictions; `nbytes` its objects' bytes).

`SuffixLookup` drafts from the client's index (dytc/shared.py: one per client; without one, a generation's own):
the generation's prompt and output are a sequence of it from the start (the per-generation tree, indexed once), and
its earlier generations' sequences are there too (the global tree). It finds the longest suffix of history + extra
(at most `max_match` tokens) that occurs with a continuation and follows the most frequent child while its
frequency given its parent (count(child) / count(node)) stays at or above `min_prob`: the paper's
frequency-scored tree, its greedy path (the router adds other sources' branches and values the path by its own
estimates). Where the walk reaches the depth limit it matches again on the extended text. Its belief is the match
length, as for the other lookups.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Collection, Sequence

from .sources import SUFFIX

KEY = 1 << 32  # an edge's key: parent * KEY + token (token ids < 2**32)


@dataclass(frozen=True)
class SuffixConfig:
    depth: int = 24  # tokens kept per suffix (match + continuation before matching again)
    max_match: int = 12  # longest suffix of the text matched (below depth)
    min_prob: float = 0.1  # a path stops before a child seen this rarely after its parent
    max_nodes: int = 2_000_000  # a client's node budget (about 110 B a node: ~0.2 GB), past which its oldest
    # sequences are evicted


class SuffixIndex:
    """Depth-limited suffix tree with counts over one or more token sequences (see the module docstring)."""

    def __init__(self, depth: int = SuffixConfig.depth, max_nodes: int | None = None) -> None:
        assert depth >= 2
        self.depth, self.max_nodes = depth, max_nodes
        self.edges: dict[int, int] = {}  # parent * KEY + token -> child (node 0: the root)
        self.count: list[int] = [0]  # node -> occurrences of its string
        self.token: list[int] = [-1]  # node -> the token on the edge into it
        self.top: list[int] = [-1]  # node -> its most frequent child (-1: none)
        self.kids: list[int] = [0]  # node -> its number of children
        self.branches: dict[int, list[int]] = {}  # node with 2+ children -> them (to find the most frequent again
        # where an eviction lowered a count)
        self.free: list[int] = []  # ids of freed nodes, reused
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()  # id -> tokens, oldest first
        self.open: dict[int, list[int]] = {}  # id of a sequence still growing -> the nodes of its open suffixes
        self.nodes = 1  # live nodes, the root included
        self.evicted = 0  # sequences evicted, all time
        self._next_id = 0

    def new_sequence(self) -> int:
        self._next_id += 1
        self.sequences[self._next_id] = []
        self.open[self._next_id] = []
        return self._next_id

    def append(self, seq: int, tokens: Sequence[int]) -> None:
        """Append tokens to the open sequence `seq` (every suffix ending at each of them joins the tree)."""
        hist, edges, count, top, kids = self.sequences[seq], self.edges, self.count, self.top, self.kids
        active, depth = self.open[seq], self.depth
        for t in tokens:
            t = int(t)
            hist.append(t)
            nxt = []
            for v in (0, *active):  # (this loop is the tree's whole cost: kept flat)
                key = v * KEY + t
                c = edges.get(key)
                if c is None:
                    if kids[v] or self.free:  # (a branch, or a freed id to reuse: the general case)
                        c = self._node(v, t)
                    else:  # (a first child: most new nodes, inlined)
                        c = len(count)
                        count.append(0)
                        self.token.append(t)
                        top.append(-1)
                        kids.append(0)
                        kids[v] = 1
                        self.nodes += 1
                    edges[key] = c
                n = count[c] = count[c] + 1
                b = top[v]
                if b != c and (b < 0 or n >= count[b]):
                    top[v] = c
                nxt.append(c)
            if len(nxt) >= depth:  # (lengths 1, 2, ...: the longest reached the depth and grows no further)
                nxt.pop()
            active = nxt
        self.open[seq] = active
        self._evict()

    def close(self, seq: int) -> None:
        """No more tokens for `seq`: it stays until evicted."""
        self.open.pop(seq, None)

    @property
    def tokens(self) -> int:
        return sum(map(len, self.sequences.values()))

    def nbytes(self) -> int:
        """Bytes of the tree's Python objects (sys.getsizeof: the edge dict, the per-node lists, the branch lists,
        the sequences kept for eviction; small ints are shared and not counted, larger ones are)."""
        lists = [self.count, self.token, self.top, self.kids, self.free, *self.branches.values(),
                 *self.sequences.values(), *self.open.values()]
        big = 8 * len(self.edges) * 2  # (node ids and keys past the small-int cache: about one int object each)
        return sys.getsizeof(self.edges) + sys.getsizeof(self.branches) + sum(map(sys.getsizeof, lists)) + big

    def stats(self) -> dict:
        return {"nodes": self.nodes, "sequences": len(self.sequences), "tokens": self.tokens,
                "evicted": self.evicted, "max_nodes": self.max_nodes}

    def match(self, text: Sequence[int], max_len: int) -> tuple[int, int]:
        """(node, length): the longest suffix of text (at most max_len tokens) that occurs with a continuation;
        (0, 0) when none does."""
        edges, top, L = self.edges, self.top, len(text)
        for m in range(min(max_len, L, self.depth - 1), 0, -1):
            v = 0
            for t in text[L - m:]:
                v = edges.get(v * KEY + t, -1)
                if v < 0:
                    break
            if v > 0 and top[v] >= 0:
                return v, m
        return 0, 0

    def match_after(self, seq: int, extra: Sequence[int], max_len: int) -> tuple[int, int]:
        """`match` of the open sequence seq's text + extra, from its open suffixes (the history's part is not walked
        again: a step's proposals cost a few look-ups each)."""
        edges, top, active, E = self.edges, self.top, self.open[seq], len(extra)
        for h in range(min(len(active), max_len - E), 0, -1):  # a suffix of the history, then all of extra
            v = active[h - 1]  # (its suffix of h tokens)
            for t in extra:
                v = edges.get(v * KEY + t, -1)
                if v < 0:
                    break
            if v > 0 and top[v] >= 0:
                return v, h + E
        return self.match(extra, min(E, max_len))  # (a suffix within extra)

    def best_child(self, v: int) -> tuple[int, int, float]:
        """(token, child, count(child) / count(v)) of v's most frequent child; token -1 when v has none."""
        c = self.top[v]
        if c < 0:
            return -1, -1, 0.0
        return self.token[c], c, self.count[c] / max(self.count[v], 1)

    def _node(self, parent: int, t: int) -> int:
        """A new child of `parent` by token t (count 0)."""
        self.nodes += 1
        k = self.kids[parent] = self.kids[parent] + 1
        if k == 2:  # (its first child is its most frequent so far)
            self.branches[parent] = [self.top[parent]]
        if self.free:
            c = self.free.pop()
            self.count[c], self.token[c], self.top[c], self.kids[c] = 0, t, -1, 0
        else:
            c = len(self.count)
            self.count.append(0)
            self.token.append(t)
            self.top.append(-1)
            self.kids.append(0)
        if k >= 2:
            self.branches[parent].append(c)
        return c

    def _evict(self) -> None:
        """Evict the oldest closed sequences (one still growing stays) while the tree is over its node budget."""
        while self.max_nodes is not None and self.nodes > self.max_nodes:
            seq = next((s for s in self.sequences if s not in self.open), None)
            if seq is None:
                return
            self._remove(self.sequences.pop(seq))
            self.evicted += 1

    def _remove(self, hist: list[int]) -> None:
        """Take back every suffix of a sequence: counts down, nodes at 0 freed (a node's descendants on the same
        walk reach 0 with it), each parent's most frequent child found again where it changed."""
        edges, count, top = self.edges, self.count, self.top
        for i in range(len(hist)):
            v = 0
            for t in hist[i:i + self.depth]:
                c = edges[v * KEY + t]
                count[c] -= 1
                if count[c] == 0:
                    del edges[v * KEY + t]
                    self._drop(v, c)
                elif top[v] == c and v in self.branches:
                    top[v] = max(self.branches[v], key=count.__getitem__)
                v = c

    def _drop(self, parent: int, c: int) -> None:
        """Child c of `parent` is gone."""
        self.nodes -= 1
        self.free.append(c)
        k = self.kids[parent] = self.kids[parent] - 1
        rest = self.branches.get(parent)
        if rest is not None:
            rest.remove(c)
            if k == 1:
                del self.branches[parent]
            self.top[parent] = max(rest, key=self.count.__getitem__)
        else:
            self.top[parent] = -1


class SuffixLookup:
    """Drafts from the client's suffix tree, where this generation's text is a sequence (see the module docstring)."""

    name = SUFFIX

    def __init__(self, tokens: Sequence[int], index: SuffixIndex | None = None, eos_ids: Collection[int] = (),
                 cfg: SuffixConfig = SuffixConfig()) -> None:
        self.cfg = cfg
        self.index = index if index is not None else SuffixIndex(cfg.depth)  # (None: this generation's own tree)
        self.seq = self.index.new_sequence()
        self.tokens: list[int] = []
        self.eos_ids = frozenset(eos_ids)
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)
        self.index.append(self.seq, tokens)

    def propose_after(self, extra: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing history + extra, and the match length behind the first (0: none)."""
        index, most, text = self.index, self.cfg.max_match, self.tokens[-self.cfg.max_match:] + list(extra)
        out: list[int] = []
        first = 0
        while len(out) < k:
            v, m = index.match(text, most) if out else index.match_after(self.seq, extra, most)
            if m == 0:
                break
            first = first or m
            while len(out) < k:  # (a match has a continuation: at least one token a round, or a return)
                tok, child, prob = index.best_child(v)
                if tok < 0:  # the depth limit: match again on the extended text
                    break
                if prob < self.cfg.min_prob or tok in self.eos_ids:
                    return out, first if out else 0
                out.append(tok)
                text.append(tok)
                v = child
        return out, first if out else 0

    def finish(self) -> None:
        """The generation ended: its sequence is closed (kept for later generations, evicted in its turn)."""
        self.index.close(self.seq)
