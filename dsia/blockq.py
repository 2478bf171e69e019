"""GGUF block-quantized products as stored (csrc/blockq.cpp, `torch.ops.casspec.block_linear`): a weight in blocks of
32 with a scale d per block (and an offset m for Q4_1), 4-bit or 8-bit codes, times activations quantized per row and
block to 8 bits, as llama.cpp multiplies them. The weights are read once for all the rows of a call, so a tree's
verification costs a few one-token steps, not one per token (torch's packed int4 kernel cost 5x one token's over 16);
each row's result is the same bits whatever the rows beside it, on every machine (the module's C++ says why).
`q4_1_blocks` / `q8_0_blocks` put a float weight in those blocks (the int4 / int8 draft levels, dsia/quant.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

WEIGHTS_PER_BLOCK = 32  # weights per block in Q4_0, Q4_1, Q8_0 (GGUF's, and the kernel's)
TILE = 16  # outputs per tile (the kernel's float lanes)
LAYOUT = 2  # bumped when BlockLinear's tensors change (stored level copies are then built again; 2: float16 scales)
GROUPS = WEIGHTS_PER_BLOCK // 4  # groups of 4 inputs per block
HALF_TINY = 2.0 ** -24  # the smallest scale a weight's blocks get (float16's smallest subnormal)


def exact_in_half(t: Tensor) -> bool:
    """Whether every value of t is a finite float16 (the kernel's scales are read as float16)."""
    h = t.float().half()
    return bool(torch.isfinite(h).all() and torch.equal(h.float(), t.float()))


class BlockLinear:
    """w[o, 32b + j] = d[o, b] * q[o, 32b + j] + m[o, b] (Q4_1; Q4_0 is m = -8 d over codes in [0, 15], Q8_0 m = 0
    over codes in [-128, 127]). x [T, in] -> y [T, out] in x's dtype (computed from float32; no bias).

    Laid out for the kernel: per tile of 16 outputs and block, 8 groups of 4 inputs, each group's 4 codes of the 16
    outputs side by side (8-bit: code + 128, a byte each; 4-bit: group g in the low nibbles, g + 4 in the high ones,
    as compact as the file's blocks); d and m per tile and block, 16 each, in float16 as GGUF stores them (d and m
    must be float16 values: `exact_in_half`)."""

    def __init__(self, q: Tensor, d: Tensor, m: Tensor | None, bits: int, kind: str = "block") -> None:
        out, n_in = q.shape
        assert bits in (4, 8) and n_in % WEIGHTS_PER_BLOCK == 0, (q.shape, bits)
        assert d.shape == (out, n_in // WEIGHTS_PER_BLOCK), (q.shape, d.shape)
        nb, tiles = n_in // WEIGHTS_PER_BLOCK, -(-out // TILE)
        pad = tiles * TILE - out  # outputs past the last: zero codes and scales
        u = (q.to(torch.int16) + 128).to(torch.uint8) if bits == 8 else q.to(torch.uint8)  # a byte per code
        g = torch.cat((u, torch.full((pad, n_in), 128 if bits == 8 else 0, dtype=torch.uint8)))  # (pad: code 0)
        g = g.reshape(tiles, TILE, nb, GROUPS, 4).permute(0, 2, 3, 1, 4)  # [tiles, blocks, groups, 16, 4]
        if bits == 8:
            self.codes = g.contiguous()
        else:
            self.codes = (g[:, :, :GROUPS // 2] | (g[:, :, GROUPS // 2:] << 4)).contiguous()
        assert exact_in_half(d) and (m is None or exact_in_half(m)), "block scales must be float16 values"
        per_tile = [torch.cat((s.float(), torch.zeros(pad, nb))).reshape(tiles, TILE, nb).transpose(1, 2)
                    for s in [d] + ([] if m is None else [m])]
        self.scales = torch.stack(per_tile).half().contiguous()  # [1 or 2, tiles, blocks, 16]: d, then m
        self.out_features = out
        self.bits = bits
        self.kind = kind  # what it stands for: "block" (a GGUF tensor as stored) or a level's quantization kind
        self.act_dtype = torch.float32

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.casspec.block_linear(x.float(), self.codes, self.scales, self.out_features).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()


def q4_1_blocks(w: Tensor, kind: str = "int4") -> BlockLinear:
    """w [out, in] as GGUF Q4_1 blocks: per 32 inputs d = (max - min) / 15, m = min (both rounded to float16, as GGUF
    stores them), w ~ d q + m, q in [0, 15]."""
    out, n_in = w.shape
    g = w.detach().float().reshape(out, n_in // WEIGHTS_PER_BLOCK, WEIGHTS_PER_BLOCK)  # [out, blocks, 32]
    lo = g.amin(dim=2).half().float()  # [out, blocks], float16 values (the kernel's scales)
    d = ((g.amax(dim=2) - lo) / 15).clamp(min=HALF_TINY).half().float()
    q = ((g - lo[..., None]) / d[..., None]).round().clamp(0, 15)  # [out, blocks, 32]
    return BlockLinear(q.reshape(out, n_in), d, lo, 4, kind)


def q8_0_blocks(w: Tensor, kind: str = "int8") -> BlockLinear:
    """w [out, in] as GGUF Q8_0 blocks: per 32 inputs d = max |w| / 127 (rounded to float16), w ~ d q, q in
    [-127, 127]."""
    out, n_in = w.shape
    g = w.detach().float().reshape(out, n_in // WEIGHTS_PER_BLOCK, WEIGHTS_PER_BLOCK)  # [out, blocks, 32]
    d = (g.abs().amax(dim=2) / 127).clamp(min=HALF_TINY).half().float()  # [out, blocks], float16 values
    q = (g / d[..., None]).round().clamp(-127, 127)
    return BlockLinear(q.reshape(out, n_in), d, None, 8, kind)
