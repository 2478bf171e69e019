"""Latency predictor: milliseconds of one forward of a level (or the target) over T tokens at context C.

One Bayesian linear regression per level on roofline-style features of (T, C):
- a per-call term (the intercept): launch / dispatch overhead plus reading the level's weights once, which is
  constant for a level, so one intercept per level carries both (the profiler records the target's weight bytes);
- T x FLOPs per token (compute of the projections), C x KV bytes per token (KV read), T x C (attention work);
- piecewise-linear hinges max(0, T - k) at knots k = 1, 2, 3, 4, 6, 8, ... 48 and a tree-mask term, so that
  non-monotone shapes (on a float32 CPU a forward over 2-4 tokens can cost more than over 8) are captured, and a
  knot the grid never reached (its weight stays at the prior's 0) just continues the line (no jump).
Timing noise on a shared machine is multiplicative (a busy neighbour slows a 10 ms and a 100 ms forward alike),
and what the router needs is relative accuracy, so each point is weighted by (ref / ms)^2 (ref: the level's
mean measured ms), i.e. the fit minimises squared relative error. The prior hyperparameters (noise and weight
precisions) come from scikit-learn's `BayesianRidge` (evidence maximisation) on standardised features; the
posterior (precision matrix P, vector b: mean = P^-1 b) is kept explicitly, so it serialises as plain JSON and
refines online by a recursive Bayesian update with exponential forgetting (`observe`, same weighting). Forgetting
decays the online data back to an anchor, a small share of the profile's own posterior (`OnlineConfig.anchor`),
not to nothing: where the timings seen while decoding say nothing (a level observed only over one token says
nothing of the slope in T), the profile's shape stays, however long the engine runs; where they do, they
dominate. Observations are absorbed in one batch update when a prediction next needs them (the router times
several forwards per step and asks once).
Prediction: mean = z . m, variance = (mean / ref)^2 / alpha + z^T P^-1 z.

Profiles (JSON files written by `casspec profile`) are matched to the machine, model and dtype by
`select_profile`; a profile measured elsewhere is never used silently.
"""
from __future__ import annotations

import importlib.resources
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dsia.errors import warn

TARGET_LEVEL = "target"  # the level name under which the target's own forward is profiled
MIN_NOISE = 0.01  # the least relative noise a fitted level's timings are taken to carry (caps its noise precision)
KNOTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)  # token counts where the latency's slope in T may change
PROFILE_VERSION = 1


@dataclass(frozen=True)
class FeatureSpec:
    """Model constants that put the features in roofline units (defaults: SmolLM2-135M-ish)."""
    gflop_per_token: float = 0.27  # 2 x parameters of the target, in GFLOP
    kv_mb_per_token: float = 0.0922  # K + V bytes of one context token over all layers, in MB
    attn_mflop_per_pair: float = 0.0442  # attention FLOPs per (new token, context token) pair, in MFLOP

    @staticmethod
    def for_model(n_params: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int,
                  elem_bytes: int) -> "FeatureSpec":
        return FeatureSpec(gflop_per_token=2 * n_params / 1e9,
                           kv_mb_per_token=2 * n_layers * n_kv_heads * head_dim * elem_bytes / 1e6,
                           attn_mflop_per_pair=4 * n_layers * n_heads * head_dim / 1e6)

    def names(self) -> list[str]:
        return (["tokens_x_gflop", "context_x_kv_mb", "tokens_x_context_x_attn_mflop", "tree_x_tokens"]
                + [f"tokens_above_{k}" for k in KNOTS])

    def features(self, tokens: int, context: int, tree: bool = False) -> np.ndarray:
        """[F] raw features of one forward (the intercept is added after scaling)."""
        return self.feature_rows(np.array([tokens]), context, tree)[0]

    def feature_rows(self, tokens: np.ndarray, context: int | np.ndarray,
                     tree: bool | np.ndarray = False) -> np.ndarray:
        """[K, F] raw features of K forwards, over tokens[k] [K] tokens each, at one context and shape (or at
        context[k], tree[k] each)."""
        t = np.asarray(tokens, dtype=np.float64)[:, None]  # [K, 1]
        c = np.broadcast_to(np.asarray(context, dtype=np.float64).reshape(-1, 1), t.shape)  # [K, 1]
        tr = np.asarray(tree, dtype=np.float64).reshape(-1, 1)  # [K | 1, 1]
        roof = np.concatenate([t * self.gflop_per_token, c * self.kv_mb_per_token,
                               t * c * self.attn_mflop_per_pair, t * tr], axis=1)  # [K, 4]
        hinges = np.maximum(0.0, t - np.asarray(KNOTS, dtype=np.float64))  # [K, knots]
        return np.concatenate([roof, hinges], axis=1)


