"""A latency profile made on first use, when no profile matches this machine, model and dtype.

Without a profile the router starts from guesses and fits the latency of each level online from nothing, which
costs the first generations their speed. So the engine measures a quick profile once (`profile.AUTO`: the
target and the levels the default methods route, a grid of about a minute at most for SmolLM2-135M on a 2-core
CPU), with a progress bar and one notice on stderr, and keeps it in the user cache
(`profiles/<model>-<dtype>-<key>.json`), keyed by everything the timings depend on: CPU model and flags, GPU,
torch version, threads, model and dtype. A lock keeps two processes from measuring it twice; it is written
atomically; one that cannot be read, or was measured under another key, is not used. `--no-autoprofile`
(Engine(autoprofile=False)) skips it.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dytc.latency import PROFILE_VERSION, read_predictor

from .engine_view import EngineView
from ..cache.usercache import entry_path, read_json, read_or_measure



def profile_path(key: dict) -> Path:
    return entry_path("profiles", key)


def cached_profile(key: dict) -> dict | None:
    """The profile made on an earlier first use under this key, or None (none, unreadable, another key, a malformed
    predictor: it is measured again)."""
    prof = read_json(profile_path(key))
    ok = prof is not None and prof.get("version") == PROFILE_VERSION and prof.get("key") == key
    return prof if ok and read_predictor(prof) is not None else None


def autoprofile(engine: EngineView, key: dict, levels: tuple[str, ...], progress: bool = True) -> dict | None:
    """The cached profile of `key`, else one measured now on `engine` (and cached); None when the engine's
    context window (capped by max_context) is too small for the grid: the latency is then fitted online."""
    from .latency_grid import AUTO, fits, profile

    if not fits(engine, AUTO):
        return cached_profile(key)
    path = profile_path(key)
    return read_or_measure(path, lambda: cached_profile(key),
                           lambda: dict(profile(engine, replace(AUTO, levels=levels), progress), key=key),
                           lambda prof: prof,
                           f"casspec: no latency profile for {key['model']} {key['dtype']} on this machine: measuring "
                           f"one (once, up to about {AUTO.budget_s:.0f} s; cached in {path.parent}; --no-autoprofile "
                           "skips it)")
