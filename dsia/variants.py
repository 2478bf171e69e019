"""The Transformer's variant builders: each returns the same weights with one thing changed (context, dense kernels,
fused projections, CUDA graphs, batch invariance, native kernels, the C++ layer stacks, the elementwise steps), never
mutating the model it was called on; and what the weights cost. `dsia.model.Transformer` inherits them.

The forward calls its optional backends (dsia/graphs.py's CUDA graphs, dsia/fastloop.py's C++ layer stacks) through
the protocols here, so that dsia/model.py names no module that imports it."""
from __future__ import annotations

import copy
import os
from typing import Callable, Protocol, Self

import torch
from torch import Tensor

from .errors import CasspecError
from .invariant import check_supported, rows_independent
from .kernels import DenseKernels
from .kvcache import KVCache
from .layer import FUSED_GROUPS, KvAccess, LayerWeights
from .plan import Plan
from .pointwise import Pointwise
from .spec import ModelSpec


def _device_memory(device: torch.device) -> int:
    """Bytes of memory on `device` (a CPU: the machine's physical memory)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")



class CaptureStats(Protocol):
    captures: int  # CUDA graphs captured so far


class GraphBackend(Protocol):
    """Small forwards replayed from CUDA graphs (dsia/graphs.py `Graphs`)."""
    stats: CaptureStats

    def run(self, cache: KVCache, tokens: Tensor, positions: Tensor, start: int, scratch_mask: Tensor | None,
            plan: Plan, logits_rows: Tensor | slice | None) -> Tensor: ...


class LayerRun(Protocol):
    """One plan's layers as one C++ call (dsia/fastloop.py `LayerStack`): (x, the last sublayer's output), or None
    where it cannot take this forward."""
    def run(self, model: Variants, x: Tensor, cache: KVCache, kv: KvAccess, cos: Tensor,
            sin: Tensor) -> tuple[Tensor, Tensor] | None: ...


class StackBackend(Protocol):
    """The plans whose layers run as one C++ call (dsia/fastloop.py `Stacks`)."""
    def get(self, model: Variants, plan: Plan) -> LayerRun | None: ...


class Variants:
    """The builders and weight accounting of dsia.model.Transformer (which defines these attributes)."""
    spec: ModelSpec
    dense: DenseKernels
    graphs: GraphBackend | None
    pointwise: Pointwise
    batch_invariant: bool
    stacks: StackBackend | None
    native: Plan | None
    embed: Tensor
    layers: list[LayerWeights]
    norm: Tensor
    lm_head: Tensor
    inv_freq: Tensor
    rope_scale: float
    cos: Tensor
    sin: Tensor

    def _rope_tables(self, positions: int) -> tuple[Tensor, Tensor]:
        """cos and the signed sin (first half negated, for `rope`'s roll) of positions [0, positions): [P, hd]."""
        pos = torch.arange(positions, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq.float())  # [P, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, hd]
        cos = (emb.cos() * self.rope_scale).to(self.embed.dtype)
        sin = (emb.sin() * self.rope_scale).to(self.embed.dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def _check_fits(self, positions: int) -> None:
        """A CasspecError where a KV cache of `positions` slots (with its RoPE tables) exceeds the device's memory."""
        s = self.spec
        need = (2 * s.n_layers * s.n_kv_heads + 2) * s.head_dim * positions * self.embed.element_size()
        have = _device_memory(self.device)
        if need > have:
            raise CasspecError(f"a context of {positions} positions needs {need / 1e9:.1f} GB of KV cache, more than "
                               f"the {have / 1e9:.1f} GB this device has: lower --max-context")

    @property
    def context(self) -> int:
        """Positions this runtime has RoPE tables for (a KV cache holds at most these)."""
        return self.cos.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype  # (the norms are always held: a native target's embedding may be blocks alone)

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def with_context(self, positions: int) -> Self:
        """The same weights with RoPE tables for `positions` positions (the context a run uses, never the file's
        claim alone: a header's 10^8 positions would ask gigabytes of tables)."""
        if not 2 <= positions <= self.spec.max_context:
            raise CasspecError(f"a context of {positions} positions is outside what the model supports (2 .. "
                               f"{self.spec.max_context}): lower --max-context")
        self._check_fits(positions)
        other = copy.copy(self)
        if positions <= self.context:  # the same bits as the longer tables' first rows
            other.cos, other.sin = self.cos[:positions], self.sin[:positions]
        else:
            other.cos, other.sin = self._rope_tables(positions)
        return other

    def with_dense(self, dense: DenseKernels) -> Self:
        """The same weights and RoPE tables, its dense products run by `dense` (which packs ahead the weights a
        chosen kernel keeps in its own layout: the only copies made)."""
        other = copy.copy(self)
        other.dense = dense
        dense.prepare(*self._dense_split())
        return other

    def dense_weights(self) -> list[Tensor]:
        """Every weight the target's dense kernels multiply: each layer's projections, then the LM head."""
        return [w for lw in self.layers for w in lw.products()] + [self.lm_head]

    def _dense_split(self) -> tuple[list[Tensor], list[Tensor]]:
        """`dense_weights` as (those whose products a target forward runs, the others): the others are those the
        native kernels run instead (a native target's layers and head: their dense copies are only read to build
        levels)."""
        run: list[Tensor] = []
        others: list[Tensor] = []
        for i, lw in enumerate(self.layers):
            native = self._native_parts(i) if self.native is not None else set()
            for w, parts in lw.product_parts():
                (others if native & set(parts) else run).append(w)
        (others if self.native is not None and self.native.head is not None else run).append(self.lm_head)
        return run, others

    def with_fused_projections(self) -> Self:
        """The same model with each layer's q|k|v and gate|up products as one each (`LayerWeights.fused`): on a
        GPU the wider products read the weights closer to the memory's bandwidth, in fewer launches. The sums
        are the same dot products, but a kernel picked for the wider shape may order them otherwise."""
        other = copy.copy(self)
        other.layers = [lw.fused() for lw in self.layers]
        return other

    def with_graphs(self, graphs: GraphBackend | None) -> Self:
        """The same weights, small forwards on graphs' cache replayed from CUDA graphs (None: eager)."""
        other = copy.copy(self)
        other.graphs = graphs
        return other

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured so far (0 without graphs): a forward during which this grew paid for a capture,
        so its time is no sample of the forward's cost."""
        return self.graphs.stats.captures if self.graphs is not None else 0

    def product_shapes(self) -> set[tuple[int, int]]:
        """The (in, out) features of the target's dense products (every layer has the first layer's)."""
        lw = self.layers[0]
        return {(w.shape[1], w.shape[0]) for w in (lw.wq, lw.wk, lw.wv, lw.wo, lw.w_gate, lw.w_up, lw.w_down,
                                                   lw.wqkv, lw.w_gate_up, self.lm_head) if w is not None}

    def with_batch_invariant(self, own_attention: bool = False) -> Self:
        """The same model, each row of a target forward computed alike whatever the rows around it (dsia/invariant.py):
        a tree verification's logits are then bit for bit those of `ar`'s one-token steps. bfloat16 on a CPU, and a
        native target in float32. own_attention: its attention is casspec's op (`cxx_pointwise`, each row over its
        own keys: invariant by construction), so the block attention's products are not checked."""
        check_supported(self.dtype, self.device, native=self.native is not None)
        kernels = () if self.native is None else tuple(
            {id(k): (k, w.shape[1]) for k, w in self._native_products()}.values())
        shapes = self.product_shapes() if self.native is None else self._dense_shapes()
        if not rows_independent(self.dense, shapes, self.spec.head_dim, self.dtype, self.device, kernels,
                                attention=not own_attention):
            if self.native is not None:
                raise CasspecError("a native target's forwards rest on this machine's kernels giving each row the "
                                   "same result whatever the row count, and here they do not: use --weights float")
            raise CasspecError("batch-invariant forwards rest on this machine's bfloat16 kernels giving each row the "
                               "same result whatever the row count, and here they do not: run without "
                               "--batch-invariant")
        other = copy.copy(self)
        other.batch_invariant = True
        return other

    def with_native(self, native: Plan) -> Self:
        """The same model, its products run by `native`'s kernels (linears, fused, head) wherever a plan does not
        replace them: the checkpoint in its stored quantization is then the target, and each level a plan over it.
        The dense weights stay for what is built from them (a level's quantized copy, a sparse gather)."""
        other = copy.copy(self)
        other.native = native
        return other

    def _native_parts(self, i: int) -> set[str]:
        """The projections of layer i the native kernels run (fused or one by one)."""
        nat = self.native
        return ({n for g, parts in FUSED_GROUPS.items() if (i, g) in nat.fused for n in parts}
                | {n for (j, n) in nat.linears if j == i})

    def _dense_shapes(self) -> set[tuple[int, int]]:
        """(in, out) of the target's products its native kernels do not run (the first layer's and the head)."""
        covered = self._native_parts(0)
        shapes = {(w.shape[1], w.shape[0]) for n, w in self.layers[0].projections().items() if n not in covered}
        return shapes | ({(self.lm_head.shape[1], self.lm_head.shape[0])} if self.native.head is None else set())

    def _native_products(self) -> list[tuple[Callable[[Tensor], Tensor], Tensor]]:
        """(kernel, a dense weight of its input width) of each native product of the first layer and the head."""
        nat, weights = self.native, self.layers[0].projections()
        out = [(k, weights[FUSED_GROUPS[g][0]]) for (i, g), k in nat.fused.items() if i == 0]
        out += [(k, weights[n]) for (i, n), k in nat.linears.items() if i == 0]
        return out + ([(nat.head, self.lm_head)] if nat.head is not None else [])

    def with_stacks(self, stacks: StackBackend | None) -> Self:
        """The same model, the layers of the plans `stacks` takes (dsia/fastloop.py) run by one C++ call each
        (None: every forward's layers in Python)."""
        other = copy.copy(self)
        other.stacks = stacks
        return other

    def with_pointwise(self, pointwise: Pointwise) -> Self:
        """The same weights, the elementwise steps run by `pointwise`."""
        other = copy.copy(self)
        other.pointwise = pointwise
        return other

    def weight_bytes(self) -> int:
        """Bytes of weights one full target forward reads (its native kernels' where it has them)."""
        seen: set[int] = set()
        total = 0
        native = self.native
        tensors = [self.norm] + ([self.lm_head] if native is None or native.head is None else [])
        kernels = {} if native is None else {id(k): k for k in [*native.linears.values(), *native.fused.values(),
                                                                native.head] if k is not None}
        for i, lw in enumerate(self.layers):
            norms = [t for t in (lw.attn_norm, lw.mlp_norm, lw.q_norm, lw.k_norm) if t is not None]
            tensors += norms + list(lw.bias.values())
            if native is None:
                tensors += lw.products()
            else:  # what the native kernels run is counted once, as their bytes, below
                covered = self._native_parts(i)
                tensors += [w for n, w in lw.projections().items() if n not in covered]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total + sum(k.nbytes for k in kernels.values())