@dataclass(frozen=True)
class Point:
    level: str  # level name, or TARGET_LEVEL
    tokens: int  # T, tokens in the forward
    context: int  # C, committed tokens before them
    tree: bool  # tree mask (True) or chain (False)
    ms: float  # median milliseconds measured


@dataclass(frozen=True)
class OnlineConfig:
    forget: float = 0.99  # per observation, the data part of the posterior is scaled by this (1 = no forgetting)
    prior_alpha: float = 1.0  # noise precision (1/ms^2) of a level with no profile
    prior_lambda: float = 1e-3  # weight precision of a level with no profile
    intercept_precision: float = 1e-6  # prior precision of the intercept (nearly flat)
    anchor: float = 0.05  # share of a profile's evidence that forgetting keeps (the anchor); 0 = decay to the prior


ARRAYS = ("mu", "sd", "prior", "P", "b", "anchor_P", "anchor_b")  # LevelFit's arrays (float64; lists in JSON)


@dataclass(eq=False)
class LevelFit:
    """Gaussian posterior over the weights of one level, in standardised feature space."""
    mu: np.ndarray  # [F] feature means
    sd: np.ndarray  # [F] feature scales
    alpha: float  # noise precision, 1/ms^2
    prior: np.ndarray  # [F+1] prior precision diagonal (intercept first)
    P: np.ndarray  # [F+1, F+1] posterior precision
    b: np.ndarray  # [F+1] posterior mean = P^-1 b
    n: int = 0  # observations absorbed (profile points + online)
    weight_bytes: int | None = None  # bytes of weights the level reads per forward, for reference
    ref_ms: float | None = None  # points weigh (ref_ms / ms)^2 (relative-error fit); None = unweighted
    anchor_P: np.ndarray | None = None  # [F+1, F+1] what forgetting decays P back to (`anchor_to`; None: not set yet)
    anchor_b: np.ndarray | None = None  # [F+1] likewise for b

    def __post_init__(self) -> None:
        for name in ARRAYS:  # (from JSON: lists)
            if getattr(self, name) is not None:
                setattr(self, name, np.asarray(getattr(self, name), dtype=np.float64))

    def anchor_to(self, share: float) -> None:
        """Make the anchor the prior plus `share` of the evidence P and b hold now (a profile's fit)."""
        prior = np.diag(self.prior)
        self.anchor_P = prior + share * (self.P - prior)
        self.anchor_b = share * self.b

    def to_json(self) -> dict:
        return {k: v.tolist() if k in ARRAYS and v is not None else v for k, v in vars(self).items()}

    def weight(self, ms: float) -> float:
        return 1.0 if self.ref_ms is None else (self.ref_ms / max(ms, 1e-6)) ** 2

    def design(self, x: np.ndarray) -> np.ndarray:
        """raw features [N, F] -> [N, F+1] standardised, with the intercept column first."""
        z = (x - self.mu) / self.sd
        return np.concatenate([np.ones((z.shape[0], 1)), z], axis=1)

    def mean_weights(self) -> np.ndarray:
        return np.linalg.solve(self.P, self.b)

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """raw features [N, F] -> (mean ms [N], std ms [N])."""
        z = self.design(x)
        P = self.P
        mean = z @ np.linalg.solve(P, self.b)
        noise = 1.0 / self.alpha if self.ref_ms is None else (np.abs(mean) / self.ref_ms) ** 2 / self.alpha
        var = noise + np.einsum("nf,fn->n", z, np.linalg.solve(P, z.T))
        return mean, np.sqrt(np.maximum(var, 0.0))

    def update(self, x: np.ndarray, ms: np.ndarray, forget: float) -> None:
        """Recursive Bayesian update with K observations, raw features x [K, F] and ms [K], in order; at each one
        the data beyond the anchor decays by `forget` (the K updates in one: observation i is scaled by
        forget^(K - 1 - i), the anchor's complement by forget^K)."""
        assert self.anchor_P is not None and self.anchor_b is not None, "anchor_to() before updating"
        z = self.design(x)  # [K, F+1]
        k = len(ms)
        c = self.alpha * np.array([self.weight(m) for m in ms]) * forget ** np.arange(k - 1, -1, -1)  # [K]
        decay = forget ** k
        self.P = self.anchor_P + decay * (self.P - self.anchor_P) + (z * c[:, None]).T @ z
        self.b = self.anchor_b + decay * (self.b - self.anchor_b) + z.T @ (c * ms)
        self.n += k


