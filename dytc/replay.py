"""Offline replay of drafting policies over a teacher-forced recording: the oracle replay that audits the router
(issue 31). casspec/tools/replay.py records; this module only computes, from plain data.

A `Recording` holds, for one prompt (a question's turn) and the target's greedy output y[0..T-1] (y[0] comes from
the prefill; a step at position j has y[j-1] as its root and drafts y[j], y[j+1], ...):
  - per level S, rank[j]: the rank of y[j] in S's distribution after y[:j] (0: S's top token), teacher-forced: one
    1-token forward of S over the target's KV of y[:j-1], exactly the first draft of a step at j. S's greedy chain
    from j equals y for about run_S(j) tokens, the consecutive positions from j where rank is 0 (inside the run S's
    context is y's prefix; live, S reads its own KV of the chain's earlier tokens where here it reads the target's);
  - per lookup L, proposed[j] and match[j]: how many tokens L proposes after y[:j] and how many of them equal y[j:];
  - cost tables: this machine's latency model (measured, fitted) at the prompt's context plus half the output:
    verify[tree][N], a target forward over an N-node tree (tree=0: a chain), and level[S][tree][n], a forward of
    S over n tokens (index 0 unused);
  - live runs of methods (dytc and the fixed methods, run for real on the same prompt): per step its position,
    nodes, accepted drafts, level forwards (level, tokens, tree) and the policy's own measured milliseconds.

Every policy is costed by the same tables, so the comparison is of decisions, not of timing noise; a live run's
own time (planning, lookups, bookkeeping) is measured and reported beside it.

Policies replayed offline: `ar`; `chain S k` (S drafts k tokens, k 1-token forwards, verified as a chain);
`lookup L` (L's proposal, verification only; AR where it proposes nothing); `lookup L else chain S k`. The per-step
oracle knows y: the least modelled time to emit y as a sequence of single-path steps, each step's d drafted tokens
covered one by one by a level whose top token it is (one 1-token forward, c_S(1)) or by a lookup segment (free:
verification only) — a shortest path over positions, with the verification V(d + 1) of each step. It ignores
what a level pays to read tokens it did not draft, so it bounds what any router with these sources can do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class LiveStep:
    pos: int  # j: output position of the step's first drafted token (its root is y[j - 1])
    nodes: int  # tree nodes verified, root included
    tree: bool  # verified with a tree mask (False: a chain or the root alone)
    accepted: int  # drafts accepted (the step emits accepted + 1 tokens)
    forwards: list[tuple[str, int, bool]]  # level forwards of the step: (level, tokens, tree mask)
    own_ms: float  # the policy's measured time in the step outside its level forwards


@dataclass
class Recording:
    question_id: str
    category: str
    context: int  # prompt tokens
    target: list[int]  # y: the target's greedy output
    ranks: dict[str, list[int]]  # level -> rank of y[j] in its distribution after y[:j] ([T]; [0] unused: -1)
    proposed: dict[str, list[int]]  # lookup -> tokens proposed after y[:j] ([T]; [0] unused)
    match: dict[str, list[int]]  # lookup -> how many of them equal y[j:] ([T])
    verify: list[list[float]]  # [tree 0/1][N] predicted ms of a target forward over N nodes (index 0 unused)
    level: dict[str, list[list[float]]]  # level -> [tree 0/1][n] predicted ms of its forward over n tokens
    live: dict[str, list[LiveStep]] = field(default_factory=dict)  # method -> its steps, run for real
    live_seconds: dict[str, float] = field(default_factory=dict)  # method -> measured generation seconds
    turn: int = 0  # the question's turn (0: the first)

    @property
    def steps_needed(self) -> int:
        """Tokens the steps emit: all of y but the prefill's y[0]."""
        return len(self.target) - 1

    def run(self, level: str, j: int) -> int:
        """run_S(j): how many tokens of level S's greedy chain from position j equal y."""
        ranks, n = self.ranks[level], 0
        while j + n < len(ranks) and ranks[j + n] == 0:
            n += 1
        return n

    def verify_ms(self, nodes: int, tree: bool) -> float:
        row = self.verify[int(tree and nodes > 1)]
        return row[min(nodes, len(row) - 1)]

    def level_ms(self, level: str, tokens: int, tree: bool = False) -> float:
        row = self.level[level][int(tree)]
        return row[min(tokens, len(row) - 1)]


