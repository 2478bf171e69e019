"""Decoding methods: each name maps to the drafting policy it builds, and the sources a multi-level method uses.

A method is one row of `POLICIES`: a function (request, drafters) -> a fresh Policy for one generation. The levels
are shared (built once per engine); dytc's acceptance estimates carry over generations of the same configuration.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence

from dsia.errors import CasspecError
from dsia.levels import LevelConfig, LevelRegistry
from dytc.acceptance import AcceptanceTracker
from dytc.cascade import Cascade, CascadeConfig
from dytc.policies import ChainConfig, ChainPolicy, PldPolicy, Policy, TreePolicy
from dytc.router import DyTC, RouterConfig
from dytc.sources import BOTTOMS, LOOKUPS, PLD

if TYPE_CHECKING:
    from .plane import Plane
    from .request import Request

SINGLE_LEVEL = ("sd", "sd-rs", "tree")  # methods drafting with Request.level
MULTI_LEVEL = ("vc", "tree+vc", "hc", "vc+hc", "dytc")  # methods drafting with Request.levels (empty: their defaults)
SEGMENTED = ("hc", "vc+hc")  # multi-level methods whose sources are chain segments "SOURCE*K"
WITH_BOTTOM = ("vc", "tree+vc", "vc+hc", "dytc")  # methods with statistical lookups beneath their levels
GPU_LEVEL = "skip0.4"  # the default draft level on a GPU (see default_sources)


@dataclass
class Drafters:
    """What the policies draw on, owned by the engine."""
    levels: LevelRegistry  # draft levels by name, built on first use and reused
    trackers: dict[str, AcceptanceTracker]  # dytc's acceptance estimates, per router configuration
    device_type: str  # "cpu" | "cuda": picks the default sources
    plane: Plane | None = None  # the levels measured on this machine, which choose the defaults (None: fixed ones)

    def sources(self, req: Request) -> list[tuple[str, int]]:
        """The request's sources of a multi-level method, or the method's defaults."""
        return parse_sources(req.method, req.levels) or default_sources(req.method, self.device_type, self.plane)

    def describe(self, req: Request) -> str:
        """The request's draft sources and where they come from, for --stats ("" for ar and pld)."""
        if req.method in SINGLE_LEVEL:
            return req.level
        if req.method not in MULTI_LEVEL:
            return ""
        names = ", ".join(f"{n}*{k}" if k else n for n, k in self.sources(req))
        if req.levels:
            return f"{names} (the request's)"
        if self.plane is not None and self.plane.sources(req.method):
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
METHODS = tuple(POLICIES)


def make_policy(req: Request, drafters: Drafters) -> Policy:
    """The drafting policy of the request's method (a fresh one per generation)."""
    return POLICIES[req.method](req, drafters)


def default_sources(method: str, device_type: str, plane: Plane | None = None) -> list[tuple[str, int]]:
    """The levels (and hc segments) of a multi-level method when the request names none: the plane's choice where
    one was measured on this machine (plane.py), else fixed ones. On the CPU the int4 kernels were the cheapest
    drafts where measured; on a GPU a small model's forward costs its kernel launches, whatever the weights'
    precision, so fewer layers (a skip level) is what makes a draft cheaper there (issue 18's measurement)."""
    chosen = plane.sources(method) if plane is not None else None
    if chosen:
        return chosen
    cpu = device_type == "cpu"
    if method == "dytc":
        return [(n, 0) for n in (RouterConfig.levels if cpu else (GPU_LEVEL,))]
    if method in ("vc", "tree+vc"):
        return [("int4" if cpu else GPU_LEVEL, 0)]
    return list(CascadeConfig.hc_segments) if cpu else [(GPU_LEVEL, 4), (PLD, 4)]


def default_levels(device_type: str, plane: Plane | None = None) -> tuple[str, ...]:
    """The draft levels the multi-level methods route by default on this device (what a profile made on first
    use measures besides the target)."""
    names = [n for m in MULTI_LEVEL for n, _ in default_sources(m, device_type, plane) if n not in LOOKUPS]
    return tuple(dict.fromkeys(names))


def parse_sources(method: str, levels: Sequence[str]) -> list[tuple[str, int]]:
    """Request.levels of a multi-level method -> [(source, segment tokens or 0)]; one clear error if malformed."""
    out = []
    for item in levels:
        name, star, k = item.partition("*")
        if method in SEGMENTED:
            if not star or not k.isdigit() or int(k) < 1:
                raise CasspecError(f"hc segment {item!r} must be SOURCE*K with K >= 1 tokens, e.g. int4*4, pld*3 "
                                   "or maxgram*3")
        elif star:
            raise CasspecError(f"{method} takes level names without *K (got {item!r}); segments are for hc")
        if name not in LOOKUPS:
            LevelConfig.parse(name)
        elif method not in SEGMENTED:
            raise CasspecError(f"{method} takes its lookups from --bottom ({', '.join(BOTTOMS)}): list only dsia "
                               "levels")
        out.append((name, int(k) if star else 0))
    return out
