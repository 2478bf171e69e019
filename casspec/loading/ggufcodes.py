"""A GGUF tensor's quantized blocks decoded into what casspec's block kernel reads (dsia/blockq.py BlockFormat): per
weight an unsigned code u, per sub-block an integer multiplier a and min b, per super-block the float16 scales D and
Dm, with w = D a (u + offset) + Dm b exactly as llama.cpp dequantizes the block (ggml-quants.c; tests/test_ggufcodes.py
checks every type against gguf's own dequantization). Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32) and the
K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (super-blocks of 256); others (IQ*, TQ*, Q8_K) are refused by the caller.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dsia.blockq import FORMATS, BlockFormat, BlockLinear

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q2_K": 84, "Q3_K": 110, "Q4_K": 144,
               "Q5_K": 176, "Q6_K": 210}  # bytes of one stored block (32 weights; K-quants 256)
QUANT_TYPES = tuple(BLOCK_BYTES)  # the quantized types casspec multiplies as stored
SCALES_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
             "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # a block's float16 fields (d, m / dmin)


@dataclass(frozen=True)
class Codes:
    """One tensor's decoded blocks, rows in the file's order (see the module docstring)."""
    kind: str  # the GGUF type
    u: Tensor  # [out, in] uint8 codes
    D: Tensor  # [out, super-blocks] float32 (float16 values)
    Dm: Tensor | None  # the same, where the format has mins
    a: Tensor | None  # [out, sub-blocks] int8 multipliers, where scaled
    b: Tensor | None  # [out, sub-blocks] int8 mins, where the format stores them

    @property
    def fmt(self) -> BlockFormat:
        return FORMATS[self.kind]

    def rows(self, index: Tensor) -> Codes:
        """These rows (in that order)."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return Codes(self.kind, self.u[index], self.D[index], pick(self.Dm), pick(self.a), pick(self.b))

    def dequantize(self) -> Tensor:
        """The float32 weight [out, in] (D a, times u + offset, plus Dm b, per sub-block)."""
        f, (out, n_in) = self.fmt, self.u.shape
        per_sub = self.D.repeat_interleave(32 * f.super // f.subblock, 1)  # [out, sub-blocks]
        scale = per_sub * (self.a.float() if self.a is not None else 1.0)
        w = scale[..., None] * (self.u.float() + f.offset).reshape(out, -1, f.subblock)
        if self.Dm is not None:
            mins = self.Dm.repeat_interleave(32 * f.super // f.subblock, 1)
            w = w + (mins * (self.b.float() if self.b is not None else 1.0))[..., None]
        return w.reshape(out, n_in)

    def kernel(self, kind: str = "block") -> BlockLinear:
        return BlockLinear(self.u, self.fmt, self.D, self.Dm, self.a, self.b, kind)


def cat(parts: list[Codes]) -> Codes:
    """Tensors of one type stacked by rows (a fused q|k|v or gate|up)."""
    join = lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])  # noqa
    return Codes(parts[0].kind, *(join(n) for n in ("u", "D", "Dm", "a", "b")))


