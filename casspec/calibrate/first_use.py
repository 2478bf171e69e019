"""What a runtime is handed after this machine was measured for its checkpoint (`calibrate`): the levels plane, which
chooses the multi-level methods' default draft levels, and the latency model the router plans with (a shipped
profile, one made on first use, or an empty one that fits online). Read back from the user cache where they were
measured before; measured now, once, where `measure` and they were not (about a minute for SmolLM2-135M on 2 cores).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from dytc.latency import FeatureSpec, LatencyModel, read_predictor, select_profile
from dytc.machine import machine_info

from ..cache.usercache import profile_key, read_json
from .autoprofile import autoprofile, cached_profile
from .engine_view import EngineView, dtype_name
from .plane import MIN_CONTEXT, Plane, PlaneConfig, cpu_candidates, levels_plane, plane_key


@dataclass
class Calibration:
    plane: Plane | None  # the levels measured on this machine (None: the methods' fixed defaults)
    latency: LatencyModel  # the router's latency predictor
    latency_source: str  # where it comes from (--stats; kept state grows from it)
    seconds: dict[str, float] = field(default_factory=dict)  # time spent by phase: plane, profile


def calibrate(engine: EngineView, measure: bool,
              levels_for: Callable[[Plane | None], tuple[str, ...]]) -> Calibration:
    """The engine's calibration: read back, else measured now where `measure`. levels_for(plane): the draft levels a
    latency profile measures besides the target (those the default methods route under that plane)."""
    t0 = time.perf_counter()
    key = profile_key(machine_info(engine.device.type), engine.name, dtype_name(engine), engine.build)
    plane = _levels_plane(engine, key, measure)  # (before the profile: it chooses the levels profiled)
    t1 = time.perf_counter()
    latency, source = _latency_model(engine, key, measure, levels_for(plane))
    return Calibration(plane, latency, source, {"plane": t1 - t0, "profile": time.perf_counter() - t1})


def _levels_plane(engine: EngineView, key: dict, measure: bool) -> Plane | None:
    """The draft levels measured on this machine that choose the multi-level methods' default sources (plane.py):
    read back, else measured now when `measure`; None on a GPU (issue 18's measured default), without a tokenizer,
    or when the context window is too small to measure in. key: the engine's machine-and-build key."""
    if engine.device.type != "cpu" or engine.tokenizer is None or engine.cache.capacity < MIN_CONTEXT:
        return None
    cfg = PlaneConfig(candidates=cpu_candidates())
    return levels_plane(engine, plane_key(key, cfg), measure, cfg)


def _latency_model(engine: EngineView, key: dict, measure: bool,
                   levels: tuple[str, ...]) -> tuple[LatencyModel, str]:
    """The predictor of the profile measured on this machine for this model and dtype (the repo's, else the one made
    on first use, measured now where `measure`); without one, an empty model that learns online from the engine's own
    timings."""
    path = select_profile(machine_info(engine.device.type), engine.name, dtype_name(engine), engine.build)
    latency = read_predictor(read_json(path)) if path is not None else None
    if latency is not None:
        return latency, f"profile {path.name}"
    prof = autoprofile(engine, key, levels) if measure else cached_profile(key)
    latency = read_predictor(prof) if prof is not None else None
    if latency is not None:
        return latency, f"profile made on first use ({prof.get('created')})"
    s, elem = engine.model.spec, engine.model.embed.element_size()
    spec = FeatureSpec.for_model(engine.model.weight_bytes() // elem, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim,
                                 elem)
    return LatencyModel(spec), "no profile for this machine, model and dtype: fitting online from own timings"
