"""What a generation is asked to do: the Request and its checks (one clear error before any work)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dsia.errors import CasspecError
from dsia.levels import LevelConfig
from dytc.router import RouterConfig
from dytc.sampling import SamplingParams
from dytc.sources import BOTTOMS

from .defaults import BOTTOM, LEVEL, MAX_NEW_TOKENS, METHOD
from .method_table import METHODS, MULTI_LEVEL, parse_sources

Prompt = str | Sequence[dict]  # raw text or chat messages [{"role": ..., "content": ...}]


@dataclass(frozen=True)
class Request:
    max_new_tokens: int = MAX_NEW_TOKENS  # hard cap on emitted tokens
    sampling: SamplingParams = SamplingParams()  # greedy by default
    stop: tuple[str, ...] = ()  # stop strings: generation ends once the text contains one (excluded from text)
    seed: int | None = None  # seed of the sampling generator; None = fresh randomness
    method: str = METHOD  # decoding method, one of METHODS
    level: str = LEVEL  # the draft level of the single-level methods (sd, tree)
    levels: tuple[str, ...] = ()  # sources of vc / dytc (level names, strongest first) and of hc / vc+hc
    # (segments "LEVEL*K", "pld*K" or "maxgram*K", in chain order); empty = the method's defaults
    bottom: str = BOTTOM  # lookups beneath the levels of vc, tree+vc, vc+hc, dytc (dytc.sources.BOTTOMS)
    router: RouterConfig | None = None  # dytc's settings (its levels and lookups come from the request); None = default
    tenant: str = ""  # the client whose memory the recycle and suffix sources draw on and add to (dytc/shared.py):
    # one client's text never drafts for another's

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise CasspecError(f"max_new_tokens must be an integer >= 1 (got {repr(self.max_new_tokens)[:40]})")
        if self.method not in METHODS:
            raise CasspecError(f"unknown method {self.method!r}: use one of {', '.join(METHODS)}")
        LevelConfig.parse(self.level)  # a clear error for a bad level name, before any work
        if self.levels:
            if self.method not in MULTI_LEVEL:
                raise CasspecError(f"levels are for {', '.join(MULTI_LEVEL)}; {self.method} takes one level")
            parse_sources(self.method, self.levels)
        if self.bottom not in BOTTOMS:
            raise CasspecError(f"unknown bottom {self.bottom!r}: use one of {', '.join(BOTTOMS)}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**64):
            raise CasspecError(f"seed must be an integer in [0, 2**64) (got {repr(self.seed)[:40]})")
        if not isinstance(self.tenant, str):
            raise CasspecError(f"tenant must be a string (got {type(self.tenant).__name__})")
        if any(not s for s in self.stop):
            raise CasspecError("stop strings must not be empty: drop the empty --stop")

    @property
    def lookups(self) -> tuple[str, ...]:
        """The statistical sources beneath the levels."""
        return BOTTOMS[self.bottom]