def fit_level(spec: FeatureSpec, points: list[Point], cfg: OnlineConfig = OnlineConfig()) -> LevelFit:
    """Fit one level: BayesianRidge picks the precisions, then the explicit posterior is formed."""
    from sklearn.linear_model import BayesianRidge

    x = np.stack([spec.features(p.tokens, p.context, p.tree) for p in points])  # [N, F]
    y = np.array([p.ms for p in points])  # [N]
    mu = x.mean(0)
    sd = x.std(0)
    sd[sd < 1e-12] = 1.0  # constant columns stay as they are
    # start the evidence maximisation from "mostly signal": from sklearn's default start (noise = var(y)) it can
    # settle on an all-noise optimum that flattens the hinges
    ref = float(y.mean())
    w = (ref / np.maximum(y, 1e-6)) ** 2  # [N] relative-error weights
    br = BayesianRidge(fit_intercept=True, max_iter=1000, alpha_init=100.0 / max(float(np.var(y)), 1e-12),
                       lambda_init=1e-3).fit((x - mu) / sd, y, sample_weight=w)
    # a floor on the weights' precision: with few points the evidence can drive it to ~0, and a feature the grid
    # never varied (a zero column) would then leave the posterior precision singular
    prior = [cfg.intercept_precision] + [max(float(br.lambda_), cfg.intercept_precision)] * x.shape[1]
    # a noise floor: timings on a machine carry at least MIN_NOISE relative noise, however exactly the points fit (an
    # unbounded precision from exact synthetic points made later online updates numerically singular)
    alpha = min(float(br.alpha_), 1.0 / (MIN_NOISE * ref) ** 2)
    fit = LevelFit(mu=mu, sd=sd, alpha=alpha, prior=prior, P=np.diag(prior), b=np.zeros(x.shape[1] + 1), ref_ms=ref)
    z = fit.design(x)
    fit.P = np.diag(prior) + fit.alpha * (z * w[:, None]).T @ z
    fit.b = fit.alpha * z.T @ (w * y)
    fit.n = len(points)
    fit.anchor_to(cfg.anchor)
    return fit


def empty_level(spec: FeatureSpec, cfg: OnlineConfig = OnlineConfig()) -> LevelFit:
    """A level with no profile: features scaled over a default grid, weak prior, learned online."""
    grid = [spec.features(t, c, tree) for t in (1, 2, 4, 8, 16, 32, 64) for c in (128, 512, 2048)
            for tree in (False, True)]
    x = np.stack(grid)
    sd = x.std(0)
    sd[sd < 1e-12] = 1.0
    prior = [cfg.intercept_precision] + [cfg.prior_lambda] * x.shape[1]
    fit = LevelFit(mu=x.mean(0), sd=sd, alpha=cfg.prior_alpha, prior=prior, P=np.diag(prior),
                   b=np.zeros(x.shape[1] + 1))
    fit.anchor_to(0.0)  # nothing measured: forgetting decays to the prior
    return fit


