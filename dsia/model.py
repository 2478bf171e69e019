"""Functional Llama-family forward over the checkpoint's own weight tensors (no second copy).

Supports Llama / SmolLM2, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm). One call:
(tokens, positions, write slot, scratch attention mask, plan) -> logits, writing K/V only at the slots given.
Batch size 1 throughout; shapes use T = tokens in this forward, D = hidden size, H = heads, Hkv = KV heads.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import CasspecError
from .invariant import (BLOCK, RowKeys, block_attention, check_supported, invariant_linear, row_keys,
                        rows_independent)
from .cxx import LIBRARY_DTYPES
from .kernels import DenseFn, DenseKernels
from .kvcache import KVCache
from .plan import TARGET, Plan
from .spec import DEFAULT_CONTEXT, ModelSpec

if TYPE_CHECKING:
    from .fastloop import Stacks
    from .graphs import Graphs

FUSED_GROUPS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}  # projections sharing one input
# forwards of at most this many rows attend with casspec's own attention where it runs (a step, a tree's
# verification: with it the C++ loop runs the layers in one region; SmolLM2 on a 2-core AMD EPYC, 200 keys, float32 /
# bfloat16: 4 rows 13.5 / 7.4 ms against SDPA's 14.4 / 9.6, 16 rows 17.6 / 17.5 against 18.3 / 18.8); a prompt's
# more rows by SDPA (64 rows: 50.5 / 60.9 ms against 47.4 / 59.8)
OWN_ATTENTION_ROWS = 16


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


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, computed in float32 as HF does, then scaled in the input dtype."""
    if x.dtype == torch.float32:  # torch's own op: the same arithmetic (bit for bit), one call instead of eight
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)  # (F.rms_norm would scale before the cast: not HF's rounding in half dtypes)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding of x [heads, T, hd] with the tables of its positions, cos [T, hd] and the signed
    sin [T, hd] (first half negated, see `Transformer.sin`): HF's x * cos + rotate_half(x) * sin, bit for bit,
    since rotate_half(x) * sin = roll(x, hd/2) * signed sin, in four calls instead of seven."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """The gated MLP's activation: silu(gate) * up, [T, I]."""
    return F.silu(gate) * up


def rope_kv(qk: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
            n_heads: int) -> Tensor:
    """RoPE of q|k [H + Hkv, T, hd] and the writes of k and v [Hkv, T, hd] to the layer's cache [Hkv, S, hd] at
    `slots` [T]; returns q [H, T, hd]. One kernel when compiled (eagerly: RoPE, then one copy each)."""
    q, k = rope(qk, cos, sin).split([n_heads, qk.shape[0] - n_heads])
    k_cache.index_copy_(1, slots, k)
    v_cache.index_copy_(1, slots, v)
    return q


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """A sublayer's output joining the residual stream and the next norm: (x + delta, RMSNorm(x + delta)), [T, D]
    each; one kernel when compiled."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


@dataclass(frozen=True)
class Pointwise:
    """The forward's small steps. Eagerly each is several kernels (an RMSNorm is eight); on a GPU, where a small
    model's step is its kernel launches, `compiled_pointwise` makes each one kernel; on a CPU, where each costs
    microseconds of dispatch, casspec's C++ ops (dsia/fastloop.py `cxx_pointwise`) make each one loop."""
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    rope: Callable[[Tensor, Tensor, Tensor], Tensor]
    silu_mul: Callable[[Tensor, Tensor], Tensor]
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    rope_kv: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int], Tensor]
    # q [H, T, hd], a layer's keys and values [Hkv, S, hd], end, mask [T, end] bool | None (causal by slot), scale ->
    # [T, H*hd], each row over its own keys whatever the other rows (LIBRARY_DTYPES on a CPU); None: SDPA's
    attention: Callable[[Tensor, Tensor, Tensor, int, Tensor | None, float], Tensor] | None = None


EAGER = Pointwise(rms_norm, rope, silu_mul, add_rms_norm, rope_kv)


