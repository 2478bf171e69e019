"""Training-free activation sparsity for draft levels: CATS / TEAL style sparse MLP kernels for a `Plan`.

Notation: x = the normed MLP input [T, D]; a = silu(gate(x)), up = up(x), h = a * up, all [T, I].
Thresholds are calibrated per prompt and per layer on the prompt's own activations: a layer's threshold is the
s-quantile of the entries' scores over the prompt tokens, so a fraction ~s of them fall below it and are skipped.

  CATS (input_sparsity == 0): gate runs dense; the entries of a scoring above the threshold are kept; up runs
      only over the kept rows of w_up (`sampled_addmm`: one dot product per kept (token, row), read in place,
      no copy) and down only over the kept rows of w_down^T (`embedding_bag`: a fused gather + weighted sum
      over a pre-transposed [I, D] copy). Extra memory: that copy, 1/3 of the MLP weights (1/6 in bfloat16).
  TEAL (input_sparsity > 0): the entries of x scoring above an input threshold are kept; gate and up run only
      over the kept input dims (one `embedding_bag` over a pre-transposed [D, 2I] = [w_gate^T | w_up^T] copy),
      then the entries of h scoring above the threshold are kept and down runs over them as above. Extra
      memory: transposed copies of all three MLP matrices (as much as the MLP weights; half in bfloat16).

Scores: plain magnitudes (|a|, |x|, |h|: CATS / TEAL), or with `weighted` the magnitude times the entry's
expected effect on the output: |a_j| * rms(up_j) * ||w_down[:, j]||, |x_d| * ||[w_gate; w_up][:, d]||,
|h_j| * ||w_down[:, j]||. Per-entry weights fold into per-entry thresholds ([I] or [D] vectors), so the
kernels compare magnitudes with a threshold either way.

Every skipped row is really skipped: nothing is computed densely and then masked. Each token keeps its own
entries, so a token's output does not depend on the other tokens of the forward (chains and trees draft alike).
The weight copies are built once per model (`SparseMlpWeights`); calibrating for a new prompt is one pass over
its activations (`MlpRecorder`, run as the prefill's plan, or `calibrate_sparse_mlps` on the prompt tokens)
plus one k-th value per layer; no weight is copied per prompt.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import CasspecError
from .model import Transformer, dense_linear
from .plan import MlpFn, Plan

with warnings.catch_warnings():  # torch warns once per process that CSR tensors are beta: have it happen here
    warnings.simplefilter("ignore")
    torch.sparse_csr_tensor(torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1), size=(1, 1))

Threshold = Tensor | float  # a scalar, or one threshold per entry ([I] or [D]) when scores are weighted


@dataclass(frozen=True)
class SparsityConfig:
    sparsity: float = 0.5  # fraction of the MLP intermediate entries dropped (of a in CATS mode, of h in TEAL)
    input_sparsity: float = 0.0  # TEAL: fraction of the MLP input entries (x before gate/up) dropped; 0 = CATS
    weighted: bool = True  # score entries by magnitude x expected output effect (False: plain CATS / TEAL)
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

    @property
    def teal(self) -> bool:
        return self.input_sparsity > 0


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


def _gather_dot(x: Tensor, w: Tensor, crow: Tensor, tok: Tensor, col: Tensor) -> Tensor:
    """(x @ w.T)[tok, col] reading only rows `col` of w: x [T, D], w [N, D], pairs sorted by token -> [n]."""
    if w.dtype in (torch.float32, torch.float64) and x.dtype == w.dtype:  # one fused kernel, w read in place
        pattern = torch.sparse_csr_tensor(crow, col, x.new_zeros(col.shape[0]), size=(x.shape[0], w.shape[0]),
                                          check_invariants=False)  # (zeros: beta=0 does not mask NaN here)
        return torch.sparse.sampled_addmm(pattern, x, w.t(), beta=0.0).values()
    xw = x.to(w.dtype)  # sampled_addmm has no bf16/fp16 kernel: gather the rows, then a small matmul
    if x.shape[0] == 1:
        return F.linear(xw, w.index_select(0, col))[0].to(x.dtype)  # [n]
    rows, where = col.unique(return_inverse=True)  # [k] union over the tokens, gathered once
    return F.linear(xw, w.index_select(0, rows))[tok, where].to(x.dtype)  # [n]


def _bag(idx: Tensor, table: Tensor, crow: Tensor, weights: Tensor) -> Tensor:
    """sum over each token's kept rows: out[t] = sum_j weights[j] * table[idx[j]] -> [T, table cols]."""
    return F.embedding_bag(idx, table, crow[:-1], mode="sum", per_sample_weights=weights.to(table.dtype))


