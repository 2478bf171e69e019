"""CUDA graphs of small forwards: one captured graph per (plan, token bucket), replayed over static buffers.

On a GPU a small model's forward costs its kernel launches (hundreds per forward) far more than its arithmetic,
and a forward over 1 or 64 tokens costs about the same. A CUDA graph replays all of a forward's kernels in one
launch. A forward of T tokens runs the graph of the smallest bucket B >= T: the T real rows write their K/V to
their slots and attend to the committed prefix plus the scratch slots their mask allows; the B - T padding rows
write to the cache's spare slots and attend to themselves alone, so they touch nothing a real row reads. Every
slot of the cache is visible to the graph's attention (through its mask), so nothing in it depends on the
context length: the same graph serves every step.

Graphs are keyed by what a plan does (its skipped sublayers, exit and kernels), not by the Plan object, so a plan
rebuilt with the same content (a skip set being searched) replays the same graph. A (plan, bucket) is captured at
its CAPTURE_AFTER-th use and at most MAX_GRAPHS are held; beyond that, forwards run eagerly. A forward that
captured is no sample of its cost (`Transformer.graph_captures`): the latency model does not learn from it. Plans
whose kernels read Python state that changes between calls (the reduced-vocabulary head grows its subset; sparse
MLPs calibrate thresholds per prompt) are not captured at all. Without CUDA (the tests) the body runs eagerly over
the same static buffers, which checks everything but the capture itself.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .kvcache import KVCache
from .model import Transformer
from .plan import Plan

GRAPH_TOKENS = (1, 2, 4, 8, 16, 32, 64)  # token counts graphs are captured for; a longer forward (prefill) runs eagerly
CAPTURE_AFTER = 1  # a (plan, bucket) is captured at its first use (an eager first run costs ~10x a replay)
MAX_GRAPHS = 48  # graphs held at most (each keeps its static buffers; intermediates share one pool)


def capturable(plan: Plan) -> bool:
    """Whether a graph of the plan stays right: its kernels read no Python state that changes between calls."""
    return plan.head is None and not plan.mlps


def plan_key(plan: Plan) -> Hashable:
    """What a (capturable) plan runs: plans with equal keys run the same kernels on the same sublayers."""
    def ids(kernels: dict) -> frozenset:
        return frozenset((k, id(f)) for k, f in kernels.items())
    return plan.skip_attn, plan.skip_mlp, plan.exit_after, ids(dict(plan.linears)), ids(dict(plan.fused))


@dataclass
class Captured:
    """One (plan, bucket): the static inputs a replay reads, the static logits it writes, and its graph."""
    body: Callable[[], Tensor]  # the forward over the static buffers
    tokens: Tensor  # [B] long
    positions: Tensor  # [B] long
    slots: Tensor  # [B] long, the cache slots written
    mask: Tensor  # [B, capacity + spare] bool
    graph: torch.cuda.CUDAGraph | None = None  # None: `replay` runs the body eagerly (no CUDA)
    logits: Tensor | None = None  # [B, V] float32, written by each replay

    def replay(self) -> Tensor:
        if self.graph is None:
            self.logits = self.body()
        else:
            self.graph.replay()
        return self.logits


@dataclass
class GraphStats:
    captures: int = 0  # graphs captured
    replays: int = 0  # forwards run from a graph
    eager: int = 0  # forwards on the engine's cache that ran eagerly (too long, not capturable, not yet captured)
    failed: int = 0  # captures that failed (those (plan, bucket)s then run eagerly)

    def __str__(self) -> str:
        return (f"{self.captures} CUDA graphs captured, {self.replays} forwards replayed, {self.eager} eager"
                + (f", {self.failed} captures failed" if self.failed else ""))


class Graphs:
    """The CUDA graphs of one model over one KV cache (with spare slots >= the largest bucket)."""

    def __init__(self, model: Transformer, cache: KVCache, buckets: tuple[int, ...] = GRAPH_TOKENS,
                 capture_after: int = CAPTURE_AFTER) -> None:
        assert cache.spare >= buckets[-1], "the cache needs a spare slot per padding row"
        self.model = model.with_graphs(None)  # the eager forward the graphs capture
        self.cache = cache
        self.buckets = buckets
        self.capture_after = capture_after
        self.cuda = cache.k.is_cuda
        self.pool = None  # one memory pool shared by every graph (they never run concurrently)
        self.uses: dict[tuple[Hashable, int], int] = {}  # (plan key, bucket) -> forwards seen
        self.captured: dict[tuple[Hashable, int], Captured] = {}  # (plan key, bucket) -> its graph (holds the plan)
        self.failed: set[tuple[Hashable, int]] = set()  # captures that failed: those run eagerly
        self.stats = GraphStats()
        dev = cache.k.device
        self.pad_slots = torch.arange(cache.capacity, cache.capacity + buckets[-1], device=dev)  # [maxB]
        self.pad_mask = torch.eye(buckets[-1], dtype=torch.bool, device=dev)  # [maxB, maxB] padding sees itself
        cache.zero_all()  # every slot enters the graphs' attention (masked), so every slot must be finite

    def run(self, cache: KVCache, tokens: Tensor, positions: Tensor, start: int, scratch_mask: Tensor | None,
            plan: Plan, logits_rows: Tensor | slice | None) -> Tensor | None:
        """Logits [N, V] from a graph (arguments as Transformer.forward), or None where the forward must run
        eagerly: another cache, more tokens than the largest bucket, a plan not capturable or not yet captured."""
        if cache is not self.cache:
            return None
        T = tokens.shape[0]
        B = next((b for b in self.buckets if b >= T), None)
        if B is None or not capturable(plan):
            self.stats.eager += 1
            return None
        key = (plan_key(plan), B)
        entry = self.captured.get(key)
        if entry is None:
            self.uses[key] = self.uses.get(key, 0) + 1
            if (key in self.failed or self.uses[key] < self.capture_after
                    or len(self.captured) >= MAX_GRAPHS):
                self.stats.eager += 1
                return None
            entry = self._capture(plan, B)
            if entry is None:
                self.failed.add(key)
                self.stats.eager += 1
                return None
            self.captured[key] = entry
        self._fill(entry, tokens, positions, start, scratch_mask)
        rows = entry.replay()[:T]  # [T, V]
        self.stats.replays += 1
        return (rows if logits_rows is None else rows[logits_rows]).clone()  # the next replay overwrites rows

    def _fill(self, e: Captured, tokens: Tensor, positions: Tensor, start: int, scratch_mask: Tensor | None) -> None:
        """Write one forward's inputs into the static buffers (padding rows after the T real ones)."""
        cache = self.cache
        B, T, length = e.tokens.shape[0], tokens.shape[0], cache.length
        e.tokens[:T] = tokens
        e.positions[:T] = positions
        e.slots[:T] = torch.arange(start, start + T, device=e.slots.device)
        e.mask[:T] = False
        e.mask[:T, :length] = True  # the committed prefix
        if scratch_mask is None:  # causal over the scratch slots
            e.mask[:T, length:start + T] = torch.ones(T, start + T - length, dtype=torch.bool,
                                                      device=e.mask.device).tril(diagonal=start - length)
        else:
            e.mask[:T, length:start + T] = scratch_mask
        e.tokens[T:] = 0
        e.positions[T:] = 0
        e.slots[T:] = self.pad_slots[:B - T]
        e.mask[T:] = False
        e.mask[T:, cache.capacity:cache.capacity + B - T] = self.pad_mask[:B - T, :B - T]

    def _capture(self, plan: Plan, B: int) -> Captured | None:
        """A graph of the plan's forward over B rows (None if capture fails). The buffers start as all padding,
        so the warm-up run before capture writes spare slots only."""
        cache, dev = self.cache, self.cache.k.device
        e = Captured(body=lambda: None, tokens=torch.zeros(B, dtype=torch.long, device=dev),
                     positions=torch.zeros(B, dtype=torch.long, device=dev), slots=self.pad_slots[:B].clone(),
                     mask=torch.zeros(B, cache.capacity + cache.spare, dtype=torch.bool, device=dev))
        e.mask[:, cache.capacity:cache.capacity + B] = self.pad_mask[:B, :B]
        e.body = lambda: self.model.forward_slots(cache, e.tokens, e.positions, e.slots, e.mask, plan)
        if self.cuda:
            try:
                side = torch.cuda.Stream(device=dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    e.body()  # warm-up: lazy initialisation (cuBLAS workspaces) must not happen during capture
                torch.cuda.current_stream(dev).wait_stream(side)
                e.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(e.graph, pool=self.pool):
                    e.logits = e.body()
                self.pool = e.graph.pool()
            except RuntimeError:  # a kernel that cannot be captured (a host sync): this (plan, bucket) stays eager
                torch.cuda.synchronize(dev)
                self.stats.failed += 1
                return None
        self.stats.captures += 1
        return e
