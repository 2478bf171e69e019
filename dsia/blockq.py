"""GGUF block-quantized products as stored (csrc/blockq.cpp, `torch.ops.casspec.block_linear`): a weight in the
blocks a GGUF file stores (every type from Q2_K to Q8_0: `FORMATS`), times activations quantized per row and block of
32 to 8 bits, as llama.cpp multiplies them. The weights are read once for all the rows of a call, so a tree's
verification costs a few one-token steps, not one per token (torch's packed int4 kernel cost 5x one token's over 16);
each row's result is the same bits whatever the rows beside it, on every machine (the module's C++ says why).
`q4_1_blocks` / `q8_0_blocks` put a float weight in those blocks (the int4 / int8 draft levels, dsia/quant.py).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

WEIGHTS_PER_BLOCK = 32  # weights per block (the kernel's, and GGUF's 32-blocks; a K-quant's super-block is 8 of them)
TILE = 16  # outputs per tile (the kernel's float lanes)
LAYOUT = 3  # bumped when BlockLinear's tensors change (stored level copies are then built again; 3: block formats)
GROUPS = WEIGHTS_PER_BLOCK // 4  # groups of 4 inputs per block
HALF_TINY = 2.0 ** -24  # the smallest scale a weight's blocks get (float16's smallest subnormal)
SCALE_SEARCH = (2.5, 3.0, 3.5, 4.0, 4.5)  # q3_blocks: a block's max |w| over each of these, the best scale kept
TILES_KEPT = 256  # BlockLinear.rows: dequantized tiles of 16 rows kept per weight, the most recently read (a 576-wide
# embedding's: 9 MB; a one-token step's embedding row took 0.12 ms dequantized per call, 0.014 kept, AMD EPYC)
KEPT_CALL_ROWS = 64  # BlockLinear.rows: calls of more rows (a prompt's) are dequantized as one, nothing kept


@dataclass(frozen=True)
class BlockFormat:
    """How the kernel reads a weight's blocks (csrc/ops.h BlockFormat): each weight an unsigned code u of base +
    planes bits, and per output w = D a (u + offset) + Dm b, with a, b integers per sub-block and D, Dm float16 per
    super-block."""
    base: int  # the codes' low bits: 4 (a nibble each), 8 (a byte each) or 0 (bit planes alone)
    planes: int = 0  # bit planes above them (0..3)
    scaled: bool = False  # an int8 multiplier a per output and sub-block (else a = 1)
    halves: bool = False  # sub-blocks of 16 inputs (else of 32)
    mins: int = 0  # 0: no Dm term; 1: b = 1 (Dm the block's offset, Q4_1 / Q5_1); 2: an int8 b per sub-block
    super: int = 1  # blocks of 32 per super-block (D, Dm): 1, or 8 (a K-quant's 256)
    offset: int = 0  # added to every code (0 down to -128)

    @property
    def code(self) -> int:
        """The format as the op takes it (base | planes << 4 | scaled << 6 | halves << 7 | mins << 8 | log2(super)
        << 10 | -offset << 16)."""
        return (self.base | self.planes << 4 | int(self.scaled) << 6 | int(self.halves) << 7 | self.mins << 8
                | (self.super.bit_length() - 1) << 10 | -self.offset << 16)

    @staticmethod
    def from_code(code: int) -> "BlockFormat":
        """The format of an op's code (the inverse of `code`)."""
        return BlockFormat(code & 15, code >> 4 & 3, bool(code >> 6 & 1), bool(code >> 7 & 1), code >> 8 & 3,
                           1 << (code >> 10 & 7), -(code >> 16))

    @property
    def bits(self) -> int:
        return self.base + self.planes

    @property
    def record(self) -> int:
        """Bytes per tile of 16 outputs and block (the base plane, the bit planes, a, b)."""
        subs = 2 if self.halves else 1
        return 64 * (self.base + self.planes) + 16 * subs * (int(self.scaled) + int(self.mins == 2))

    @property
    def subblock(self) -> int:
        """Inputs per sub-block (a and b)."""
        return 16 if self.halves else 32


