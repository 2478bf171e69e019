"""Continuous batching: several generations on one engine, each on its own KV cache, stepping together. Each step
every running generation drafts (its own policy, sources and cache slots), ONE target forward verifies all their
trees (step.verify_batch: each sequence's rows over its own cache, the products shared), each accepts its path and
updates; generations join (their prompt's forward alone) and leave between steps. Each generation's tokens are the
ones it gets alone: the batched forward gives every row the bits of its forward alone where the target's kernels
are row-invariant (casspec's own products and attention: a native target, or --kernels casspec), and the float32
library products' last-bit differences elsewhere, as between a tree verification and a one-token step.

Speculation sized to the load: before drafting, each generation is told what the rest of the step holds (`Load`:
the other generations' rows, expected tokens and drafting time, from their last step); dytc then weighs its drafts
against the whole batch's throughput (dytc/router.py), down to the root alone when a batch is wide enough that
drafts no longer pay.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from dsia.gcpause import paused_gc
from dytc.policies import Load

from .live import CacheSlot, Live
from .prefixes import PrefixStore
from .request import Request
from .stats import Result
from .step import Decoding, verify_batch

if TYPE_CHECKING:
    from .engine import Engine


class LastStep(NamedTuple):
    """A generation's last step, which the next one tells the others (`Load`)."""
    rows: int = 1  # rows it verified
    tokens: float = 1.0  # tokens it emitted
    draft_ms: float = 0.0  # its drafting time


@dataclass(eq=False)
class Running:
    """A generation of the batch."""
    live: Live  # its text side
    dec: Decoding  # its decode loop
    slot: CacheSlot  # the KV cache it runs on
    owner: object = None  # the caller's handle (casspec serve: its job)
    last: LastStep = LastStep()  # its last step

    @property
    def done(self) -> bool:
        """Ended: EOS, a stop string, its budget, its cancel, or the window full."""
        return self.live.finished or self.live.cancelled() or not self.dec.has_room


@dataclass
class BatchStats:
    """What the batch did (casspec serve's /metrics: casspec:batch_*_total)."""
    steps: int = 0  # batched steps (one target forward each)
    sequences: int = 0  # generations over all steps (the batch width, summed)
    rows: int = 0  # rows verified over all steps
    drafted: int = 0  # draft tokens verified over all steps
    root_only: int = 0  # generations' steps that verified the root alone
    prefix_hits: int = 0  # prompts that took kept KV (Batch.prefixes)
    prefix_tokens: int = 0  # the prompt tokens whose forward that saved


@dataclass
class Batch:
    """Up to `max_batch` generations of one engine at once (the caller drives it from one thread: `join`, `step`,
    `leave`)."""
    engine: Engine
    max_batch: int  # most generations at once
    running: list[Running] = field(default_factory=list)
    # every cache made, on first need (not the engine's own: a generation another thread runs through the engine's
    # API between two steps uses that one)
    slots: list[CacheSlot] = field(default_factory=list)
    free: list[CacheSlot] = field(default_factory=list)  # those no generation runs on
    stats: BatchStats = field(default_factory=BatchStats)
    prefixes: PrefixStore | None = None  # finished generations' KV, which a later prompt of the same client that
    # starts with their tokens copies in place of computing it (None: only what a free cache still holds is reused)

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (got {self.max_batch})")

    @property
    def full(self) -> bool:
        return len(self.running) >= self.max_batch

    @torch.inference_mode()
    def join(self, prompt_ids: list[int], req: Request, cancel: threading.Event | None = None,
             owner: object = None) -> tuple[Running, str]:
        """Start a generation (its prompt's forward alone, on the free cache that holds most of its prompt, a new
        cache where none is free; a kept prefix of the client's copied in where it holds more); it steps with the
        others from the next `step`. Returns it and its first text."""
        assert not self.full, "the batch is full"
        if not self.free:
            self.free.append(CacheSlot(self.engine.model.new_cache(self.engine.cache.capacity)))
            self.slots.append(self.free[-1])
        slot = max(self.free, key=lambda s: s.reusable(prompt_ids) if s.tenant == req.tenant else 0)
        if slot.tenant != req.tenant:  # (another client's tokens: not reused, nor their time saved seen)
            slot.forget()
        if self.prefixes is not None and self.engine.reuse_prefix:
            n, kept = self.prefixes.longest(req.tenant, prompt_ids)
            if kept is not None and n > slot.reusable(prompt_ids):
                self.prefixes.restore(req.tenant, kept, n, slot)
                self.stats.prefix_hits += 1
                self.stats.prefix_tokens += n
        with self.engine.hold(), paused_gc():
            live, dec = self.engine.open(prompt_ids, req, slot, cancel)
            self.free.remove(slot)
            run = Running(live, dec, slot, owner)
            self.running.append(run)
            return run, live.feed(dec.begin())

    @torch.inference_mode()
    def step(self) -> list[tuple[Running, str]]:
        """One step of every running generation that is not done: each drafts (told the others' load), one target
        forward verifies every tree, each accepts; (generation, the text its tokens settle) for each."""
        runs = [r for r in self.running if not r.done]
        if not runs:
            return []
        with self.engine.hold(), paused_gc():
            total = LastStep(*(sum(column) for column in zip(*(r.last for r in runs))))
            trees = []
            for r in runs:  # draft
                r.dec.ctx.load = Load(total.rows - r.last.rows, total.tokens - r.last.tokens,
                                      total.draft_ms - r.last.draft_ms) if len(runs) > 1 else None
                ms0 = r.dec.stats.draft_seconds
                trees.append((r.dec, r.dec.draft()))
                r.last = r.last._replace(draft_ms=(r.dec.stats.draft_seconds - ms0) * 1e3)
            logits = verify_batch(self.engine.model, self.engine.latency, trees)  # verify: one forward
            out = []
            for r, (dec, tree), lg in zip(runs, trees, logits):
                emitted = dec.accept(tree, lg)  # accept, update
                r.last = r.last._replace(rows=len(tree), tokens=float(len(emitted)))
                out.append((r, r.live.feed(emitted)))
            self._count(trees)
        return out

    def leave(self, run: Running) -> tuple[Result, str]:
        """End a generation (done or given up): its Result and the text it held back; its cache is free again,
        holding its tokens for a prompt that starts with them."""
        self.running.remove(run)
        run.slot.keep(run.dec.ctx.history)
        run.slot.tenant = run.dec.req.tenant
        if self.prefixes is not None and self.engine.reuse_prefix:  # (kept only where a prompt may take them)
            self.prefixes.keep(run.dec.req.tenant, run.slot.left, run.slot.cache)
        self.free.append(run.slot)
        run.dec.finish()
        with self.engine.hold():
            return self.engine.close(run.live)

    def drop(self, run: Running) -> None:
        """Give a generation up without its Result (a step failed under it): its cache is free again, what it holds
        forgotten."""
        self.running.remove(run)
        run.slot.forget()
        self.free.append(run.slot)

    def _count(self, trees: list) -> None:
        s = self.stats
        s.steps += 1
        s.sequences += len(trees)
        s.rows += sum(len(t) for _, t in trees)
        s.drafted += sum(len(t) - 1 for _, t in trees)
        s.root_only += sum(len(t) == 1 for _, t in trees)