# ---------------------------------------------------------------------------------------------- kernels
class CatsMlp:
    """CATS: dense gate, then up and down only over the entries with |silu(gate)| > threshold."""

    def __init__(self, w_gate: Tensor, w_up: Tensor, down_t: Tensor, threshold: Threshold) -> None:
        self.w_gate = w_gate  # [I, D] (the model's own tensor)
        self.w_up = w_up  # [I, D] (the model's own tensor, read in place; a copy when weight_dtype differs)
        self.down_t = down_t  # [I, D] = w_down^T, contiguous copy
        self.threshold = threshold  # scalar or [I]

    def __call__(self, x: Tensor) -> Tensor:
        a = F.silu(dense_linear(x, self.w_gate))  # [T, I]
        keep = a.abs() > self.threshold  # [T, I]
        tok, col = keep.nonzero(as_tuple=True)  # [n] kept (token, entry) pairs, by token
        crow = _row_starts(keep, tok)  # [T + 1]
        h = a[tok, col] * _gather_dot(x, self.w_up, crow, tok, col)  # [n]
        return _bag(col, self.down_t, crow, h).to(x.dtype)  # [T, D]


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
    """What the kernels read besides the model's own tensors, built once per model and mode and shared by
    every calibration: transposed weight copies (in `cfg.weight_dtype`) and per-entry weight norms."""

    def __init__(self, model: Transformer, cfg: SparsityConfig) -> None:
        layers = tuple(range(model.spec.n_layers) if cfg.layers is None else cfg.layers)
        for i in layers:
            if not 0 <= i < model.spec.n_layers:
                raise CasspecError(f"layer {i} is out of range: the model has {model.spec.n_layers} layers")
            if any(k in model.layers[i].bias for k in ("gate", "up", "down")):
                raise CasspecError(f"layer {i} has MLP biases, which the sparse MLP kernels do not support")
        self.teal, self.layers = cfg.teal, layers
        self.dtype = cfg.weight_dtype or model.dtype
        self.down_t: dict[int, Tensor] = {}  # layer -> [I, D]
        self.up: dict[int, Tensor] = {}  # layer -> [I, D] (CATS, only when the copies' dtype is not the model's)
        self.gate_up_t: dict[int, Tensor] = {}  # layer -> [D, 2I] (TEAL only)
        self.down_norm: dict[int, Tensor] = {}  # layer -> [I] ||w_down[:, j]||
        self.in_norm: dict[int, Tensor] = {}  # layer -> [D] ||[w_gate; w_up][:, d]|| (TEAL only)
        for i in layers:
            lw = model.layers[i]
            self.down_t[i] = lw.w_down.t().contiguous().to(self.dtype)
            self.down_norm[i] = lw.w_down.float().norm(dim=0)
            if cfg.teal:
                self.gate_up_t[i] = torch.cat((lw.w_gate.t(), lw.w_up.t()), dim=1).to(self.dtype)
                self.in_norm[i] = torch.cat((lw.w_gate, lw.w_up)).float().norm(dim=0)
            elif self.dtype != lw.w_up.dtype:
                self.up[i] = lw.w_up.to(self.dtype)

    def matches(self, model: Transformer, cfg: SparsityConfig, layers: tuple[int, ...]) -> bool:
        return self.teal == cfg.teal and self.layers == layers and self.dtype == (cfg.weight_dtype or model.dtype)

    @property
    def nbytes(self) -> int:
        return _nbytes(*self.down_t.values(), *self.up.values(), *self.gate_up_t.values(), *self.down_norm.values(),
                       *self.in_norm.values())


