"""The zero-cost sources of one generation as the DyTC router asks them (dytc/router.py): each lookup's proposal
after the history + a tree path, the recycled branch at the root, which lookups' last root proposals held
(`sources.HELD`), their CPU time, and what a verification leaves them (the history, the recycled candidates).
"""
from __future__ import annotations

import time
from typing import Callable, Collection, Iterator

from .ngram import Lookup
from .policies import DraftContext
from .recycle import RecycleLookup, learn
from .sources import RECYCLE, held

Proposal = tuple[list[int], int]  # (tokens, the lookup's belief in the first: a match length or a bucket)


class Lookups:
    def __init__(self, ctx: DraftContext, names: Collection[str], tokens: int, held_tokens: int) -> None:
        self.by_name: dict[str, Lookup] = {n: ctx.lookup(n) for n in names}
        self.tokens, self.held_tokens = tokens, held_tokens  # most tokens proposed at once (held: a copy under way)
        self.held: set[str] = set()  # lookups whose proposal at the last step's root held over all it emitted
        self.calls: dict[str, list[float]] = {}  # source -> [proposals asked, their CPU ms]

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self.by_name)

    def at(self, path: list[int]) -> dict[str, Proposal]:
        """Every lookup's proposal after the history + path (the tokens from the root's child to a leaf)."""
        return {name: self._timed(name, lk.propose_after, path, self.held_tokens if name in self.held else self.tokens)
                for name, lk in self.by_name.items()}

    def branch(self, path: list[int], taken: set[int]) -> Proposal | None:
        """The recycled proposal after the history + path whose first token is not in `taken` (the tokens already
        drafted there: the recycled tree's next branch); None without the recycle source."""
        lookup = self.by_name.get(RECYCLE)
        if lookup is None:
            return None
        assert isinstance(lookup, RecycleLookup)
        return self._timed(RECYCLE, lookup.alternative, path, taken, self.tokens)

    def source(self, name: str) -> str:
        """A lookup's source name this step: held(name) where its last root proposal held (a copy under way)."""
        return held(name) if name in self.held else name

    def observe(self, ctx: DraftContext, emitted: list[int], held_now: set[str],
                level_rows: list[tuple[int, list[int], list[float]]]) -> None:
        """After a verification: the emitted tokens join each history; the recycled candidates learn the target's
        rows (and the levels' rows); held_now: the lookups whose root proposal held."""
        self.held = held_now
        for lookup in self.by_name.values():
            lookup.extend(emitted)
        learn(self.by_name, not ctx.coupled, ctx.target_top, level_rows)

    def finish(self) -> None:
        for lookup in self.by_name.values():
            lookup.finish()

    def report(self) -> dict[str, dict[str, float]]:
        """Proposals asked and microseconds of CPU per proposal, per source (the router's measured time per step,
        O, which every step's cost starts at, holds them)."""
        return {"lookup_calls_by_source": {s: int(n) for s, (n, _) in self.calls.items()},
                "lookup_us_by_source": {s: round(1e3 * ms / max(n, 1), 1) for s, (n, ms) in self.calls.items()}}

    def _timed(self, name: str, propose: Callable[..., Proposal], *args: object) -> Proposal:
        t0 = time.perf_counter()
        out = propose(*args)
        calls = self.calls.setdefault(name, [0, 0.0])
        calls[0] += 1
        calls[1] += (time.perf_counter() - t0) * 1e3
        return out
