"""The decoding methods by name and what each drafts with: nothing (ar), a lookup (pld), one draft level (sd, tree:
Request.level) or several (the cascades and dytc: Request.levels), with chain segments (hc) and statistical lookups
beneath its levels or not; and the default sources of a multi-level method. Read by the request's checks, the
policies (methods.py), bench, ablations and the CLI: the one table of methods."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from dsia.errors import CasspecError
from dsia.levels import LevelConfig
from dytc.sources import BOTTOMS, LOOKUPS, PLD

from .defaults import GPU_LEVEL, HC_SEGMENTS, LEVEL, ROUTED_LEVELS

if TYPE_CHECKING:
    from ..calibrate.plane import Plane


@dataclass(frozen=True)
class MethodSpec:
    drafts: str  # "none" (the target alone), "lookup", "level" (Request.level) or "levels" (Request.levels, empty:
    # the defaults below)
    segmented: bool = False  # its sources are chain segments "SOURCE*K" (hc)
    bottom: bool = False  # statistical lookups beneath its levels (Request.lookups)


TABLE = {
    "ar": MethodSpec("none"),  # plain autoregressive decoding
    "pld": MethodSpec("lookup"),  # prompt lookup's chain
    "sd": MethodSpec("level"),  # one level's chain (sampling: coupled drafts)
    "sd-rs": MethodSpec("level"),  # the same chain sampled from q, recursive rejection sampling
    "tree": MethodSpec("level"),  # one level's tree
    "vc": MethodSpec("levels", bottom=True),  # CS Drafting's vertical cascade
    "tree+vc": MethodSpec("levels", bottom=True),
    "hc": MethodSpec("levels", segmented=True),  # CS Drafting's horizontal cascade
    "vc+hc": MethodSpec("levels", segmented=True, bottom=True),
    "dytc": MethodSpec("levels", bottom=True),  # the Dynamic Tree Cascade router
}
METHODS = tuple(TABLE)
SINGLE_LEVEL = tuple(n for n, m in TABLE.items() if m.drafts == "level")  # methods drafting with Request.level
MULTI_LEVEL = tuple(n for n, m in TABLE.items() if m.drafts == "levels")  # with Request.levels
SEGMENTED = tuple(n for n, m in TABLE.items() if m.segmented)
WITH_BOTTOM = tuple(n for n, m in TABLE.items() if m.bottom)
NO_LEVELS = "none"  # dytc's levels given as this alone: the router over its lookups (--bottom) only, no level


def default_sources(method: str, device_type: str, plane: Plane | None = None) -> list[tuple[str, int]]:
    """The levels (and hc segments) of a multi-level method when the request names none: the plane's choice where
    one was measured on this machine (plane.py), else fixed ones. On the CPU the int4 kernels were the cheapest
    drafts where measured; on a GPU a small model's forward costs its kernel launches, whatever the weights'
    precision, so fewer layers (a skip level) is what makes a draft cheaper there (issue 18's measurement)."""
    chosen = plane.sources(method, HC_SEGMENTS) if plane is not None else None
    if chosen:
        return chosen
    cpu = device_type == "cpu"
    if method == "dytc":
        return [(n, 0) for n in (ROUTED_LEVELS if cpu else (GPU_LEVEL,))]
    if method in ("vc", "tree+vc"):
        return [(LEVEL if cpu else GPU_LEVEL, 0)]
    return list(HC_SEGMENTS) if cpu else [(GPU_LEVEL, 4), (PLD, 4)]


def default_levels(device_type: str, plane: Plane | None = None) -> tuple[str, ...]:
    """The draft levels the multi-level methods route by default on this device (what a profile made on first
    use measures besides the target)."""
    names = [n for m in MULTI_LEVEL for n, _ in default_sources(m, device_type, plane) if n not in LOOKUPS]
    return tuple(dict.fromkeys(names))


def parse_sources(method: str, levels: Sequence[str]) -> list[tuple[str, int]]:
    """Request.levels of a multi-level method -> [(source, segment tokens or 0)]; one clear error if malformed.
    dytc's (NO_LEVELS,): [] (its lookups alone)."""
    if method == "dytc" and tuple(levels) == (NO_LEVELS,):
        return []
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
