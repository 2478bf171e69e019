"""One generation's decode loop on one screen: draft -> verify -> accept -> update, a step at a time, until the caller
stops taking blocks or the context window is full (`steps`); and the target's prompt forward (`prefill`).

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
from typing import Iterator, Sequence

import numpy as np
import torch

from dsia.kvcache import KVCache
from dsia.model import Transformer
from dytc.latency import TARGET_LEVEL, LatencyModel
from dytc.policies import DraftContext, Policy
from dytc.sampling import SamplingParams, coupled_top, warp
from dytc.tree import DraftTree, ancestor_mask, depths, is_chain, position_ids
from dytc.verify import Noise, verify_coupled, verify_greedy, verify_sampling

from .request import Request
from .stats import Stats


def steps(ctx: DraftContext, req: Request, stats: Stats, policy: Policy, latency: LatencyModel,
          generator: torch.Generator | None, noise: Noise | None) -> Iterator[list[int]]:
    """Yield the root, then each step's emitted tokens, while the caller takes them and the window has room."""
    cache = ctx.cache
    with stats.timer("draft"):
        policy.begin(ctx)
    yield [ctx.history[-1]]
    while cache.length + 1 < cache.capacity:
        with stats.timer("draft"):
            tree = policy.draft(ctx)  # draft
        with stats.timer("verify"):
            stats.predicted_verify_seconds += predicted_verify_ms(latency, cache, tree) / 1e3
            context = cache.length
            logits = verify_forward(ctx.model, cache, latency, tree)  # verify: one target forward over the tree
            path, bonus = accept(tree, logits, req.sampling, generator, noise, context)  # accept
            cache.commit(path)  # update: the accepted path's KV joins the committed prefix
        if noise is not None:
            noise.forget_before(cache.length + 1)  # (positions up to the next root's are drawn)
            stats.noise_seconds = noise.seconds
        emitted = [tree.tokens[i] for i in path[1:]] + [bonus]
        ctx.commit(emitted)
        with stats.timer("draft"):
            policy.observe(ctx, tree, path, emitted)
        stats.record_step(len(tree) - 1, len(path) - 1, ctx.draft_forwards, ctx.draft_ms, policy.report())
        yield emitted


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
    dev, chain = model.device, is_chain(tree.parents)
    captures, t0 = model.graph_captures, time.perf_counter()
    logits = model.forward(cache, torch.tensor(tree.tokens, device=dev), position_ids(tree.parents, cache.length, dev),
                           cache.length, None if chain else ancestor_mask(tree.parents, dev))  # [N, V]
    if logits.is_cuda:
        torch.cuda.synchronize(dev)
    if model.graph_captures == captures:  # (a forward that captured a graph is no sample of its cost)
        latency.observe(TARGET_LEVEL, len(tree), cache.length, (time.perf_counter() - t0) * 1e3, not chain)
    return logits


def predicted_verify_ms(latency: LatencyModel, cache: KVCache, tree: DraftTree) -> float:
    """What the latency model expects the verification of `tree` to take (0 before it knows the target)."""
    if not latency.known(TARGET_LEVEL):
        return 0.0
    return float(latency.predict_mean(TARGET_LEVEL, np.array([len(tree)]), cache.length,
                                      not is_chain(tree.parents))[0])  # (no uncertainty: no solve)


def pick(logits: torch.Tensor, sampling: SamplingParams, noise: Noise | None, position: int) -> int:
    """The target's token after the last row of logits [T, V], at sequence position `position`."""
    if sampling.greedy or noise is None:
        return int(logits[-1].argmax())
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
