"""SuffixDecoding (arXiv 2411.04975) as a draft source: frequency-scored continuations from suffix trees.

`SuffixIndex` is a depth-limited suffix tree (a trie of every suffix of each sequence, cut at `depth` tokens) with
a count per node: how many times that token string occurs. Appending a token extends the sequence's up to `depth`
open suffixes by one node each (O(depth) per token). A global index holds several sequences and a node budget:
past it, the oldest sequences are evicted (their suffixes' counts taken back, nodes at 0 freed), so its memory is
bounded (`SUFFIX_MAX_NODES`; `stats` reports nodes, sequences and tokens).

`SuffixLookup` drafts after the history from two indexes: the generation's own (prompt + output) and the client's
global one over its earlier generations (prompt + output each, added when a generation ends: dytc/shared.py). In
each it finds the longest suffix of history + extra (at most `SUFFIX_MAX_MATCH` tokens) that occurs with a
continuation, takes the index whose match is longer, and follows the most frequent child while its frequency
given its parent (count(child) / count(node)) stays at or above `SUFFIX_MIN_PROB`: the paper's frequency-scored
tree, its greedy path (the router adds other sources' branches and values the path by its own estimates). Where
the walk reaches the depth limit it matches again on the extended text. Its belief is the match length, as for
the other lookups (speculation past a short match is cut by the estimates, not a fixed rule).
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Collection, Sequence

from .sources import SUFFIX

SUFFIX_DEPTH = 24  # tokens kept per suffix (match + continuation before matching again)
SUFFIX_MAX_MATCH = 12  # longest suffix of the text matched
SUFFIX_MIN_PROB = 0.1  # a path stops before a child seen this rarely after its parent
SUFFIX_MAX_NODES = 2_000_000  # a global index's node budget (about 200 B a node: ~0.4 GB), past which the oldest
# sequences are evicted


class SuffixIndex:
    """Depth-limited suffix tree with counts over one or more token sequences (see the module docstring)."""

    def __init__(self, depth: int = SUFFIX_DEPTH, max_nodes: int | None = None) -> None:
        assert depth >= 2
        self.depth, self.max_nodes = depth, max_nodes
        self.children: list[dict[int, int]] = [{}]  # node -> token -> child (node 0: the root)
        self.count: list[int] = [0]  # node -> occurrences of its string
        self.level: list[int] = [0]  # node -> its string's length
        self.free: list[int] = []  # ids of freed nodes, reused
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()  # id -> tokens, oldest first
        self.open: dict[int, list[int]] = {}  # id -> the nodes of its last suffixes (shorter than depth)
        self.nodes = 1  # live nodes, the root included
        self.evicted = 0  # sequences evicted, all time
        self._next_id = 0

    def new_sequence(self) -> int:
        self._next_id += 1
        self.sequences[self._next_id] = []
        self.open[self._next_id] = []
        return self._next_id

    def append(self, seq: int, tokens: Sequence[int]) -> None:
        """Append tokens to sequence `seq` (every suffix ending at each of them joins the tree)."""
        hist, children, count, level = self.sequences[seq], self.children, self.count, self.level
        active = self.open[seq]
        for t in tokens:
            t = int(t)
            hist.append(t)
            nxt = []
            for v in [0, *active]:
                if level[v] >= self.depth:
                    continue
                c = children[v].get(t)
                if c is None:
                    c = children[v][t] = self._node(level[v] + 1)
                count[c] += 1
                nxt.append(c)
            active = nxt
        self.open[seq] = active
        self._evict(keep=seq)

    def close(self, seq: int) -> None:
        """No more tokens for `seq` (it stays in the tree until evicted)."""
        self.open.pop(seq, None)

    @property
    def tokens(self) -> int:
        return sum(map(len, self.sequences.values()))

    def nbytes(self) -> int:
        """Bytes of the tree's Python objects (sys.getsizeof: the children dicts, the per-node lists, the sequences
        kept for eviction; small ints are shared and not counted)."""
        lists = [self.children, self.count, self.level, self.free, *self.sequences.values(), *self.open.values()]
        return sum(map(sys.getsizeof, self.children)) + sum(map(sys.getsizeof, lists))

    def stats(self) -> dict:
        return {"nodes": self.nodes, "sequences": len(self.sequences), "tokens": self.tokens,
                "evicted": self.evicted, "max_nodes": self.max_nodes}

    def _node(self, lvl: int) -> int:
        self.nodes += 1
        if self.free:
            n = self.free.pop()
            self.children[n], self.count[n], self.level[n] = {}, 0, lvl
            return n
        self.children.append({})
        self.count.append(0)
        self.level.append(lvl)
        return len(self.count) - 1

    def _evict(self, keep: int) -> None:
        """Evict the oldest sequences (not `keep`) while the tree is over its node budget."""
        while self.max_nodes is not None and self.nodes > self.max_nodes and len(self.sequences) > 1:
            seq = next(s for s in self.sequences if s != keep)
            self._remove(self.sequences.pop(seq))
            self.open.pop(seq, None)
            self.evicted += 1

    def _remove(self, hist: list[int]) -> None:
        children, count = self.children, self.count
        for i in range(len(hist)):
            v = 0
            for t in hist[i:i + self.depth]:
                c = children[v][t]
                count[c] -= 1
                if count[c] == 0:  # (its subtree holds only this suffix's nodes below: freed as the walk goes on)
                    del children[v][t]
                    self.free.append(c)
                    self.nodes -= 1
                v = c

    def match(self, text: Sequence[int], max_len: int = SUFFIX_MAX_MATCH) -> tuple[int, int]:
        """(node, length): the longest suffix of text (at most max_len tokens) that occurs with a continuation;
        (0, 0) when none does."""
        children, L = self.children, len(text)
        for m in range(min(max_len, L, self.depth - 1), 0, -1):
            v = 0
            for t in text[L - m:]:
                v = children[v].get(t, -1)
                if v < 0:
                    break
            if v > 0 and children[v]:
                return v, m
        return 0, 0

    def best_child(self, v: int) -> tuple[int, int, float]:
        """(token, child, count(child) / count(v)) of v's most frequent child (ties: the smallest token); token -1
        when v has none."""
        kids = self.children[v]
        if not kids:
            return -1, -1, 0.0
        tok = min(kids, key=lambda t: (-self.count[kids[t]], t))
        return tok, kids[tok], self.count[kids[tok]] / max(self.count[v], 1)


class SuffixLookup:
    """Drafts from the generation's own suffix tree and the client's global one (see the module docstring)."""

    name = SUFFIX

    def __init__(self, tokens: Sequence[int], global_index: SuffixIndex | None = None,
                 eos_ids: Collection[int] = ()) -> None:
        self.local = SuffixIndex()
        self.seq = self.local.new_sequence()
        self.tokens: list[int] = []
        self.global_index = global_index
        self.eos_ids = frozenset(eos_ids)
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)
        self.local.append(self.seq, tokens)

    def propose_after(self, extra: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing history + extra, and the match length behind the first (0: none)."""
        text = self.tokens[-SUFFIX_MAX_MATCH:] + list(extra)
        out: list[int] = []
        first = 0
        while len(out) < k:
            index, v, m = self._match(text)
            if m == 0:
                break
            first = first or m
            while len(out) < k:  # (a match has a continuation: at least one token a round, or a return)
                tok, child, prob = index.best_child(v)
                if tok < 0:  # the depth limit: match again on the extended text
                    break
                if prob < SUFFIX_MIN_PROB or tok in self.eos_ids:
                    return out, first if out else 0
                out.append(tok)
                text.append(tok)
                v = child
        return out, first if out else 0

    def _match(self, text: list[int]) -> tuple[SuffixIndex, int, int]:
        """The index with the longer match of text's suffix (the generation's own on a tie), its node and length."""
        v, m = self.local.match(text)
        best = (self.local, v, m)
        if self.global_index is not None:
            gv, gm = self.global_index.match(text)
            if gm > m:
                best = (self.global_index, gv, gm)
        return best

    def finish(self) -> None:
        """The generation ended: its text joins the global index, for later generations."""
        if self.global_index is not None and self.tokens:
            seq = self.global_index.new_sequence()
            self.global_index.append(seq, self.tokens)
            self.global_index.close(seq)
            self.global_index = None  # (once)
