"""Functional Llama-family forward over the checkpoint's own weight tensors (no second copy).

Supports Llama / SmolLM2, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm). One call:
(tokens, positions, write slot, scratch attention mask, plan) -> logits, writing K/V only at the slots given.
Batch size 1 throughout; shapes use T = tokens in this forward, D = hidden size, H = heads, Hkv = KV heads.
The variant builders (`with_*`) and weight accounting are inherited from dsia/variants.py; a layer's weights are
dsia/layer.py's, the elementwise steps dsia/pointwise.py's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .blockq import BlockLinear
from .errors import CasspecError
from .invariant import KEYS_PER_BLOCK, block_attention, invariant_linear, row_keys
from .cxx import LIBRARY_DTYPES
from .kernels import DenseFn, DenseKernels
from .kvcache import KVCache
from .layer import FUSED_GROUPS, BatchPart, KvAccess, LayerWeights
from .plan import TARGET, Plan
from .pointwise import EAGER
from .spec import DEFAULT_CONTEXT, ModelSpec
from .variants import GraphBackend, StackBackend, Variants


@dataclass(frozen=True)
class BatchItem:
    """One sequence's share of a batched forward (`Transformer.forward_batch`): as forward's arguments."""
    cache: KVCache  # the sequence's own cache
    tokens: Tensor  # [T]
    positions: Tensor  # [T] absolute
    start: int  # first slot written (>= cache.length)
    scratch_mask: Tensor | None = None  # [T, start + T - cache.length] bool (None: causal)
    head_rows: int | None = None  # its last rows that get logits (None: all; 0: none, a prompt's chunk)


class Transformer(Variants):
    """The runtime: spec + references to the HF model's tensors + RoPE tables. Stateless across calls."""

    def __init__(self, spec: ModelSpec, embed: Tensor, layers: list[LayerWeights], norm: Tensor,
                 lm_head: Tensor, inv_freq: Tensor, rope_scale: float) -> None:
        self.spec = spec
        # the dense product of every target linear and the head, per token count: oneDNN where it exists for the
        # dtype, else BLAS; `with_dense` gives a view running the fastest measured on this machine
        # (casspec.calibrate.tune)
        self.dense = DenseKernels.default(norm.dtype, norm.device)
        self.graphs: GraphBackend | None = None  # CUDA graphs of small forwards (`with_graphs`); None runs eagerly
        self.pointwise = EAGER  # the elementwise steps (`with_pointwise`: compiled ones on a GPU)
        self.batch_invariant = False  # target forwards whose rows do not depend on each other (`with_batch_invariant`)
        self.stacks: StackBackend | None = None  # plans whose layers run as one C++ call (`with_stacks`); None: Python
        # the target's own kernels where the checkpoint is run in its stored quantization (`with_native`): every
        # product a plan does not replace runs them instead of the dense weights; None: the dense weights
        self.native: Plan | None = None
        self.embed = embed  # [V, D] (a meta tensor where the embedding is held as stored blocks, `embed_blocks`)
        self.embed_blocks: BlockLinear | None = None  # the token embedding as a GGUF file stores it (native)
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

    def embed_rows(self, tokens: Tensor) -> Tensor:
        """The embedding's rows of `tokens` [T]: [T, D] (dequantized from the stored blocks where it is held so)."""
        if self.embed_blocks is not None:
            return self.embed_blocks.rows(tokens.flatten()).to(self.dtype).reshape(*tokens.shape, -1)
        return F.embedding(tokens, self.embed)

    def head_source(self) -> Tensor | BlockLinear:
        """What a head's exact rows are read from: the LM head tensor, or the native head's blocks where that is all
        the model holds of it (never a float copy)."""
        if self.lm_head.is_meta and self.native is not None and isinstance(self.native.head, BlockLinear):
            return self.native.head
        return self.lm_head

    def dense_head(self) -> Tensor:
        """The LM head's float weight [V, D]: the tensor held, or dequantized from the native head's blocks (a
        temporary, for what builds a level from it)."""
        src = self.head_source()
        return src.dequantize() if isinstance(src, BlockLinear) else src

    def head_rows(self, tokens: Tensor) -> Tensor:
        """The LM head's float rows of `tokens` [n]: [n, D] (from the native head's blocks where it is held so)."""
        src = self.head_source()
        return src.rows(tokens) if isinstance(src, BlockLinear) else src.index_select(0, tokens)

    def new_cache(self, capacity: int | None = None, spare: int = 0) -> KVCache:
        s = self.spec
        cap = min(capacity or self.context, self.context)
        if self.batch_invariant:  # its attention reads whole blocks of slots, past the last one written
            spare = max(spare, KEYS_PER_BLOCK)
        self._check_fits(cap + spare)
        return KVCache(s.n_layers, s.n_kv_heads, s.head_dim, cap, self.dtype, self.device, spare)

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
        T, end = tokens.shape[0], start + tokens.shape[0]
        if end > cache.capacity:
            raise CasspecError(f"context window full ({cache.capacity} tokens); shorten the prompt or the output")
        if self.graphs is not None and visible_prefix is None:  # a captured CUDA graph, where one fits
            logits = self.graphs.run(cache, tokens, positions, start, scratch_mask, plan, logits_rows)
            if logits is not None:
                return logits
        kernel = self._attention_of(plan)
        if kernel == "rows":
            rows = row_keys(cache.length, start, T, scratch_mask, visible_prefix, self.device)
            cache.reserve(max(end, rows.shared))
            kv = KvAccess(start=start, end=end, rows=rows)
        else:
            kv = self._masked(cache, start, T, scratch_mask, visible_prefix, own=kernel == "own")
        return self._layers(cache, tokens, positions, kv, plan, logits_rows)

    def forward_batch(self, items: Sequence[BatchItem], plan: Plan = TARGET) -> list[Tensor]:
        """Several sequences' forwards as one (continuous batching), their rows sharing every product, each attending
        over its own cache (casspec's own attention where it runs: each row the bits it gets alone, whatever the rows
        beside it; SDPA per sequence elsewhere). Returns each item's logits [N_i, V] in float32."""
        parts, row0 = [], 0
        for it in items:
            T = it.tokens.shape[0]
            if it.start + T > it.cache.capacity:
                raise CasspecError(f"context window full ({it.cache.capacity} tokens); shorten the output")
            kv = self._masked(it.cache, it.start, T, it.scratch_mask, None, self._own_attention)
            parts.append(BatchPart(it.cache, slice(row0, row0 + T), kv))
            row0 += T
        tokens = torch.cat([it.tokens for it in items])  # [sum T]
        positions = torch.cat([it.positions for it in items])  # [sum T]
        heads = [len(it.tokens) if it.head_rows is None else it.head_rows for it in items]
        rows = None if heads == [len(it.tokens) for it in items] else torch.cat([  # the rows that get logits
            torch.arange(p.rows.stop - n, p.rows.stop, device=self.device) for p, n in zip(parts, heads)])
        logits = self._layers(items[0].cache, tokens, positions, KvAccess(parts=tuple(parts)), plan, rows)  # [R, V]
        return list(logits.split(heads))

    def _masked(self, cache: KVCache, start: int, T: int, scratch_mask: Tensor | None, visible_prefix: int | None,
                own: bool) -> KvAccess:
        """Slots [start, start + T) made safe to read and what each row sees (own attention's order is causal by
        slot: a chain needs no mask; SDPA's causal prefill at slot 0 is is_causal)."""
        cache.reserve(start + T)
        chain = own and scratch_mask is None and visible_prefix is None
        mask = None if chain else self._attn_mask(cache.length, start, T, scratch_mask, visible_prefix)
        return KvAccess(start=start, end=start + T, mask=mask, is_causal=mask is None and T > 1 and not own, own=own)

    def _attention_of(self, plan: Plan) -> str:
        """Which attention a forward runs: "own" (Pointwise.attention: each row over its own keys, one loop) wherever
        the Pointwise has one, a prompt's too (each row's bits then the same however a prompt is split, and faster
        than SDPA since a KV head's query heads go together: SmolLM2's 26 dev prompts in float32 on a 2-core AMD
        EPYC, 5.85-6.12 s against 6.68-7.06, bfloat16 7.69-8.11 against 8.05-8.62); else "rows" (block_attention)
        for a batch-invariant target, a prompt's prefill too (a later prompt that starts with this one reuses its
        KV: written otherwise, it would differ in the last bits from what one-token steps write), "sdpa" elsewhere."""
        if self._own_attention:
            return "own"
        return "rows" if self.batch_invariant and plan.is_target else "sdpa"

    @property
    def _own_attention(self) -> bool:
        """Whether casspec's attention op takes this model's forwards (its Pointwise has one; CPU, a dtype it takes)."""
        return self.pointwise.attention is not None and self.dtype in LIBRARY_DTYPES and self.device.type == "cpu"

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
        x = self.embed_rows(tokens)  # [T, D] the residual stream
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

    def rows_split_alike(self) -> bool:
        """Whether a target forward's rows get the same bits however its rows are split between forwards (a prompt's
        in chunks): its own attention, and products whose rows do not depend on the rows beside them."""
        return self._own_attention and (self.batch_invariant or self.dense_row_invariant())

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
        b, fn = self.layers[i].bias.get(name), self.linear_kernel(i, name, plan)
        if fn is None:
            return self._dense(plan)(x, w, b)
        return fn(x) if b is None else fn(x) + b

    def _fused(self, i: int, key: str, weight: Tensor | None, parts: tuple[str, ...],
               plan: Plan) -> Callable[[Tensor], Tensor] | None:
        """One product for the projections `parts` of layer i (`fused_product`), callable; None: one each."""
        fn, dense = self.fused_product(i, key, weight, parts, plan)
        return functools.partial(self._dense(plan), w=dense) if dense is not None else fn

    def _attention(self, i: int, lw: LayerWeights, x: Tensor, cache: KVCache, kv: KvAccess, cos: Tensor,
                   sin: Tensor, plan: Plan) -> Tensor:
        s, T = self.spec, x.shape[0]
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
        for p in kv.parts:  # (a batched forward: each sequence's rows to its own cache)
            p.cache.write(i, p.kv.start, k[:, p.rows], v[:, p.rows])
        if kv.parts:
            return
        if kv.slots is None:
            cache.write(i, kv.start, k, v)
        else:
            cache.write_slots(i, kv.slots, k, v)

    def _attend(self, i: int, lw: LayerWeights, q: Tensor, cache: KVCache, kv: KvAccess, plan: Plan) -> Tensor:
        """Attend with q [H, T, hd] (RoPE applied) to layer i's cache (this forward's k, v written), project:
        [T, D]."""
        if kv.parts:  # a batched forward: each sequence's rows over its own cache
            o = torch.cat([self._attend_rows(i, q[:, p.rows], p.cache, p.kv) for p in kv.parts])  # [T, H*hd]
        else:
            o = self._attend_rows(i, q, cache, kv)  # [T, H*hd]
        return self._linear(i, "o", o, lw.wo, plan)

    def _attend_rows(self, i: int, q: Tensor, cache: KVCache, kv: KvAccess) -> Tensor:
        """Layer i's attention of q [H, T, hd] over its cache as kv says: [T, H*hd] (the output projection's input)."""
        s = self.spec
        T = q.shape[1]
        if kv.own:  # each row over its own keys, one loop
            return self.pointwise.attention(q, cache.k[i], cache.v[i], kv.end, kv.mask, s.head_dim ** -0.5)
        if kv.rows is not None:  # batch-invariant: each row over its own keys, block by block
            o = block_attention(q, cache.k[i], cache.v[i], kv.rows, s.head_dim ** -0.5)  # [H, T, hd]
        else:
            if kv.slots is None:
                keys, values = cache.read(i, kv.end)  # [Hkv, end, hd]
            else:
                keys, values = cache.k[i], cache.v[i]  # [Hkv, capacity + spare, hd]
            o = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=kv.mask,
                                               is_causal=kv.is_causal, enable_gqa=s.n_heads != s.n_kv_heads)[0]
        return o.transpose(0, 1).reshape(T, s.n_heads * s.head_dim)  # [T, H*hd]

    def _mlp(self, i: int, lw: LayerWeights, x: Tensor, plan: Plan) -> Tensor:
        return self.mlp_down(i, self.mlp_hidden(i, x, plan), plan)  # [T, D]

    def mlp_hidden(self, i: int, x: Tensor, plan: Plan = TARGET) -> Tensor:
        """Layer i's MLP up to silu(gate) * up of x [T, D] (after its norm), with the plan's kernels: [T, I]."""
        lw = self.layers[i]
        gate_up = self._fused(i, "gate_up", lw.w_gate_up, FUSED_GROUPS["gate_up"], plan)
        if gate_up is not None:
            gate, up = gate_up(x).chunk(2, dim=-1)  # [T, I] each
        else:
            gate = self._linear(i, "gate", x, lw.w_gate, plan)  # [T, I]
            up = self._linear(i, "up", x, lw.w_up, plan)  # [T, I]
        return self.pointwise.silu_mul(gate, up)

    def mlp_down(self, i: int, h: Tensor, plan: Plan = TARGET) -> Tensor:
        """Layer i's down product of h [T, I], with the plan's kernels: [T, D]."""
        return self._linear(i, "down", h, self.layers[i].w_down, plan)
