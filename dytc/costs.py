"""The router's cost tables for one step: predicted milliseconds of a verification by node count and of each draft
level's forward by token count, from the latency model (latency.py), with guesses where nothing is measured yet."""
from __future__ import annotations

import numpy as np

from .latency import TARGET_LEVEL, LatencyModel

GUESS_VERIFY_MS = (50.0, 1.0)  # before any verification is timed: V(N) = a + b (N - 1) ms, replaced after one step
GUESS_LEVEL_SHARE = 0.5  # a level never profiled nor run costs this share of a verification of as many tokens
MIN_MS = 1e-3  # floor of every predicted time (a fitted line can dip below zero far from its data)
COST_REFRESH_STEPS = 4  # the router predicts its tables again after this many steps (they move little between)


def cost_tables(latency: LatencyModel | None, levels: list[str], context: int, n_max: int,
                constant_cost: float | None = None, batched: bool = False) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Verification ms by node count, and each level's forward ms by token count, at `context` committed tokens
    ([n_max + 1] each, index 0 unused). constant_cost (ablation, no predictor): a verification costs 1 whatever its
    size, a level forward this fraction of it. batched: the verification is a forward that other generations' rows
    share (a batched step), by its rows in all: a tree of N nodes beside `others` rows costs entry others + N (one
    table for every load; its first row is no one-token step)."""
    T = np.arange(1, n_max + 1)
    if constant_cost is not None:
        flat = np.concatenate([[0.0], np.full(n_max, constant_cost)])
        return np.concatenate([[0.0], np.ones(n_max)]), {name: flat for name in levels}
    rows = latency.spec.feature_rows(T, context, True) if latency is not None else None  # [n_max, F] shared
    v = _verify(latency, T, context, batched, rows)
    verify_ms = np.concatenate([[0.0], np.maximum(v, MIN_MS)])
    level_ms = {}
    for name in levels:
        if latency is not None and latency.known(name):
            c = latency.predict_mean(name, T, context, tree=True, rows=rows)
        else:  # not profiled and not run yet: a share of a target forward of as many tokens, until it is timed
            c = GUESS_LEVEL_SHARE * (verify_ms[T] if not batched else _verify(latency, T, context, False))
        level_ms[name] = np.concatenate([[0.0], np.maximum(c, MIN_MS)])
    return verify_ms, level_ms


def _verify(latency: LatencyModel | None, T: np.ndarray, context: int, batched: bool,
            rows: np.ndarray | None = None) -> np.ndarray:
    """Predicted ms of target forwards over T [K] rows (a tree's; the first a one-token step unless batched); rows:
    their tree features, where the caller has them."""
    if latency is None or not latency.known(TARGET_LEVEL):  # nothing measured yet: a flat guess, replaced after
        return GUESS_VERIFY_MS[0] + GUESS_VERIFY_MS[1] * (T - 1)  # the first verification
    v = latency.predict_mean(TARGET_LEVEL, T, context, tree=True, rows=rows)
    v[0] = latency.predict_mean(TARGET_LEVEL, T[:1], context, tree=batched)[0]
    return v
