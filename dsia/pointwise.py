"""The forward's small elementwise steps (RMSNorm, RoPE, the gated MLP's activation, KV writes) and the `Pointwise`
bundle that runs them: eagerly, compiled into one kernel each (a GPU), or as casspec's C++ ops (dsia/fastloop.py)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


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
