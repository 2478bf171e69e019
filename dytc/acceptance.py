"""Online acceptance estimates: exponential moving averages of how often drafted tokens are accepted.

A drafted token is *tested* when its parent is on the accepted path (the target looked at it) and *accepted* when
it is on the path itself. Tokens are grouped by (source, bucket): the source is what proposed the token (a level,
or a lookup such as "pld": dytc/sources.py), the bucket a coarse measure of the draft's own belief in it — the
draft probability of the token for a neural level, the match length for a lookup. After each verification every
group with tested tokens moves toward its recent rate: a <- lam * a + (1 - lam) * a_recent, where a_recent is accepted /
tested over the group's last `window` steps with tested tokens (CAS-Spec: lam = 0.7 over a window of about 20
steps; a windowed rate keeps one rejected token from cutting the estimate by 30%). A per-source average over all
buckets values tokens not drafted yet (the planner's lookahead), and a bucket's estimate is shrunk toward it by
`shrink` pseudo-tokens (a bucket with few tested tokens in its window says little). A level's top-1 tokens and
its lower-ranked ones (siblings) are separate sources.

Where a level's agreement was measured on this machine (the levels plane: its top-1 agreement with the target along
the target's own answers), its per-source average starts there (`seed`) instead of at the blind `prior_level`, so
that the router does not settle on the level a blind prior happens to favour and never test the other (issue 31:
int4 agreed 0.989 there, int4+vocab 0.894, both started at 0.8, and int4 was never drafted with). `origins` says
where each source's average stands: seeded from a measurement, or learned from verifications (kept with the state).
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from .sources import OVERRULED, SIBLING, is_lookup

LEARNED = "learned"  # an origin: the source's average moved with verifications


@dataclass(frozen=True)
class AcceptanceConfig:
    lam: float = 0.7  # weight of the previous estimate in each step's update (CAS-Spec's lambda)
    window: int = 20  # steps (with tested tokens) over which the recent rate is counted
    shrink: float = 10.0  # pseudo-tokens of the source's average in a bucket's estimate
    prob_edges: tuple[float, ...] = (0.1, 0.2, 0.4, 0.6, 0.8, 0.9, 0.97)  # draft-probability bucket edges
    max_match: int = 4  # prompt-lookup match lengths >= this share a bucket
    prior_level: float = 0.8  # start value of a neural level's per-source average
    prior_lookup: float = 0.5  # start value of a lookup's per-source average (a 1-token match's n / (n + 1))
    prior_overruled: float = 0.1  # start value of a lookup token that a level disagreed with
    prior_sibling: float = 0.5  # a sibling's start value, as a fraction of a top-1 token's of the same probability
    # (and its source's average, as a fraction of its level's miss rate: `mean`)
    floor: float = 0.01  # estimates never reach 0 or 1: a source can always win back trust
    ceil: float = 0.995


@dataclass
class AcceptanceTracker:
    cfg: AcceptanceConfig = AcceptanceConfig()
    rates: dict[tuple[str, int], float] = field(default_factory=dict)  # (source, bucket) -> estimate
    overall: dict[str, float] = field(default_factory=dict)  # source -> estimate over all its tokens
    counts: dict[str, list[int]] = field(default_factory=dict)  # source -> [tested, accepted], all time
    recent: dict[tuple[str, int] | str, deque] = field(default_factory=dict)  # key -> last steps' (tested, accepted)
    origins: dict[str, str] = field(default_factory=dict)  # source -> where its average comes from (seed, LEARNED)
    memo: dict[tuple[str, int], float] = field(default_factory=dict, repr=False, compare=False)  # estimates asked
    # since the last update (the router asks the same few thousands of times a step); cleared by seed and update

    def seed(self, measured: dict[str, float], origin: str) -> None:
        """Start each source's average at its measured acceptance (a level's agreement), where it has none yet."""
        self.memo.clear()
        for source, rate in measured.items():
            if source not in self.overall:
                self.overall[source] = min(self.cfg.ceil, max(self.cfg.floor, rate))
                self.origins[source] = origin

    def bucket(self, source: str, belief: float) -> int:
        """belief: the draft probability of the token (a level) or the match length (a lookup)."""
        if is_lookup(source):
            return max(0, min(int(belief), self.cfg.max_match))
        return bisect.bisect_right(self.cfg.prob_edges, belief)

    def _prior(self, source: str, bucket: int) -> float:
        if source.endswith(OVERRULED):
            return self.cfg.prior_overruled
        if is_lookup(source):
            return bucket / (bucket + 1.0)  # match length n -> n / (n + 1)
        edges = (0.0,) + self.cfg.prob_edges + (1.0,)
        mid = 0.5 * (edges[bucket] + edges[bucket + 1])
        return self.cfg.prior_sibling * mid if source.endswith(SIBLING) else mid  # as if the draft were calibrated

    def estimate(self, source: str, belief: float) -> float:
        """Probability that a token from `source` with this belief is accepted, given its parent is."""
        key = (source, self.bucket(source, belief))
        known = self.memo.get(key)
        if known is not None:
            return known
        if key not in self.rates or source not in self.overall:
            est = self._rate(key)
        else:
            n = sum(t for t, _ in self.recent[key])  # tested tokens in the bucket's window
            est = (n * self.rates[key] + self.cfg.shrink * self.overall[source]) / (n + self.cfg.shrink)
        self.memo[key] = est
        return est

    def _rate(self, key: tuple[str, int]) -> float:
        """A bucket's estimate; a bucket not seen yet starts from its source's average where that exists."""
        if key in self.rates:
            return self.rates[key]
        lookup = is_lookup(key[0]) and not key[0].endswith(OVERRULED)  # a match length's prior beats the average
        return self.overall[key[0]] if key[0] in self.overall and not lookup else self._prior(*key)

    def mean(self, source: str) -> float:
        """Acceptance of a typical token of `source` (for tokens not drafted yet). A sibling's, before any was
        tested, is prior_sibling times its level's miss rate: it can be accepted only where the level's top-1 token
        is not (it started at prior_level, and the buckets a level's siblings had not reached yet started there:
        on the AMD EPYC int4's siblings were valued at 0.2-0.3 and drafted at up to 15 a step in a fresh engine,
        none of 30 accepted)."""
        if source in self.overall:
            return self.overall[source]
        if is_lookup(source):
            return self.cfg.prior_lookup
        if source.endswith(SIBLING):
            return self.cfg.prior_sibling * (1.0 - self.mean(source.removesuffix(SIBLING)))
        return self.cfg.prior_level

    def update(self, outcomes: list[tuple[str, float, bool]]) -> None:
        """One verification's tested tokens: (source, belief, accepted)."""
        lam, lo, hi = self.cfg.lam, self.cfg.floor, self.cfg.ceil
        self.memo.clear()
        groups: dict[tuple[str, int], list[int]] = {}
        per_source: dict[str, list[int]] = {}
        for source, belief, ok in outcomes:
            for d, key in ((groups, (source, self.bucket(source, belief))), (per_source, source)):
                g = d.setdefault(key, [0, 0])
                g[0] += 1
                g[1] += int(ok)
        for key, (n, k) in groups.items():
            self.rates[key] = min(hi, max(lo, lam * self._rate(key) + (1 - lam) * self._recent(key, n, k)))
        for source, (n, k) in per_source.items():
            self.overall[source] = min(hi, max(lo, lam * self.mean(source) + (1 - lam) * self._recent(source, n, k)))
            c = self.counts.setdefault(source, [0, 0])
            c[0] += n
            c[1] += k
            self.origins[source] = LEARNED

    def _recent(self, key: tuple[str, int] | str, tested: int, accepted: int) -> float:
        """Add one step's counts to the key's window; the window's acceptance rate."""
        win = self.recent.setdefault(key, deque(maxlen=self.cfg.window))
        win.append((tested, accepted))
        return sum(a for _, a in win) / sum(t for t, _ in win)

    # ------------------------------------------------------------------ plain JSON (kept between processes)
    def to_json(self) -> dict:
        """The estimates and windows (the config is the caller's: a tracker is read back under the same one)."""
        def key(k: tuple[str, int] | str) -> list:
            return list(k) if isinstance(k, tuple) else [k]

        return {"rates": [[*key(k), v] for k, v in self.rates.items()], "overall": self.overall,
                "counts": self.counts, "recent": [[key(k), list(map(list, w))] for k, w in self.recent.items()],
                "origins": self.origins}

    @staticmethod
    def from_json(d: dict, cfg: AcceptanceConfig = AcceptanceConfig()) -> "AcceptanceTracker":
        """A tracker from to_json's output (KeyError, TypeError or ValueError on a malformed one)."""
        def key(k: list) -> tuple[str, int] | str:
            return (str(k[0]), int(k[1])) if len(k) == 2 else str(k[0])

        return AcceptanceTracker(
            cfg, rates={(str(s), int(b)): float(v) for s, b, v in d["rates"]},
            overall={str(s): float(v) for s, v in d["overall"].items()},
            counts={str(s): [int(t), int(a)] for s, (t, a) in d["counts"].items()},
            recent={key(k): deque(((int(t), int(a)) for t, a in w), maxlen=cfg.window) for k, w in d["recent"]},
            origins={str(s): str(o) for s, o in d.get("origins", {}).items()})
