"""The k largest entries of each row of a [T, V] tensor over a large vocabulary, for a small k (drafts' next tokens,
a head's shortlist), and with them the row's log-sum-exp (a draft's probabilities of those tokens).

On a CPU with casspec's library built, one pass of its own op (csrc/rowtop.cpp: 5-25 us a row over 49k tokens on a
2-core AMD EPYC, against 50-130 us for ATen's softmax or log-sum-exp and top-k); elsewhere ATen's ops."""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from .cxx import ISAS, build_error

TOPK_BLOCK = 1024  # ATen's path: a row is cut into blocks this long; the top k lie in the k blocks with the largest
# maxima


def _own_op(x: Tensor, k: int) -> bool:
    """Whether casspec's op takes x and k: a float32 CPU matrix, k in 1..its row's length, the library built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and 0 < k <= x.shape[1]
            and build_error() is None)


@functools.cache
def _own_lse() -> bool:
    """Whether the library's log-sum-exp beats ATen's here: on its AVX-512 path (15 us a 49k row on the AMD EPYC,
    top k included). On its AVX2 and plain paths GCC compares the 16 lanes of e^x's underflow test one by one
    (136 and 72 us there, against ATen's 37)."""
    return build_error() is None and torch.ops.casspec.machine_isa() == ISAS.index("avx512")


def top_k(x: Tensor, k: int, block: int = TOPK_BLOCK) -> tuple[Tensor, Tensor]:
    """torch.topk(x, k) of rows x [T, V] for a small k (values, indices [T, k], largest first; of equal values the
    lower index first where casspec's op runs). ATen's path, about twice as fast as torch.topk on a CPU over a 50k
    vocabulary: each of the k largest lies in a block whose maximum is among the k largest block maxima, so one
    pass takes the blocks' maxima and the sort looks at k blocks only. (On a GPU, where its five kernels would cost
    more than one, torch.topk itself.)"""
    if _own_op(x, k):
        return torch.ops.casspec.row_top(x, k)
    T, V = x.shape
    if x.device.type != "cpu" or V % block or k * block >= V:
        return x.topk(k, dim=-1)
    blocks = x.reshape(T, V // block, block)  # [T, nb, B] (a view where x is contiguous)
    best = blocks.amax(-1).topk(k, dim=-1).indices  # [T, k] the blocks holding the top k
    cand = blocks.gather(1, best[:, :, None].expand(T, k, block)).reshape(T, k * block)  # [T, k*B]
    values, at = cand.topk(k, dim=-1)  # [T, k]
    return values, best.gather(1, at // block) * block + at % block


def argmax_rows(x: Tensor) -> Tensor:
    """The index of each row's largest entry of x [T, V]: [T] int64 (of equal ones the lowest index, as torch.argmax;
    NaN read as -inf, on every path). The target's greedy token: casspec's op where it runs (one pass, 3-6 us a row
    over 49k tokens against ATen's 35-45 us a call on a 2-core AMD EPYC), ATen's argmax elsewhere."""
    if _own_op(x, 1) and x.stride(-1) == 1:
        return torch.ops.casspec.row_top(x, 1)[1][:, 0]
    return torch.nan_to_num(x, nan=float("-inf")).argmax(-1)


def top_k_logsumexp(x: Tensor, k: int, scale: float = 1.0,
                    block: int = TOPK_BLOCK) -> tuple[Tensor, Tensor, Tensor]:
    """The k largest entries of rows x [T, V] (as top_k; block: as top_k's) and each row's log(sum_j e^(scale x_j))
    [T] (scale > 0): softmax(scale x) at the top k is e^(scale values - lse)."""
    if _own_op(x, k) and scale > 0 and _own_lse():
        return torch.ops.casspec.row_top_lse(x, k, scale)
    values, indices = top_k(x, k, block)
    return values, indices, (x * scale).logsumexp(-1)
