"""Draft levels: the strategy registry, level names <-> configs, and the runtime objects that turn a config into
a Plan.

A level is a virtual draft model: the target's own weights run with some accelerations switched on. Names:
`int8`, `int4`, `nf4` (weight-only quantization), `w8a8` (int8 weights and activations), `skip0.4` (fraction of
sublayers skipped, set searched on the fly), `exit24` (exit after layer 24), `sparse0.5` (MLP activation
sparsity), `vocab` (reduced head), and mixes joined by `+` in any order, e.g. `int4+sparse0.5`,
`int4+skip0.2+vocab` (the canonical name orders them as STRATEGIES does: quant, skip, exit, sparse, vocab).

Each strategy is one class in the file of its kernels (see dsia/strategy.py for the interface) and one line of
STRATEGIES; parsing, naming, errors and the Level below are generic over it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, TypeVar

from torch import Tensor

from .errors import CasspecError
from .exit import Exit
from .kvcache import KVCache
from .model import Transformer
from .plan import Plan
from .quant import Quant
from .skip import Skip
from .sparsity import Sparse
from .strategy import HasBytes, Resources, Store, Strategy, Switch
from .vocab import Vocab

# One line per draft strategy. The order is the canonical order of a mix's name parts, and the order in which
# the strategies add their switches to a Plan (a later one's head replaces an earlier one's: vocab over quant).
STRATEGIES: tuple[type[Strategy], ...] = (
    Quant,  # int8 | int4 | nf4 | w8a8: quantized copies of the linears (quant.py)
    Skip,  # skipR: a searched set of sublayers skipped (skip.py)
    Exit,  # exitL: exit after layer L (exit.py)
    Sparse,  # sparseS: activation-sparse MLPs (sparsity.py)
    Vocab,  # vocab: reduced-vocabulary head (vocab.py)
)
# bumped when what the levels compute changes (2: the quantized levels' int4r head; 3: int8/int4 on casspec's block
# kernel), so that what was measured of them on a machine (latency profiles, levels planes, the state generations
# keep) is measured again
LEVELS_VERSION = 3

S = TypeVar("S", bound=Switch)


def _name_error(name: str, why: str, strategies: tuple[type[Strategy], ...]) -> CasspecError:
    forms = ", ".join(form for cls in strategies for form in cls.FORMS)
    return CasspecError(f"unknown level {name!r} ({why}): use {forms}, or mixes joined by '+', e.g. int4+sparse0.5")


def _parse_part(name: str, part: str, strategies: tuple[type[Strategy], ...]) -> Strategy:
    for cls in strategies:
        try:
            strategy = cls.parse(part)
        except CasspecError as e:  # its form, a value out of range
            raise _name_error(name, str(e), strategies) from None
        if strategy is not None:
            return strategy
    raise _name_error(name, f"{part!r} is not a level form", strategies)


@dataclass(frozen=True)
class LevelConfig:
    strategies: tuple[Strategy, ...] = ()  # at most one per strategy class, in canonical order; () = the target

    @property
    def name(self) -> str:
        return "+".join(s.name for s in self.strategies) or "target"

    @staticmethod
    def parse(name: str, strategies: tuple[type[Strategy], ...] = STRATEGIES) -> LevelConfig:
        """The level a name spells (parts joined by '+', any order), in the canonical order of `strategies`."""
        found: dict[type[Strategy], Strategy] = {}
        for part in name.strip().split("+"):
            strategy = _parse_part(name, part.strip(), strategies)
            if type(strategy) in found:
                raise _name_error(name, f"{strategy.KEY} is given twice", strategies)
            found[type(strategy)] = strategy
        return LevelConfig(tuple(found[cls] for cls in strategies if cls in found))

    def check(self, model: Transformer) -> None:
        for strategy in self.strategies:
            try:
                strategy.check(model)
            except CasspecError as e:
                raise CasspecError(f"level {self.name}: {e}") from None


class Level:
    """A draft level bound to a model. `plan` is the current Plan; `begin` calibrates on a new prompt,
    `observe` learns from newly committed tokens (skip search steps, vocabulary), `forward` drafts."""

    def __init__(self, config: LevelConfig, resources: Resources) -> None:
        config.check(resources.model)
        self.config = config
        self.name = config.name
        self.switches: tuple[Switch, ...] = tuple(s.bind(resources) for s in config.strategies)  # canonical order
        self.plan = self._plan()

    def _plan(self, without: Switch | None = None) -> Plan:
        """The plan of every switch (but `without`), added in canonical order."""
        plan = Plan()
        for sw in self.switches:
            if sw is not without:
                plan = sw.extend(plan)
        return plan

    def switch(self, kind: type[S]) -> S | None:
        """The level's switch of that class (e.g. SkipSwitch), None if the level has none."""
        return next((sw for sw in self.switches if isinstance(sw, kind)), None)

    @property
    def holds(self) -> tuple[HasBytes, ...]:
        """The distinct objects this level holds beyond the target's weights (shared copies are the same object)."""
        return tuple({id(o): o for sw in self.switches for o in sw.holds}.values())

    @property
    def extra_bytes(self) -> int:
        """Memory this level holds beyond the target's weights (quantized / transposed copies, head rows)."""
        return sum(o.nbytes for o in self.holds)

    @property
    def searching(self) -> bool:
        """Whether a switch is still searching its set on the fly (each `observe` runs one evaluation)."""
        return any(sw.searching for sw in self.switches)

    def begin(self, model: Transformer, cache: KVCache, history: list[int]) -> None:
        """A new prompt: e.g. calibrate sparsity thresholds on its last committed tokens, reset the vocabulary."""
        for sw in self.switches:
            sw.begin(model, cache, history)
        self.plan = self._plan()

    def observe(self, model: Transformer, cache: KVCache, history: list[int], emitted: list[int]) -> None:
        """After a step: every switch learns from the emitted tokens (e.g. the vocabulary grows), then each
        searching switch runs one evaluation over the plan of the level's other switches."""
        for sw in self.switches:
            sw.observe(model, cache, history, emitted)
        searching = [sw for sw in self.switches if sw.searching]
        for sw in searching:
            sw.step(model, cache, history, self._plan(without=sw))
        if searching:
            self.plan = self._plan()

    @property
    def writes_all_layers(self) -> bool:
        """Whether a forward writes the KV of every layer (no skipped attention, no early exit), so that any other
        level can attend to the scratch slots it wrote."""
        return all(sw.writes_all_layers for sw in self.switches)

    def forward(self, model: Transformer, cache: KVCache, tokens: Tensor, positions: Tensor, start: int,
                scratch_mask: Tensor | None = None, logits_rows: Tensor | slice | None = None) -> Tensor:
        """Draft logits [N, V] for tokens [T] written to scratch slots [start, start + T)."""
        return model.forward(cache, tokens, positions, start, scratch_mask, self.plan, logits_rows)


