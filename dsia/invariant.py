"""Batch-invariant target forwards: each row's logits whatever the other rows of its forward (bfloat16, CPU).

A tree verification runs N tokens in one forward, `ar` one per forward; in bfloat16 the kernels sum in orders that
depend on those shapes, so at a near-tie of the target the two can pick different tokens. Measured on an Intel Xeon
(torch 2.13, oneDNN 3.12; scripts/bf16_batch_invariance.py), a row's result there depends on the other rows through:

- the attention: SDPA's flash kernel blocks the queries by their count (one query is a case of its own) and the
  keys by their length, and a tree row's keys have masked ones between them, which moves the rest within its VNNI
  pairs and vector lanes;
- the dense products: torch computes a bfloat16 product of at most 16^3 multiply-adds with its own kernels and a
  larger one with oneDNN's, and oneDNN's kernel for one row sums a long dot product (in-features > 1024) in
  another order than its kernels for more rows. Over two rows or more, in oneDNN, every row's result was the same
  whatever the row count (every product shape tried, 1-70 rows) -- an observation, which oneDNN does not promise.

So in this mode every product runs through oneDNN over two rows or more (`invariant_linear`, `invariant_matmul`
pad the rows), and the attention (`block_attention`) lays each row's keys out in position order (the committed
prefix, then its own ancestors), in blocks of KEYS_PER_BLOCK positions: scores of every row against every slot read
(each one dot product over the head), a float32 softmax over the row's positions (the masked ones past its last key
are zeros), each block's share of the output by a product over exactly KEYS_PER_BLOCK keys, and the blocks summed
pairwise in position order. Committed whole blocks are read in place by every row; the positions past them (a tree row's
ancestors, at most KEYS_PER_BLOCK + depth keys) are gathered per row. The arithmetic is that of HF's eager attention in
bfloat16 (scores and probabilities rounded to bfloat16), with the weighted sum taken per block.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .errors import CasspecError
from .kernels import DenseFn

KEYS_PER_BLOCK = 64  # key positions per block: the fixed unit of every attention reduction in the mode


def check_supported(dtype: torch.dtype, device: torch.device, native: bool = False) -> None:
    """The mode's invariance is that of oneDNN's bfloat16 CPU kernels (what the tests check); a native quantized
    target (float32 around packed int4 kernels, whose bfloat16 activations would round the attention's last-bit
    differences into larger ones) takes it in float32 too."""
    if device.type != "cpu" or (dtype != torch.bfloat16 and not (native and dtype == torch.float32)):
        raise CasspecError("batch-invariant forwards are implemented for bfloat16 on a CPU (in float32 every method "
                           "already gives ar's tokens, see the README); use --dtype bfloat16 --device cpu")


TORCH_OWN_MACS = 16 ** 3  # torch computes a bf16 product of at most this many multiply-adds (all its matrices
# together) with kernels of its own, a larger one with oneDNN's (aten/src/ATen/native/mkldnn/Matmul.cpp, checksize)


FP32_MIN_ROWS = 3  # in float32 (MKL's sgemm) a product over one or two rows sums otherwise than over three or more
# (measured on the Intel Xeon: from three rows on, every row's result was the same whatever the count)


def min_rows(batch: int, inner: int, cols: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """The fewest rows a product of `batch` matrices [rows, inner] @ [inner, cols] runs over in the mode: in
    bfloat16 two (a one-row product is oneDNN's matrix-vector kernel), and enough for torch to hand it to oneDNN;
    in float32 FP32_MIN_ROWS."""
    if dtype == torch.float32:
        return FP32_MIN_ROWS
    return max(2, TORCH_OWN_MACS // max(1, batch * inner * cols) + 1)


def _pad_rows(a: Tensor, rows: int) -> Tensor:
    """a [..., M, K] with its first row repeated up to `rows` rows (a itself where it has that many)."""
    M = a.shape[-2]
    if M >= rows:
        return a
    return torch.cat((a, a[..., :1, :].expand(*a.shape[:-2], rows - M, a.shape[-1])), dim=-2)


def invariant_linear(dense: DenseFn, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """dense(x, w, b) for x [T, in], w [out, in], over `min_rows` rows at least (the padding dropped): [T, out]."""
    return dense(_pad_rows(x, min_rows(1, w.shape[1], w.shape[0], x.dtype)), w, b)[:x.shape[0]]


def invariant_matmul(a: Tensor, b: Tensor) -> Tensor:
    """a [..., M, K] @ b [..., K, N] over `min_rows` rows at least: [..., M, N]."""
    M, K = a.shape[-2:]
    return (_pad_rows(a, min_rows(a.numel() // (M * K), K, b.shape[-1], a.dtype)) @ b)[..., :M, :]


PROBE_ROWS = (1, 2, 3, 5, 8, 16)  # row counts the self-check compares


@torch.inference_mode()
def rows_independent(dense: DenseFn, shapes: set[tuple[int, int]], hd: int, dtype: torch.dtype,
                     device: torch.device, kernels: tuple[tuple[Callable[[Tensor], Tensor], int], ...] = (),
                     attention: bool = True) -> bool:
    """The mode's premise on this machine: `invariant_linear` over each (in, out) product shape, the attention's
    block products (head size hd) and the given kernels ((x [T, in] -> [T, out], in): a native target's), give every
    row what it gets alone, whatever the row count. An observation of the kernels (oneDNN's), not their promise, so
    `Transformer.with_batch_invariant` checks it where it runs."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    cases = [(functools.partial(invariant_linear, dense), rand(n_out, n_in)) for n_in, n_out in sorted(shapes)]
    if attention:  # (the block attention's products: q @ k.T, p @ v)
        cases += [(invariant_matmul, rand(KEYS_PER_BLOCK, hd).t()), (invariant_matmul, rand(KEYS_PER_BLOCK, hd))]
    cases += [(lambda x, w, k=k: k(x), rand(1, n_in)) for k, n_in in kernels]  # (w: only its in-features count)
    R = max(PROBE_ROWS)
    for fn, w in cases:
        x = rand(R, w.shape[1] if fn is not invariant_matmul else w.shape[0])  # [R, inner]
        alone = torch.cat([fn(x[i:i + 1], w) for i in range(R)])  # [R, out]
        if not all(torch.equal(fn(x[:r], w), alone[:r]) for r in PROBE_ROWS):
            return False
    return True


def _round_up(n: int) -> int:
    return -(-n // KEYS_PER_BLOCK) * KEYS_PER_BLOCK


@dataclass(frozen=True)
class RowKeys:
    """Each row's keys in position order, in whole blocks. Positions [0, shared) are cache slots [0, shared), read
    in place by every row (so they must hold finite values: written, or zeroed by `KVCache.reserve`); positions
    [shared, shared + W) are the slots shared + tail, gathered per row from slots [shared, end) (tail None: no
    such positions). bias [T, shared + W] is 0 at the positions holding one of the row's keys (a prefix of
    them), -inf past them."""
    shared: int  # a multiple of KEYS_PER_BLOCK
    bias: Tensor  # [T, shared + W] float32
    tail: Tensor | None = None  # [T, W] long, W a multiple of KEYS_PER_BLOCK (padding positions read slot `shared`,
    # masked)
    end: int = 0  # one past the last slot a tail reads

    @staticmethod
    def causal(prefix: int, T: int, device: torch.device) -> "RowKeys":
        """Row r sees slots [0, prefix + r]: its keys are its slots, read in place (up to the next whole block)."""
        width = _round_up(prefix + T)
        seen = prefix + torch.arange(1, T + 1, device=device)  # [T] keys per row
        return RowKeys(width, _bias(torch.arange(width, device=device) < seen[:, None]))

    @staticmethod
    def tree(prefix: int, scratch: int, ancestors: Tensor) -> "RowKeys":
        """Row r sees slots [0, prefix) and the scratch slots scratch + j where ancestors[r, j] ([T, S] bool), its
        keys in that order (a tree's ancestors, by depth): the whole blocks of the prefix in place, the rest
        gathered."""
        T, S = ancestors.shape
        dev = ancestors.device
        shared = prefix // KEYS_PER_BLOCK * KEYS_PER_BLOCK
        rest = prefix - shared  # committed keys in the first gathered block
        count = ancestors.sum(1)  # [T] ancestors per row, itself included
        width = _round_up(rest + int(count.max()))
        order = torch.argsort((~ancestors).to(torch.uint8), dim=1, stable=True)  # [T, S] ancestors first, in order
        k = torch.arange(width, device=dev)  # [W] gathered positions
        j = (k - rest).clamp(0, S - 1).expand(T, -1)  # [T, W] the ancestor a position holds
        slots = torch.where(k < rest, k, scratch - shared + order.gather(1, j))  # [T, W] past `shared`
        valid = k < rest + count[:, None]  # [T, W]
        bias = torch.cat((torch.zeros(T, shared, device=dev), _bias(valid)), dim=1)
        return RowKeys(shared, bias, torch.where(valid, slots, 0), scratch + S)


def _bias(valid: Tensor) -> Tensor:
    """0 where valid, -inf elsewhere: float32 of valid's shape."""
    return torch.zeros(valid.shape, device=valid.device).masked_fill_(~valid, float("-inf"))


def row_keys(length: int, start: int, T: int, scratch_mask: Tensor | None, visible_prefix: int | None,
             device: torch.device) -> RowKeys:
    """The keys of a forward's rows (the arguments of `Transformer.forward`): each row's visible scratch slots, in
    slot order, must hold the positions that follow the visible prefix (as a draft tree's ancestors do)."""
    if scratch_mask is None and visible_prefix is None:  # causal over every slot before each row
        return RowKeys.causal(start, T, device)
    if scratch_mask is None:  # causal over the scratch slots
        scratch_mask = torch.ones(T, start + T - length, dtype=torch.bool, device=device).tril(start - length)
    prefix = length if visible_prefix is None else visible_prefix
    return RowKeys.tree(prefix, length, scratch_mask.to(device))


def block_attention(q: Tensor, keys: Tensor, values: Tensor, rows: RowKeys, scale: float) -> Tensor:
    """Attention of q [H, T, hd] (RoPE applied) over a layer's cache keys, values [Hkv, slots, hd] (slots >=
    rows.shared), each row over its own keys (`rows`), reduced block by block: [H, T, hd]."""
    H, T, hd = q.shape
    Hkv = keys.shape[0]
    G = H // Hkv  # query heads per KV head (head h reads KV head h // G)
    shared = rows.shared
    nS = shared // KEYS_PER_BLOCK
    span = max(shared, rows.end)  # every row against every slot read (a tree's further keys, gathered after)
    # (copied: torch's product would copy a strided slice too, and transpose it on the way, which costs more)
    k = keys[:, :span].contiguous()  # [Hkv, span, hd]
    scores = invariant_matmul(q.reshape(Hkv, G * T, hd), k.transpose(1, 2)).view(Hkv, G, T, span)  # bf16
    if rows.tail is not None:
        W = rows.tail.shape[1]
        gathered = scores[..., shared:].gather(-1, rows.tail.expand(Hkv, G, T, W))  # [Hkv, G, T, W]
        scores = torch.cat((scores[..., :shared], gathered), dim=-1)  # [Hkv, G, T, shared + W]
        v_t = values.index_select(1, rows.tail.flatten() + shared).view(Hkv, T, W, hd)  # [Hkv, T, W, hd]
    scores = torch.add(rows.bias, scores, alpha=scale)  # float32, -inf past each row's keys (+ 0: exact)
    p = torch.softmax(scores, dim=-1).to(q.dtype)  # [Hkv, G, T, positions]
    # each block's share of the output: a product over B = KEYS_PER_BLOCK keys, the rows of every query head and token
    # together
    p_in = p[..., :shared].reshape(Hkv, G * T, nS, KEYS_PER_BLOCK).transpose(1, 2)  # [Hkv, nS, G*T, B]
    v_in = values[:, :shared].contiguous().view(Hkv, nS, KEYS_PER_BLOCK, hd)
    parts = invariant_matmul(p_in, v_in).view(Hkv, nS, G, T, hd)
    if rows.tail is not None:
        nW = W // KEYS_PER_BLOCK
        p_t = p[..., shared:].reshape(Hkv, G, T, nW, KEYS_PER_BLOCK).permute(0, 2, 3, 1, 4)  # [Hkv, T, nW, G, B]
        parts_t = invariant_matmul(p_t, v_t.view(Hkv, T, nW, KEYS_PER_BLOCK, hd))  # [Hkv, T, nW, G, hd]
        parts = torch.cat((parts, parts_t.permute(0, 2, 3, 1, 4)), dim=1)  # [Hkv, nS + nW, G, T, hd]
    return sum_blocks(parts.float()).to(q.dtype).reshape(H, T, hd)  # (a view unless padded rows left gaps)


def sum_blocks(parts: Tensor) -> Tensor:
    """parts [Hkv, n, ...] summed over its blocks (dim 1) pairwise, over the spans [i 2^k, (i + 1) 2^k): a row's
    blocks past its last key are zeros, and however many there are, they add nothing to its sum. [Hkv, ...]."""
    n = parts.shape[1]
    width = 1 << (n - 1).bit_length()  # the power of two >= n
    if width > n:
        parts = torch.cat((parts, parts.new_zeros(parts.shape[0], width - n, *parts.shape[2:])), dim=1)
    while parts.shape[1] > 1:
        parts = parts[:, 0::2] + parts[:, 1::2]
    return parts[:, 0]
