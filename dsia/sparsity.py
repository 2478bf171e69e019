"""Training-free activation sparsity (TEAL style) for draft levels: sparse MLP kernels for a `Plan`; the
`sparseS` draft strategy.

Notation: x = the normed MLP input [T, D]; a = silu(gate(x)), up = up(x), h = a * up, all [T, I].
Thresholds are calibrated per prompt and per layer on the prompt's own activations: a layer's threshold is the
s-quantile of the entries' scores over the prompt tokens, so a fraction ~s of them fall below it and are skipped.

The entries of x scoring above an input threshold are kept; gate and up run only over the kept input dims (one
`embedding_bag`: a fused gather + weighted sum over a pre-transposed [D, 2I] = [w_gate^T | w_up^T] copy), then
the entries of h scoring above the threshold are kept and down runs only over them (`embedding_bag` over a
pre-transposed [I, D] = w_down^T copy). Extra memory: transposed copies of all three MLP matrices (as much as
the MLP weights; half in bfloat16).

Scores: plain magnitudes (|x|, |h|), or with `weighted` the magnitude times the entry's expected effect on the
output: |x_d| * ||[w_gate; w_up][:, d]||, |h_j| * ||w_down[:, j]||. Per-entry weights fold into per-entry
thresholds ([D] or [I] vectors), so the kernels compare magnitudes with a threshold either way.

Every skipped row is really skipped: nothing is computed densely and then masked. Each token keeps its own
entries, so a token's output does not depend on the other tokens of the forward (chains and trees draft alike).
The weight copies are built once per model (`SparseMlpWeights`); calibrating for a new prompt is one pass over
its activations (`MlpRecorder`, run as the prefill's plan, or `calibrate_sparse_mlps` on the prompt tokens)
plus one k-th value per layer; no weight is copied per prompt.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import CasspecError
from .kvcache import KVCache
from .model import Transformer
from .plan import MlpFn, Plan
from .strategy import HasBytes, Resources, Strategy, Switch

Threshold = Tensor | float  # a scalar, or one threshold per entry ([I] or [D]) when scores are weighted


@dataclass(frozen=True)
class SparsityConfig:
    sparsity: float = 0.5  # fraction of the MLP intermediate entries (of h) dropped
    input_sparsity: float = 0.0  # fraction of the MLP input entries (x before gate/up) dropped; 0 keeps them all
    weighted: bool = True  # score entries by magnitude x expected output effect (False: plain TEAL magnitudes)
    layers: tuple[int, ...] | None = None  # layers that get a sparse MLP; None = all
    calib_tokens: int = 256  # at most this many prompt tokens (evenly spread) calibrate the thresholds
    weight_dtype: torch.dtype | None = None  # dtype of the transposed weight copies; None = the model's dtype

    def __post_init__(self) -> None:
        for name in ("sparsity", "input_sparsity"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise CasspecError(f"{name} must be in [0, 1), got {v!r}")
        if self.calib_tokens < 1:
            raise CasspecError(f"calib_tokens must be at least 1, got {self.calib_tokens}")


def _nbytes(*ts: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def quantile_threshold(scores: Tensor, s: float) -> float:
    """The s-quantile of the (non-negative) scores: a fraction ~(1 - s) of them is above it."""
    flat = scores.flatten()
    k = math.floor(s * flat.numel())
    return float(flat.kthvalue(k).values) if k > 0 else -1.0  # -1: keep everything


def _row_starts(keep: Tensor, tok: Tensor) -> Tensor:
    """CSR row pointers of the kept entries: keep [T, N] bool, tok [n] (their tokens, sorted) -> [T + 1]."""
    if keep.shape[0] == 1:
        return torch.tensor([0, tok.shape[0]], device=keep.device)
    return F.pad(torch.bincount(tok, minlength=keep.shape[0]).cumsum(0), (1, 0))


def _bag(idx: Tensor, table: Tensor, crow: Tensor, weights: Tensor) -> Tensor:
    """sum over each token's kept rows: out[t] = sum_j weights[j] * table[idx[j]] -> [T, table cols]."""
    return F.embedding_bag(idx, table, crow[:-1], mode="sum", per_sample_weights=weights.to(table.dtype))


