"""The levels plane: which draft levels the multi-level methods (vc, hc, dytc) draft with by default on this machine,
chosen from a measurement made on it.

A level's worth depends on the machine: on one CPU an int4 forward costs a third of the target's, on another the
int4 kernel is slow and bfloat16 or int8 products are cheap. So on first use (with the latency profile, see
autoprofile.py; `--no-autoprofile` skips both) the engine measures each candidate level's cost ratio (its one-token
forward over the target's) and its top-1 agreement (teacher-forced along the target's own greedy answer to a few
calibration prompts, as `casspec levels` does), and the target's verification of several tokens against one. It
keeps the measurement in the user cache (`planes/`, keyed like the profiles: CPU model and flags, torch, threads,
model, dtype, the engine's build, and the candidates) and chooses from it:

  a level drafting a chain of k tokens, each accepted with probability a (its agreement) given the ones before,
  for c target steps per token, verified in one forward of k + 1 tokens costing v(k + 1) one-token steps, emits
  E = 1 + a + ... + a^k tokens per E / (k c + v(k + 1)) of a step: its predicted speedup over AR, at its best k.

Levels are ranked by that speedup; `dytc` routes up to `top` of them, best first, less any dominated by one before
it (`Plane.routed`), `vc` drafts with the first, and `hc`'s level segments take the first `top` in rank order (its
lookup segments stay). Within a generation the router's acceptance
estimates and latency model refine online what the plane measured once. Without a plane (on a GPU, or not measured)
the methods keep their fixed defaults (methods.default_sources).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

import torch

from dsia.kernels import time_ms
from dytc.sources import LOOKUPS

from .engine_view import EngineView
from ..cache.usercache import entry_path, read_json, read_or_measure


COST_MARGIN = 0.1  # a level must cost this fraction less than a more accurate one to be routed beside it: a smaller
# saving is within the cost ratio's noise (medians of 7 forwards; 3-7% between planes on the AMD EPYC) and below what
# exploring and valuing one more level costs the router
PLANE_VERSION = 1  # bumped when what a plane file holds changes (older files are measured again)
# the candidates on a CPU: the quantized bodies with the int4r head (int4 with the reduced vocabulary too) and the
# bfloat16 copy; skip, exit and sparsity levels drafted far less exactly there (`casspec levels`, README)
CPU_CANDIDATES = ("int4", "int4+vocab", "int8", "w8a8", "bf16")
# where casspec's C++ library builds, int4 and int8 run its block kernel (dsia/quant.py), reading 0.56 / 1.06 bytes a
# weight where bf16 reads 2 and w8a8 1 (fbgemm's): a one-token draft forward, bound by those bytes, is no cheaper on
# any CPU in those kinds, so only the block kinds are measured there (2.6 s less of a first use on the AMD EPYC)
LIBRARY_CANDIDATES = ("int4", "int4+vocab", "int8")
# generic prompts, none from any benchmark: a prose answer and a code answer, as chat users ask
MIN_CONTEXT = 256  # the smallest context window a plane is measured in (a prompt, its answer, a verification)
CALIBRATION = ("Explain how a refrigerator keeps food cold, in a few short paragraphs.",
               "Write a Python function that merges two sorted lists, and explain how it works.")


def cpu_candidates() -> tuple[str, ...]:
    """The levels a CPU's plane measures: the block kinds where casspec's library builds, else torch's kinds too."""
    from dsia.cxx import build_error

    return LIBRARY_CANDIDATES if build_error() is None else CPU_CANDIDATES


@dataclass(frozen=True)
class PlaneConfig:
    candidates: tuple[str, ...] = CPU_CANDIDATES  # levels measured (those this torch cannot build are left out)
    prompts: tuple[str, ...] = CALIBRATION  # chat prompts whose greedy answers the agreement is measured along
    max_new_tokens: int = 48  # tokens of each answer
    repeats: int = 7  # timed one-token forwards per level and prompt (their median)
    verify_tokens: int = 8  # the target's forward over this many tokens is timed against one token's
    top: int = 2  # levels dytc routes (and hc's level segments)
    max_k: int = 10  # longest chain valued


@dataclass(frozen=True)
class Ranked:
    name: str
    speedup: float  # predicted over AR, at the best chain length k
    k: int
    cost_ratio: float
    agreement: float