@functools.cache
def compiled_pointwise() -> Pointwise:
    """The elementwise steps compiled by torch.compile (Inductor; shapes dynamic, so compiled once each)."""
    compile_ = functools.partial(torch.compile, dynamic=True, fullgraph=True)
    return Pointwise(compile_(rms_norm), compile_(rope), compile_(silu_mul), compile_(add_rms_norm),
                     compile_(rope_kv))


def _device_memory(device: torch.device) -> int:
    """Bytes of memory on `device` (a CPU: the machine's physical memory)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Transformer:
    """The runtime: spec + references to the HF model's tensors + RoPE tables. Stateless across calls."""

    def __init__(self, spec: ModelSpec, embed: Tensor, layers: list[LayerWeights], norm: Tensor,
                 lm_head: Tensor, inv_freq: Tensor, rope_scale: float) -> None:
        self.spec = spec
        # the dense product of every target linear and the head, per token count: oneDNN where it exists for the
        # dtype, else BLAS; `with_dense` gives a view running the fastest measured on this machine (casspec.tune)
        self.dense = DenseKernels.default(embed.dtype, embed.device)
        self.graphs: Graphs | None = None  # CUDA graphs of small forwards (`with_graphs`); None runs eagerly
        self.pointwise = EAGER  # the elementwise steps (`with_pointwise`: compiled ones on a GPU)
        self.batch_invariant = False  # target forwards whose rows do not depend on each other (`with_batch_invariant`)
        self.stacks: Stacks | None = None  # plans whose layers run as one C++ call (`with_stacks`); None: Python
        # the target's own kernels where the checkpoint is run in its stored quantization (`with_native`): every
        # product a plan does not replace runs them instead of the dense weights; None: the dense weights
        self.native: Plan | None = None
        self.embed = embed  # [V, D]
        self.layers = layers
        self.norm = norm  # [D]
        self.lm_head = lm_head  # [V, D] (may be the embedding itself when tied)
        if inv_freq.shape != (spec.head_dim // 2,):
            raise CasspecError(f"the model's RoPE has {inv_freq.numel()} frequencies for a head of {spec.head_dim}: "
                               "casspec rotates the whole head (head size / 2 frequencies); use a checkpoint "
                               "without partial rotary embeddings")
        self.inv_freq = inv_freq  # [hd/2]
        self.rope_scale = rope_scale
        self.cos, self.sin = self._rope_tables(min(spec.max_context, DEFAULT_CONTEXT))  # [P, hd] each

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

    def with_context(self, positions: int) -> "Transformer":
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

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @staticmethod
    def from_hf(model) -> "Transformer":
        """Wrap a loaded HF `*ForCausalLM` (Llama family) without copying its weights."""
        spec = ModelSpec.from_hf_config(model.config)
        inner = model.model
        layers = []
        for blk in inner.layers:
            att, mlp = blk.self_attn, blk.mlp
            projs = dict(q=att.q_proj, k=att.k_proj, v=att.v_proj, o=att.o_proj,
                         gate=mlp.gate_proj, up=mlp.up_proj, down=mlp.down_proj)
            layers.append(LayerWeights(
                attn_norm=blk.input_layernorm.weight.data,
                wq=att.q_proj.weight.data, wk=att.k_proj.weight.data, wv=att.v_proj.weight.data,
                wo=att.o_proj.weight.data,
                q_norm=att.q_norm.weight.data if spec.qk_norm else None,
                k_norm=att.k_norm.weight.data if spec.qk_norm else None,
                mlp_norm=blk.post_attention_layernorm.weight.data,
                w_gate=mlp.gate_proj.weight.data, w_up=mlp.up_proj.weight.data, w_down=mlp.down_proj.weight.data,
                bias={n: p.bias.data for n, p in projs.items() if getattr(p, "bias", None) is not None}))
        rot = inner.rotary_emb
        return Transformer(spec, inner.embed_tokens.weight.data, layers, inner.norm.weight.data,
                           model.lm_head.weight.data, rot.inv_freq, float(getattr(rot, "attention_scaling", 1.0)))

    def with_dense(self, dense: DenseKernels) -> "Transformer":
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

    def with_fused_projections(self) -> "Transformer":
        """The same model with each layer's q|k|v and gate|up products as one each (`LayerWeights.fused`): on a
        GPU the wider products read the weights closer to the memory's bandwidth, in fewer launches. The sums
        are the same dot products, but a kernel picked for the wider shape may order them otherwise."""
        other = copy.copy(self)
        other.layers = [lw.fused() for lw in self.layers]
        return other

    def with_graphs(self, graphs: Graphs | None) -> "Transformer":
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

    def with_batch_invariant(self, own_attention: bool = False) -> "Transformer":
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

    def with_native(self, native: Plan) -> "Transformer":
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

    def with_stacks(self, stacks: Stacks | None) -> "Transformer":
        """The same model, the layers of the plans `stacks` takes (dsia/fastloop.py) run by one C++ call each
        (None: every forward's layers in Python)."""
        other = copy.copy(self)
        other.stacks = stacks
        return other

    def with_pointwise(self, pointwise: Pointwise) -> "Transformer":
        """The same weights, the elementwise steps run by `pointwise`."""
        other = copy.copy(self)
        other.pointwise = pointwise
        return other

    def new_cache(self, capacity: int | None = None, spare: int = 0) -> KVCache:
        s = self.spec
        cap = min(capacity or self.context, self.context)
        if self.batch_invariant:  # its attention reads whole blocks of slots, past the last one written
            spare = max(spare, BLOCK)
        self._check_fits(cap + spare)
        return KVCache(s.n_layers, s.n_kv_heads, s.head_dim, cap, self.dtype, self.device, spare)

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

    # ------------------------------------------------------------------ forward
    def forward(self, cache: KVCache, tokens: Tensor, positions: Tensor, start: int,
                scratch_mask: Tensor | None = None, plan: Plan = TARGET,
                logits_rows: Tensor | slice | None = None, visible_prefix: int | None = None) -> Tensor:
        """Run T new tokens on top of the committed prefix and return their logits.

        tokens, positions: [T] (positions are absolute, e.g. prefix length + tree depth).
        start: first cache slot to write (>= cache.length); the tokens go to slots [start, start + T).
        scratch_mask: [T, start + T - cache.length] bool, which scratch slots each token sees (its ancestors
            and itself); the committed prefix is always visible. None = causal over all slots [0, start + T).
        logits_rows: which of the T rows need logits (None = all). Returns logits [N, V] in float32.
        visible_prefix: only committed slots [0, visible_prefix) are visible (default: all of them); used to
            re-score already committed tokens teacher-forced in scratch (e.g. the skip-set search).
        """
        T = tokens.shape[0]
        end = start + T
        if end > cache.capacity:
            raise CasspecError(f"context window full ({cache.capacity} tokens); shorten the prompt or the output")
        if self.graphs is not None and visible_prefix is None:  # a captured CUDA graph, where one fits
            logits = self.graphs.run(cache, tokens, positions, start, scratch_mask, plan, logits_rows)
            if logits is not None:
                return logits
        kernel = self._attention_of(T, plan)
        if kernel == "rows":
            rows = row_keys(cache.length, start, T, scratch_mask, visible_prefix, self.device)
            cache.reserve(max(end, rows.shared))
            kv = KvAccess(start=start, end=end, rows=rows)
        else:
            cache.reserve(end)
            mask = self._attn_mask(cache.length, start, T, scratch_mask, visible_prefix)
            kv = KvAccess(start=start, end=end, mask=mask, is_causal=mask is None and T > 1,  # causal: prefill at 0
                          own=kernel == "own")
        return self._layers(cache, tokens, positions, kv, plan, logits_rows)

    def _attention_of(self, T: int, plan: Plan) -> str:
        """Which attention a forward over T rows runs: "own" (Pointwise.attention: each row over its own keys, one
        loop), "rows" (the batch-invariant block_attention) or "sdpa". A batch-invariant target attends with its own
        where the Pointwise has one, else by blocks, a prompt's prefill too (a later prompt that starts with this
        one reuses its KV: written otherwise, it would differ in the last bits from what one-token steps write);
        any other forward with its own over up to OWN_ATTENTION_ROWS rows (where it is faster than SDPA's), SDPA over
        more."""
        own = self.pointwise.attention is not None and self.dtype in LIBRARY_DTYPES and self.device.type == "cpu"
        if self.batch_invariant and plan.is_target:
            return "own" if own else "rows"
        return "own" if own and T <= OWN_ATTENTION_ROWS else "sdpa"

    def forward_slots(self, cache: KVCache, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor,
                      plan: Plan = TARGET) -> Tensor:
        """Run T tokens written to the given cache slots, each attending to the slots its mask row allows.

        tokens, positions, slots: [T]; mask: [T, capacity + spare] bool over every slot of the cache (which must
        be zeroed, `KVCache.zero_all`). Returns logits [T, V] in float32. No host sync and no shape that depends
        on a value: the body of a CUDA graph (dsia.graphs)."""
        return self._layers(cache, tokens, positions, KvAccess(slots=slots, mask=mask), plan, None)

    def _layers(self, cache: KVCache, tokens: Tensor, positions: Tensor, kv: KvAccess, plan: Plan,
                logits_rows: Tensor | slice | None) -> Tensor:
        """Embedding, the plan's layers, final norm and head: logits [N, V] in float32."""
        s = self.spec
        cos, sin = self.cos[positions], self.sin[positions]  # [T, hd]
        x = F.embedding(tokens, self.embed)  # [T, D] the residual stream
        delta: Tensor | None = None  # [T, D] the last sublayer's output, added to x together with the next norm
        n_layers = s.n_layers if plan.exit_after is None else plan.exit_after
        stack = self.stacks.get(self, plan) if self.stacks is not None and kv.slots is None else None
        done = stack.run(self, x, cache, kv, cos, sin) if stack is not None else None
        if done is not None:  # the same layers as one C++ call
            (x, delta), n_layers = done, 0
        for i in range(n_layers):
            lw = self.layers[i]
            if i not in plan.skip_attn:
                x, h = self._residual_norm(x, delta, lw.attn_norm)
                delta = self._attention(i, lw, h, cache, kv, cos, sin, plan)
            if i not in plan.skip_mlp:
                x, h = self._residual_norm(x, delta, lw.mlp_norm)
                mlp = plan.mlps.get(i)
                delta = mlp(h) if mlp is not None else self._mlp(i, lw, h, plan)
        if logits_rows is not None:
            x, delta = x[logits_rows], None if delta is None else delta[logits_rows]
        _, h = self._residual_norm(x, delta, self.norm)  # [N, D]
        head = plan.head if plan.head is not None else self.native.head if self.native is not None else None
        logits = head(h) if head is not None else self._dense(plan)(h, self.lm_head)
        return logits.float()  # [N, V]

    def _residual_norm(self, x: Tensor, delta: Tensor | None, weight: Tensor) -> tuple[Tensor, Tensor]:
        """(x + delta, its RMSNorm): the residual stream after the last sublayer and the next one's input."""
        if delta is None:
            return x, self.pointwise.rms_norm(x, weight, self.spec.norm_eps)
        return self.pointwise.add_rms_norm(x, delta, weight, self.spec.norm_eps)

    def _attn_mask(self, length: int, start: int, T: int, scratch_mask: Tensor | None,
                   visible_prefix: int | None) -> Tensor | None:
        """Boolean SDPA mask [T, start + T] or None (T == 1 sees every slot; causal prefill uses is_causal)."""
        if scratch_mask is None and visible_prefix is None:
            if T == 1 or start == 0:
                return None
            return torch.ones(T, start + T, dtype=torch.bool, device=self.device).tril(diagonal=start)
        if scratch_mask is None:  # causal over the scratch slots
            scratch_mask = torch.ones(T, start + T - length, dtype=torch.bool, device=self.device).tril(
                diagonal=start - length)
        assert scratch_mask.shape == (T, start + T - length), (scratch_mask.shape, T, start, length)
        prefix = torch.ones(T, length, dtype=torch.bool, device=self.device)
        if visible_prefix is not None:
            prefix[:, visible_prefix:] = False
        return torch.cat((prefix, scratch_mask.to(self.device)), dim=1)

    def _dense(self, plan: Plan) -> DenseFn:
        """The kernel of the plan's dense products: the target's; in the batch-invariant mode, for a target forward,
        over enough rows that every row's result is the same whatever their number (`invariant_linear`), unless
        its kernel is row-invariant by construction (casspec's own, in a dtype it takes)."""
        if self.batch_invariant and plan.is_target and not self.dense_row_invariant():
            return functools.partial(invariant_linear, self.dense)
        return self.dense

    def dense_row_invariant(self) -> bool:
        """Whether every dense product of a target forward runs a kernel whose rows do not depend on the row count."""
        return self.dense.row_invariant(self.dtype, self.device)

    def linear_kernel(self, i: int, name: str, plan: Plan) -> Callable[[Tensor], Tensor] | None:
        """The kernel that runs projection `name` of layer i: the plan's, else the target's native one; None: the
        dense weight (the one home of this choice: the Python loop and dsia/fastloop.py read it)."""
        fn = plan.linears.get((i, name)) if plan.linears else None
        if fn is None and self.native is not None:
            fn = self.native.linears.get((i, name))
        return fn

    def fused_product(self, i: int, key: str, weight: Tensor | None, parts: tuple[str, ...],
                      plan: Plan) -> tuple[Callable[[Tensor], Tensor] | None, Tensor | None]:
        """One product for the projections `parts` of layer i, as (kernel, None): the plan's fused kernel, else
        (where the plan replaces none of the parts) the native target's; or (None, weight): the layer's own fused
        dense weight (where it has one); (None, None): one product per part."""
        fn = plan.fused.get((i, key)) if plan.fused else None
        if fn is None and not any((i, n) in plan.linears for n in parts):
            if self.native is not None:  # the target's own fused kernel, else one product per part (None)
                return self.native.fused.get((i, key)), None
            return None, weight
        return fn, None

    def _linear(self, i: int, name: str, x: Tensor, w: Tensor, plan: Plan) -> Tensor:
        b = self.layers[i].bias.get(name)
        fn = self.linear_kernel(i, name, plan)
        if fn is not None:
            y = fn(x)
            return y if b is None else y + b
        return self._dense(plan)(x, w, b)

    def _fused(self, i: int, key: str, weight: Tensor | None, parts: tuple[str, ...],
               plan: Plan) -> Callable[[Tensor], Tensor] | None:
        """One product for the projections `parts` of layer i (`fused_product`), callable; None: one each."""
        fn, dense = self.fused_product(i, key, weight, parts, plan)
        return functools.partial(self._dense(plan), w=dense) if dense is not None else fn

    def _attention(self, i: int, lw: LayerWeights, x: Tensor, cache: KVCache, kv: KvAccess, cos: Tensor,
                   sin: Tensor, plan: Plan) -> Tensor:
        s = self.spec
        T = x.shape[0]
        qkv = self._fused(i, "qkv", lw.wqkv, FUSED_GROUPS["qkv"], plan)
        if qkv is not None and lw.q_norm is None and not lw.bias:  # one kernel, one RoPE call for q and k
            qk, v = qkv(x).split([(s.n_heads + s.n_kv_heads) * s.head_dim, s.n_kv_heads * s.head_dim], dim=-1)
            qk = qk.reshape(T, s.n_heads + s.n_kv_heads, s.head_dim).transpose(0, 1)  # [H + Hkv, T, hd]
            v = v.reshape(T, s.n_kv_heads, s.head_dim).transpose(0, 1)  # [Hkv, T, hd]
            if kv.slots is not None:  # RoPE and both cache writes in one step (one kernel when compiled)
                q = self.pointwise.rope_kv(qk, v, cos, sin, cache.k[i], cache.v[i], kv.slots, s.n_heads)
                return self._attend(i, lw, q, cache, kv, plan)
            q, k = self.pointwise.rope(qk, cos, sin).split([s.n_heads, s.n_kv_heads])  # [H, T, hd], [Hkv, T, hd]
            self._write_kv(i, k, v, cache, kv)
            return self._attend(i, lw, q, cache, kv, plan)
        if qkv is not None:  # one kernel for the three projections
            q, k, v = qkv(x).split([s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim,
                                    s.n_kv_heads * s.head_dim], dim=-1)
            q, k, v = (t if lw.bias.get(n) is None else t + lw.bias[n] for t, n in ((q, "q"), (k, "k"), (v, "v")))
        else:
            q = self._linear(i, "q", x, lw.wq, plan)
            k = self._linear(i, "k", x, lw.wk, plan)
            v = self._linear(i, "v", x, lw.wv, plan)
        q = q.reshape(T, s.n_heads, s.head_dim)  # [T, H, hd]
        k = k.reshape(T, s.n_kv_heads, s.head_dim)  # [T, Hkv, hd]
        v = v.reshape(T, s.n_kv_heads, s.head_dim)  # [T, Hkv, hd]
        if lw.q_norm is not None:
            q = self.pointwise.rms_norm(q, lw.q_norm, s.norm_eps)
            k = self.pointwise.rms_norm(k, lw.k_norm, s.norm_eps)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H|Hkv, T, hd]
        q = self.pointwise.rope(q, cos, sin)
        k = self.pointwise.rope(k, cos, sin)
        self._write_kv(i, k, v, cache, kv)
        return self._attend(i, lw, q, cache, kv, plan)

    @staticmethod
    def _write_kv(i: int, k: Tensor, v: Tensor, cache: KVCache, kv: KvAccess) -> None:
        """Write layer i's k, v [Hkv, T, hd] (RoPE applied) to the slots the forward writes."""
        if kv.slots is None:
            cache.write(i, kv.start, k, v)
        else:
            cache.write_slots(i, kv.slots, k, v)

    def _attend(self, i: int, lw: LayerWeights, q: Tensor, cache: KVCache, kv: KvAccess, plan: Plan) -> Tensor:
        """Attend with q [H, T, hd] (RoPE applied) to layer i's cache (this forward's k, v written), project:
        [T, D]."""
        s = self.spec
        T = q.shape[1]
        if kv.own:  # each row over its own keys, one loop
            o = self.pointwise.attention(q, cache.k[i], cache.v[i], kv.end, kv.mask, s.head_dim ** -0.5)  # [T, H*hd]
            return self._linear(i, "o", o, lw.wo, plan)
        if kv.rows is not None:  # batch-invariant: each row over its own keys, block by block
            o = block_attention(q, cache.k[i], cache.v[i], kv.rows, s.head_dim ** -0.5)  # [H, T, hd]
        else:
            if kv.slots is None:
                keys, values = cache.read(i, kv.end)  # [Hkv, end, hd]
            else:
                keys, values = cache.k[i], cache.v[i]  # [Hkv, capacity + spare, hd]
            o = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=kv.mask,
                                               is_causal=kv.is_causal, enable_gqa=s.n_heads != s.n_kv_heads)[0]
        o = o.transpose(0, 1).reshape(T, s.n_heads * s.head_dim)  # [T, H*hd]
        return self._linear(i, "o", o, lw.wo, plan)

    def _mlp(self, i: int, lw: LayerWeights, x: Tensor, plan: Plan) -> Tensor:
        gate_up = self._fused(i, "gate_up", lw.w_gate_up, FUSED_GROUPS["gate_up"], plan)
        if gate_up is not None:
            gate, up = gate_up(x).chunk(2, dim=-1)  # [T, I] each
        else:
            gate = self._linear(i, "gate", x, lw.w_gate, plan)  # [T, I]
            up = self._linear(i, "up", x, lw.w_up, plan)  # [T, I]
        return self._linear(i, "down", self.pointwise.silu_mul(gate, up), lw.w_down, plan)  # [T, D]
