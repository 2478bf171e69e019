"""The decoder layers of a forward as one C++ call (csrc/layers.cpp, built once per machine with the system's C++
compiler and cached by torch.utils.cpp_extension).

A forward is about 36 small operations per layer; on a CPU each one called from Python costs a few microseconds more
than the same call made from C++, which for a 30-layer model is a fifth of a one-token int4 forward and a tenth of a
float32 one. A `LayerStack` holds a plan's layer weights, laid out once, and runs its layers in one call: the same
ATen operations in the same order as `Transformer._layers`, so the same bits (tested). It takes plans whose every
layer runs both sublayers with products that are packed 4-bit kernels (the int4 levels), GGUF blocks as stored
(dsia/blockq.py: a native target) or dense weights through BLAS or MKL's packed sgemm (a float32 target), with or
without q|k|v and gate|up fused, with or without biases, and a batch-invariant target's attention where its products
are all packed (a GGUF target run as stored); the others (skipped sublayers, an early exit, sparse MLPs, other
quantized kernels, oneDNN's product, q/k norms, batch-invariant targets with dense products) run the Python loop.
Where no compiler is found the build fails once, quietly, and every forward runs the Python loop. A float32 call
whose every product is casspec's own (blocks, or dense weights on casspec's kernel), or a bfloat16 one whose every
product is a dense one on casspec's kernel without a bias, and whose norms, RoPE and attention are casspec's ops
runs its layers in one parallel region instead (csrc/step.cpp: no ATen op between them; the same bits,
`LayerStack.one_region`).

The same library holds casspec's own ops: for a float32 or bfloat16 forward's small steps (csrc/ops.cpp: RMSNorm
with the residual add, RoPE, and an attention that computes each row over its own keys, so a row's bits do not depend
on the rows beside it), which `cxx_pointwise` gives the Python loop and a stack runs for a model that has them, so
the two loops stay the same bits; and the block product of GGUF weights as stored (csrc/blockq.cpp).
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .blockq import BlockLinear
from .cxx import LIBRARY_DTYPES
from .invariant import KEYS_PER_BLOCK, FP32_MIN_ROWS, TORCH_OWN_MACS
from .kernels import casspec_panels, kernel_for, mkl_packed
from .layer import FUSED_GROUPS, KvAccess
from .model import Transformer
from .pointwise import EAGER, Pointwise
from .plan import Plan
from .qkernels import FusedLinear, Int4Linear, Int8GroupLinear

if TYPE_CHECKING:
    from .kvcache import KVCache

SLOTS = ("q", "k", "v", "o", "gate", "up", "down")  # a layer's product slots (q holds q|k|v where fused, gate gate|up)
# a slot's kind: empty (a part of a fused product), packed 4-bit, dense weight, GGUF blocks as stored (BlockLinear)
NONE, PACKED, DENSE, BLOCKS = -1, 0, 1, 2
DENSE_KERNELS = {"blas": 1, "mkl": 2, "casspec": 3}  # the dense kernels the C++ loop runs, by DenseKernels name
# the dtype code ATen's ScalarType enum gives each activation dtype a packed kernel may take
SCALAR_TYPE = {torch.float32: 6, torch.float16: 5, torch.bfloat16: 15}


class Unsupported(Exception):
    """A plan the C++ loop does not run (the Python loop does)."""


EMPTY = torch.empty(0)


@dataclass(frozen=True)
class Slot:
    kind: int  # NONE, PACKED, DENSE or BLOCKS
    weight: Tensor  # packed codes, or the dense weight [out, in]
    aux: Tensor  # packed: scales and zeros (blocks: scales); dense: MKL's packed copy where MKL may run it
    bias: Tensor  # [out], or empty
    group_size: int = 0  # packed; blocks: the outputs
    doubled: int = 0  # packed: 1 where the kernel takes [x, x] (Int8GroupLinear); blocks: the block format's code
    act_dtype: torch.dtype | None = None  # packed: the activations' dtype
    panels: Tensor = EMPTY  # dense: casspec's panels of the weight where casspec's kernel may run it


EMPTY_SLOT = Slot(NONE, EMPTY, EMPTY, EMPTY)


@dataclass(frozen=True)
class LayerStack:
    """A plan's layers as one C++ object (torch.classes.casspec.Stack), and the slots it was built from."""
    stack: object
    slots: tuple[Slot, ...]  # [7L]

    @functools.cached_property
    def one_region(self) -> bool:
        """Whether its calls with casspec's ops and attention run in one parallel region (csrc/step.cpp): a float32
        stack of casspec's products, or a bfloat16 one of dense products without biases."""
        return bool(self.stack.one_region())

    @functools.cached_property
    def dense(self) -> bool:
        """Whether any product is dense (a call then names the dense kernel for its token count)."""
        return any(slot.kind == DENSE for slot in self.slots)

    def run(self, model: Transformer, x: Tensor, cache: KVCache, kv: KvAccess, cos: Tensor,
            sin: Tensor) -> tuple[Tensor, Tensor] | None:
        """The layers over x [T, D] (after the embedding), writing K/V at slots [kv.start, kv.end): (x, delta), the
        residual stream and the last MLP's output, not yet added, as the Python loop leaves them; None where the
        dense kernel chosen for T rows is one the C++ loop does not run (the caller runs the Python loop)."""
        name = kernel_for(model.dense, x.shape[0], x.dtype, x.device) if self.dense else "blas"
        if name not in DENSE_KERNELS:
            return None
        if kv.parts:  # a batched forward: each sequence's rows over its own cache, by casspec's ops and attention
            if model.pointwise.attention is None or not all(p.kv.own for p in kv.parts):
                return None
            return self.stack.run_batch(x, DENSE_KERNELS[name], [p.cache.k for p in kv.parts],
                                        [p.cache.v for p in kv.parts], cos, sin,
                                        [p.rows.stop - p.rows.start for p in kv.parts],
                                        [p.kv.start for p in kv.parts], [p.kv.end for p in kv.parts],
                                        [p.kv.mask for p in kv.parts])
        rows = kv.rows  # the batch-invariant attention's keys of each row (None: SDPA)
        return self.stack.run(x, DENSE_KERNELS[name], cache.k, cache.v, cos, sin, kv.start, kv.end, kv.mask,
                              kv.is_causal, None if rows is None else rows.bias, None if rows is None else rows.tail,
                              0 if rows is None else rows.shared, 0 if rows is None else rows.end,
                              model.pointwise.attention is not None, kv.own)


