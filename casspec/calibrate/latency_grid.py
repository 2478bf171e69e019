"""The latency grid: median latency of the target's and each level's forward over a grid, and its predictor (the
profile a first use measures, calibrate/autoprofile.py; `casspec profile` and its report, tools/profile_report.py).

Grid: tokens in the forward (chain: causal mask; tree: a binary tree's ancestor mask) x context length x level.
At each context C the target prefills C random tokens (committed), each level calibrates once (`begin`), then
every forward writes T tokens to scratch at slot C and is never committed. Each point is the median of its
timed calls over `repeats` rounds through all of the context's points, after `warmup` untimed rounds
(synchronising on cuda). The predictor (dytc.latency) is fitted on the points not held out; `heldout_mape` is
its error on the held-out ones.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Callable

import torch
from tqdm import tqdm

from dsia.errors import CasspecError
from dsia.kernels import time_ms
from dsia.levels import LevelConfig
from dsia.vocab import VocabConfig
from dytc.latency import (PROFILE_VERSION, TARGET_LEVEL, FeatureSpec, LatencyModel, Point, heldout_mape,
                          split_heldout)
from dytc.machine import machine_info
from dytc.tree import ancestor_mask, position_ids

from .engine_view import EngineView, dtype_name


PROFILE_LEVELS = ("int8", "int4", "int4+vocab", "skip0.4", "sparse0.5")  # dytc's default levels and one per strategy


@dataclass(frozen=True)
class ProfileConfig:
    tokens: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)  # T per forward
    contexts: tuple[int, ...] = (128, 1024, 4096)  # committed tokens C (capped by the window)
    levels: tuple[str, ...] = PROFILE_LEVELS  # draft levels profiled besides the target
    shapes: tuple[str, ...] = ("chain", "tree")  # attention masks of the T tokens
    repeats: int = 5  # timed rounds over each context's points
    warmup: int = 1  # untimed rounds first
    stat: str = "median"  # what a point keeps of its timed rounds: "median" | "min" (see STATS)
    budget_s: float | None = None  # seconds of timed rounds over all contexts; None: all `repeats` rounds
    heldout: float = 0.2  # fraction of each level's points left out of the fit
    seed: int = 0  # prefill tokens and the held-out split


# the --quick grid, also the profile made on first use (autoprofile.py) with the levels the default methods route:
# the token counts of the router's trees (at most 32 nodes) and level forwards in powers of two, two contexts,
# chain and tree masks; 72 points for the target and two levels, 3 rounds each, about 6 s for SmolLM2-135M float32
# on a quiet 2-core CPU (the 10 token counts and 5 rounds before took 14 s), and no more rounds once 40 s of them
# are spent on a busy one. Each point keeps its fastest round (see README); the router refines it online
QUICK = ProfileConfig(tokens=(1, 2, 4, 8, 16, 32), contexts=(128, 1024), levels=(), repeats=3, stat="min",
                      budget_s=40.0)
AUTO = QUICK


STATS: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "min": min}


def _tree_parents(n: int) -> list[int]:
    """A binary tree in node order: node i's parent is (i - 1) // 2."""
    return [-1] + [(i - 1) // 2 for i in range(1, n)]


def fits(engine: EngineView, cfg: ProfileConfig) -> bool:
    """Whether the engine's context window holds the grid (at least one context, then its longest forward)."""
    return bool(_contexts(engine, cfg))


def _contexts(engine: EngineView, cfg: ProfileConfig) -> list[int]:
    room = engine.cache.capacity - max(cfg.tokens) - 1  # the longest forward must fit in the window
    ctx = sorted({min(c, room) for c in cfg.contexts if c >= 1})
    return [c for c in ctx if c >= 1]


Call = tuple[str, int, bool, Callable[[], object]]  # (level name, T, tree, the timed forward)


def _calls(engine: EngineView, cfg: ProfileConfig, levels: list, ids: list[int], C: int) -> list[Call]:
    """Every (level, shape, T) forward of the grid at context C; the target is level TARGET_LEVEL."""
    model, cache, dev = engine.model, engine.cache, engine.device
    calls: list[Call] = []
    for name, level in [(TARGET_LEVEL, None)] + list(zip(cfg.levels, levels)):
        if level is not None:
            level.begin(model, cache, ids[:C + 1])
            name = level.name
        for shape in cfg.shapes:
            for T in cfg.tokens:
                tree = shape == "tree"
                parents = _tree_parents(T) if tree else list(range(-1, T - 1))
                tok = torch.tensor(ids[C - T:C] if T <= C else ids[:T], device=dev)  # [T]
                pos = position_ids(parents, C, dev)  # [T]
                mask = ancestor_mask(parents, dev) if tree else None  # [T, T]
                if level is None:
                    def fn(tok=tok, pos=pos, mask=mask):
                        return model.forward(cache, tok, pos, C, mask)
                else:
                    def fn(tok=tok, pos=pos, mask=mask, level=level):
                        return level.forward(model, cache, tok, pos, C, mask)
                calls.append((name, T, tree, fn))
    return calls


def _rounds(calls: list[Call], cfg: ProfileConfig, dev: torch.device, bar: tqdm, budget_s: float | None) -> list:
    """[per call: the ms of each timed round]. Rounds go over all the calls (not repeats of one call in a row), so
    that a burst of load from elsewhere on the machine hits one round of many points rather than every repeat of
    a few; after the first timed round no round starts once `budget_s` is spent."""
    times: list[list[float]] = [[] for _ in calls]
    t0 = time.perf_counter()
    for r in range(cfg.warmup + cfg.repeats):
        if r > cfg.warmup and budget_s is not None and time.perf_counter() - t0 > budget_s:
            bar.update(len(calls) * (cfg.warmup + cfg.repeats - r))  # the rounds left out
            break
        for i, (_, _, _, fn) in enumerate(calls):
            ms = time_ms(fn, dev)
            if r >= cfg.warmup:
                times[i].append(ms)
                bar.update(1)
    return times


@torch.inference_mode()
def measure_grid(engine: EngineView, cfg: ProfileConfig,
                 progress: bool = True) -> tuple[list[Point], list[list[float]]]:
    """Time every (level, shape, T, C) point of the grid; the target is level TARGET_LEVEL. Returns the points
    (each one's ms is the `cfg.stat` of its timed rounds) and, in the same order, the ms of those rounds."""
    for name in cfg.levels:
        LevelConfig.parse(name)
    levels = [engine.levels.get(n) for n in cfg.levels]  # builds quantized copies once
    model, cache = engine.model, engine.cache
    contexts = _contexts(engine, cfg)
    if not contexts:
        raise CasspecError(f"the context window ({cache.capacity} tokens) cannot hold a forward of {max(cfg.tokens)} "
                           "tokens after a context: raise --max-context")
    gen = torch.Generator().manual_seed(cfg.seed)
    # prefill ids from the low (frequent, in BPE merge order) ids, as in text: a reduced-vocab level's head then
    # keeps its usual size instead of growing with thousands of distinct random ids
    high = min(model.spec.vocab_size, VocabConfig.frequent)
    ids = torch.randint(3, high, (max(contexts) + 1,), generator=gen).tolist()
    total = len(contexts) * (len(levels) + 1) * len(cfg.shapes) * len(cfg.tokens) * cfg.repeats  # timed forwards
    bar = tqdm(total=total, desc="profile", unit="fwd", disable=not progress, file=sys.stderr,
               bar_format="{l_bar}{bar}| {n}/{total} timed forwards [{elapsed}<{remaining}]")
    budget = cfg.budget_s / len(contexts) if cfg.budget_s is not None else None  # per context
    points: list[Point] = []
    runs: list[list[float]] = []
    for C in contexts:
        cache.rollback(0)
        engine.extend_prefix(ids[:C])
        calls = _calls(engine, cfg, levels, ids, C)
        times = _rounds(calls, cfg, engine.device, bar, budget)
        points += [Point(name, T, C, tree, STATS[cfg.stat](t)) for (name, T, tree, _), t in zip(calls, times)]
        runs += times
    bar.close()
    cache.rollback(0)
    return points, runs


def feature_spec(engine: EngineView) -> FeatureSpec:
    s, m = engine.model.spec, engine.model
    tensors = [m.embed, m.lm_head, m.norm] + [t for lw in m.layers for t in (*vars(lw).values(), *lw.bias.values())]
    n_params = sum(t.numel() for t in {t.data_ptr(): t for t in tensors if isinstance(t, torch.Tensor)}.values())
    return FeatureSpec.for_model(n_params, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim,
                                 torch.finfo(engine.dtype).bits // 8)


def profile(engine: EngineView, cfg: ProfileConfig = ProfileConfig(), progress: bool = True) -> dict:
    """Measure the grid, fit the predictor on the kept points and score it on the held-out ones."""
    device = engine.device
    t0 = time.perf_counter()
    points, runs = measure_grid(engine, cfg, progress)
    seconds = time.perf_counter() - t0
    train, held = split_heldout(points, cfg.heldout, cfg.seed)
    predictor = LatencyModel.fit(feature_spec(engine), train,
                                 weight_bytes={TARGET_LEVEL: engine.model.weight_bytes()})
    heldset = set(held)
    return {
        "version": PROFILE_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(str(device)),
        "model": engine.name,
        "dtype": dtype_name(engine),
        "device": device.type,
        "kernels": engine.build,  # the target's dense kernels (and on a GPU, graphs etc.) its timings are of
        "config": asdict(cfg),
        "grid": [dict(asdict(p), heldout=p in heldset, runs=[round(ms, 3) for ms in r]) for p, r in zip(points, runs)],
        "predictor": predictor.to_json(),
        "heldout_mape": heldout_mape(predictor, held),
        "seconds": round(seconds, 1),  # wall time of the measurements (level set-up included)
    }