# a policy: (recording, position j) -> (modelled ms of the step, tokens it emits)
Policy = Callable[[Recording, int], tuple[float, int]]


def ar() -> Policy:
    return lambda r, j: (r.verify_ms(1, False), 1)


def chain(level: str, k: int) -> Policy:
    def step(r: Recording, j: int) -> tuple[float, int]:
        return k * r.level_ms(level, 1) + r.verify_ms(k + 1, False), min(r.run(level, j), k) + 1
    return step


def lookup(name: str, otherwise: Policy | None = None) -> Policy:
    fallback = otherwise or ar()

    def step(r: Recording, j: int) -> tuple[float, int]:
        k = r.proposed[name][j]
        if k == 0:
            return fallback(r, j)
        return r.verify_ms(k + 1, False), r.match[name][j] + 1
    return step


def replay(r: Recording, policy: Policy) -> tuple[float, int]:
    """(modelled ms, steps) of emitting all of y with `policy`."""
    j, ms, steps = 1, 0.0, 0
    while j < len(r.target):
        cost, emitted = policy(r, j)
        ms += cost
        steps += 1
        j += emitted
    return ms, steps


def replay_live(r: Recording, method: str) -> tuple[float, float, int]:
    """(modelled ms, measured own ms, steps) of a live run, costed by the recording's tables."""
    ms = own = 0.0
    for s in r.live[method]:
        ms += sum(r.level_ms(lv, n, t) for lv, n, t in s.forwards) + r.verify_ms(s.nodes, s.tree)
        own += s.own_ms
    return ms, own, len(r.live[method])


def _cheapest_token(r: Recording, j: int) -> tuple[float, str]:
    """The cheapest level whose top token at j is y[j], and its 1-token forward ms (inf, "" if none)."""
    best = (float("inf"), "")
    for name, ranks in r.ranks.items():
        if ranks[j] == 0:
            best = min(best, (r.level_ms(name, 1), name))
    return best


def oracle(r: Recording, max_drafts: int = 31) -> tuple[float, int, dict[str, int]]:
    """The per-step oracle (module docstring): (modelled ms, steps, emitted drafts by source)."""
    T = len(r.target)
    best = [0.0] * (T + 1)  # best[j]: least ms to emit y[j:] (j = T: nothing left)
    plan: list[tuple[int, list[str]]] = [(0, [])] * (T + 1)  # best[j]'s first step: (drafts d, source per draft)
    for j in range(T - 1, 0, -1):
        cover, how = [0.0], [[]]  # cover[i]: least ms to draft y[j:j+i]; how[i]: the source of each
        best[j], plan[j] = r.verify_ms(1, False) + best[min(j + 1, T)], (0, [])
        for i in range(1, min(max_drafts, T - j) + 1):
            p = j + i - 1  # the position drafted last
            c, name = _cheapest_token(r, p)
            cover.append(cover[i - 1] + c)
            how.append(how[i - 1] + [name])
            for lk, matches in r.match.items():  # a lookup segment started at s covering y[s..p]
                for s in range(j, p + 1):
                    if matches[s] >= p - s + 1 and cover[s - j] < cover[i]:
                        cover[i], how[i] = cover[s - j], how[s - j] + [lk] * (p - s + 1)
            if cover[i] == float("inf"):
                break
            total = cover[i] + r.verify_ms(i + 1, False) + best[min(j + i + 1, T)]
            if total < best[j]:
                best[j], plan[j] = total, (i, how[i])
    j, steps, used = 1, 0, {}
    while j < T:
        d, names = plan[j]
        for n in names:
            used[n] = used.get(n, 0) + 1
        steps += 1
        j += d + 1
    return best[1], steps, used


def static_policies(r: Recording, ks: tuple[int, ...] = (2, 4, 6, 8, 10)) -> dict[str, Policy]:
    """The fixed offline policies over the recording's sources, by name."""
    out: dict[str, Policy] = {"ar": ar()}
    for lk in r.match:
        out[f"lookup {lk}"] = lookup(lk)
    for lv in r.ranks:
        for k in ks:
            out[f"chain {lv} {k}"] = chain(lv, k)
            for lk in r.match:
                out[f"{lk} else chain {lv} {k}"] = lookup(lk, chain(lv, k))
    return out