# ---------------------------------------------------------------------------------------------- kernel
class TealMlp:
    """TEAL: gate and up over the input dims with |x| > x_threshold, down over the entries with
    |silu(gate) * up| > threshold."""

    def __init__(self, gate_up_t: Tensor, down_t: Tensor, x_threshold: Threshold, threshold: Threshold) -> None:
        self.gate_up_t = gate_up_t  # [D, 2I] = [w_gate^T | w_up^T]: row d holds all that input dim d feeds
        self.down_t = down_t  # [I, D] = w_down^T
        self.x_threshold = x_threshold  # scalar or [D]
        self.threshold = threshold  # scalar or [I]

    def __call__(self, x: Tensor) -> Tensor:
        keep = x.abs() > self.x_threshold  # [T, D]
        tok, dim = keep.nonzero(as_tuple=True)  # [n] kept (token, input dim) pairs, by token
        gate, up = _bag(dim, self.gate_up_t, _row_starts(keep, tok), x[tok, dim]).to(x.dtype).chunk(2, 1)  # [T, I]
        h = F.silu(gate) * up  # [T, I]
        keep = h.abs() > self.threshold  # [T, I]
        tok, col = keep.nonzero(as_tuple=True)  # [m]
        return _bag(col, self.down_t, _row_starts(keep, tok), h[tok, col]).to(x.dtype)  # [T, D]


# ---------------------------------------------------------------------------------------------- weights
class SparseMlpWeights:
    """What the kernels read, built once per model, layer set and dtype and shared by every calibration (and
    every sparsity): transposed weight copies (in `cfg.weight_dtype`) and per-entry weight norms."""

    def __init__(self, model: Transformer, cfg: SparsityConfig) -> None:
        layers = tuple(range(model.spec.n_layers) if cfg.layers is None else cfg.layers)
        for i in layers:
            if not 0 <= i < model.spec.n_layers:
                raise CasspecError(f"layer {i} is out of range: the model has {model.spec.n_layers} layers")
            if any(k in model.layers[i].bias for k in ("gate", "up", "down")):
                raise CasspecError(f"layer {i} has MLP biases, which the sparse MLP kernels do not support")
        self.layers = layers
        self.dtype = cfg.weight_dtype or model.dtype
        self.down_t: dict[int, Tensor] = {}  # layer -> [I, D]
        self.gate_up_t: dict[int, Tensor] = {}  # layer -> [D, 2I]
        self.down_norm: dict[int, Tensor] = {}  # layer -> [I] ||w_down[:, j]||
        self.in_norm: dict[int, Tensor] = {}  # layer -> [D] ||[w_gate; w_up][:, d]||
        for i in layers:
            lw = model.layers[i]
            down, gate, up = lw.dense("down"), lw.dense("gate"), lw.dense("up")  # (a native target's dequantized)
            self.down_t[i] = down.t().contiguous().to(self.dtype)
            self.down_norm[i] = down.float().norm(dim=0)
            self.gate_up_t[i] = torch.cat((gate.t(), up.t()), dim=1).to(self.dtype)
            self.in_norm[i] = torch.cat((gate, up)).float().norm(dim=0)

    def matches(self, model: Transformer, cfg: SparsityConfig, layers: tuple[int, ...]) -> bool:
        return self.layers == layers and self.dtype == (cfg.weight_dtype or model.dtype)

    @property
    def nbytes(self) -> int:
        return _nbytes(*self.down_t.values(), *self.gate_up_t.values(), *self.down_norm.values(),
                       *self.in_norm.values())