def _packed_slot(kernel: object, bias: Tensor | None) -> Slot:
    if isinstance(kernel, FusedLinear):
        kernel = kernel.kernel
    if isinstance(kernel, BlockLinear):
        return Slot(BLOCKS, kernel.codes, kernel.scales, EMPTY if bias is None else bias, kernel.out_features,
                    kernel.format)
    if not isinstance(kernel, (Int4Linear, Int8GroupLinear)):
        raise Unsupported(type(kernel).__name__)
    return Slot(PACKED, kernel.packed, kernel.scales_and_zeros, EMPTY if bias is None else bias, kernel.group_size,
                int(isinstance(kernel, Int8GroupLinear)), kernel.act_dtype)


def _dense_slot(model: Transformer, w: Tensor, bias: Tensor | None) -> Slot:
    mkl, own = model.dense.keeps_copy("mkl", w), model.dense.keeps_copy("casspec", w)
    return Slot(DENSE, w, mkl_packed(w) if mkl else EMPTY, EMPTY if bias is None else bias,
                panels=casspec_panels(w) if own else EMPTY)


def _linear_slot(model: Transformer, plan: Plan, i: int, name: str) -> Slot:
    """Projection `name` of layer i, with the kernel Transformer.linear_kernel chooses."""
    lw = model.layers[i]
    kernel = model.linear_kernel(i, name, plan)
    bias = lw.bias.get(name)
    if kernel is not None:
        return _packed_slot(kernel, bias)
    return _dense_slot(model, lw.projections()[name], bias)


def _layer_slots(model: Transformer, plan: Plan, i: int) -> list[Slot]:
    """Layer i's seven product slots, with the kernels Transformer.fused_product / linear_kernel choose."""
    lw = model.layers[i]
    slots = {"o": _linear_slot(model, plan, i, "o"), "down": _linear_slot(model, plan, i, "down")}
    for group, parts in FUSED_GROUPS.items():
        kernel, dense = model.fused_product(i, group, lw.wqkv if group == "qkv" else lw.w_gate_up, parts, plan)
        if kernel is None and dense is None:  # one product per part
            slots.update({p: _linear_slot(model, plan, i, p) for p in parts})
            continue
        # (a fused product's slots hold its parts' biases, added after its split, as the Python loop adds them)
        slot = _packed_slot(kernel, None) if kernel is not None else _dense_slot(model, dense, None)
        slots[parts[0]] = dataclasses.replace(slot, bias=lw.bias.get(parts[0], EMPTY))
        slots.update({p: dataclasses.replace(EMPTY_SLOT, bias=lw.bias.get(p, EMPTY)) for p in parts[1:]})
    return [slots[name] for name in SLOTS]


