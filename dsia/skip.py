"""Layer skipping at sublayer granularity; the skip set is searched on the fly (SWIFT-style, no training).

A skipped attention sublayer reads and writes no KV; a skipped MLP passes the residual through. The search
scores a candidate set by how well the skipped model reproduces the most recent committed tokens in one
teacher-forced forward over the existing cache (written to scratch, the committed prefix untouched):
primary score top-1 agreement, tie-break the mean probability of the right token. It first scores each
sublayer skipped alone and starts from the least harmful ones, then proposes random swaps and keeps
improvements, one evaluation per call, so that it can be interleaved with decoding; it stops at a target
agreement or after a budget, and the set is then kept (for the level's later prompts too).

The `skipR` draft strategy: a fraction R of all sublayers skipped, the set searched on top of the level's
other switches.
"""
from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from .errors import CasspecError
from .kvcache import KVCache
from .model import Transformer
from .plan import Plan
from .strategy import Resources, Strategy, Switch

Sublayer = tuple[str, int]  # ("attn" | "mlp", layer index)
# the search waits for this many committed tokens: a candidate is scored on the last min(window, length - 1) of
# them (teacher-forced, behind at least one visible token), and fewer than 8 scored tokens are too few to rank sets
MIN_COMMITTED = 9
# a proposal swaps this many skipped sublayers for kept ones, drawn uniformly: one twice as often as two (small
# moves refine a good set, an occasional double swap escapes a local optimum)
SWAP_SIZES = (1, 1, 2)


def skippable(n_layers: int) -> list[Sublayer]:
    """Every sublayer except those of the first and the last layer."""
    return [(kind, i) for i in range(1, n_layers - 1) for kind in ("attn", "mlp")]


def skip_count(n_layers: int, ratio: float) -> int:
    """Sublayers skipped at a given fraction of all 2 * n_layers sublayers (capped at the skippable ones)."""
    return min(round(ratio * 2 * n_layers), len(skippable(n_layers)))


def skip_plan(skips: frozenset[Sublayer], base: Plan | None = None) -> Plan:
    """A plan skipping the given sublayers (on top of `base`'s other switches)."""
    attn = frozenset(i for kind, i in skips if kind == "attn")
    mlp = frozenset(i for kind, i in skips if kind == "mlp")
    if base is None:
        return Plan(skip_attn=attn, skip_mlp=mlp)
    return dataclasses.replace(base, skip_attn=attn | base.skip_attn, skip_mlp=mlp | base.skip_mlp)


def contiguous_skips(n_layers: int, count: int) -> frozenset[Sublayer]:
    """The fixed baseline: `count` sublayers of the layers just before the last one (mlp, attn, going down)."""
    order = [(kind, i) for i in range(n_layers - 2, 0, -1) for kind in ("mlp", "attn")]
    return frozenset(order[:count])


@dataclass(frozen=True)
class SkipSearchConfig:
    ratio: float  # fraction of all sublayers skipped (e.g. 0.4)
    window: int = 48  # most recent committed tokens a candidate is scored on
    budget: int = 24  # phase-2 swap evaluations (after one evaluation per skippable sublayer)
    target_agreement: float = 0.95  # stop as soon as a candidate reaches this agreement
    seed: int = 0  # seed of the proposal generator


@torch.inference_mode()
def score_window(model: Transformer, cache: KVCache, history: list[int], window: int,
                 plan: Plan) -> tuple[float, float]:
    """Teacher-forced score of `plan` on the last `window` committed tokens: (top-1 agreement, mean p(right)).

    history: every token so far; history[:cache.length] is committed, history[-1] is the uncommitted root.
    The inputs history[L-W:L] are run in scratch at their own positions, seeing the prefix [0, L-W) only.
    """
    L = cache.length
    W = min(window, L - 1)
    inputs = torch.tensor(history[L - W:L], device=model.device)  # [W]
    targets = torch.tensor(history[L - W + 1:L + 1], device=model.device)  # [W]
    logits = model.forward(cache, inputs, torch.arange(L - W, L, device=model.device), L, plan=plan,
                           visible_prefix=L - W)  # [W, V]
    agree = (logits.argmax(-1) == targets).float().mean().item()
    p_right = torch.softmax(logits, -1).gather(-1, targets[:, None]).mean().item()
    return agree, p_right


