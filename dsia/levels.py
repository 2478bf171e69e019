"""Draft levels: canonical names <-> configs, and the runtime objects that turn a config into a Plan.

A level is a virtual draft model: the target's own weights run with some accelerations switched on. Names:
`int8`, `int4`, `nf4` (weight-only quantization), `skip0.4` (fraction of sublayers skipped, set searched on
the fly), `exit24` (exit after layer 24), `sparse0.5` (MLP activation sparsity), `vocab` (reduced head), and
mixes joined by `+` in any order, e.g. `int4+sparse0.5`, `int4+skip0.2+vocab` (the canonical name orders them
quant, skip, exit, sparse, vocab).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from .errors import CasspecError
from .kvcache import KVCache
from .model import Transformer
from .plan import Plan
from .quant import QuantConfig, QuantizedLinears, quantize_linears
from .skip import SkipSearch, SkipSearchConfig
from .sparsity import MlpRecorder, SparseMlpWeights, SparsityConfig, calibrate_sparse_mlps
from .vocab import VocabConfig, VocabHead

QUANT_KINDS = ("int8", "int4", "nf4")
LEVEL_FORMS = ("int8", "int4", "nf4", "skipR", "exitL", "sparseS", "vocab")
_PART = re.compile(r"^(int8|int4|nf4|vocab|skip(0?\.\d+)|exit(\d+)|sparse(0?\.\d+))$")


def _name_error(name: str, why: str) -> CasspecError:
    return CasspecError(f"unknown level {name!r} ({why}): use int8, int4, nf4, skipR (0 < R < 1), exitL "
                        "(1 <= L < layers), sparseS (0 < S < 1), vocab, or mixes joined by '+', e.g. int4+sparse0.5")


@dataclass(frozen=True)
class LevelConfig:
    quant: str | None = None  # weight-only quantization kind (int8 | int4 | nf4), None = full precision
    skip: float = 0.0  # fraction of all sublayers skipped; the set is searched on the fly
    exit_after: int | None = None  # run only the first exit_after layers; None = all
    sparse: float = 0.0  # fraction of MLP intermediate activations dropped (training-free, calibrated on the prompt)
    vocab: bool = False  # score only a subset of the vocabulary in the draft head

    @property
    def name(self) -> str:
        parts = [self.quant] if self.quant else []
        if self.skip:
            parts.append(f"skip{self.skip:g}")
        if self.exit_after is not None:
            parts.append(f"exit{self.exit_after}")
        if self.sparse:
            parts.append(f"sparse{self.sparse:g}")
        if self.vocab:
            parts.append("vocab")
        return "+".join(parts) or "target"

    @staticmethod
    def parse(name: str) -> "LevelConfig":
        fields: dict = {}
        for part in name.strip().split("+"):
            m = _PART.match(part.strip())
            if not m:
                raise _name_error(name, f"{part!r} is not a level form")
            key = {"int8": "quant", "int4": "quant", "nf4": "quant", "vocab": "vocab"}.get(part, None)
            if part.startswith("skip"):
                key, value = "skip", float(m.group(2))
                if not 0 < value < 1:
                    raise _name_error(name, "the skip fraction must be in (0, 1)")
            elif part.startswith("exit"):
                key, value = "exit_after", int(m.group(3))
                if value < 1:
                    raise _name_error(name, "exit after at least one layer")
            elif part.startswith("sparse"):
                key, value = "sparse", float(m.group(4))
                if not 0 < value < 1:
                    raise _name_error(name, "the sparsity must be in (0, 1)")
            else:
                value = part if key == "quant" else True
            if key in fields:
                raise _name_error(name, f"{key} is given twice")
            fields[key] = value
        return LevelConfig(**fields)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "LevelConfig":
        return LevelConfig(**json.loads(text))

    def check(self, model: Transformer) -> None:
        if self.exit_after is not None and not 1 <= self.exit_after < model.spec.n_layers:
            raise CasspecError(f"level {self.name}: exit layer must be in [1, {model.spec.n_layers - 1}] for this "
                               "model")


def sparsity_config(sparse: float) -> SparsityConfig:
    """The kernel behind `sparseS`: TEAL-style, S of the MLP intermediate and S/2.5 of the MLP input dropped,
    entries ranked by their weighted effect, over bfloat16 weight copies (measured on SmolLM2-135M, CPU: the
    cheapest sparse MLP at top-1 agreement >= 0.85; CATS-style gate-dense kernels saved little here)."""
    return SparsityConfig(sparsity=sparse, input_sparsity=round(sparse / 2.5, 3), weighted=True,
                          weight_dtype=torch.bfloat16)


class Resources:
    """What levels share, built once per model: quantized copies, sparse weight copies, skip searches."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.quant: dict[str, QuantizedLinears] = {}
        self.sparse_weights: dict[tuple, SparseMlpWeights] = {}  # (mode, layers, dtype) -> transposed copies
        self.skip_searches: dict[tuple[str | None, float], SkipSearch] = {}  # (quant, ratio) -> search

    def quantized(self, kind: str) -> QuantizedLinears:
        if kind not in self.quant:
            self.quant[kind] = quantize_linears(self.model, QuantConfig(kind))
        return self.quant[kind]

    def sparse(self, cfg: SparsityConfig) -> SparseMlpWeights:
        key = (cfg.teal, cfg.layers, cfg.weight_dtype)  # the copies do not depend on the sparsity itself
        if key not in self.sparse_weights:
            self.sparse_weights[key] = SparseMlpWeights(self.model, cfg)
        return self.sparse_weights[key]

    def skip_search(self, quant: str | None, ratio: float) -> SkipSearch:
        key = (quant, ratio)
        if key not in self.skip_searches:
            self.skip_searches[key] = SkipSearch(self.model.spec.n_layers, SkipSearchConfig(ratio=ratio))
        return self.skip_searches[key]


