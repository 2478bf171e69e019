"""The DyTC router's configuration and per-step state: the tree under construction, what each node is, and the
actions valued.

`Step` is created by `DyTC.draft` for one step and read by `DyTC.observe` after its verification; nothing about a
step lives anywhere else. Notation as in router.py: p_n a node's estimated acceptance probability, E the expected
tokens of the step, D the predicted draft ms spent, V(N) the predicted verification ms of an N-node tree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection

from .ngram import PLD_NUM_TOKENS
from .sources import FREE, PLD, base_lookup, held, is_lookup
from .tree import DraftTree


@dataclass(frozen=True)
class RouterConfig:
    levels: tuple[str, ...] = ()  # names of the neural draft levels the router is given (its caller names them)
    lookups: tuple[str, ...] = (PLD,)  # statistical sources at the bottom (sources.BOTTOMS); () = none
    max_nodes: int = 48  # most tree nodes verified, root included (32 was 5% slower greedy on the AMD EPYC: int4
    # agreed 0.98 there, so its chains want to be long, and a lookup's copy rides after them)
    lookahead: int = 16  # longest segment k valued when a level extends a node
    expand_candidates: int = 4  # most probable expandable leaves, and inner nodes, considered each round
    top_k: int = 4  # tokens of a level's distribution kept per node it ran (sibling candidates)
    lookup_tokens: int = PLD_NUM_TOKENS  # most lookup tokens attached at once
    held_lookup_tokens: int = 24  # the same for a lookup whose last proposal at the root held (sources.HELD)
    review_tokens: int = 6  # most lookup tokens a level's forward reviews at once
    fallback: bool = True  # verify the root alone when no tree is predicted to beat AR
    explore_every: int = 16  # after this many fallbacks in a row, draft one tree anyway
    explore_level_after: int | None = 64  # steps without a level before it is forced (_stale_level; None: never)
    step_overhead: bool = True  # count the router's own measured time per step in each step's cost (D starts at O)
    constant_cost: float | None = None  # ablation: no latency predictor; a verification costs one target step
    # whatever its size, a level forward this fraction of it whatever its tokens (None: the fitted predictor)


@dataclass
class Node:
    source: str  # "root", a level name, its sibling source, a lookup name or an overruled lookup (sources.py)
    belief: float  # draft probability (level) or match length (lookup) of the token
    p: float  # estimated probability that the node is accepted
    depth: int
    kv: str | None = None  # level whose KV for this node is in scratch (None: no draft forward ran it)
    dists: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)  # level -> its top tokens/probs
    proposals: dict[str, tuple[list[int], int]] | None = None  # lookup -> (tokens after this node, match length);
    # None: not asked yet
    branch: tuple[list[int], int] | None = None  # the recycled proposal whose first token is not a child yet (the
    # root; asked again when children were added)
    branch_for: int = -1  # the number of children `branch` was asked with


@dataclass
class Action:
    rate: float  # the tree's predicted throughput after the whole action (tokens per ms)
    node: int
    source: str  # a level name or a lookup name
    k: int  # tokens of the segment valued
    review: int = 0  # level actions: lookup tokens its first forward reviews (vertical cascade)
    reviewed: str = ""  # the lookup whose proposal it reviews
    branch: bool = False  # a lookup action at the root with children: its branch proposal (Node.branch)


@dataclass
class Step:
    """One step's tree under construction and what the router knows of it."""
    tree: DraftTree
    nodes: list[Node]  # per tree node
    verify_ms: list[float]  # [n_max + 1] predicted verification ms by node count (index 0 unused; plain floats:
    # the router's inner loops index them thousands of times a step)
    level_ms: dict[str, list[float]]  # level -> [n_max + 1] predicted forward ms by token count (index 0 unused)
    spent: float = 0.0  # predicted draft ms of the actions taken
    base: float = 0.0  # expected tokens of the other generations in a batched step (their rows priced in verify_ms)

    @property
    def expected(self) -> float:
        """E: expected tokens the step emits (accepted drafts plus the bonus token; a batched step's others' too)."""
        return self.base + sum(nd.p for nd in self.nodes)

    @property
    def rate(self) -> float:
        """E / (D + V(N)): the predicted throughput of verifying the tree as it is."""
        return self.expected / (self.spent + self.verify_ms[len(self.tree)])

    def add(self, parent: int, token: int, source: str, belief: float, p: float) -> int:
        """A new node below `parent`; its id."""
        n = self.tree.add(parent, token)
        self.nodes.append(Node(source, belief, p, self.nodes[parent].depth + 1))
        return n

    def truncate(self, size: int) -> None:
        """Drop the nodes from `size` on (the last ones added: nothing else hangs below them)."""
        del self.tree.tokens[size:], self.tree.parents[size:], self.nodes[size:]
        if self.tree.q:
            del self.tree.q[size:]

    def rescale(self, n: int, factor: float) -> None:
        """Multiply the estimates of n and its subtree (the subtree's conditional estimates are unchanged)."""
        sub = {n}
        for c in range(n, len(self.tree)):
            if c == n or self.tree.parents[c] in sub:
                sub.add(c)
                self.nodes[c].p *= factor


