"""A generation in progress, outside its decode loop: its text side (`Live`: committed tokens cut at EOS, a stop
string, the token budget or a cancel; text pieces as they settle; its Result) and the KV cache it decodes on
(`CacheSlot`: what the last generation left there, for the next prompt that starts with it to reuse)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from dsia.kvcache import KVCache

from .detok import Decode, TextStream
from .request import Request
from .stats import Result, Stats


def reusable_prefix(held: Sequence[int], prompt_ids: Sequence[int]) -> int:
    """How many leading prompt tokens `held` (tokens whose KV is at hand) covers, at most all but the prompt's last:
    its forward gives the first new token's logits."""
    n = min(len(held), len(prompt_ids) - 1)
    return next((i for i in range(n) if held[i] != prompt_ids[i]), max(n, 0))


@dataclass
class CacheSlot:
    """A KV cache and the tokens its committed prefix holds from the generation that used it last."""
    cache: KVCache
    left: list[int] = field(default_factory=list)  # the tokens the last generation left committed
    changes: int = -1  # cache.changes then (anything since, e.g. a measurement, voids them)
    tenant: str = ""  # the client whose generation left them (a batch reuses them for that client's prompts alone)

    def reusable(self, prompt_ids: Sequence[int]) -> int:
        """How many leading prompt tokens the cache still holds (at most all but the last: its logits give the
        first token); 0 when anything changed the cache since."""
        return reusable_prefix(self.left, prompt_ids) if self.changes == self.cache.changes else 0

    def keep(self, history: Sequence[int]) -> None:
        """Note what a generation with this history leaves committed."""
        self.left, self.changes = list(history[:self.cache.length]), self.cache.changes

    def forget(self) -> None:
        self.left, self.changes = [], -1


class Live:
    """One generation's text side: `feed` each block of tokens its steps commit (the pieces of text they settle
    come back), until `finished`; then `close` gives its Result and the text still held back."""

    def __init__(self, req: Request, stats: Stats, decode: Decode, eos_ids: frozenset[int],
                 cancel: threading.Event | None, started: float) -> None:
        self.req, self.stats, self.eos_ids, self.cancel = req, stats, eos_ids, cancel
        self.started = started  # perf_counter() when it was asked for (its first token's time counts from there)
        self.out: list[int] = []  # the tokens emitted
        self.text = TextStream(decode, req.stop)
        self.t0 = time.perf_counter()  # when its decoding began

    @property
    def finished(self) -> bool:
        return bool(self.stats.finish_reason)

    def feed(self, block: list[int]) -> str:
        """Take a block of committed tokens, each looked at for EOS, a stop string and the budget; the text they
        settle ("" where the generation ended in this block: `close` gives the rest)."""
        stats, out = self.stats, self.out
        if not out:
            stats.first_token_seconds = time.perf_counter() - self.started
        for tok in block:
            out.append(tok)
            if tok in self.eos_ids:
                stats.finish_reason = "eos"
            elif self.req.stop and self.text.update(out):  # each token's text, looked at for a stop string
                stats.finish_reason = "stop"
            elif len(out) >= self.req.max_new_tokens:
                stats.finish_reason = "length"
            if stats.finish_reason:
                return ""
        self.text.update(out)
        return self.text.ready()

    def cancelled(self) -> bool:
        """Whether its cancel is set (checked between steps, after a block's text went out: the next step does not
        start; finish_reason "cancelled")."""
        if not self.finished and self.cancel is not None and self.cancel.is_set():
            self.stats.finish_reason = "cancelled"
        return self.stats.finish_reason == "cancelled"

    def close(self, kernels: str | None = None) -> tuple[Result, str]:
        """Its Result and the text not given yet (a stop string cut off). kernels: what ran its forwards, where the
        engine adds to it at the end (its CUDA graphs' counts)."""
        stats = self.stats
        last = self.text.finish(self.out)
        stats.new_tokens = len(self.out)
        stats.seconds = time.perf_counter() - self.t0
        if kernels is not None:
            stats.kernels = kernels
        if not stats.finish_reason:
            stats.finish_reason = "context"
        return Result(text=self.text.text, token_ids=self.out, stats=stats), last
