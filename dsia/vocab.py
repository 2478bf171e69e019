"""Reduced-vocabulary draft head: score only a subset of the vocabulary.

The LM head is a large share of a small model's weight bytes (SmolLM2-135M: 49152 x 576, about 20%). A draft
level may score only the tokens seen so far in the prompt and output plus a fixed frequent set (the lowest
token ids: BPE assigns ids in merge order, so low ids are the frequent pieces). Tokens outside the subset get
logit -inf, so the draft never proposes them and their draft probability is exactly 0: verification, which
always uses the full head, stays exact (greedy) and lossless (sampling, since q is the distribution the draft
really sampled from).

The `vocab` draft strategy: the level's head scores the prompt's and output's tokens plus the frequent set (it wins
over a quantized head when mixed).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from .kvcache import KVCache
from .model import Transformer
from .plan import Plan
from .strategy import HasBytes, Resources, Strategy, Switch


@dataclass(frozen=True)
class VocabConfig:
    frequent: int = 8192  # the lowest token ids, always in the subset
    capacity: int = 16384  # most tokens the subset can hold (frequent + seen); later unseen tokens are dropped
    dtype: torch.dtype = torch.bfloat16  # storage and matmul dtype of the gathered head rows


class VocabHead:
    """A HeadFn over a growing subset of the vocabulary: h [N, D] -> logits [N, V] (-inf outside)."""

    def __init__(self, head_rows: Callable[[Tensor], Tensor], shape: tuple[int, int], device: torch.device,
                 cfg: VocabConfig = VocabConfig()) -> None:
        self.cfg = cfg
        self.head_rows = head_rows  # token ids [n] -> the target's head rows [n, D] (Transformer.head_rows)
        V, D = shape
        self.vocab_size = V
        self.device = device
        cap = min(cfg.capacity, V)
        self.rows = torch.empty(cap, D, dtype=cfg.dtype, device=device)  # [cap, D] gathered head rows
        self.ids = torch.empty(cap, dtype=torch.long, device=device)  # [cap] their token ids
        self.member = torch.zeros(V, dtype=torch.bool)  # [V] is the token in the subset
        self.n = 0
        self.add(range(min(cfg.frequent, cap)))

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size() + self.ids.numel() * 8 + self.member.numel()

    def add(self, tokens: Iterable[int]) -> None:
        """Add tokens (e.g. newly committed ones) to the subset; unknown or duplicate ids are ignored."""
        new = [t for t in dict.fromkeys(tokens) if 0 <= t < self.vocab_size and not self.member[t]]
        new = new[: self.rows.shape[0] - self.n]
        if not new:
            return
        idx = torch.tensor(new, dtype=torch.long, device=self.device)
        self.rows[self.n:self.n + len(new)] = self.head_rows(idx).to(self.cfg.dtype)
        self.ids[self.n:self.n + len(new)] = idx
        self.member[idx.cpu()] = True
        self.n += len(new)

    def reset(self) -> None:
        """Back to the frequent set only (a new prompt)."""
        self.member[self.ids[self.cfg.frequent:self.n].cpu()] = False
        self.n = min(self.cfg.frequent, self.n)

    def __call__(self, h: Tensor) -> Tensor:
        sub = F.linear(h.to(self.cfg.dtype), self.rows[:self.n])  # [N, n]
        out = torch.full((h.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32, device=h.device)
        out[:, self.ids[:self.n]] = sub.float()
        return out  # [N, V]


# ---------------------------------------------------------------------------------------------- strategy
@dataclass(frozen=True)
class Vocab(Strategy):
    """`vocab`: a reduced-vocabulary head (its own subset per level, grown from the committed tokens)."""

    FORMS: ClassVar[tuple[str, ...]] = ("vocab",)
    KEY: ClassVar[str] = "vocab"

    @classmethod
    def parse(cls, part: str) -> Vocab | None:
        return cls() if part == "vocab" else None

    @property
    def name(self) -> str:
        return "vocab"

    def bind(self, resources: Resources) -> Switch:
        m = resources.model
        return VocabSwitch(VocabHead(m.head_rows, tuple(m.lm_head.shape), m.device, VocabConfig()))


class VocabSwitch(Switch):
    def __init__(self, head: VocabHead) -> None:
        self.head = head

    def extend(self, plan: Plan) -> Plan:
        return dataclasses.replace(plan, head=self.head)

    def begin(self, model: Transformer, cache: KVCache, history: list[int]) -> None:
        self.head.reset()
        self.head.add(history)

    def observe(self, model: Transformer, cache: KVCache, history: list[int], emitted: list[int]) -> None:
        self.head.add(emitted)

    @property
    def holds(self) -> tuple[HasBytes, ...]:
        return (self.head,)