def unused_proposals(step: Step, emitted: list[int], held_now: Collection[str] = ()) -> list[tuple[str, float, bool]]:
    """Free tests of the lookups, (source, match length, accepted) each: every lookup's proposal at the root that the
    step did not draft there, checked against the emitted tokens as a chain of its drafts would have been (a token
    is tested where the ones before it matched; exact under sampling too, where a drafted token is accepted iff it
    is the token the target emits). So a lookup's estimates keep learning while the router drafts with other
    sources: the oracle replay found Max-Gram's long-match bucket at 0.13 after one question where it failed, never
    drafted again, while it proposed 10 right tokens a step on the next questions. held_now: the lookups the step
    counted as held (`sources.HELD`), whose tests are theirs. The sources that remember earlier text (`FREE`) are
    not tested so beside another lookup's drafts at the root: there the text is a copy, which their memory holds too
    (native SmolLM2 on the Intel Xeon: recycle's free tests 30% right, its drafts 13%, and it drafted on that)."""
    tree = step.tree
    drafted = {base_lookup(step.nodes[c].source) for c in range(1, len(tree)) if tree.parents[c] == 0}
    copying = any(is_lookup(name) for name in drafted)
    out = []
    for name, (tokens, match) in (step.nodes[0].proposals or {}).items():
        if name in drafted or copying and name in FREE:
            continue
        source = held(name) if name in held_now else name
        for token, target in zip(tokens, emitted):
            out.append((source, match, token == target))
            if token != target:
                break
    return out


def held_lookups(step: Step, emitted: list[int]) -> set[str]:
    """The lookups whose proposal at the step's root equals the emitted tokens as far as both go (`sources.HELD`:
    their tokens are estimated apart in the next step)."""
    return {name for name, (tokens, _) in (step.nodes[0].proposals or {}).items()
            if tokens and tokens[:len(emitted)] == emitted[:len(tokens)]}


def consecutive_runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids -> [start, end) ranges of consecutive ids."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(a, b) for a, b in runs]


def geometric(a: float, t: float) -> float:
    """a + a^2 + ... + a^t, with a fractional last term for a fractional t (expected accepted tokens of a
    t-token segment whose tokens are each accepted with probability a given the previous one)."""
    whole = int(t)
    total = a * (1 - a ** whole) / (1 - a) if a < 1 else float(whole)
    return total + (t - whole) * a ** (whole + 1)


def stale_level(cfg: RouterConfig, step: Step, last_drafted: dict[str, int], steps: int) -> str | None:
    """Exploration: the routed level drafted with longest ago (last_drafted: level -> the step it last drafted in;
    steps: this one), where that is over `explore_level_after` steps ago, among those whose chain of k tokens, all
    accepted, beats AR for some k (a level costing a target step is not forced); it takes the step's first action,
    so that an estimate never tested otherwise is (at most one step in that many; the router reports
    `explore_steps` and `explore_loss`, the predicted throughput each gave up)."""
    if (after := cfg.explore_level_after) is None or len(last_drafted) < 2:
        return None
    V, ks = step.verify_ms, range(1, min(cfg.lookahead, len(step.verify_ms) - 2) + 1)
    could_pay = [n for n in last_drafted if any((1 + k) / (k * step.level_ms[n][1] + V[1 + k]) > 1 / V[1] for k in ks)]
    name = min(could_pay, key=lambda n: last_drafted[n], default=None)
    return name if name is not None and steps - last_drafted[name] > after else None