# ---------------------------------------------------------------------------------------------- calibration
class MlpRecorder:
    """A plan running the dense MLPs exactly as the target does while recording what calibration needs: |x|
    and |h| of at most `cfg.calib_tokens` tokens per layer, evenly spread. Use `recorder.plan` for the prompt's
    prefill (logits and KV are bit-identical to the target's), then `calibrate_sparse_mlps(model, recorder, cfg)`."""

    def __init__(self, model: Transformer, cfg: SparsityConfig) -> None:
        self.model, self.cfg = model, cfg
        self.layers = tuple(range(model.spec.n_layers) if cfg.layers is None else cfg.layers)
        self.x: dict[int, list[Tensor]] = {i: [] for i in self.layers}  # [t, D] |x|
        self.h: dict[int, list[Tensor]] = {i: [] for i in self.layers}  # [t, I] |h|
        self.plan = Plan(mlps={i: self._recording_mlp(i) for i in self.layers})

    @property
    def tokens(self) -> int:
        return sum(t.shape[0] for t in self.h[self.layers[0]]) if self.layers else 0

    def _recording_mlp(self, i: int) -> MlpFn:
        model = self.model  # the target's own kernels (dense or native): bit-identical outputs

        def mlp(x: Tensor) -> Tensor:  # Transformer._mlp, recording the MLP's hidden activations on the way
            h = model.mlp_hidden(i, x)  # [T, I]
            self._record(i, x, h)
            return model.mlp_down(i, h)  # [T, D]

        return mlp

    def _record(self, i: int, x: Tensor, h: Tensor) -> None:
        room = self.cfg.calib_tokens - sum(t.shape[0] for t in self.h[i])
        if room <= 0:
            return
        rows = torch.linspace(0, x.shape[0] - 1, min(room, x.shape[0]), device=x.device).round().long().unique()
        self.x[i].append(x[rows].abs().float())  # [t, D]
        self.h[i].append(h[rows].abs().float())  # [t, I]

    def thresholds(self, weights: SparseMlpWeights) -> dict[int, tuple[Threshold, Threshold]]:
        """layer -> (x_threshold, threshold) for the kernels."""
        if self.tokens == 0:
            raise CasspecError("no activations were recorded: run the recorder's plan over the prompt first")
        cfg = self.cfg
        out: dict[int, tuple[Threshold, Threshold]] = {}
        for i in self.layers:
            in_scale = weights.in_norm[i] if cfg.weighted else None  # |x_d| * ||[w_gate; w_up][:, d]||
            h_scale = weights.down_norm[i] if cfg.weighted else None  # |h_j| * ||w_down[:, j]||
            out[i] = (_threshold(torch.cat(self.x[i]), in_scale, cfg.input_sparsity),
                      _threshold(torch.cat(self.h[i]), h_scale, cfg.sparsity))
        return out


def _threshold(mags: Tensor, scale: Tensor | None, s: float) -> Threshold:
    """The threshold on magnitudes mags [t, N] that drops a fraction s of the scores mags * scale (scale [N]):
    a scalar without a scale, else per entry (t / scale; an entry with scale 0 is never kept)."""
    if scale is None:
        return quantile_threshold(mags, s)
    t = quantile_threshold(mags * scale, s)
    if t < 0:
        return -1.0
    return (t / scale).to(torch.float32)  # [N] (inf where scale == 0)


@dataclass
class SparseMlps:
    mlps: dict[int, MlpFn]  # layer -> sparse MLP kernel, for Plan.mlps
    thresholds: dict[int, tuple[Threshold, Threshold]]  # layer -> (x_threshold, intermediate threshold)
    weights: SparseMlpWeights  # the shared weight copies: pass them to the next calibration
    cfg: SparsityConfig

    @property
    def nbytes(self) -> int:
        """Extra memory: the weight copies and norms, plus the per-entry thresholds."""
        ts = [t for pair in self.thresholds.values() for t in pair if isinstance(t, Tensor)]
        return self.weights.nbytes + _nbytes(*ts)

    def plan(self) -> Plan:
        return Plan(mlps=self.mlps)


@torch.no_grad()
def record_prompt(model: Transformer, tokens: Tensor, cfg: SparsityConfig) -> MlpRecorder:
    """Run a calibration forward over the prompt tokens [T] on a scratch cache, recording its activations."""
    rec = MlpRecorder(model, cfg)
    T = tokens.shape[0]
    model.forward(model.new_cache(T), tokens, torch.arange(T, device=tokens.device), 0, plan=rec.plan,
                  logits_rows=slice(T - 1, T))
    return rec