class SkipSearch:
    """On-the-fly search of a skip set of fixed size; call `step` once per decode step until `done`.

    Phase 1 scores every skippable sublayer skipped alone (one evaluation per call); the set starts as the
    `count` sublayers whose removal hurts least. Phase 2 proposes random swaps (biased towards harmless
    sublayers) and keeps improvements until the target agreement or the budget is reached.
    """

    def __init__(self, n_layers: int, cfg: SkipSearchConfig) -> None:
        self.cfg = cfg
        self.count = skip_count(n_layers, cfg.ratio)
        self.candidates = skippable(n_layers)
        self.skips: frozenset[Sublayer] = contiguous_skips(n_layers, self.count)  # until phase 1 ends
        self.single: dict[Sublayer, tuple[float, float]] = {}  # phase 1: score with only that sublayer skipped
        self.score: tuple[float, float] = (-1.0, -1.0)
        self.evals = 0
        self.done = self.count == 0
        self.rng = random.Random(cfg.seed)

    def step(self, model: Transformer, cache: KVCache, history: list[int], base: Plan | None = None) -> None:
        """One evaluation of one candidate set, scored on the latest committed tokens."""
        if self.done or cache.length < MIN_COMMITTED:
            return
        self.evals += 1
        if len(self.single) < len(self.candidates):  # phase 1: one sublayer at a time
            s = self.candidates[len(self.single)]
            self.single[s] = score_window(model, cache, history, self.cfg.window, skip_plan(frozenset([s]), base))
            if len(self.single) < len(self.candidates):
                return
            candidate = frozenset(sorted(self.candidates, key=lambda c: self.single[c], reverse=True)[:self.count])
        else:
            candidate = self._propose()
        score = score_window(model, cache, history, self.cfg.window, skip_plan(candidate, base))
        if score > self.score:
            self.skips, self.score = candidate, score
        if self.score[0] >= self.cfg.target_agreement or self.evals >= self.cfg.budget + len(self.candidates):
            self.done = True

    def _propose(self) -> frozenset[Sublayer]:
        """Swap one or two skipped sublayers for kept ones, kept ones drawn by their phase-1 score."""
        skipped = sorted(self.skips)
        kept = [s for s in self.candidates if s not in self.skips]
        n = min(self.rng.choice(SWAP_SIZES), len(skipped), len(kept))
        out = set(skipped)
        for s in self.rng.sample(skipped, n):
            out.remove(s)
        weights = [max(self.single.get(s, (0.0, 0.0))[1], 1e-3) for s in kept]
        while len(out) < self.count:
            out.add(self.rng.choices(kept, weights)[0])
        return frozenset(out)

    def plan(self, base: Plan | None = None) -> Plan:
        return skip_plan(self.skips, base)


# ---------------------------------------------------------------------------------------------- strategy
_FORM = re.compile(r"^skip(0?\.\d+)$")


@dataclass(frozen=True)
class Skip(Strategy):
    """`skipR`: a fraction R of all sublayers skipped, the set searched on the fly over the level's other switches."""

    ratio: float  # fraction of all sublayers skipped, in (0, 1)

    FORMS: ClassVar[tuple[str, ...]] = ("skipR (0 < R < 1)",)
    KEY: ClassVar[str] = "skip"

    def __post_init__(self) -> None:
        if not 0 < self.ratio < 1:
            raise CasspecError("the skip fraction must be in (0, 1)")

    @classmethod
    def parse(cls, part: str) -> Skip | None:
        m = _FORM.match(part)
        return cls(float(m.group(1))) if m else None

    @property
    def name(self) -> str:
        return f"skip{self.ratio:g}"

    def bind(self, resources: Resources) -> Switch:
        # one search per level: its scores are only comparable over one plan of the other switches
        return SkipSwitch(SkipSearch(resources.model.spec.n_layers, SkipSearchConfig(ratio=self.ratio)))


class SkipSwitch(Switch):
    def __init__(self, search: SkipSearch) -> None:
        self.search = search

    def extend(self, plan: Plan) -> Plan:
        return self.search.plan(plan)

    @property
    def searching(self) -> bool:
        return not self.search.done

    def step(self, model: Transformer, cache: KVCache, history: list[int], others: Plan) -> None:
        self.search.step(model, cache, history, others)

    @property
    def writes_all_layers(self) -> bool:
        return not any(kind == "attn" for kind, _ in self.search.skips)