def reads_kv_of(reader: str, writer: Level | None) -> bool:
    """Whether level `reader` can attend to scratch KV that `writer` wrote (None: no draft forward wrote it):
    its own, or that of a level writing every layer."""
    return writer is not None and (writer.name == reader or writer.writes_all_layers)


class LevelRegistry:
    """Levels by name for one model, built once and reused (a quantized copy is shared by every mix)."""

    def __init__(self, model: Transformer, strategies: tuple[type[Strategy], ...] = STRATEGIES,
                 store: Store | None = None) -> None:
        self.resources = Resources(model, store)  # store: where built copies outlive the process (None: nowhere)
        self.strategies = strategies
        self.levels: dict[str, Level] = {}

    def get(self, name: str) -> Level:
        config = LevelConfig.parse(name, self.strategies)
        if config.name not in self.levels:
            self.levels[config.name] = Level(config, self.resources)
        return self.levels[config.name]

    def drop(self, names: Iterable[str]) -> None:
        """Forget these levels and what only they held (a quantized copy no remaining level shares), so that its
        memory is freed and its stored copy removed; a later `get` builds them again."""
        for name in names:
            self.levels.pop(LevelConfig.parse(name, self.strategies).name, None)
        self.resources.keep_only({id(o) for lv in self.levels.values() for o in lv.holds})