@dataclass(frozen=True)
class Plane:
    """A measured plane and its choice."""
    ranked: tuple[Ranked, ...]  # best first
    verify_ratio: float  # the target's forward over `verify_tokens` tokens, in one-token forwards
    verify_tokens: int
    top: int = 2
    created: str = ""  # when it was measured
    scored: int = 0  # tokens each agreement was measured on (0: unknown, no level is dominated)

    @property
    def chosen(self) -> tuple[str, ...]:
        """The `top` best ranked levels (hc's level segments, in this order)."""
        return tuple(r.name for r in self.ranked[:self.top])

    @property
    def routed(self) -> tuple[str, ...]:
        """The levels dytc routes: up to `top`, best ranked first, leaving out a level dominated by one taken before
        it: not cheaper by COST_MARGIN and not more accurate beyond the measurement's noise (two standard errors of
        a binomial agreement over `scored` tokens). Such a level only costs the router exploration and valuation:
        on the AMD EPYC int8 agreed like int4 (0.979 both, 94 tokens) at 1.3x its cost, and the oracle replay found
        dytc drafting hundreds of tokens with it that int4 would have drafted for less."""
        out: list[Ranked] = []
        for r in self.ranked:
            if len(out) == self.top:
                break
            if not any(r.cost_ratio > (1.0 - COST_MARGIN) * o.cost_ratio
                       and r.agreement <= o.agreement + self._noise(o.agreement) for o in out):
                out.append(r)
        return tuple(r.name for r in out)

    def _noise(self, agreement: float) -> float:
        """Two standard errors of an agreement measured on `scored` tokens (-1 when unknown: nothing is dominated)."""
        if self.scored <= 0:
            return -1.0
        return 2.0 * (max(agreement * (1.0 - agreement), 1.0 / self.scored) / self.scored) ** 0.5

    def sources(self, method: str, hc_segments: Sequence[tuple[str, int]]) -> list[tuple[str, int]] | None:
        """A multi-level method's default sources from this plane (None: not one this plane chooses for); hc's take
        the shape of `hc_segments` (its levels replaced by the plane's choice, in order; lookups kept)."""
        if not self.ranked:
            return None
        if method == "dytc":
            return [(n, 0) for n in self.routed]
        if method in ("vc", "tree+vc"):
            return [(self.ranked[0].name, 0)]
        if method in ("hc", "vc+hc"):
            names = iter(self.chosen)
            segments = [(s, k) if s in LOOKUPS else (next(names, None), k) for s, k in hc_segments]
            return [(s, k) for s, k in segments if s is not None]
        return None

    def describe(self) -> str:
        return ", ".join(f"{r.name} {r.speedup:.2f}x (cost {r.cost_ratio:.2f}, agreement {r.agreement:.3f})"
                         for r in self.ranked)


def chain_speedup(cost: float, agreement: float, verify: Callable[[int], float], max_k: int) -> tuple[float, int]:
    """(predicted speedup over AR, chain length k) of a level drafting k tokens at `cost` target steps each, each
    accepted with probability `agreement` given the ones before, verified in one forward of k + 1 tokens costing
    verify(k + 1) one-token steps; k = 0 (AR itself, speedup 1) when no chain pays."""
    best, best_k = 1.0, 0
    for k in range(1, max_k + 1):
        tokens = sum(agreement ** i for i in range(k + 1))  # 1 + a + ... + a^k
        speedup = tokens / (k * cost + verify(k + 1))
        if speedup > best:
            best, best_k = speedup, k
    return best, best_k


def rank(levels: dict[str, dict], verify_ratio: float, verify_tokens: int, max_k: int) -> tuple[Ranked, ...]:
    """The measured levels ({name: {cost_ratio, agreement}}) by predicted speedup, best first. The verification of
    n tokens costs 1 + (n - 1) (verify_ratio - 1) / (verify_tokens - 1) one-token forwards (a line through the two
    measured points, never below one)."""
    slope = max(verify_ratio - 1.0, 0.0) / max(verify_tokens - 1, 1)
    verify = lambda n: 1.0 + (n - 1) * slope  # noqa: E731
    out = []
    for name, row in levels.items():
        s, k = chain_speedup(row["cost_ratio"], row["agreement"], verify, max_k)
        out.append(Ranked(name, s, k, row["cost_ratio"], row["agreement"]))
    return tuple(sorted(out, key=lambda r: -r.speedup))


