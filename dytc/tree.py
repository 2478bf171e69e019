"""Draft token trees: nodes with a parent, a token and the distribution q it was drawn from.

Node 0 is the root: the last committed token, whose KV is not yet in the cache. A tree is flattened in node
order (parents before children); node i attends to the committed prefix, its ancestors and itself, at
position prefix_length + depth(i).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor


@dataclass
class DraftTree:
    tokens: list[int]  # token of each node; tokens[0] is the root
    parents: list[int]  # parent node of each node; parents[0] == -1
    q: list[Tensor | None] = field(default_factory=list)  # per node: the draft distribution [V] it was drawn
    # from (None = deterministic draft: q is one-hot on the token); empty list = all deterministic

    @staticmethod
    def root(token: int) -> "DraftTree":
        return DraftTree([token], [-1])

    @staticmethod
    def chain(root: int, tokens: Sequence[int]) -> "DraftTree":
        """root -> tokens[0] -> tokens[1] -> ... (deterministic drafts)."""
        return DraftTree([root, *tokens], list(range(-1, len(tokens))))

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, q: Tensor | None = None) -> int:
        assert 0 <= parent < len(self.tokens)
        if q is not None and not self.q:
            self.q = [None] * len(self.tokens)
        if self.q:
            self.q.append(q)
        self.tokens.append(token)
        self.parents.append(parent)
        return len(self.tokens) - 1

    def children(self) -> list[list[int]]:
        ch: list[list[int]] = [[] for _ in self.parents]
        for i in range(1, len(self.parents)):
            ch[self.parents[i]].append(i)
        return ch

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root down to `node`, inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def ancestor_mask(parents: list[int], device: torch.device | str = "cpu") -> Tensor:
    """[N, N] bool: mask[i, j] = j is i or an ancestor of i. Parents must precede children."""
    n = len(parents)
    rows = [[False] * n for _ in range(n)]  # (built in Python, one tensor at the end: a step builds several)
    for i, p in enumerate(parents):
        if i:
            assert 0 <= p < i, "parents must precede children"
            rows[i][:i] = rows[p][:i]
        rows[i][i] = True
    return torch.tensor(rows, dtype=torch.bool, device=device).reshape(n, n)


def ancestor_rows(parents: list[int], start: int, device: torch.device | str = "cpu") -> Tensor:
    """[N - start, N] bool: the rows of ancestor_mask(parents) from node `start` on, without building the others
    (a draft forward over the last nodes of a tree)."""
    n, rows = len(parents), []
    for i in range(start, n):
        row, j = [False] * n, i
        while j >= 0:
            row[j] = True
            j = parents[j]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool, device=device).reshape(n - start, n)


def depths(parents: list[int]) -> list[int]:
    """[N] each node's depth (the root's is 0). Parents must precede children."""
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def position_ids(parents: list[int], prefix_length: int, device: torch.device | str = "cpu") -> Tensor:
    """[N] absolute positions: prefix_length + depth."""
    return torch.tensor(depths(parents), dtype=torch.long, device=device) + prefix_length


def is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))
