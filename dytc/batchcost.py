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


class BatchCost:
    """A batched step's wall time (ms) by its generations and drafted nodes, fitted online."""

    def __init__(self) -> None:
        self.points: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)  # (generations, extra nodes, ms)
        self._coef: tuple[float, float, float] | None = None  # (a, b, c), or None until fitted again

    def observe(self, generations: int, rows: int, ms: float) -> None:
        """One batched step: its generations, the rows their trees had in all, its wall time (less level forwards)."""
        if generations < 1 or rows < generations or not np.isfinite(ms) or ms <= 0:
            return
        self.points.append((generations, rows - generations, float(ms)))
        self._coef = None

    @property
    def ready(self) -> bool:
        """Enough steps, and steps with different numbers of drafted nodes (c measured)."""
        return len(self.points) >= MIN_STEPS and len({e for _, e, _ in self.points}) >= 2

    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c): ms of a step, per generation, per drafted node (c at least 0: a node is never free)."""
        if self._coef is None:
            data = np.array(self.points, dtype=np.float64)  # [K, 3]
            x, y = data[:, :2], data[:, 2]  # [K, 2] (generations, extra), [K]
            mean, std = x.mean(0), x.std(0)
            std[std == 0] = 1.0
            z = np.column_stack([np.ones(len(x)), (x - mean) / std])  # [K, 3]
            w = np.linalg.solve(z.T @ z + RIDGE * len(x) * np.diag([0.0, 1.0, 1.0]), z.T @ y)  # [3]
            b, c = w[1] / std[0], max(0.0, w[2] / std[1])
            self._coef = (float(w[0] - b * mean[0] - w[2] / std[1] * mean[1]), float(b), float(c))
        return self._coef

    def step_ms(self, generations: int, extra: int) -> float:
        """The predicted wall time of a step of `generations` trees with `extra` drafted nodes in all."""
        a, b, c = self.coefficients()
        return a + b * generations + c * extra

    def table(self, generations: int, others_extra: int, n_max: int) -> list[float]:
        """[n_max + 1] (index 0 unused): the step's predicted ms where one generation's tree has N nodes beside the
        others' trees (`others_extra` drafted nodes among them), N = 1 .. n_max."""
        a, b, c = self.coefficients()
        first = a + b * generations + c * others_extra
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
