"""What the zero-cost sources remember across generations, per client, and the one factory of every lookup.

A `Memory` belongs to one client (`Request.tenant`: `casspec serve` names one per API key and OpenAI `user`): the
target's recycled candidates (dytc/recycle.py) and the suffix tree of its generations (dytc/suffix.py: each
generation's prompt and output a sequence of it, the earlier ones kept up to a node budget). One client's text never
drafts for another's. `SharedDrafts` (owned by the engine) keeps one Memory per client, the most recently used
`MAX_CLIENTS`, and drops the oldest past that.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Collection, Sequence


from .ngram import LOOKUP_CLASSES, Lookup
from .recycle import Recycled, RecycleLookup
from .sources import RECYCLE, SUFFIX
from .suffix import SuffixConfig, SuffixIndex, SuffixLookup
from .verify import Noise

MAX_CLIENTS = 64  # clients whose memories are kept (the least recently used is dropped past this)
MAX_BYTES = 512 << 20  # the memories' bytes in all, past which the least recently used clients' are dropped (a client
# chooses its OpenAI `user`: without a total, 64 clients' suffix trees could hold 64 x 0.2 GB)


@dataclass
class Memory:
    """One client's recycled candidates (at most a row per vocabulary token) and suffix tree."""
    suffix: SuffixConfig = SuffixConfig()  # the suffix tree's shape, its node budget, its drafts' cut
    recycled: dict[str, Recycled] = field(default_factory=dict)  # "greedy" | "sampling" -> table (a sampled row's
    # log-probabilities are the target's own, but kept apart so that a mode's drafts learn from its own steps)
    suffixes: SuffixIndex | None = None

    def table(self, greedy: bool) -> Recycled:
        mode = "greedy" if greedy else "sampling"
        if mode not in self.recycled:
            self.recycled[mode] = Recycled()
        return self.recycled[mode]

    def suffix_index(self) -> SuffixIndex:
        if self.suffixes is None:
            self.suffixes = SuffixIndex(self.suffix.depth, self.suffix.max_nodes)
        return self.suffixes

    def nbytes(self) -> int:
        """About what it holds (its tables' rows and its tree's objects)."""
        return sum(t.nbytes for t in self.recycled.values()) + (self.suffixes.nbytes() if self.suffixes else 0)


@dataclass
class SharedDrafts:
    """Every client's Memory: the most recently used, at most max_clients of them and max_bytes in all (checked as a
    generation starts; the asking client's is kept)."""
    suffix: SuffixConfig = SuffixConfig()  # every client's suffix tree's
    max_clients: int = MAX_CLIENTS
    max_bytes: int = MAX_BYTES
    clients: OrderedDict[str, Memory] = field(default_factory=OrderedDict)

    def memory(self, tenant: str) -> Memory:
        mem = self.clients.get(tenant)
        if mem is None:
            mem = self.clients[tenant] = Memory(self.suffix)
        self.clients.move_to_end(tenant)
        total = self.nbytes()
        while len(self.clients) > 1 and (len(self.clients) > self.max_clients or total > self.max_bytes):
            total -= self.clients.popitem(last=False)[1].nbytes()
        return mem

    def nbytes(self) -> int:
        return sum(m.nbytes() for m in self.clients.values())

    def forget(self, tenant: str | None = None) -> None:
        """Drop one client's memory (None: every client's)."""
        if tenant is None:
            self.clients.clear()
        else:
            self.clients.pop(tenant, None)


def new_lookup(name: str, tokens: Sequence[int], eos_ids: Collection[int], memory: Memory | None = None,
               noise: Noise | None = None, temperature: float = 1.0) -> Lookup:
    """A lookup by source name over an initial history; recycle and suffix draw on the client's memory (without
    one, on the generation's own steps and text alone). noise: sampling (coupled recycled drafts)."""
    if name == RECYCLE:  # (without a memory: a table of this generation's own verifications)
        table = memory.table(noise is None) if memory is not None else Recycled()
        return RecycleLookup(tokens, table, eos_ids, noise, temperature)
    if name == SUFFIX:
        if memory is None:
            return SuffixLookup(tokens, None, eos_ids)
        return SuffixLookup(tokens, memory.suffix_index(), eos_ids, memory.suffix)
    return LOOKUP_CLASSES[name](tokens, eos_ids=eos_ids)