@torch.no_grad()
def calibrate_sparse_mlps(model: Transformer, prompt: Tensor | MlpRecorder, cfg: SparsityConfig = SparsityConfig(),
                          weights: SparseMlpWeights | None = None) -> SparseMlps:
    """Sparse MLP kernels with thresholds calibrated on the prompt: `prompt` is its tokens [T] (a calibration
    forward runs here) or an `MlpRecorder` whose plan already ran over it (e.g. as the prefill's plan).
    Pass the `weights` of an earlier call to reuse its weight copies (built here otherwise)."""
    rec = prompt if isinstance(prompt, MlpRecorder) else record_prompt(model, prompt, cfg)
    if weights is None:
        weights = SparseMlpWeights(model, cfg)
    if not weights.matches(model, cfg, rec.layers):
        raise CasspecError("the sparse MLP weights were built for another layer set or dtype: "
                           "build them with this config")
    thresholds = rec.thresholds(weights)
    mlps: dict[int, MlpFn] = {i: TealMlp(weights.gate_up_t[i], weights.down_t[i], tx, t)
                              for i, (tx, t) in thresholds.items()}
    return SparseMlps(mlps, thresholds, weights, cfg)


# ---------------------------------------------------------------------------------------------- strategy
# sparseS drops S of the MLP intermediate and S / INPUT_RATIO of its input (S = 0.5: 50% and 20%): measured on
# SmolLM2-135M, CPU, the cheapest sparse MLP at top-1 agreement >= 0.85
INPUT_RATIO = 2.5
CALIB_WINDOW = 64  # a sparse level calibrates on the last this many committed tokens of each new prompt
_FORM = re.compile(r"^sparse(0?\.\d+)$")


@dataclass(frozen=True)
class Sparse(Strategy):
    """`sparseS`: TEAL-style sparse MLPs over bfloat16 weight copies, entries ranked by their weighted effect."""

    sparsity: float  # fraction of the MLP intermediate dropped, in (0, 1)

    FORMS: ClassVar[tuple[str, ...]] = ("sparseS (0 < S < 1)",)
    KEY: ClassVar[str] = "sparse"

    def __post_init__(self) -> None:
        if not 0 < self.sparsity < 1:
            raise CasspecError("the sparsity must be in (0, 1)")

    @classmethod
    def parse(cls, part: str) -> Sparse | None:
        m = _FORM.match(part)
        return cls(float(m.group(1))) if m else None

    @property
    def name(self) -> str:
        return f"sparse{self.sparsity:g}"

    @property
    def config(self) -> SparsityConfig:
        return SparsityConfig(sparsity=self.sparsity, input_sparsity=round(self.sparsity / INPUT_RATIO, 3),
                              weighted=True, weight_dtype=torch.bfloat16)

    def bind(self, resources: Resources) -> Switch:
        cfg = self.config
        key = ("sparse", cfg.layers, cfg.weight_dtype)  # the copies do not depend on the sparsity itself
        return SparseSwitch(cfg, resources.get(key, lambda model: SparseMlpWeights(model, cfg)))


class SparseSwitch(Switch):
    def __init__(self, cfg: SparsityConfig, weights: SparseMlpWeights) -> None:
        self.cfg = cfg
        self.weights = weights  # shared by every sparse level
        self.mlps: dict[int, MlpFn] = {}  # calibrated at begin

    def extend(self, plan: Plan) -> Plan:
        return dataclasses.replace(plan, mlps=self.mlps)

    def begin(self, model: Transformer, cache: KVCache, history: list[int]) -> None:
        """Calibrate the thresholds on the last CALIB_WINDOW committed tokens (teacher-forced in scratch)."""
        L = cache.length
        W = min(CALIB_WINDOW, L)
        rec = MlpRecorder(model, self.cfg)
        with torch.inference_mode():
            model.forward(cache, torch.tensor(history[L - W:L], device=model.device),
                          torch.arange(L - W, L, device=model.device), L, plan=rec.plan, visible_prefix=L - W,
                          logits_rows=slice(W - 1, W))
        self.mlps = calibrate_sparse_mlps(model, rec, self.cfg, self.weights).mlps

    @property
    def holds(self) -> tuple[HasBytes, ...]:
        return (self.weights,)