class Level:
    """A draft level bound to a model. `plan` is the current Plan; `begin` calibrates on a new prompt,
    `observe` learns from newly committed tokens (skip search steps, vocabulary), `forward` drafts."""

    def __init__(self, config: LevelConfig, resources: Resources) -> None:
        model = resources.model
        config.check(model)
        self.config = config
        self.name = config.name
        self.resources = resources
        self.quant = resources.quantized(config.quant) if config.quant else None
        self.search = resources.skip_search(config.quant, config.skip) if config.skip else None
        self.sparse_cfg = sparsity_config(config.sparse) if config.sparse else None
        self.sparse_weights = resources.sparse(self.sparse_cfg) if self.sparse_cfg else None
        self.vocab = VocabHead(model.lm_head, VocabConfig()) if config.vocab else None
        self._mlps: dict = {}
        self.plan = self._build_plan()

    @property
    def extra_bytes(self) -> int:
        """Memory this level holds beyond the target's weights (quantized / transposed copies, head rows)."""
        total = self.quant.nbytes if self.quant else 0
        total += self.sparse_weights.nbytes if self.sparse_weights else 0
        total += self.vocab.nbytes if self.vocab else 0
        return total

    def _base_plan(self) -> Plan:
        """Every switch of the level except the searched skip set."""
        c = self.config
        return Plan(exit_after=c.exit_after,
                    linears=self.quant.linears if self.quant else {},
                    fused=self.quant.fused if self.quant else {},
                    mlps=self._mlps,
                    head=self.vocab if self.vocab is not None else (self.quant.head if self.quant else None))

    def _build_plan(self) -> Plan:
        base = self._base_plan()
        return self.search.plan(base) if self.search else base

    def begin(self, model: Transformer, cache: KVCache, history: list[int], window: int = 64) -> None:
        """A new prompt: calibrate sparsity thresholds on its last `window` committed tokens; reset the vocab."""
        if self.sparse_cfg is not None:
            L = cache.length
            W = min(window, L)
            rec = MlpRecorder(model, self.sparse_cfg)
            with torch.inference_mode():
                model.forward(cache, torch.tensor(history[L - W:L], device=model.device),
                              torch.arange(L - W, L, device=model.device), L, plan=rec.plan, visible_prefix=L - W,
                              logits_rows=slice(W - 1, W))
            self._mlps = calibrate_sparse_mlps(model, rec, self.sparse_cfg, self.sparse_weights).mlps
        if self.vocab is not None:
            self.vocab.reset()
            self.vocab.add(history)
        self.plan = self._build_plan()

    def observe(self, model: Transformer, cache: KVCache, history: list[int], emitted: list[int]) -> None:
        """After a step: grow the vocabulary, run one skip-search evaluation while the search is open."""
        if self.vocab is not None:
            self.vocab.add(emitted)
        if self.search is not None and not self.search.done:
            self.search.step(model, cache, history, self._base_plan())
            self.plan = self._build_plan()

    @property
    def writes_all_layers(self) -> bool:
        """Whether a forward writes the KV of every layer (no skipped attention, no early exit), so that any other
        level can attend to the scratch slots it wrote."""
        return not self.plan.skip_attn and self.plan.exit_after is None

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

    def __init__(self, model: Transformer) -> None:
        self.resources = Resources(model)
        self.levels: dict[str, Level] = {}

    def get(self, name: str) -> Level:
        config = LevelConfig.parse(name)
        if config.name not in self.levels:
            self.levels[config.name] = Level(config, self.resources)
        return self.levels[config.name]