@dataclass
class LatencyModel:
    spec: FeatureSpec
    levels: dict[str, LevelFit] = field(default_factory=dict)
    online: OnlineConfig = OnlineConfig()
    _weights: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)  # level -> posterior
    # mean weights (a solve), until its next observation
    _pending: dict[str, list[tuple[int, int, bool, float]]] = field(default_factory=dict, repr=False, compare=False)
    # level -> observations (tokens, context, tree, ms) not absorbed yet

    def __post_init__(self) -> None:
        for fit in self.levels.values():  # a profile's fit read back from JSON without its anchor (older files)
            if fit.anchor_P is None or fit.anchor_b is None:
                fit.anchor_to(self.online.anchor)

    @staticmethod
    def fit(spec: FeatureSpec, points: list[Point], online: OnlineConfig = OnlineConfig(),
            weight_bytes: dict[str, int] | None = None) -> "LatencyModel":
        by_level: dict[str, list[Point]] = {}
        for p in points:
            by_level.setdefault(p.level, []).append(p)
        model = LatencyModel(spec, {name: fit_level(spec, pts, online) for name, pts in by_level.items()}, online)
        for name, nbytes in (weight_bytes or {}).items():
            if name in model.levels:
                model.levels[name].weight_bytes = nbytes
        return model

    def known(self, level: str) -> bool:
        self._absorb(level)
        return level in self.levels and self.levels[level].n > 0

    def predict_ms(self, level: str, tokens: int, context: int, tree: bool = False) -> tuple[float, float]:
        """(mean ms, std ms) of one forward of `level` over `tokens` tokens at `context` committed tokens."""
        if not self.known(level):
            raise KeyError(f"no latency data for level {level!r}: profile it or observe() its timings first")
        mean, std = self.levels[level].predict(self.spec.features(tokens, context, tree)[None])
        return float(mean[0]), float(std[0])

    def predict_mean(self, level: str, tokens: np.ndarray, context: int, tree: bool = False,
                     rows: np.ndarray | None = None) -> np.ndarray:
        """Mean ms [K] for each token count in tokens [K] at one context (vectorised; no uncertainty). rows: their
        raw features, where the caller has them already (`spec.feature_rows(tokens, context, tree)`)."""
        if not self.known(level):
            raise KeyError(f"no latency data for level {level!r}: profile it or observe() its timings first")
        fit, w = self.levels[level], self._weights.get(level)
        if w is None:
            w = self._weights[level] = fit.mean_weights()
        return fit.design(self.spec.feature_rows(tokens, context, tree) if rows is None else rows) @ w

    def cost_ratio(self, level: str, tokens: int, context: int, tree: bool = False) -> tuple[float, float]:
        """(ratio, std) of the level's forward vs the target's 1-token step at the same context (delta method)."""
        lm, ls = self.predict_ms(level, tokens, context, tree)
        tm, ts = self.predict_ms(TARGET_LEVEL, 1, context)
        ratio = lm / tm
        return ratio, abs(ratio) * math.hypot(ls / max(abs(lm), 1e-9), ts / max(abs(tm), 1e-9))

    def observe(self, level: str, tokens: int, context: int, ms: float, tree: bool = False) -> None:
        """Absorb a timing measured while decoding (a level with no profile starts from a weak prior); it takes
        effect when a prediction of the level next needs it."""
        if level not in self.levels:
            self.levels[level] = empty_level(self.spec, self.online)
        self._pending.setdefault(level, []).append((tokens, context, tree, ms))

    def _absorb(self, level: str) -> None:
        """Apply the level's pending observations (one batch update)."""
        pending = self._pending.pop(level, None)
        if pending:
            self._weights.pop(level, None)
            tokens, context, tree, ms = (np.array(col) for col in zip(*pending))  # [K] each
            self.levels[level].update(self.spec.feature_rows(tokens, context, tree), ms.astype(np.float64),
                                      self.online.forget)

    # ------------------------------------------------------------------ plain JSON
    def to_json(self) -> dict:
        for level in list(self._pending):
            self._absorb(level)
        return {"features": self.spec.names(), "spec": vars(self.spec), "online": vars(self.online),
                "levels": {name: fit.to_json() for name, fit in self.levels.items()}}

    @staticmethod
    def from_json(d: dict) -> "LatencyModel":
        return LatencyModel(FeatureSpec(**d["spec"]), {n: LevelFit(**f) for n, f in d["levels"].items()},
                            OnlineConfig(**d["online"]))