def from_json(obj: dict, cfg: PlaneConfig = PlaneConfig()) -> Plane:
    """A plane from its stored measurement (KeyError/TypeError/ValueError when malformed)."""
    levels = {n: {"cost_ratio": float(r["cost_ratio"]), "agreement": float(r["agreement"])}
              for n, r in obj["levels"].items()}
    vr, vt = float(obj["verify_ratio"]), int(obj["verify_tokens"])
    return Plane(rank(levels, vr, vt, cfg.max_k), vr, vt, cfg.top, str(obj.get("created", "")),
                 len(cfg.prompts) * (cfg.max_new_tokens - 1))


def plane_key(profile_key: dict, cfg: PlaneConfig) -> dict:
    """Everything a plane depends on: what a latency profile does (usercache.profile_key) and its candidates."""
    return dict(profile_key, candidates=list(cfg.candidates), prompts=list(cfg.prompts),
                max_new_tokens=cfg.max_new_tokens, version=PLANE_VERSION)


def plane_path(key: dict) -> Path:
    return entry_path("planes", key)


def cached_plane(key: dict, cfg: PlaneConfig = PlaneConfig()) -> Plane | None:
    """The plane measured earlier under this key; None when there is none or it cannot be read."""
    obj = read_json(plane_path(key))
    if obj is None or obj.get("key") != key:
        return None
    try:
        return from_json(obj, cfg)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def buildable(engine: EngineView, names: tuple[str, ...]) -> list[str]:
    """The candidates this engine can build (w8a8 needs fbgemm, a shape may not fit a kernel, ...)."""
    from dsia.errors import CasspecError

    out = []
    for name in names:
        try:
            engine.levels.get(name)
        except CasspecError:
            continue
        out.append(name)
    return out


def _verify_ratio(engine: EngineView, tokens: int, repeats: int) -> float:
    """The target's forward over `tokens` new tokens (causal, at the cache's context) over its one-token forward,
    medians of interleaved timings."""
    model, cache, dev = engine.model, engine.cache, engine.device
    L = cache.length
    one, many = [], []
    for r in range(repeats + 2):
        for n, out in ((1, one), (tokens, many)):
            tok = torch.full((n,), 7, device=dev)
            pos = torch.arange(L, L + n, device=dev)
            mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
            ms = time_ms(lambda: model.forward(cache, tok, pos, L, mask), dev)
            if r >= 2:  # the first two are warm-up
                out.append(ms)
    return statistics.median(many) / statistics.median(one)


def measure(engine: EngineView, cfg: PlaneConfig = PlaneConfig(), progress: bool = True) -> dict:
    """Measure the plane on `engine` (cost ratio and agreement of each buildable candidate; the verification
    ratio); the engine's cache is left empty."""
    from .questions import Question
    from .agreement import measure_levels

    names = buildable(engine, cfg.candidates)
    questions = [Question(f"calibration-{i}", "calibration", [p]) for i, p in enumerate(cfg.prompts)]
    report = measure_levels(engine, questions, names, cfg.max_new_tokens, cfg.repeats, progress)
    with torch.inference_mode():
        ratio = _verify_ratio(engine, cfg.verify_tokens, cfg.repeats)
    engine.cache.rollback(0)
    engine.forget_prefix()
    return {"version": PLANE_VERSION, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "target_ms": report["target_ms"], "verify_ratio": ratio, "verify_tokens": cfg.verify_tokens,
            "levels": {n: {k: r[k] for k in ("cost_ratio", "agreement", "extra_bytes")}
                       for n, r in report["levels"].items()}}


def levels_plane(engine: EngineView, key: dict, measure_now: bool, cfg: PlaneConfig = PlaneConfig(),
                 progress: bool = True) -> Plane | None:
    """The plane of `key`: read back, else (when measure_now) measured now and cached; None otherwise."""
    if not measure_now:
        return cached_plane(key, cfg)

    def measured() -> dict:
        obj = dict(measure(engine, cfg, progress), key=key)
        plane = from_json(obj, cfg)
        # the candidates no method drafts with hold copies of the weights (bf16: half of them): free them
        engine.levels.drop(r.name for r in plane.ranked if r.name not in plane.chosen + plane.routed)
        return obj

    path = plane_path(key)
    return read_or_measure(path, lambda: cached_plane(key, cfg), measured, lambda obj: from_json(obj, cfg),
                           f"casspec: measuring the draft levels {', '.join(cfg.candidates)} on this machine to choose "
                           f"the default ones (once, about half a minute; cached in {path.parent}; --no-autoprofile "
                           "skips it)")
