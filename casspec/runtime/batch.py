"""Continuous batching: several generations on one engine, each on its own KV cache, stepping together. Each step
every running generation drafts (its own policy, sources and cache slots), ONE target forward verifies all their
trees (step.verify_batch: each sequence's rows over its own cache, the products shared), each accepts its path and
updates; generations join between steps (their prompt's forward alone, or, where others are running and the prompt
is longer than `prefill_chunk`, a chunk of it in each step's forward: the others go on meanwhile) and leave between
steps. Each generation's tokens are the ones it gets alone: the batched forward gives every row the bits of its
forward alone where the target's kernels are row-invariant (casspec's own products and attention: a native target,
or --kernels casspec; only there does a prompt run in chunks), and the float32 library products' last-bit
differences elsewhere, as between a tree verification and a one-token step.

Speculation sized to the load: before drafting, each generation is told what the rest of the step holds (`Load`:
the other generations' rows, expected tokens and drafting time, from their last step); dytc then weighs its drafts
against the whole batch's throughput (dytc/router.py), down to the root alone when a batch is wide enough that
drafts no longer pay.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from dsia.gcpause import paused_gc
from dsia.model import BatchItem
from dytc.batchcost import BatchCost, SpeculationSwitch
from dytc.policies import Load

from .live import CacheSlot, Live
from .prefixes import PrefixStore
from .request import Request
from .stats import Result
from .step import Decoding, Prefilled, verify_batch

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


@dataclass(eq=False)
class Joining:
    """A generation whose prompt's forward runs a chunk a step, beside the running generations' steps."""
    prompt_ids: list[int]
    req: Request
    slot: CacheSlot  # its cache: the prompt's KV up to its committed length so far
    cancel: threading.Event | None
    owner: object  # the caller's handle
    started: float  # perf_counter() at its join (its first token's latency counts from there)
    reused: int  # prompt tokens its cache held at the join
    seconds: float = 0.0  # wall time of the forwards its chunks rode in


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
    prompt_chunks: int = 0  # chunks of joining prompts run in the steps' forwards
    undrafted: int = 0  # batched steps that drafted nothing (SpeculationSwitch: their goodput measured the better)


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
    prefill_chunk: int = 0  # a prompt joining running generations runs this many tokens a step in their forwards
    # (where its rows' bits do not depend on the split: Transformer.rows_split_alike); 0: its whole forward at the
    # join, the others waiting
    joining: list[Joining] = field(default_factory=list)  # generations whose prompt is running in chunks
    given_up: list[object] = field(default_factory=list)  # owners of joining generations cancelled before their
    # first token (their callers are told by whoever drives the batch: `take_given_up`)
    cost: BatchCost = field(default_factory=BatchCost)  # its steps' wall time by generations and drafted nodes,
    # which the generations' drafts are weighed against (dytc/batchcost.py)
    switch: SpeculationSwitch = field(default_factory=SpeculationSwitch)  # whether a step drafts at all, by the
    # goodput its steps measured with and without drafts at that width

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (got {self.max_batch})")

    @property
    def full(self) -> bool:
        return len(self.running) + len(self.joining) >= self.max_batch

    @property
    def busy(self) -> bool:
        """Whether a generation is running or joining (a `step` has work)."""
        return bool(self.running or self.joining)

    @torch.inference_mode()
    def join(self, prompt_ids: list[int], req: Request, cancel: threading.Event | None = None,
             owner: object = None) -> tuple[Running, str] | None:
        """Start a generation on the free cache that holds most of its prompt (a new cache where none is free; a
        kept prefix of the client's copied in where it holds more): its prompt's forward alone, then it steps with
        the others from the next `step`: returns it and its first text. Or, where others are running and the rest
        of its prompt is longer than `prefill_chunk` (and its rows' bits do not depend on the split), its prompt
        runs a chunk a step in their forwards: None, and the step that runs its last chunk returns it with its
        first text."""
        assert not self.full, "the batch is full"
        slot = self._slot(prompt_ids, req)
        reused = slot.reusable(prompt_ids) if self.engine.reuse_prefix else 0
        if self.busy and 0 < self.prefill_chunk < len(prompt_ids) - reused and self.engine.model.rows_split_alike():
            slot.cache.rollback(reused)
            self.free.remove(slot)
            self.joining.append(Joining(prompt_ids, req, slot, cancel, owner, time.perf_counter(), reused))
            return None
        with self.engine.hold(), paused_gc():
            live, dec = self.engine.open(prompt_ids, req, slot, cancel)
            self.free.remove(slot)  # (after the open: where it fails, the cache stays free)
            return self._start(slot, live, dec, owner)

    def _slot(self, prompt_ids: list[int], req: Request) -> CacheSlot:
        """The free cache that holds most of the prompt (a new one where none is free), a kept prefix of the
        client's copied in where it holds more."""
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
        return slot

    def _start(self, slot: CacheSlot, live: Live, dec: Decoding, owner: object) -> tuple[Running, str]:
        """A generation whose prompt's forward ran (its cache off the free list) joins the running ones: it and its
        first text."""
        run = Running(live, dec, slot, owner)
        self.running.append(run)
        return run, live.feed(dec.begin())

    @torch.inference_mode()
    def step(self) -> list[tuple[Running, str]]:
        """One step of every running generation that is not done: each drafts (told the others' load), one target
        forward verifies every tree (the joining prompts' next chunks riding in it), each accepts; (generation, the
        text its tokens settle) for each, and for each generation whose prompt's last chunk ran (its first text)."""
        runs = [r for r in self.running if not r.done]
        for j in [j for j in self.joining if j.cancel is not None and j.cancel.is_set()]:
            self.drop(j)
            self.given_up.append(j.owner)
        if not runs and not self.joining:
            return []
        with self.engine.hold(), paused_gc():
            started, levels_s = time.perf_counter(), sum(r.dec.stats.draft_forward_seconds for r in runs)
            total = LastStep(*(sum(column) for column in zip(*(r.last for r in runs))))
            drafts = self.switch.drafts(len(runs)) if len(runs) > 1 else True
            trees = []
            for r in runs:  # draft
                r.dec.ctx.load = Load(total.rows - r.last.rows, total.tokens - r.last.tokens,
                                      total.draft_ms - r.last.draft_ms, len(runs) - 1, self.cost,
                                      drafts) if len(runs) > 1 else None
                ms0 = r.dec.stats.draft_seconds
                trees.append((r.dec, r.dec.draft()))
                r.last = r.last._replace(draft_ms=(r.dec.stats.draft_seconds - ms0) * 1e3)
            chunks = self._chunks()  # the joining prompts' next chunks ride in the forward
            t0 = time.perf_counter()
            logits = verify_batch(self.engine.model, self.engine.latency, trees, [c for _, c in chunks])  # verify
            seconds = time.perf_counter() - t0
            out = []
            for r, (dec, tree), lg in zip(runs, trees, logits):
                emitted = dec.accept(tree, lg)  # accept, update
                r.last = r.last._replace(rows=len(tree), tokens=float(len(emitted)))
                out.append((r, r.live.feed(emitted)))
            # (a policy that does not read Load.drafts drafts whatever the switch says: counted where none did)
            self.stats.undrafted += not drafts and all(len(t) == 1 for _, t in trees)
            if len(runs) > 1 and not chunks:  # (a prompt's chunk riding in it: not a step of these alone)
                ms = (time.perf_counter() - started) * 1e3
                self.switch.observe(len(runs), drafts, sum(int(r.last.tokens) for r in runs), ms)
                levels_ms = (sum(r.dec.stats.draft_forward_seconds for r in runs) - levels_s) * 1e3
                self.cost.observe(len(runs), sum(len(t) for _, t in trees), ms - levels_ms)  # (levels: per action)
            out += self._prefilled(chunks, logits[len(trees):], seconds)
            self._count(trees)
        return out

    def _chunks(self) -> list[tuple[Joining, BatchItem]]:
        """The joining prompts' next chunks, first come first, `prefill_chunk` tokens in all: each as its share of
        the step's forward (logits of its last row where it ends its prompt). (Telling the drafts of the step that
        these rows ride in it made them draft as if verifying were dear: 7 prompts joining 8 generations, native,
        12.1-13.5 s against 9.7-9.9 s without chunks.)"""
        dev, left, out = self.engine.model.device, self.prefill_chunk, []
        for j in self.joining:
            a = j.slot.cache.length
            b = min(len(j.prompt_ids), a + left)
            if b == a:
                break
            left -= b - a
            out.append((j, BatchItem(j.slot.cache, torch.tensor(j.prompt_ids[a:b], device=dev),
                                     torch.arange(a, b, device=dev), a, head_rows=int(b == len(j.prompt_ids)))))
        return out

    def _prefilled(self, chunks: list[tuple[Joining, BatchItem]], logits: list[torch.Tensor],
                   seconds: float) -> list[tuple[Running, str]]:
        """Commit the chunks that ran; the generations whose prompt they ended start: each and its first text."""
        out = []
        for (j, item), lg in zip(chunks, logits):
            j.slot.cache.commit(list(range(len(item.tokens))))
            j.seconds += seconds
            self.stats.prompt_chunks += 1
            if item.head_rows:  # (joining until it is open: where opening fails, the caller drops it as joining)
                live, dec = self.engine.open(j.prompt_ids, j.req, j.slot, j.cancel,
                                             prefilled=Prefilled(lg, j.reused, j.seconds, j.started))
                self.joining.remove(j)
                out.append(self._start(j.slot, live, dec, j.owner))
        return out

    def take_given_up(self) -> list[object]:
        """The owners of joining generations given up since the last call (cancelled before their first token)."""
        owners, self.given_up = self.given_up, []
        return owners

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
            return self.engine.close(run.live, busy=self.busy)

    def drop(self, run: Running | Joining) -> None:
        """Give a generation up without its Result (a step failed under it, or it was cancelled while joining): its
        cache is free again, what it holds forgotten."""
        (self.running if isinstance(run, Running) else self.joining).remove(run)
        run.slot.forget()
        self.free.append(run.slot)

    def _count(self, trees: list) -> None:
        s = self.stats
        s.steps += 1
        s.sequences += len(trees)
        s.rows += sum(len(t) for _, t in trees)
        s.drafted += sum(len(t) - 1 for _, t in trees)
        s.root_only += sum(len(t) == 1 for _, t in trees)