# ---------------------------------------------------------------------------------------------- calibration
class MlpRecorder:
    """A plan running the dense MLPs exactly as the target does while recording what calibration needs:
    |a| (CATS) or |x| and |h| (TEAL) of at most `cfg.calib_tokens` tokens per layer, evenly spread, and
    the sum of up^2 over them. Use `recorder.plan` for the prompt's prefill (logits and KV are bit-identical
    to the target's), then `calibrate_sparse_mlps(model, recorder, cfg)`."""

    def __init__(self, model: Transformer, cfg: SparsityConfig) -> None:
        self.model, self.cfg = model, cfg
        self.layers = tuple(range(model.spec.n_layers) if cfg.layers is None else cfg.layers)
        self.x: dict[int, list[Tensor]] = {i: [] for i in self.layers}  # [t, D] |x| (TEAL)
        self.act: dict[int, list[Tensor]] = {i: [] for i in self.layers}  # [t, I] |a| (CATS) or |h| (TEAL)
        self.up_sq: dict[int, Tensor] = {}  # [I] sum of up^2 over the recorded tokens
        self.plan = Plan(mlps={i: self._recording_mlp(i) for i in self.layers})

    @property
    def tokens(self) -> int:
        return sum(t.shape[0] for t in self.act[self.layers[0]]) if self.layers else 0

    def _recording_mlp(self, i: int) -> MlpFn:
        lw = self.model.layers[i]

        def mlp(x: Tensor) -> Tensor:  # the ops of Transformer._mlp (this family has no MLP biases)
            a = F.silu(dense_linear(x, lw.w_gate))  # [T, I]
            up = dense_linear(x, lw.w_up)  # [T, I]
            h = a * up  # [T, I]
            self._record(i, x, a, up, h)
            return dense_linear(h, lw.w_down)  # [T, D]

        return mlp

    def _record(self, i: int, x: Tensor, a: Tensor, up: Tensor, h: Tensor) -> None:
        room = self.cfg.calib_tokens - sum(t.shape[0] for t in self.act[i])
        if room <= 0:
            return
        rows = torch.linspace(0, x.shape[0] - 1, min(room, x.shape[0]), device=x.device).round().long().unique()
        sq = up[rows].float().pow(2).sum(0)  # [I]
        self.up_sq[i] = self.up_sq[i] + sq if i in self.up_sq else sq
        if self.cfg.teal:
            self.x[i].append(x[rows].abs().float())  # [t, D]
            self.act[i].append(h[rows].abs().float())  # [t, I]
        else:
            self.act[i].append(a[rows].abs().float())  # [t, I]

    def thresholds(self, weights: SparseMlpWeights) -> dict[int, tuple[Threshold, Threshold]]:
        """layer -> (x_threshold, threshold) for the kernels; x_threshold is -1 (keep all) in CATS mode."""
        if self.tokens == 0:
            raise CasspecError("no activations were recorded: run the recorder's plan over the prompt first")
        cfg = self.cfg
        out: dict[int, tuple[Threshold, Threshold]] = {}
        for i in self.layers:
            tx: Threshold = -1.0
            if cfg.teal:
                tx = _threshold(torch.cat(self.x[i]), weights.in_norm[i] if cfg.weighted else None,
                                cfg.input_sparsity)
            scale = None
            if cfg.weighted:  # CATS: |a| * rms(up) * ||w_down col||, TEAL: |h| * ||w_down col||
                scale = weights.down_norm[i]
                if not cfg.teal:
                    scale = scale * (self.up_sq[i] / self.tokens).sqrt()
            out[i] = (tx, _threshold(torch.cat(self.act[i]), scale, cfg.sparsity))
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
        raise CasspecError("the sparse MLP weights were built for another mode, layer set or dtype: "
                           "build them with this config")
    thresholds = rec.thresholds(weights)
    mlps: dict[int, MlpFn] = {}
    for i, (tx, t) in thresholds.items():
        if cfg.teal:
            mlps[i] = TealMlp(weights.gate_up_t[i], weights.down_t[i], tx, t)
        else:
            w_up = weights.up.get(i, model.layers[i].w_up)
            mlps[i] = CatsMlp(model.layers[i].w_gate, w_up, weights.down_t[i], t)
    return SparseMlps(mlps, thresholds, weights, cfg)
