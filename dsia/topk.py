"""The k largest entries of each row of a [T, V] tensor over a large vocabulary, for a small k (drafts' next tokens,
a head's shortlist)."""
from __future__ import annotations

from torch import Tensor

TOPK_BLOCK = 1024  # a row is cut into blocks this long; the top k lie in the k blocks with the largest maxima


def top_k(x: Tensor, k: int, block: int = TOPK_BLOCK) -> tuple[Tensor, Tensor]:
    """torch.topk(x, k) of rows x [T, V] for a small k (values, indices [T, k], largest first), about twice as fast
    on a CPU over a 50k vocabulary: each of the k largest lies in a block whose maximum is among the k largest
    block maxima, so one pass takes the blocks' maxima and the sort looks at k blocks only. (On a GPU, where its
    five kernels would cost more than one, torch.topk itself.)"""
    T, V = x.shape
    if x.device.type != "cpu" or V % block or k * block >= V:
        return x.topk(k, dim=-1)
    blocks = x.reshape(T, V // block, block)  # [T, nb, B] (a view where x is contiguous)
    best = blocks.amax(-1).topk(k, dim=-1).indices  # [T, k] the blocks holding the top k
    cand = blocks.gather(1, best[:, :, None].expand(T, k, block)).reshape(T, k * block)  # [T, k*B]
    values, at = cand.topk(k, dim=-1)  # [T, k]
    return values, best.gather(1, at // block) * block + at % block