# ---------------------------------------------------------------------- held-out evaluation
def split_heldout(points: list[Point], fraction: float = 0.2, seed: int = 0) -> tuple[list[Point], list[Point]]:
    """(train, held out): per level, a seeded random `fraction` of the points is left out of the fit."""
    rng = random.Random(seed)
    train: list[Point] = []
    held: list[Point] = []
    levels = sorted({p.level for p in points})
    for level in levels:
        pts = [p for p in points if p.level == level]
        k = int(round(fraction * len(pts))) if len(pts) > 4 else 0
        out = set(rng.sample(range(len(pts)), k))
        for i, p in enumerate(pts):
            (held if i in out else train).append(p)
    return train, held


def heldout_mape(model: LatencyModel, held: list[Point]) -> dict[str, float]:
    """Per level: mean |predicted - measured| / measured over the held-out points."""
    errs: dict[str, list[float]] = {}
    for p in held:
        mean, _ = model.predict_ms(p.level, p.tokens, p.context, p.tree)
        errs.setdefault(p.level, []).append(abs(mean - p.ms) / p.ms)
    return {level: float(np.mean(e)) for level, e in errs.items()}


def default_profiles() -> Path:
    """The shipped profiles: package data of an installed casspec (`dytc.profiles`), else the checkout's profiles/
    (when the packages run from a checkout that is not installed)."""
    try:
        return Path(str(importlib.resources.files("dytc.profiles")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "profiles"


def read_predictor(prof: object) -> LatencyModel | None:
    """The predictor of a profile (a parsed profile JSON), or None when it is missing or malformed: it must build
    and predict once for each of its levels (keys, list lengths and matrix shapes all checked)."""
    try:
        model = LatencyModel.from_json(prof["predictor"])  # type: ignore[index]
        for fit in model.levels.values():
            mean, std = fit.predict(model.spec.features(1, 1)[None])
            if not (np.isfinite(mean).all() and np.isfinite(std).all()):
                return None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, ArithmeticError):  # LinAlgError: ValueError
        return None
    return model


def _profile_header(path: Path) -> dict | None:
    """The profile JSON in `path`, or None, with one warning line, when it is unreadable, truncated or not a profile
    (a JSON object with machine, model and dtype)."""
    try:
        prof = json.loads(path.read_text())
    except (OSError, ValueError):
        prof = None
    if not (isinstance(prof, dict) and isinstance(prof.get("machine"), dict) and "model" in prof and "dtype" in prof):
        warn(f"skipping the latency profile {path}: it is unreadable, truncated or not a profile; measure it again "
             "with casspec profile")
        return None
    return prof


def select_profile(machine: dict, model: str, dtype: str, kernels: str | None = None,
                   folder: str | Path | None = None) -> Path | None:
    """The newest profile in `folder` measured on this CPU model and GPU, for this model and dtype, with these
    dense kernels (`Engine.build`; a profile that does not record them predates casspec's own kernels and matches
    none: its forwards ran 1.3-3x slower than today's on the AMD EPYC, and a router steered by it drafted too little),
    else None. A file that is not a profile, or a matching one whose predictor is malformed, is skipped with one
    warning line."""
    folder = Path(folder) if folder is not None else default_profiles()
    best: tuple[str, Path] | None = None
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        prof = _profile_header(path)
        if prof is None:
            continue
        m = prof["machine"]
        ok = (prof.get("version") == PROFILE_VERSION and m.get("cpu") == machine.get("cpu")
              and m.get("gpu") == machine.get("gpu") and prof["model"] == model and prof["dtype"] == dtype
              and prof.get("kernels") == kernels)
        if ok and read_predictor(prof) is None:
            warn(f"skipping the latency profile {path}: its predictor is missing or malformed; measure it again "
                 "with casspec profile")
            continue
        if ok and (best is None or str(prof.get("created", "")) >= best[0]):
            best = (str(prof.get("created", "")), path)
    return best[1] if best else None
