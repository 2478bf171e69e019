"""A decoder layer's weights as the forward reads them, and where a forward writes and reads its K/V."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .invariant import RowKeys
from .kvcache import KVCache

FUSED_GROUPS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}  # projections sharing one input


@dataclass
class LayerWeights:
    attn_norm: Tensor  # [D]
    wq: Tensor  # [H*hd, D]
    wk: Tensor  # [Hkv*hd, D]
    wv: Tensor  # [Hkv*hd, D]
    wo: Tensor  # [D, H*hd]
    q_norm: Tensor | None  # [hd] (Qwen3)
    k_norm: Tensor | None
    mlp_norm: Tensor  # [D]
    w_gate: Tensor  # [I, D]
    w_up: Tensor  # [I, D]
    w_down: Tensor  # [D, I]
    bias: dict[str, Tensor]  # projection name -> bias [out], only where the checkpoint has one (Qwen2: q, k, v)
    wqkv: Tensor | None = None  # [(H + 2 Hkv) hd, D] q|k|v as one weight (`fused`; wq, wk, wv are its row views)
    w_gate_up: Tensor | None = None  # [2I, D] gate|up as one weight (`fused`; w_gate, w_up are its row views)
    # where the projections are held only as stored blocks (a native GGUF target: the fields above are meta
    # tensors, shapes without values), the float32 weight of a projection by name, dequantized on each call
    stored: Callable[[str], Tensor] | None = None

    def fused(self) -> "LayerWeights":
        """These weights with q|k|v and gate|up each concatenated into one (two products where there were five);
        the separate ones become row views of them, so the concatenation is the only copy this layer keeps."""
        if self.wqkv is not None:
            return self
        wqkv = torch.cat((self.wq, self.wk, self.wv))
        w_gate_up = torch.cat((self.w_gate, self.w_up))
        wq, wk, wv = wqkv.split([self.wq.shape[0], self.wk.shape[0], self.wv.shape[0]])
        w_gate, w_up = w_gate_up.split([self.w_gate.shape[0], self.w_up.shape[0]])
        return dataclasses.replace(self, wq=wq, wk=wk, wv=wv, w_gate=w_gate, w_up=w_up, wqkv=wqkv,
                                   w_gate_up=w_gate_up)

    def dense(self, name: str) -> Tensor:
        """Projection `name`'s float weight [out, in]: the tensor held, or dequantized from the stored blocks (a
        temporary: what builds a draft level from the weights reads it and lets it go)."""
        w = self.projections()[name]
        return self.stored(name) if w.is_meta and self.stored is not None else w

    def projections(self) -> dict[str, Tensor]:
        """Each projection's weight by name (q, k, v, o, gate, up, down), [out, in] each."""
        return dict(q=self.wq, k=self.wk, v=self.wv, o=self.wo, gate=self.w_gate, up=self.w_up, down=self.w_down)

    def products(self) -> list[Tensor]:
        """The weights the target's forward multiplies, each once (the fused ones in place of their parts)."""
        return [w for w, _ in self.product_parts()]

    def product_parts(self) -> list[tuple[Tensor, tuple[str, ...]]]:
        """`products`, each with the projections it computes."""
        qkv = [(self.wqkv, ("q", "k", "v"))] if self.wqkv is not None else [(self.wq, ("q",)), (self.wk, ("k",)),
                                                                              (self.wv, ("v",))]
        gate_up = ([(self.w_gate_up, ("gate", "up"))] if self.w_gate_up is not None
                   else [(self.w_gate, ("gate",)), (self.w_up, ("up",))])
        return qkv + [(self.wo, ("o",))] + gate_up + [(self.w_down, ("down",))]


@dataclass(frozen=True)
class KvAccess:
    """Where a forward writes its K/V and what it attends to: slots [start, end) with an SDPA mask over slots
    [0, end) (None: all of them, causal when is_causal); or, for a CUDA graph, the slots given as a tensor with a
    mask over every slot of the cache."""
    start: int = 0  # first slot written (a contiguous run)
    end: int = 0  # one past the last slot written and read
    slots: Tensor | None = None  # [T] the slots written, in place of [start, end)
    mask: Tensor | None = None  # [T, end] or [T, capacity + spare] bool
    is_causal: bool = False  # plain causal prefill at slot 0
    rows: RowKeys | None = None  # in place of the mask, each row's keys for the batch-invariant attention
    own: bool = False  # attend with Pointwise.attention (over `mask`, None: causal by slot) instead of SDPA
    parts: tuple["BatchPart", ...] = ()  # a batched forward's sequences (each its own cache and access; the
    # fields above then unused)


@dataclass(frozen=True)
class BatchPart:
    """One sequence's rows of a batched forward (continuous batching): written to and attending over its own
    cache as its KvAccess says, as a forward of its rows alone would."""
    cache: KVCache
    rows: slice  # its rows of the forward
    kv: KvAccess  # its slots in its cache (own attention, or SDPA over its mask)