def _half(block: np.ndarray, at: int) -> Tensor:
    """The float16 at byte `at` of every block [..., bytes] -> float32 [...]."""
    return torch.from_numpy(block[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32))


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> 6-bit scales and mins [..., 8] (ggml's get_scale_min_k4)."""
    lo, hi = s[..., 0:4].astype(np.int32), s[..., 4:8].astype(np.int32)
    top = s[..., 8:12].astype(np.int32)
    sc = np.concatenate((lo & 63, (top & 15) | ((lo >> 6) << 4)), axis=-1)
    mn = np.concatenate((hi & 63, (top >> 4) | ((hi >> 6) << 4)), axis=-1)
    return sc, mn


def _q3_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes [..., 12] -> the 16 signed 6-bit scales [..., 16] (low 4 bits from bytes 0-7, the high
    2 from bytes 8-11), each minus 32."""
    s = s.astype(np.int32)
    out = []
    for k in range(4):  # scales 4k .. 4k + 3
        low = (s[..., 4 * (k % 2):4 * (k % 2) + 4] >> (4 * (k // 2))) & 15
        out.append(low | (((s[..., 8:12] >> (2 * k)) & 3) << 4))
    return np.concatenate(out, axis=-1) - 32


def _shifts(*values: int, shape: tuple[int, ...]) -> Tensor:
    """Shift counts as a uint8 tensor of `shape` (to broadcast against the stored bytes)."""
    return torch.tensor(values, dtype=torch.uint8).reshape(shape)


def _bits8(x: Tensor) -> Tensor:
    """Each byte's 8 bits, lowest first: [..., n] -> [..., n, 8] (numpy's unpackbits, bitorder little)."""
    return (x[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1


def _u_small(blocks: Tensor, kind: str) -> Tensor:
    """The codes of 32-weight blocks [out, nb, bytes] (uint8) -> uint8 [out, nb, 32]."""
    if kind == "Q8_0":
        return blocks[..., 2:] ^ 0x80  # q + 128 (int8 q's two's complement bits, the top one flipped)
    qs = blocks[..., -16:]
    u = torch.cat((qs & 15, qs >> 4), dim=-1)  # element j in the low nibble of byte j, j + 16 in the high
    if kind in ("Q5_0", "Q5_1"):
        at = 2 if kind == "Q5_0" else 4
        u |= _bits8(blocks[..., at:at + 4]).flatten(-2) << 4  # bit j of qh: element j's fifth
    return u


def _u_k(blocks: Tensor, kind: str) -> Tensor:
    """The codes of K-quant super-blocks [out, nb, bytes] (uint8) -> uint8 [out, nb, 256] (ggml-quants.c's
    dequantize_row_*: element e of a super-block, as the index expressions below lay it out; torch's byte operations
    run on every thread)."""
    out, nb = blocks.shape[:2]
    if kind in ("Q2_K", "Q3_K"):  # e = 128 n + 32 j + 16 h + l: bits 2j of qs[32 n + 16 h + l]
        qs = (blocks[..., 16:80] if kind == "Q2_K" else blocks[..., 32:96]).reshape(out, nb, 2, 1, 2, 16)
        u = (qs >> _shifts(0, 2, 4, 6, shape=(4, 1, 1))) & 3  # [out, nb, n, j, h, l]
        if kind == "Q3_K":  # + 4 where bit 4 n + j of hmask[16 h + l] is set
            hm = blocks[..., 0:32].reshape(out, nb, 1, 1, 2, 16)
            u = u + (((hm >> _shifts(*range(8), shape=(2, 4, 1, 1))) & 1) << 2)
    elif kind in ("Q4_K", "Q5_K"):  # e = 64 c + 32 h + l: nibble h of qs[32 c + l] (+ 16: bit 2 c + h of qh[l])
        qs = (blocks[..., 16:144] if kind == "Q4_K" else blocks[..., 48:176]).reshape(out, nb, 4, 1, 32)
        u = (qs >> _shifts(0, 4, shape=(2, 1))) & 15  # [out, nb, c, h, l]
        if kind == "Q5_K":
            bits = _bits8(blocks[..., 16:48])  # [out, nb, l, bit]
            u = u | (bits.transpose(2, 3).reshape(out, nb, 4, 2, 32) << 4)
    else:  # Q6_K, e = 128 n + 32 k + l: nibble k // 2 of ql[64 n + 32 (k % 2) + l], bits 2k of qh[32 n + l]
        ql = blocks[..., 0:128].reshape(out, nb, 2, 1, 2, 32)
        low = (ql >> _shifts(0, 4, shape=(2, 1, 1))) & 15  # [out, nb, n, k // 2, k % 2, l]
        qh = blocks[..., 128:192].reshape(out, nb, 2, 1, 32)
        high = (qh >> _shifts(0, 2, 4, 6, shape=(4, 1))) & 3  # [out, nb, n, k, l]
        u = low.reshape(out, nb, 2, 4, 32) | (high << 4)
    return u.contiguous().reshape(out, nb, 256)


def decode(kind: str, data: np.ndarray) -> Codes:
    """One tensor's stored bytes [out, bytes per row] (a whole number of blocks a row) -> its Codes."""
    out = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(out, -1, BLOCK_BYTES[kind])  # [out, nb, bytes]
    i8 = lambda x: torch.from_numpy(np.ascontiguousarray(x).astype(np.int8)).reshape(out, -1)  # noqa: E731
    Dm = a = b = None
    bytes_ = torch.from_numpy(blocks)  # (the codes' unpacking in torch: its byte operations run on every thread)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        u, D = _u_small(bytes_, kind), _half(blocks, 0)
        if kind in ("Q4_1", "Q5_1"):
            Dm = _half(blocks, 2)
    else:
        u = _u_k(bytes_, kind)
        if kind == "Q2_K":
            sc = blocks[..., 0:16].astype(np.int32)
            a, b, D, Dm = i8(sc & 15), i8(sc >> 4), _half(blocks, 80), -_half(blocks, 82)
        elif kind == "Q3_K":
            a, D = i8(_q3_scales(blocks[..., 96:108])), _half(blocks, 108)
        elif kind in ("Q4_K", "Q5_K"):
            sc, mn = _k4_scales(blocks[..., 4:16])
            a, b, D, Dm = i8(sc), i8(mn), _half(blocks, 0), -_half(blocks, 2)
        else:  # Q6_K
            a, D = i8(blocks[..., 192:208].view(np.int8)), _half(blocks, 208)
    u = u.contiguous().reshape(out, -1)
    return Codes(kind, u, D, Dm, a, b)


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """Random stored blocks of an [rows, cols] tensor (random codes and integer scales; float16 fields |N(0, scale)|):
    synthetic weights of a real file's layout and shape, where gguf's writer has no quantizer for the type (its
    K-quants). -> [rows, bytes per row] uint8."""
    per = 256 if kind.endswith("_K") else 32
    if cols % per:
        raise ValueError(f"{kind} rows are whole blocks of {per} weights, not {cols}")
    data = rng.integers(0, 256, (rows, cols // per, BLOCK_BYTES[kind]), dtype=np.uint8)
    for at in SCALES_AT[kind]:
        half = np.abs(rng.normal(0, scale, (rows, cols // per))).astype(np.float16)
        data[..., at:at + 2] = half[..., None].view(np.uint8)
    return data.reshape(rows, -1)