# GGUF's block types as the kernel reads them (casspec/loading/ggufcodes.py decodes a file's blocks into these)
FORMATS = {
    "Q4_0": BlockFormat(4, offset=-8),
    "Q4_1": BlockFormat(4, mins=1),
    "Q5_0": BlockFormat(4, 1, offset=-16),
    "Q5_1": BlockFormat(4, 1, mins=1),
    "Q8_0": BlockFormat(8, offset=-128),  # (u = q + 128)
    "Q2_K": BlockFormat(0, 2, scaled=True, halves=True, mins=2, super=8),
    "Q3_K": BlockFormat(0, 3, scaled=True, halves=True, super=8, offset=-4),
    "Q4_K": BlockFormat(4, scaled=True, mins=2, super=8),
    "Q5_K": BlockFormat(4, 1, scaled=True, mins=2, super=8),
    "Q6_K": BlockFormat(4, 2, scaled=True, halves=True, super=8, offset=-32),
}


def exact_in_half(t: Tensor) -> bool:
    """Whether every value of t is a finite float16 (the kernel's scales are read as float16)."""
    h = t.float().half()
    return bool(torch.isfinite(h).all() and torch.equal(h.float(), t.float()))


def _per_tile(t: Tensor, tiles: int) -> Tensor:
    """[out, n] -> [tiles, n, 16] (outputs past the last: zeros)."""
    out, n = t.shape
    if tiles * TILE > out:  # (most weights have whole tiles: no copy)
        t = torch.cat((t, t.new_zeros(tiles * TILE - out, n)))
    return t.reshape(tiles, TILE, n).transpose(1, 2)


