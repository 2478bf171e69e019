"""What a batched step costs, learned from the batch's own steps (continuous batching, casspec/runtime/batch.py).

A batched step drafts every running generation's tree, verifies them all in one target forward, and accepts each.
Its time is not the latency model's (latency.py: one sequence's forward over T rows at one context): each
generation in the forward reads its own KV cache (a row of another sequence costs its KV read; a row of the same
tree shares it), and every node adds to the Python around the forward (its acceptance, its bookkeeping). On a
2-core AMD EPYC, native SmolLM2, 8 generations of ~270 positions: the forward alone 10.4 ms where the latency model
predicted 7.9, the first extra node of a tree 1.17 ms, the next ones ~0.8 (predicted 0.7-0.8, the Python not at
all), and dytc drafting under that load was 16% slower than the same generations as plain batched AR.

So the batch fits its steps' wall time (drafting, forward, acceptance; less the draft levels' forwards, which the
router prices per action) by a ridge least squares over its last WINDOW steps:

    ms = a + b * generations + c * extra,    extra = rows - generations (the drafted nodes in all)

c is what one more drafted node costs the whole step, b one more generation. A router weighing a tree beside
others' (`router.new_step`) then prices its N nodes as the step's predicted time at its extra nodes + N - 1, and
drafts a node only where the tokens it adds beat that (down to no drafts where the batch is wide enough). The fit
is used once the window has seen steps with different numbers of drafted nodes (else c is not measured: the
latency model's batched table serves meanwhile, and as it drafts, the steps vary).
"""
from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 256  # batched steps the fit keeps (the oldest forgotten first: the machine's load and the batch change)
MIN_STEPS = 8  # steps before the fit is used
RIDGE = 1e-3  # the ridge penalty on standardised features (the fit stays defined when generations never vary)


def _terms(g: int, e: int, y: float) -> np.ndarray:
    """One step's terms of BatchCost.sums."""
    return np.array([1.0, g, e, y, g * g, e * e, g * e, g * y, e * y])


class BatchCost:
    """A batched step's wall time (ms) by its generations and drafted nodes, fitted online."""

    def __init__(self) -> None:
        self.points: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)  # (generations, extra nodes, ms)
        self.sums = np.zeros(9)  # over the window: n, g, e, y, gg, ee, ge, gy, ey (kept as points come and go)
        self._coef: tuple[float, float, float] | None = None  # (a, b, c), or None until fitted again

    def observe(self, generations: int, rows: int, ms: float) -> None:
        """One batched step: its generations, the rows their trees had in all, its wall time (less level forwards)."""
        if generations < 1 or rows < generations or not np.isfinite(ms) or ms <= 0:
            return
        if len(self.points) == WINDOW:
            self.sums -= _terms(*self.points[0])
        self.points.append((generations, rows - generations, float(ms)))
        self.sums += _terms(*self.points[-1])
        self._coef = None

    @property
    def ready(self) -> bool:
        """Enough steps, and steps with different numbers of drafted nodes (c measured)."""
        return len(self.points) >= MIN_STEPS and self._spread()[1] > 0

    def _spread(self) -> tuple[float, float]:
        """The window's variance of generations and of drafted nodes."""
        n, g, e, _, gg, ee = self.sums[:6]
        return gg / n - (g / n) ** 2, ee / n - (e / n) ** 2

    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c): ms of a step, per generation, per drafted node (c at least 0: a node is never free). Ridge on
        standardised features, intercept free: (Cov + RIDGE diag(var)) (b, c) = Cov(x, y), a = mean y - (b, c) .
        mean x (a feature that never varied: variance taken as 1, its coefficient then 0)."""
        if self._coef is None:
            n, g, e, y, gg, ee, ge, gy, ey = self.sums
            vg, ve = (v if v > 1e-12 else 0.0 for v in self._spread())
            cge, cgy, cey = ge / n - g * e / n ** 2, gy / n - g * y / n ** 2, ey / n - e * y / n ** 2
            m = np.array([[vg + RIDGE * (vg or 1.0), cge], [cge, ve + RIDGE * (ve or 1.0)]])
            b, c = np.linalg.solve(m, np.array([cgy, cey]))
            a = y / n - b * g / n - c * e / n
            self._coef = (float(a), float(b), float(max(0.0, c)))
        return self._coef

    def step_ms(self, generations: int, extra: int) -> float:
        """The predicted wall time of a step of `generations` trees with `extra` drafted nodes in all."""
        a, b, c = self.coefficients()
        return a + b * generations + c * extra

    def table(self, generations: int, others_extra: int, n_max: int) -> list[float]:
        """[n_max + 1] (index 0 unused): the step's predicted ms where one generation's tree has N nodes beside the
        others' trees (`others_extra` drafted nodes among them), N = 1 .. n_max."""
        first, c = self.step_ms(generations, others_extra), self.coefficients()[2]
        return [0.0] + [max(first + c * (n - 1), 1e-3) for n in range(1, n_max + 1)]


EXPLORE_EVERY = 8  # a batch width's less productive mode still runs one step in this many (its goodput kept measured)
GOODPUT_WEIGHT = 0.1  # weight of one step's goodput in its mode's running mean (about the last ten steps)


class SpeculationSwitch:
    """Whether a batched step drafts at all, from measured goodput: per batch width, the running mean of the tokens
    per ms of the whole step (drafting, forward, acceptance) over the steps that drafted and over those that verified
    every root alone; a width drafts while that pays, the other mode still tried one step in EXPLORE_EVERY. The
    router prices each node it drafts (BatchCost), but its own search costs a step whatever it decides (native
    SmolLM2, 8 generations, AMD EPYC: ~0.2 ms a generation), and estimates err: the steps themselves say which mode
    is faster on this machine, at this load, for this work."""

    def __init__(self) -> None:
        self.goodput: dict[tuple[int, bool], float] = {}  # (width, drafts) -> running mean tokens/ms
        self.steps: dict[int, int] = {}  # width -> steps decided

    def drafts(self, width: int) -> bool:
        """This step's mode at `width` generations: True where drafting measured faster (or is not measured yet)."""
        k = self.steps[width] = self.steps.get(width, 0) + 1
        on, off = self.goodput.get((width, True)), self.goodput.get((width, False))
        if on is None or off is None:
            return on is None
        return (on >= off) != (k % EXPLORE_EVERY == 0)

    def observe(self, width: int, drafts: bool, tokens: int, ms: float) -> None:
        """A step of `width` generations in mode `drafts` emitted `tokens` in `ms` (wall time, all of it)."""
        if ms <= 0 or not np.isfinite(ms):
            return
        g, old = tokens / ms, self.goodput.get((width, drafts))
        self.goodput[(width, drafts)] = g if old is None else old + GOODPUT_WEIGHT * (g - old)
