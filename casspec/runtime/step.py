"""One generation's decode loop on one screen: draft -> verify -> accept -> update, a step at a time, until the caller
stops taking blocks or the context window is full (`Decoding.steps`), or one step of several generations at once
(`verify_batch`: continuous batching); and the target's prompt forward (`prefill`).

Invariant: the KV cache holds every committed token except the last one (the tree root); each step runs ONE target
forward over [root, draft nodes...], accepts a path, commits the path's KV and emits the accepted draft tokens plus
the target's own next token (the bonus token), which becomes the next root. The Engine (engine.py) holds the lock,
turns blocks into text, applies stops and keeps what the cache holds for the next prompt.

Sampling runs on the CPU (a few [N, V] rows a step). Deterministic drafts (ar, pld, sd, tree, vc, tree+vc, hc,
vc+hc, dytc) are checked against position-owned Gumbel noise (dytc.verify.verify_coupled): a seed then gives the
same tokens whatever was drafted. Drafts sampled from q (sd-rs) go through recursive rejection sampling.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

import numpy as np
import torch

from dsia.kvcache import KVCache
from dsia.model import BatchItem, Transformer
from dsia.topk import argmax_rows, top_k_logsumexp
from dytc.latency import TARGET_LEVEL, LatencyModel
from dytc.policies import DraftContext, Policy
from dytc.sampling import SamplingParams, coupled_top, warp
from dytc.tree import DraftTree, ancestor_mask, depths, is_chain, position_ids
from dytc.verify import Noise, verify_coupled, verify_greedy, verify_sampling

from .request import Request
from .stats import Stats


@dataclass
class Decoding:
    """One generation's decode loop between its steps: `draft` a tree, the target verifies it (alone,
    `verify_forward`, or with other generations' trees in one batched forward, `verify_batch`), `accept` takes
    the path the target agrees with and updates the cache, the history and the policy."""
    ctx: DraftContext  # the model, this generation's KV cache, its history (last token the root), sampling
    req: Request
    stats: Stats
    policy: Policy
    latency: LatencyModel
    generator: torch.Generator | None  # draws of drafts sampled from q and of their checks (sampling)
    noise: Noise | None  # position-owned noise of the coupled verification (sampling)
    finished: bool = False  # `finish` ran

    def begin(self) -> list[int]:
        """The policy's start over the prompt; the first block: the root (the prefill's token)."""
        with self.stats.timer("draft"):
            self.policy.begin(self.ctx)
        return [self.ctx.history[-1]]

    @property
    def has_room(self) -> bool:
        """Whether the window holds another step (AR's last slot left free)."""
        return self.ctx.cache.length + 1 < self.ctx.cache.capacity

    def draft(self) -> DraftTree:
        with self.stats.timer("draft"):
            return self.policy.draft(self.ctx)

    def accept(self, tree: DraftTree, logits: torch.Tensor) -> list[int]:
        """Accept from the target's logits at every node [N, V]; commit the path's KV; the tokens emitted."""
        cache, stats = self.ctx.cache, self.stats
        with stats.timer("verify"):
            path, bonus = accept(tree, logits, self.req.sampling, self.generator, self.noise, cache.length)
            cache.commit(path)  # update: the accepted path's KV joins the committed prefix
        if self.noise is not None:
            self.noise.forget_before(cache.length + 1)  # (positions up to the next root's are drawn)
            stats.noise_seconds = self.noise.seconds
        emitted = [tree.tokens[i] for i in path[1:]] + [bonus]
        self.ctx.commit(emitted)
        with stats.timer("draft"):
            if k := self.policy.target_top_k:  # the target's candidates after each accepted node (the rows whose
                # context is the text's own), for the policy to keep
                values, top, lse = top_k_logsumexp(logits[path].float(), k)  # [P, k], [P, k], [P]
                self.ctx.target_top = ([tree.tokens[i] for i in path], top.tolist(), (values - lse[:, None]).tolist())
            self.policy.observe(self.ctx, tree, path, emitted)
        stats.record_step(len(tree) - 1, len(path) - 1, self.ctx.draft_forwards, self.ctx.draft_ms,
                          self.policy.report())
        return emitted

    def finish(self) -> None:
        """The generation ended: the policy keeps what later generations draw on (once)."""
        if not self.finished:
            self.finished = True
            with self.stats.timer("draft"):
                self.policy.finish(self.ctx)

    @torch.inference_mode()
    def steps(self) -> Iterator[list[int]]:
        """Yield the root, then each step's emitted tokens, while the caller takes them and the window has room."""
        yield self.begin()
        while self.has_room:
            tree = self.draft()  # draft
            with self.stats.timer("verify"):  # verify: one target forward over the tree
                self.stats.predicted_verify_seconds += predicted_verify_ms(self.latency, self.ctx.cache, tree) / 1e3
                logits = verify_forward(self.ctx.model, self.ctx.cache, self.latency, tree)
            yield self.accept(tree, logits)  # accept, update


def verify_batch(model: Transformer, latency: LatencyModel, batch: Sequence[tuple[Decoding, DraftTree]],
                 prompts: Sequence[BatchItem] = ()) -> list[torch.Tensor]:
    """One target forward over several generations' trees (each on its own cache: continuous batching) and the
    chunks of prompts joining them (their rows' logits as each one's head_rows says); each one's logits [N_i, V],
    the prompts' after the trees'. The latency model learns the forward's time by its rows in all (at the mean
    committed length) where no prompt rode in it."""
    if len(batch) == 1 and not prompts:  # (one generation: its forward alone, as without batching)
        d, tree = batch[0]
        with d.stats.timer("verify"):
            return [verify_forward(model, d.ctx.cache, latency, tree)]
    items = [tree_forward(model, d.ctx.cache, t) for d, t in batch] + list(prompts)
    t0 = time.perf_counter()
    logits = model.forward_batch(items)
    if logits[0].is_cuda:
        torch.cuda.synchronize(model.device)
    ms = (time.perf_counter() - t0) * 1e3
    if batch and not prompts:
        rows = sum(len(t) for _, t in batch)
        context = round(sum(d.ctx.cache.length for d, _ in batch) / len(batch))
        latency.observe(TARGET_LEVEL, rows, context, ms, any(it.scratch_mask is not None for it in items))
    for d, _ in batch:
        d.stats.verify_seconds += ms / 1e3  # (each generation waited for the whole forward)
    return logits


class Prefilled(NamedTuple):
    """A prompt's forward run already (a chunk a step, beside other generations' steps: runtime/batch.py), its KV
    committed in the cache."""
    logits: torch.Tensor  # [1, V] after its last token
    reused: int  # prompt tokens whose KV the cache held before
    seconds: float  # wall time of the forwards its chunks rode in
    started: float  # perf_counter() when it was asked for (its first token's latency counts from there)


@torch.inference_mode()
def prefill(model: Transformer, cache: KVCache, ids: Sequence[int]) -> torch.Tensor:
    """Commit the target's KV for ids[cache.length:] (ids must start with the committed tokens) in one forward;
    returns the logits of the last token [1, V]."""
    dev, start, n = model.device, cache.length, len(ids)
    logits = model.forward(cache, torch.tensor(ids[start:], device=dev), torch.arange(start, n, device=dev), start,
                           logits_rows=slice(n - 1 - start, n - start))
    cache.commit(list(range(n - start)))
    return logits


def verify_forward(model: Transformer, cache: KVCache, latency: LatencyModel, tree: DraftTree) -> torch.Tensor:
    """One target forward over the flattened tree, written to scratch; the latency model learns its time.
    Returns logits [N, V]."""
    it = tree_forward(model, cache, tree)
    captures, t0 = model.graph_captures, time.perf_counter()
    logits = model.forward(cache, it.tokens, it.positions, it.start, it.scratch_mask)  # [N, V]
    if logits.is_cuda:
        torch.cuda.synchronize(model.device)
    if model.graph_captures == captures:  # (a forward that captured a graph is no sample of its cost)
        latency.observe(TARGET_LEVEL, len(tree), cache.length, (time.perf_counter() - t0) * 1e3,
                        it.scratch_mask is not None)
    return logits


def tree_forward(model: Transformer, cache: KVCache, tree: DraftTree) -> BatchItem:
    """The target forward's inputs for a tree on cache: its tokens at their depths' positions, written to the
    scratch slots from cache.length, each node seeing its ancestors (no mask for a chain)."""
    dev = model.device
    return BatchItem(cache, torch.tensor(tree.tokens, device=dev), position_ids(tree.parents, cache.length, dev),
                     cache.length, None if is_chain(tree.parents) else ancestor_mask(tree.parents, dev))


def predicted_verify_ms(latency: LatencyModel, cache: KVCache, tree: DraftTree) -> float:
    """What the latency model expects the verification of `tree` to take (0 before it knows the target)."""
    if not latency.known(TARGET_LEVEL):
        return 0.0
    return float(latency.predict_mean(TARGET_LEVEL, np.array([len(tree)]), cache.length,
                                      not is_chain(tree.parents))[0])  # (no uncertainty: no solve)


def pick(logits: torch.Tensor, sampling: SamplingParams, noise: Noise | None, position: int) -> int:
    """The target's token after the last row of logits [T, V], at sequence position `position`."""
    if sampling.greedy or noise is None:
        return int(argmax_rows(logits[-1:])[0])
    return int(coupled_top(logits[-1:].cpu(), sampling, noise, [position], 1)[1][0, 0])


def accept(tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None,
           noise: Noise | None, root_position: int) -> tuple[list[int], int]:
    """The accepted path of tree nodes from the root and the target's token after it, from the target's logits
    at every node [N, V]."""
    if sampling.greedy or noise is None:
        return verify_greedy(tree, logits)
    if all(q is None for q in tree.q):
        positions = [root_position + d + 1 for d in depths(tree.parents)]  # [N]: the position after each node
        return verify_coupled(tree, coupled_top(logits.cpu(), sampling, noise, positions, 1)[1][:, 0].tolist())
    return verify_sampling(tree, warp(logits.cpu(), sampling), generator)


def seed_of(req: Request) -> int:
    """The seed of a sampled generation (a fresh one when the request has none); 0 when greedy."""
    if req.sampling.greedy:
        return 0
    return req.seed if req.seed is not None else int(torch.randint(0, 2**62, ()).item())