class BlockLinear:
    """w[o, i] = D[o, s] a[o, j] (u[o, i] + offset) + Dm[o, s] b[o, j] (s: i's super-block, j: its sub-block; a = 1
    where the format is not scaled, b = 1 where its mins are 1). x [T, in] -> y [T, out] in x's dtype (computed from
    float32; no bias).

    Laid out for the kernel, per tile of 16 outputs and block of 32 inputs, one record: the base plane (8 groups of 4
    inputs, each group's 4 codes of the 16 outputs side by side; nibbles: group g low, g + 4 high, as compact as the
    file's blocks), each bit plane (per group a 64-bit mask, bit 4 lane + j), then a and b per sub-block [16] int8;
    D and Dm per tile and super-block [16] float16, as GGUF stores them (they must be float16 values)."""

    def __init__(self, u: Tensor, fmt: BlockFormat, D: Tensor, Dm: Tensor | None = None, a: Tensor | None = None,
                 b: Tensor | None = None, kind: str = "block") -> None:
        out, n_in = u.shape
        nb, tiles = n_in // WEIGHTS_PER_BLOCK, -(-out // TILE)
        assert n_in % (WEIGHTS_PER_BLOCK * fmt.super) == 0 and D.shape == (out, nb // fmt.super), (u.shape, D.shape)
        assert (Dm is not None) == (fmt.mins != 0) and (a is not None) == fmt.scaled and (b is not None) == (
            fmt.mins == 2), fmt
        assert int(u.min()) >= 0 and int(u.max()) < 1 << fmt.bits, "codes outside the format's bits"
        g = _per_tile(u.to(torch.uint8), tiles).transpose(1, 2)  # [tiles, 16, in]
        g = g.reshape(tiles, TILE, nb, GROUPS, 4).permute(0, 2, 3, 1, 4)  # [tiles, blocks, groups, 16, 4]
        parts = []
        if fmt.base == 8:
            parts.append(g.reshape(tiles, nb, -1))
        elif fmt.base == 4:
            low = g & 15
            parts.append((low[:, :, :GROUPS // 2] | (low[:, :, GROUPS // 2:] << 4)).reshape(tiles, nb, -1))
        for p in range(fmt.planes):
            bits = ((g >> (fmt.base + p)) & 1).reshape(tiles, nb, GROUPS, 64).numpy()
            parts.append(torch.from_numpy(np.packbits(bits, axis=-1, bitorder="little")).reshape(tiles, nb, -1))
        per = WEIGHTS_PER_BLOCK // fmt.subblock
        for t in [a] if fmt.scaled else []:
            parts.append(self._per_block(t, tiles, nb, per))
        for t in [b] if fmt.mins == 2 else []:
            parts.append(self._per_block(t, tiles, nb, per))
        self.codes = (torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]).contiguous()  # [tiles, blocks, record]
        assert self.codes.shape[-1] == fmt.record, (self.codes.shape, fmt)
        assert exact_in_half(D) and (Dm is None or exact_in_half(Dm)), "block scales must be float16 values"
        self.scales = torch.stack([_per_tile(s.float(), tiles) for s in [D] + ([] if Dm is None else [Dm])]
                                  ).half().contiguous()  # [1 or 2, tiles, super-blocks, 16]: D, then Dm
        self.out_features = out
        self.format = fmt.code
        self.kind = kind  # what it stands for: "block" (a GGUF tensor as stored) or a level's quantization kind
        self.act_dtype = torch.float32

    @staticmethod
    def _per_block(t: Tensor, tiles: int, nb: int, per: int) -> Tensor:
        """a or b [out, blocks * per] -> bytes [tiles, blocks, per * 16] (sub-block j's 16 outputs together)."""
        assert int(t.min()) >= -128 and int(t.max()) <= 127, "multipliers and mins are int8"
        v = _per_tile(t.to(torch.int8), tiles)  # [tiles, blocks * per, 16]
        return v.reshape(tiles, nb, per * TILE).view(torch.uint8)

    def dequantize(self, tiles: Tensor | None = None) -> Tensor:
        """The float32 weight [out, in] these blocks hold (or the rows of `tiles` [n], [16 n, in]; rows past
        out_features are zeros): w = D a (u + offset) + Dm b, as the file's dequantization computes it."""
        fmt = BlockFormat.from_code(self.format)
        codes = self.codes if tiles is None else self.codes[tiles]  # [t, blocks, record]
        scales = self.scales if tiles is None else self.scales[:, tiles]  # [1 or 2, t, supers, 16]
        t, nb = codes.shape[:2]
        at, u = 0, torch.zeros(t, nb, GROUPS, TILE * 4, dtype=torch.int32)  # [t, blocks, groups, 16 x 4]
        if fmt.base == 8:
            u += codes[..., :512].reshape(t, nb, GROUPS, -1).int()
        elif fmt.base == 4:
            two = codes[..., :256].reshape(t, nb, GROUPS // 2, -1).int()
            u += torch.cat((two & 15, two >> 4), dim=2)
        at = 64 * fmt.base
        for p in range(fmt.planes):
            packed = codes[..., at:at + 64].reshape(t, nb, GROUPS, 8).numpy()
            bits = np.unpackbits(packed, axis=-1, bitorder="little")  # [t, blocks, groups, 64]
            u += torch.from_numpy(bits.astype(np.int32)) << (fmt.base + p)
            at += 64
        u = u.reshape(t, nb, GROUPS, TILE, 4).permute(0, 3, 1, 2, 4).reshape(t, TILE, nb, -1)  # [t, 16, blocks, 32]
        subs = 2 if fmt.halves else 1
        u = u.reshape(t, TILE, nb * subs, -1).float() + fmt.offset  # [t, 16, sub-blocks, per sub-block]

        def per_sub(raw: Tensor) -> Tensor:  # [t, blocks, subs * 16] int8 -> [t, 16, sub-blocks]
            return raw.view(torch.int8).reshape(t, nb, subs, TILE).permute(0, 3, 1, 2).reshape(t, TILE, -1).float()

        def per_super(s: Tensor) -> Tensor:  # [t, supers, 16] -> [t, 16, sub-blocks]
            return s.float().transpose(1, 2).repeat_interleave(fmt.super * subs, dim=2)

        scale = per_super(scales[0]) * (per_sub(codes[..., at:at + 16 * subs]) if fmt.scaled else 1.0)
        w = scale[..., None] * u
        if fmt.mins:
            mins = per_super(scales[1]) * (per_sub(codes[..., -16 * subs:]) if fmt.mins == 2 else 1.0)
            w = w + mins[..., None]
        w = w.reshape(t * TILE, -1)
        return w[:self.out_features] if tiles is None else w

    def scores(self, h: Tensor, tokens: Tensor) -> Tensor:
        """h [N, in] times the rows `tokens` [N, k] of each h's own: [N, k], the bits the whole product gives there
        (each output lane is computed alone: only the tiles holding the rows asked for are multiplied)."""
        tiles, where = torch.unique(tokens // TILE, return_inverse=True)  # [U], [N, k]
        sub = torch.ops.casspec.block_linear(h.float().contiguous(), self.codes[tiles], self.scales[:, tiles],
                                             TILE * len(tiles), self.format)  # [N, 16 U]
        return sub.gather(1, where * TILE + tokens % TILE)

    def rows(self, index: Tensor) -> Tensor:
        """The float32 rows `index` [n] of the weight, [n, in] (a token embedding stored in blocks: only the tiles
        of the rows asked for are dequantized; for a few rows, a step's, the TILES_KEPT tiles read last are kept)."""
        tiles, lanes = index // TILE, index % TILE
        if index.numel() > KEPT_CALL_ROWS:
            unique, inverse = torch.unique(tiles, return_inverse=True)
            return self.dequantize(unique).reshape(len(unique), TILE, -1)[inverse, lanes]
        kept = _KEPT.setdefault(self, OrderedDict())  # tile -> its rows [16, in], least recently read first
        tiles, lanes = tiles.tolist(), lanes.tolist()
        if missing := sorted(set(tiles) - kept.keys()):
            for t, w in zip(missing, self.dequantize(torch.tensor(missing)).view(len(missing), TILE, -1)):
                kept[t] = w.clone()  # (its own memory: a view would hold the whole call's tiles past its eviction)
        rows = torch.stack([kept[t][lane] for t, lane in zip(tiles, lanes)])  # [n, in]
        for t in tiles:
            kept.move_to_end(t)
        while len(kept) > TILES_KEPT:
            kept.popitem(last=False)
        return rows

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.casspec.block_linear(x.float(), self.codes, self.scales, self.out_features,
                                              self.format).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()


# BlockLinear.rows' kept tiles per weight (outside the weight's fields, which QuantCodec stores)
_KEPT: weakref.WeakKeyDictionary[BlockLinear, OrderedDict[int, Tensor]] = weakref.WeakKeyDictionary()


def q4_1_blocks(w: Tensor, kind: str = "int4") -> BlockLinear:
    """w [out, in] as GGUF Q4_1 blocks: per 32 inputs d = (max - min) / 15, m = min (both rounded to float16, as GGUF
    stores them), w ~ d q + m, q in [0, 15]."""
    out, n_in = w.shape
    g = w.detach().float().reshape(out, n_in // WEIGHTS_PER_BLOCK, WEIGHTS_PER_BLOCK)  # [out, blocks, 32]
    lo = g.amin(dim=2).half().float()  # [out, blocks], float16 values (the kernel's scales)
    d = ((g.amax(dim=2) - lo) / 15).clamp(min=HALF_TINY).half().float()
    q = ((g - lo[..., None]) / d[..., None]).round().clamp(0, 15)  # [out, blocks, 32]
    return BlockLinear(q.reshape(out, n_in), FORMATS["Q4_1"], d, lo, kind=kind)


def q8_0_blocks(w: Tensor, kind: str = "int8") -> BlockLinear:
    """w [out, in] as GGUF Q8_0 blocks: per 32 inputs d = max |w| / 127 (rounded to float16), w ~ d q, q in
    [-127, 127]."""
    out, n_in = w.shape
    g = w.detach().float().reshape(out, n_in // WEIGHTS_PER_BLOCK, WEIGHTS_PER_BLOCK)  # [out, blocks, 32]
    d = (g.abs().amax(dim=2) / 127).clamp(min=HALF_TINY).half().float()  # [out, blocks], float16 values
    q = (g / d[..., None]).round().clamp(-127, 127)
    return BlockLinear(q.reshape(out, n_in) + 128, FORMATS["Q8_0"], d, kind=kind)


def _per_super(s: Tensor, per: int) -> Tensor:
    """The largest of `s` [out, blocks] over each super-block of `per` blocks, as a float16 scale of 127 steps:
    [out, blocks / per] (float16 values, at least HALF_TINY)."""
    out, nb = s.shape
    return (s.reshape(out, nb // per, per).amax(-1) / 127).clamp(min=HALF_TINY).half().float()


def q3_blocks(w: Tensor, kind: str = "int3") -> BlockLinear:
    """w [out, in] re-quantized to 3 bits a weight (a draft level read from fewer bytes than a 4-5 bit target):
    per block of 32 a symmetric scale s held as an int8 multiple a of its super-block's float16 D (super-blocks of
    256 where the rows are whole ones, else the block), w ~ D a (u - 4), u in [0, 7]; s = max |w| / c, c of
    SCALE_SEARCH the one of least squared error in each block (round to nearest clips the largest weights less)."""
    out, n_in = w.shape
    per = 8 if n_in % 256 == 0 else 1
    g = w.detach().float().reshape(out, n_in // WEIGHTS_PER_BLOCK, WEIGHTS_PER_BLOCK)  # [out, blocks, 32]
    amax = g.abs().amax(-1)  # [out, blocks]
    tries = torch.stack([amax / c for c in SCALE_SEARCH])  # [tries, out, blocks]
    err = torch.stack([((g / s.clamp(min=1e-30)[..., None]).round().clamp(-4, 3) * s[..., None] - g).square().sum(-1)
                       for s in tries])
    s = tries.gather(0, err.argmin(0)[None])[0]
    D = _per_super(s, per)  # [out, supers]
    d = D.repeat_interleave(per, 1)  # [out, blocks]: each block's super-block scale
    a = (s / d).round().clamp(1, 127)  # [out, blocks]
    step = (d * a)[..., None]
    u = (g / step).round().clamp(-4, 3) + 4
    return BlockLinear(u.reshape(out, n_in), BlockFormat(0, 3, scaled=True, super=per, offset=-4), D, a=a, kind=kind)


def q2_blocks(w: Tensor, kind: str = "int2") -> BlockLinear:
    """w [out, in] re-quantized to 2 bits a weight: per block of 32 w ~ s u - m (s = (max - min) / 3, m = -min, the
    range widened to hold 0), each an int8 multiple of its super-block's float16 D / Dmin; u in [0, 3]."""
    out, n_in = w.shape
    per = 8 if n_in % 256 == 0 else 1
    g = w.detach().float().reshape(out, n_in // WEIGHTS_PER_BLOCK, WEIGHTS_PER_BLOCK)  # [out, blocks, 32]
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)  # [out, blocks]
    s, m = (hi - lo) / 3, -lo
    D, Dmin = _per_super(s, per), _per_super(m, per)
    d, dmin = D.repeat_interleave(per, 1), Dmin.repeat_interleave(per, 1)  # [out, blocks]
    a = (s / d).round().clamp(1, 127)
    b = (m / dmin).round().clamp(0, 127)
    step = (d * a)[..., None]
    offset = (dmin * b)[..., None]
    u = ((g + offset) / step).round().clamp(0, 3)
    return BlockLinear(u.reshape(out, n_in), BlockFormat(0, 2, scaled=True, mins=2, super=per), D, -Dmin, a, b,
                       kind=kind)