def layer_stack(model: Transformer, plan: Plan) -> LayerStack | None:
    """The plan's layers as one C++ call (see the module docstring), or None where the Python loop runs them."""
    s = model.spec
    if (plan.skip_attn or plan.skip_mlp or plan.exit_after is not None or plan.mlps or s.qk_norm
            or model.device.type != "cpu"):
        return None
    try:
        slots = [slot for i in range(s.n_layers) for slot in _layer_slots(model, plan, i)]
    except Unsupported:
        return None
    if (model.batch_invariant and plan.is_target and any(slot.kind == DENSE for slot in slots)
            and not model.dense_row_invariant()):
        return None  # (its dense products run over padded rows: invariant_linear, in the Python loop)
    acts = {slot.act_dtype for slot in slots if slot.kind == PACKED}
    if len(acts) > 1:
        return None
    norms = [w for lw in model.layers for w in (lw.attn_norm, lw.mlp_norm)]
    stack = torch.classes.casspec.Stack(
        norms, [slot.kind for slot in slots], [slot.weight for slot in slots], [slot.aux for slot in slots],
        [slot.panels for slot in slots], [slot.bias for slot in slots], [slot.group_size for slot in slots],
        [slot.doubled for slot in slots],
        SCALAR_TYPE[acts.pop() if acts else torch.float32], s.n_heads, s.n_kv_heads, s.norm_eps,
        [KEYS_PER_BLOCK, FP32_MIN_ROWS, TORCH_OWN_MACS])
    return LayerStack(stack, tuple(slots))


class Stacks:
    """Each plan's LayerStack (or None), found on the plan's first forward and kept while the plan lives."""

    def __init__(self) -> None:
        # plan -> (the target's native kernels it was found with, its stack)
        self._of: weakref.WeakKeyDictionary[Plan, tuple[Plan | None, LayerStack | None]] = \
            weakref.WeakKeyDictionary()

    def get(self, model: Transformer, plan: Plan) -> LayerStack | None:
        found = self._of.get(plan)
        if found is None or found[0] is not model.native:
            found = self._of[plan] = (model.native, layer_stack(model, plan))
        return found[1]


def _own_cpu(*xs: Tensor) -> bool:
    """Whether the tensors are CPU ones of one dtype casspec's ops take (float32 or bfloat16)."""
    return all(x.dtype == xs[0].dtype and x.dtype in LIBRARY_DTYPES and x.device.type == "cpu" for x in xs)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.dim() == 2 and _own_cpu(x) and x.stride(1) == 1:
        return torch.ops.casspec.rms_norm(x, weight, eps)
    return EAGER.rms_norm(x, weight, eps)  # (q/k norms over [T, heads, hd], other dtypes)


def _add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if x.dim() == 2 and _own_cpu(x, delta) and x.stride(1) == 1 and delta.stride(1) == 1:
        return torch.ops.casspec.add_rms_norm(x, delta, weight, eps)
    return EAGER.add_rms_norm(x, delta, weight, eps)


def _silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    if gate.dim() == 2 and _own_cpu(gate, up) and gate.stride(1) == 1 and up.stride(1) == 1:
        return torch.ops.casspec.silu_mul(gate, up)
    return EAGER.silu_mul(gate, up)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    if x.dim() == 3 and _own_cpu(x) and x.stride(2) == 1:
        return torch.ops.casspec.rope(x, cos, sin)
    return EAGER.rope(x, cos, sin)


@functools.cache
def cxx_pointwise() -> Pointwise:
    """The forward's small steps by casspec's C++ ops where they take the tensors (float32 or bfloat16 on a CPU:
    RMSNorm with the residual add, RoPE, the MLP's silu(gate) * up, and each row's attention over its own keys; a
    bfloat16 op rounds each result where the eager ops round it), else eagerly.
    The C++ loop calls the same ops for a model with this Pointwise, so both loops give the same bits. Needs the
    build (`build_error()` None)."""
    return dataclasses.replace(EAGER, rms_norm=_rms_norm, add_rms_norm=_add_rms_norm, rope=_rope,
                               silu_mul=_silu_mul, attention=torch.ops.casspec.attention)
