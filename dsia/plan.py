"""A per-call plan: which sublayers run, where the forward exits, which kernels replace the dense ones.

The target is `Plan()` (nothing switched on). A draft level is a Plan built by the strategies; the model and
its config are never mutated to switch behaviour, the plan is simply passed to `Transformer.forward`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from torch import Tensor

# a replacement for one linear projection: x [T, in] -> y [T, out]
LinearFn = Callable[[Tensor], Tensor]
# one kernel for projections that share their input: x [T, in] -> [T, sum(out)] (keys "qkv", "gate_up")
FusedFn = Callable[[Tensor], Tensor]
# a replacement for a whole MLP sublayer (after its norm): x [T, dim] -> y [T, dim]
MlpFn = Callable[[Tensor], Tensor]
# a replacement for the LM head (after the final norm): h [N, dim] -> logits [N, vocab]
HeadFn = Callable[[Tensor], Tensor]

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True, eq=False)
class Plan:
    skip_attn: frozenset[int] = frozenset()  # layers whose attention sublayer is skipped (no KV read or written)
    skip_mlp: frozenset[int] = frozenset()  # layers whose MLP sublayer is skipped (residual passes through)
    exit_after: int | None = None  # run layers [0, exit_after) then final norm + head; None runs all layers
    linears: Mapping[tuple[int, str], LinearFn] = field(default_factory=dict)  # (layer, projection) -> kernel
    fused: Mapping[tuple[int, str], FusedFn] = field(default_factory=dict)  # (layer, "qkv"|"gate_up") -> kernel
    mlps: Mapping[int, MlpFn] = field(default_factory=dict)  # layer -> whole-MLP kernel (e.g. sparse)
    head: HeadFn | None = None  # LM head kernel; None uses the dense tied/untied head

    @property
    def is_target(self) -> bool:
        return not (self.skip_attn or self.skip_mlp or self.exit_after is not None
                    or self.linears or self.fused or self.mlps or self.head is not None)


TARGET = Plan()
