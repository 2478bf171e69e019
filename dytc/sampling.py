"""The one sampling warp (temperature, top-k, top-p), shared by drafting and verification.

Drafts and the target must warp their logits with exactly the same function, or lossless speculative
sampling silently stops being lossless.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from dsia.errors import CasspecError
from dsia.topk import argmax_rows, top_k, top_k_logsumexp

from .verify import SEED_MODULUS, Noise, own_noise


GREEDY_BELOW = 1e-4  # temperatures below this are greedy decoding (the warp's limit as T -> 0 is the argmax;
# far below it logits / T overflows)
NUCLEUS_CANDIDATES = (256, 4096)  # top-p: the nucleus is looked for among this many most likely tokens, then
# (rows whose nucleus is larger) this many (partial sorts, a fraction of a full one over a 50k vocabulary); a row
# whose nucleus is larger still gets the full sort
DRAFT_CANDIDATES = 64  # coupled drafting: a row's warp is computed over its this many most likely tokens wherever
# they hold its whole support (top-k within them, or top-p's nucleus); other rows are warped whole
CANDIDATES_BLOCK = 256  # `top_k`'s block when finding them (64 blocks of 256 hold them)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) = greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with cumulative probability >= top_p; 1 = off

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature):
            raise CasspecError(f"temperature must be a finite number (got {self.temperature}); use 0 for greedy "
                               "decoding, e.g. 0.7 to sample")
        if self.temperature < 0:
            raise CasspecError(f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy decoding")
        if not 0 < self.top_p <= 1:
            raise CasspecError(f"top_p must be in (0, 1] (got {self.top_p}); use 1 to turn it off")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise CasspecError(f"top_k must be an integer >= 0 (got {self.top_k!r}); use 0 to turn it off")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def warp(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [N, V] -> probabilities [N, V] (float32). Greedy gives the one-hot of the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(argmax_rows(logits), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = probs.masked_fill(_outside_nucleus(probs, params.top_p), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _outside_nucleus(probs: Tensor, top_p: float) -> Tensor:
    """[N, V] bool: the tokens top-p drops, those whose more likely tokens' mass already reaches top_p (the first
    token is always kept)."""
    V = probs.shape[-1]
    keep = torch.zeros_like(probs, dtype=torch.bool)  # [N, V]
    rows = torch.arange(probs.shape[0])  # rows whose nucleus is not found yet
    for k in [min(k, V) for k in NUCLEUS_CANDIDATES] + [V]:
        top, order = probs[rows].topk(k, dim=-1) if k < V else torch.sort(probs[rows], dim=-1, descending=True)
        before = top.cumsum(-1) - top  # mass strictly before each
        ends = before[:, -1] >= top_p if k < V else torch.ones(len(rows), dtype=torch.bool)  # nucleus within k
        keep[rows[ends]] = keep[rows[ends]].scatter_(-1, order[ends], before[ends] < top_p)
        rows = rows[~ends]
        if len(rows) == 0:
            break
    return ~keep


def coupled_top(logits: Tensor, params: SamplingParams, noise: Noise, positions: Sequence[int], k: int,
                candidates: int = DRAFT_CANDIDATES) -> tuple[Tensor, Tensor]:
    """A coupled draft's k best tokens: the top k of log warp(q) + g per row, and the softmax of those perturbed
    scores at them (probabilities, float32), [T, k] each; logits [T, V] of the draft, row j's g the noise of
    positions[j] (float64; only the candidates' noise is drawn where they hold the support). With k = 1, of the
    target's logits, the target's own sample at each row (Gumbel-max: distributed as warp(p)), the one function
    that draws it for every method (`casspec.runtime.step`), so a seed gives the same tokens whatever was drafted.
    Each row's result depends on that row alone.

    The same tokens as `warp` over the whole row, but cheaper: where a row's warped support lies within its
    `candidates` most likely tokens (top-k no wider than them, or a nucleus they reach), only they are warped and
    perturbed (casspec's op, csrc/coupled.cpp, where its library is built: one call for every row; elsewhere ATen's
    small ops); the other rows (a top-k wider than the candidates, or a wider nucleus: a sampled token often lies
    further down there) are warped whole, and with temperature alone the logits / T are perturbed whole (log q up
    to a constant per row). A draft matches the target's own token (this function with k = 1 on the target's
    logits) wherever the two perturbed argmaxes agree."""
    T, V = logits.shape
    m = min(candidates, V)
    whole = params.top_k == 0 and params.top_p == 1.0  # temperature alone: every token in the support
    if own_noise() and params.top_k <= m and (m == V or not whole):
        probs, tokens, inside = torch.ops.casspec.coupled_top(
            logits.float().contiguous(), params.temperature, params.top_k, params.top_p, noise.seed % SEED_MODULUS,
            torch.tensor(positions, dtype=torch.long), k, m)  # [T, k], [T, k], [T]
    elif whole:
        z = logits.float() / params.temperature  # [T, V] log q up to a constant per row (no effect on either result)
        return _perturbed_top(z.double() + _rows(noise, positions), k)
    elif params.top_k > candidates or candidates >= V:
        return _perturbed_top(warp(logits, params).log().double() + _rows(noise, positions), k)
    else:
        probs, tokens, inside = _candidates_top(logits, params, noise, positions, k, candidates)
    if not bool(inside.all()):  # a nucleus wider than the candidates: those rows warped whole
        wide = (~inside).nonzero()[:, 0]
        probs[wide], tokens[wide] = _perturbed_top(warp(logits[wide], params).log().double()
                                                   + _rows(noise, [positions[j] for j in wide.tolist()]), k)
    return probs, tokens


def _candidates_top(logits: Tensor, params: SamplingParams, noise: Noise, positions: Sequence[int], k: int,
                    candidates: int) -> tuple[Tensor, Tensor, Tensor]:
    """`coupled_top` over each row's candidates by ATen's ops (top_k <= candidates, and top-k or top-p on):
    (probs, tokens [T, k], inside [T]: whether the row's support lies within its candidates; the others' results
    are to be replaced). csrc/coupled.cpp computes the same in one call."""
    T = logits.shape[0]
    top, ci, lse = top_k_logsumexp(logits.float(), candidates, 1.0 / params.temperature, CANDIDATES_BLOCK)  # [T, M]
    # descending, [T, M], [T]: the candidates and log sum e^z of the whole row, z = logits / temperature
    cz = top / params.temperature  # [T, M] z at the candidates (log q up to a constant per row)
    if 0 < params.top_k < candidates:
        cz[:, params.top_k:] = float("-inf")
    inside = torch.ones(T, dtype=torch.bool)  # [T] rows whose support lies within their candidates
    if params.top_p < 1.0:
        norm = cz.logsumexp(-1, keepdim=True) if params.top_k > 0 else lse[:, None]  # [T, 1]
        p = (cz - norm).exp()  # [T, M] warped probabilities before top-p
        before = p.cumsum(-1) - p
        if params.top_k == 0:  # (a top-k within the candidates holds the nucleus)
            inside = before[:, -1] >= params.top_p
        cz = cz.masked_fill(before >= params.top_p, float("-inf"))
    probs, at = _perturbed_top(cz.double() + torch.stack([noise(positions[j], ci[j]) for j in range(T)]), k)
    return probs, ci.gather(1, at), inside


def _rows(noise: Noise, positions: Sequence[int]) -> Tensor:
    """The whole rows' noise at positions [len(positions), V]."""
    return torch.stack([noise(p, None) for p in positions])


def _perturbed_top(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k best of perturbed scores [T, n] (float64): their softmax probabilities (float32) and indices."""
    top_s, top_i = top_k(scores, k)  # [T, k]
    return (top_s - scores.logsumexp(-1, keepdim=True)).exp().float(), top_i


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """probs [N, V] -> tokens [N] drawn with the given generator."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
