"""Prompt prefixes kept across generations, as vLLM's automatic prefix caching and llama-server's prompt cache keep
them: the committed KV of each finished generation's tokens (its prompt and output), copied to host memory, the least
recently used dropped past a byte budget. A new prompt that starts with kept tokens of the same client copies their KV
into its cache in place of their forward. They are the bits the engine computed for those tokens at those positions,
so reusing them is reusing a cache slot that still holds them (`CacheSlot.reusable`), wherever the prompt's cache
now lies. Entries are per client (`Request.tenant`): another client's prompt never finds them (nor, by its time to
first token, learns that they exist).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from dsia.errors import CasspecError
from dsia.kvcache import KVCache

from .live import CacheSlot, reusable_prefix


@dataclass(frozen=True)
class Kept:
    """One generation's committed tokens and their KV."""
    tokens: tuple[int, ...]
    k: Tensor  # [layers, kv_heads, len(tokens), head_dim]
    v: Tensor  # the same

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def check_megabytes(mb: object) -> None:
    """A prefix store's size in MB (--prefix-cache-mb): an integer >= 0 (0: none), one clear error otherwise."""
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
        raise CasspecError(f"the prefix cache size must be an integer number of MB >= 0 (got {mb!r}); 0 turns it off")


class PrefixStore:
    """Kept prefixes per client, at most `max_bytes` of KV in all (least recently used dropped first)."""

    def __init__(self, max_bytes: int) -> None:
        assert max_bytes >= 0, max_bytes
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[str, tuple[int, ...]], Kept] = OrderedDict()  # least recently used first
        self.nbytes = 0

    def longest(self, tenant: str, prompt_ids: Sequence[int]) -> tuple[int, Kept | None]:
        """The client's entry sharing most leading tokens with the prompt, and how many (at most all but the prompt's
        last token: its logits give the first new one)."""
        best, found = 0, None
        for (owner, _), kept in self.entries.items():
            n = reusable_prefix(kept.tokens, prompt_ids) if owner == tenant else 0
            if n > best:
                best, found = n, kept
        return best, found

    def restore(self, tenant: str, kept: Kept, n: int, slot: CacheSlot) -> None:
        """Put kept's first n tokens' KV into the slot's cache as its committed prefix (the slot then holds them)."""
        slot.cache.load(kept.k[:, :, :n], kept.v[:, :, :n])
        slot.keep(kept.tokens[:n])
        self.entries.move_to_end((tenant, kept.tokens))

    def keep(self, tenant: str, tokens: Sequence[int], cache: KVCache) -> None:
        """Keep the committed KV of `tokens` (cache's first len(tokens) slots); an entry they extend is replaced, one
        that holds them already is only marked used."""
        tokens = tuple(tokens)
        n = len(tokens)
        if n == 0 or self.max_bytes == 0:
            return
        for owner, held in list(self.entries):
            if owner != tenant:
                continue
            if len(held) >= n and held[:n] == tokens:
                self.entries.move_to_end((owner, held))
                return
            if held == tokens[:len(held)]:
                self._drop((owner, held))
        kept = Kept(tokens, cache.k[:, :, :n].clone(), cache.v[:, :, :n].clone())
        if kept.nbytes > self.max_bytes:
            return
        self.entries[(tenant, tokens)] = kept
        self.nbytes += kept.nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: tuple[str, tuple[int, ...]]) -> None:
        self.nbytes -= self.entries.pop(key).nbytes
