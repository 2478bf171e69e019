"""The layer loop of packed 4-bit forwards in C++ (csrc/layers.cpp, built once per machine with the system's C++
compiler and cached by torch.utils.cpp_extension).

A draft level's forward is about 36 small operations per layer; on a CPU each one called from Python costs a few
microseconds more than the same call made from C++, which for a 30-layer model is a third of a one-token int4
forward. `Int4Stack` runs the decoder layers of a plan whose every product is a packed 4-bit kernel (the int4 levels,
a GGUF target as stored, whose Q8_0 blocks run as two 4-bit planes) as one call: the same ATen operations in the
same order as `Transformer._layers`, so the same bits (tested), without Python between them. Plans with anything
else (skipped sublayers, an early exit, sparse MLPs, dense or NF4 products, biases, q/k norms) run the Python loop.
Where no compiler is found the build fails once, quietly, and every forward runs the Python loop.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .model import FUSED_GROUPS, KvAccess, Transformer
from .plan import Plan
from .quant import FusedLinear, Int4Linear, Int8GroupLinear

if TYPE_CHECKING:
    from .kvcache import KVCache

SOURCE = Path(__file__).parent / "csrc" / "layers.cpp"
EXTENSION = "casspec_layers"  # the built library's name (torch's extension cache rebuilds it when the source changes)
# the dtype code ATen's ScalarType enum gives each activation dtype a packed kernel may take
SCALAR_TYPE = {torch.float32: 6, torch.float16: 5, torch.bfloat16: 15}


@functools.cache
def build_error() -> str | None:
    """Build (or load the cached build of) the C++ layer loop once per process: None when torch.ops.casspec holds
    it, else why not (the Python loop then runs every forward)."""
    try:
        from torch.utils.cpp_extension import load
        load(name=EXTENSION, sources=[str(SOURCE)], extra_cflags=["-O2"], is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja, a header mismatch: the Python loop is the same computation
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


@dataclass(frozen=True)
class Int4Stack:
    """A plan's decoder layers laid out for one C++ call: per layer two norms and four products (q|k|v, o,
    gate|up, down), each product's packed weight, scales and zeros, group size, and whether it takes [x, x]."""
    norms: list[Tensor]  # [2L] attention, MLP norm weights [D]
    packed: list[Tensor]  # [4L]
    scales: list[Tensor]  # [4L]
    group_sizes: list[int]  # [4L]
    doubled: list[int]  # [4L] 1: 8-bit codes as two 4-bit planes (Int8GroupLinear)
    act_dtype: int  # ATen ScalarType code of the activations every product takes
    n_heads: int
    n_kv_heads: int
    eps: float

    def run(self, x: Tensor, cache: KVCache, kv: KvAccess, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """The layers over x [T, D] (after the embedding), writing K/V at slots [kv.start, kv.end): (x, delta),
        the residual stream and the last MLP's output, not yet added, as the Python loop leaves them."""
        return torch.ops.casspec.int4_layers(x, self.norms, self.packed, self.scales, self.group_sizes,
                                             self.doubled, self.act_dtype, cache.k, cache.v, cos, sin, kv.start,
                                             kv.end, kv.mask, kv.is_causal, self.n_heads, self.n_kv_heads, self.eps)


def _packed(kernel: object) -> Int4Linear | Int8GroupLinear | None:
    """The packed 4-bit kernel behind a plan's product (None: another kind)."""
    if isinstance(kernel, FusedLinear):
        kernel = kernel.kernel
    return kernel if isinstance(kernel, (Int4Linear, Int8GroupLinear)) else None


def _product(model: Transformer, plan: Plan, i: int, key: str) -> object:
    """The kernel the Python loop runs for product `key` of layer i (None: a dense weight, or parts one by one),
    as Transformer._fused and _linear choose it."""
    native = model.native or Plan()
    if key in FUSED_GROUPS:
        kernel = plan.fused.get((i, key))
        if kernel is None and not any((i, p) in plan.linears for p in FUSED_GROUPS[key]):
            kernel = native.fused.get((i, key))
        return kernel
    return plan.linears.get((i, key), native.linears.get((i, key)))


def int4_stack(model: Transformer, plan: Plan) -> Int4Stack | None:
    """The plan's layers as one C++ call, where every product is packed 4-bit and the layers are plain (see the
    module docstring); None where not."""
    s = model.spec
    if (plan.skip_attn or plan.skip_mlp or plan.exit_after is not None or plan.mlps or s.qk_norm
            or model.device.type != "cpu" or any(lw.bias for lw in model.layers)):
        return None
    norms, kernels = [], []
    for i, lw in enumerate(model.layers):
        norms += [lw.attn_norm, lw.mlp_norm]
        kernels += [_packed(_product(model, plan, i, key)) for key in ("qkv", "o", "gate_up", "down")]
    if any(k is None for k in kernels) or len({k.act_dtype for k in kernels}) != 1:
        return None
    return Int4Stack(norms, [k.packed for k in kernels], [k.scales_and_zeros for k in kernels],
                     [k.group_size for k in kernels], [int(isinstance(k, Int8GroupLinear)) for k in kernels],
                     SCALAR_TYPE[kernels[0].act_dtype], s.n_heads, s.n_kv_heads, s.norm_eps)


class Stacks:
    """Each plan's Int4Stack (or None), found on the plan's first forward and kept while the plan lives."""

    def __init__(self) -> None:
        # plan -> (the target's native kernels it was found with, its stack)
        self._of: weakref.WeakKeyDictionary[Plan, tuple[Plan | None, Int4Stack | None]] = weakref.WeakKeyDictionary()

    def get(self, model: Transformer, plan: Plan) -> Int4Stack | None:
        found = self._of.get(plan)
        if found is None or found[0] is not model.native:
            found = self._of[plan] = (model.native, int4_stack(model, plan))
        return found[1]
