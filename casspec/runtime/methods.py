"""Decoding methods' policies: each name of the method table (method_table.py) maps to the drafting policy it builds.

A method is one row of `POLICIES`: a function (request, drafters) -> a fresh Policy for one generation. The levels
are shared (built once per engine); dytc's acceptance estimates carry over generations of the same configuration.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from dsia.levels import LevelRegistry
from dytc.acceptance import AcceptanceTracker
from dytc.cascade import Cascade
from dytc.policies import ChainConfig, ChainPolicy, PldPolicy, Policy, TreePolicy
from dytc.router import DyTC, RouterConfig
from dytc.sources import LOOKUPS

from .defaults import HC_SEGMENTS
from .method_table import MULTI_LEVEL, SINGLE_LEVEL, default_sources, parse_sources
from .request import Request

if TYPE_CHECKING:
    from ..calibrate.plane import Plane



@dataclass
class Drafters:
    """What the policies draw on, owned by the engine."""
    levels: LevelRegistry  # draft levels by name, built on first use and reused
    trackers: dict[str, AcceptanceTracker]  # dytc's acceptance estimates, per router configuration
    device_type: str  # "cpu" | "cuda": picks the default sources
    plane: Plane | None = None  # the levels measured on this machine, which choose the defaults (None: fixed ones)

    def sources(self, req: Request) -> list[tuple[str, int]]:
        """The request's sources of a multi-level method, or the method's defaults."""
        if req.levels:
            return parse_sources(req.method, req.levels)
        return default_sources(req.method, self.device_type, self.plane)

    def describe(self, req: Request) -> str:
        """The request's draft sources and where they come from, for --stats ("" for ar and pld)."""
        if req.method in SINGLE_LEVEL:
            return req.level
        if req.method not in MULTI_LEVEL:
            return ""
        names = ", ".join(f"{n}*{k}" if k else n for n, k in self.sources(req)) or "no level (its lookups alone)"
        if req.levels:
            return f"{names} (the request's)"
        if self.plane is not None and self.plane.sources(req.method, HC_SEGMENTS):
            return f"{names} (chosen by the levels measured on this machine, {self.plane.created})"
        return f"{names} (fixed defaults)"


def _dytc(req: Request, d: Drafters) -> Policy:
    names = tuple(n for n, _ in d.sources(req))
    cfg = replace(req.router or RouterConfig(), levels=names, lookups=req.lookups)
    # estimates carry over generations, kept apart for greedy and sampled ones (a coupled draft is accepted where
    # two perturbed argmaxes agree: another rate than the plain argmax's)
    mode = "greedy" if req.sampling.greedy else "sampling"
    tracker = d.trackers.setdefault(f"{mode} {cfg!r}", AcceptanceTracker())
    if d.plane is not None:  # a level not run yet starts at its agreement measured on this machine
        tracker.seed({r.name: r.agreement for r in d.plane.ranked if r.name in names},
                     f"levels plane {d.plane.created}")
    return DyTC([d.levels.get(n) for n in names], tracker, cfg)


def _vc(req: Request, d: Drafters) -> Policy:
    return Cascade.vc([d.levels.get(n) for n, _ in d.sources(req)], req.lookups, tree=req.method == "tree+vc")


def _hc(req: Request, d: Drafters) -> Policy:
    segments = d.sources(req)
    levels = {n: d.levels.get(n) for n, _ in segments if n not in LOOKUPS}
    return Cascade.hc(levels, segments, req.lookups if req.method == "vc+hc" else None)


POLICIES: dict[str, Callable[[Request, Drafters], Policy]] = {
    "ar": lambda req, d: Policy(),  # the root alone: plain autoregressive decoding
    "pld": lambda req, d: PldPolicy(),  # prompt lookup's chain
    "sd": lambda req, d: ChainPolicy(d.levels.get(req.level)),  # one level's chain (sampling: coupled drafts)
    # the same chain sampled from the level's q and checked by recursive rejection sampling (sampling only; greedy
    # it is sd)
    "sd-rs": lambda req, d: ChainPolicy(d.levels.get(req.level), ChainConfig(coupled=False)),
    "tree": lambda req, d: TreePolicy(d.levels.get(req.level)),  # one level's tree
    "vc": _vc, "tree+vc": _vc, "hc": _hc, "vc+hc": _hc,  # CS Drafting's cascades
    "dytc": _dytc,  # the Dynamic Tree Cascade router
}


def make_policy(req: Request, drafters: Drafters) -> Policy:
    """The drafting policy of the request's method (a fresh one per generation)."""
    return POLICIES[req.method](req, drafters)
