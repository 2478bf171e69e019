"""The quantized linear kernels the quantized levels run (dsia/quant.py builds them): int8, int4 and int8g through
torch's packed kernels or casspec's block kernel (dsia/blockq.py), bitsandbytes' NF4, bfloat16, fbgemm's w8a8, the
int4r head rescored with the target's rows (`RescoredHead`) and one kernel for several projections (`FusedLinear`).
Each maps x [T, in] to [T, out] and says its bytes (`nbytes`)."""
from __future__ import annotations

import functools
import importlib
import logging
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from .blockq import BlockLinear
from .errors import CasspecError
from .topk import top_k

SHORTLIST = 64  # int4r: tokens per row the 4-bit head ranks best, scored again with the target's own rows (a
# sampled draft's token lies among them nearly always; 16 kept greedy agreement but cost 5 points at temperature 1)
SHORTLIST_BLOCK = 256  # int4r: `top_k`'s block over the 4-bit logits (the shortlist lies in SHORTLIST of them)
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
NF4_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes.functional.quantize_4bit accepts
# w8a8: fbgemm quantizes the activations to 7 bits when True (AVX2's 16-bit multiply-adds can saturate on 8x8 bits);
# with AVX512-VNNI 8 bits do not saturate and draft more exactly (on AVX2 alone a saturated draft is only rejected)
W8A8_REDUCE_RANGE = False


# ---------------------------------------------------------------------------------------------- kernels
class Int8Linear:
    """Per-output-channel symmetric int8: w ~ q * scale. x [T, in] -> y [T, out] (no bias)."""

    kind = "int8"

    def __init__(self, w: Tensor, act_dtype: torch.dtype = torch.bfloat16) -> None:
        w = w.detach().float()  # [out, in]
        self.act_dtype = act_dtype
        self.scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(act_dtype)  # [out]
        # quantize against the rounded scale, so q * scale is the nearest point the kernel can represent
        self.q = (w / self.scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)  # [out, in]

    def __call__(self, x: Tensor) -> Tensor:
        return torch._weight_int8pack_mm(x.to(self.act_dtype), self.q, self.scales).to(x.dtype)  # [T, out]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.q, self.scales)


class Int4Linear:
    """Group-wise asymmetric 4-bit (gpt-fast / torchao tinygemm convention), q in [0, 15]:
    w[o, g*G:(g+1)*G] ~ (q - 8) * scale[g, o] + zero[g, o]. x [T, in] -> y [T, out] (no bias)."""

    kind = "int4"

    def __init__(self, w: Tensor, group_size: int, act_dtype: torch.dtype = torch.bfloat16) -> None:
        out, n_in = w.shape
        assert int4_fits(out, n_in, group_size), (out, n_in, group_size)
        g = w.detach().float().reshape(out, n_in // group_size, group_size)  # [out, n_groups, G]
        lo, hi = g.amin(dim=2), g.amax(dim=2)  # [out, n_groups]
        scale = ((hi - lo) / 15).clamp(min=1e-6).to(act_dtype)  # min/max puts a GGUF Q4_1 block on its own grid
        zero = (lo + 8 * scale.float()).to(act_dtype)
        q = ((g - zero.float()[..., None]) / scale.float()[..., None] + 8).round().clamp(0, 15)  # [out, n_groups, G]
        self._pack(q.reshape(out, n_in), scale, zero, group_size, act_dtype)

    @classmethod
    def from_codes(cls, q: Tensor, scale: Tensor, zero: Tensor, group_size: int,
                   act_dtype: torch.dtype = torch.bfloat16) -> Int4Linear:
        """The kernel of given codes q [out, in] in [0, 15] and scale, zero [out, n_groups] (w = (q - 8) scale +
        zero; a GGUF Q4_0 / Q4_1 block as stored, its scales rounded to act_dtype)."""
        k = cls.__new__(cls)
        k._pack(q, scale.to(act_dtype), zero.to(act_dtype), group_size, act_dtype)
        return k

    def _pack(self, q: Tensor, scale: Tensor, zero: Tensor, group_size: int, act_dtype: torch.dtype) -> None:
        assert int4_fits(*q.shape, group_size), (q.shape, group_size)
        self.group_size = group_size
        self.act_dtype = act_dtype
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)  # [out, in/2]
        self.scales_and_zeros = torch.stack((scale, zero), dim=2).transpose(0, 1).contiguous()  # [n_groups, out, 2]

    def __call__(self, x: Tensor) -> Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x.to(self.act_dtype), self.packed, self.group_size,
                                              self.scales_and_zeros)  # [T, out]
        return y.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed, self.scales_and_zeros)


class Int8GroupLinear:
    """Group-wise symmetric int8, w[o, g*G:(g+1)*G] ~ q * d[o, g] with q in [-127, 127] (GGUF Q8_0 when G = 32),
    run through the int4 kernel as two nibble planes: q + 128 = 16 * h + l, so
    w = (h - 8) * 16d + (l - 8) * d + 8d, i.e. y = [x, x] @ [hi | lo].T with int4 scales (16d, 0) and (d, 8d).
    Twice the bytes of int4, as many as per-channel int8, but per-group scales. x [T, in] -> y [T, out]."""

    kind = "int8g"

    def __init__(self, w: Tensor, group_size: int, act_dtype: torch.dtype = torch.bfloat16) -> None:
        out, n_in = w.shape
        assert int4_fits(out, n_in, group_size), (out, n_in, group_size)
        g = w.detach().float().reshape(out, n_in // group_size, group_size)  # [out, n_groups, G]
        d = (g.abs().amax(dim=2) / 127).clamp(min=1e-12).to(act_dtype)  # [out, n_groups]
        q = (g / d.float()[..., None]).round().clamp(-127, 127)  # [out, n_groups, G]
        self._pack(q.reshape(out, n_in), d, group_size, act_dtype)

    @classmethod
    def from_codes(cls, q: Tensor, d: Tensor, group_size: int,
                   act_dtype: torch.dtype = torch.bfloat16) -> Int8GroupLinear:
        """The kernel of given codes q [out, in] in [-128, 127] and scales d [out, n_groups] (w = q d; a GGUF Q8_0
        block as stored, its scale rounded to act_dtype)."""
        k = cls.__new__(cls)
        k._pack(q, d.to(act_dtype), group_size, act_dtype)
        return k

    def _pack(self, q: Tensor, d: Tensor, group_size: int, act_dtype: torch.dtype) -> None:
        out, n_in = q.shape
        assert int4_fits(out, n_in, group_size), (q.shape, group_size)
        q = q.to(torch.int32).reshape(out, n_in // group_size, group_size) + 128  # [out, n_groups, G] in [0, 255]
        nibbles = torch.cat((q >> 4, q & 15), dim=1).reshape(out, 2 * n_in)  # [out, 2*in]: hi planes, then lo planes
        self.group_size = group_size
        self.act_dtype = act_dtype
        self.packed = torch._convert_weight_to_int4pack_for_cpu(nibbles, 1)  # [out, in]
        scale = torch.cat((16 * d, d), dim=1)  # [out, 2*n_groups]
        zero = torch.cat((torch.zeros_like(d), 8 * d), dim=1)  # [out, 2*n_groups]
        self.scales_and_zeros = torch.stack((scale, zero), dim=2).transpose(0, 1).contiguous()  # [2*n_groups, out, 2]

    def __call__(self, x: Tensor) -> Tensor:
        xx = x.to(self.act_dtype).repeat(1, 2)  # [T, 2*in]
        y = torch._weight_int4pack_mm_for_cpu(xx, self.packed, self.group_size, self.scales_and_zeros)  # [T, out]
        return y.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed, self.scales_and_zeros)


class NF4Linear:
    """bitsandbytes NF4: 16 normal-quantile levels times a per-block absmax (blocks of `blocksize` along in).
    Uses bnb's fused AVX512-BF16 CPU kernel (bf16 activations). x [T, in] -> y [T, out] (no bias)."""

    kind = "nf4"

    def __init__(self, w: Tensor, blocksize: int) -> None:
        bnb, bnbF = _bitsandbytes()
        out, n_in = w.shape
        packed, state = bnbF.quantize_4bit(w.detach().float().contiguous(), blocksize=blocksize, quant_type="nf4")
        self.fused = w.device.type == "cpu" and nf4_fits(out, n_in, blocksize) and bnbF.has_avx512bf16()
        if self.fused:  # repack for the fused kernel (what bnb.nn.Linear4bit does on its first CPU forward)
            packed, state = bnbF._convert_weight_packed_for_cpu(packed, state)  # [out, in/2], absmax bf16
        else:
            packed = packed.t()  # generic path: dequantize, then a dense matmul
        self.packed, self.state, self._matmul = packed, state, bnb.matmul_4bit

    def __call__(self, x: Tensor) -> Tensor:
        # the fused CPU kernel takes bf16; bnb's CUDA kernels the model's half dtype; its generic CPU path float32
        a = x.to(torch.bfloat16) if self.fused else x if x.is_cuda else x.float()
        return self._matmul(a, self.packed, self.state).to(x.dtype)  # [T, out]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed, self.state.absmax, self.state.code)


class BF16Linear:
    """The weight rounded to bfloat16, multiplied densely in bfloat16. x [T, in] -> y [T, out] (no bias)."""

    kind = "bf16"

    def __init__(self, w: Tensor) -> None:
        self.w = w.detach().to(torch.bfloat16).contiguous()  # [out, in]

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x.to(torch.bfloat16), self.w).to(x.dtype)  # [T, out]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.w)


class W8A8Linear:
    """Per-output-channel symmetric int8 weights, activations quantized per call (per tensor, asymmetric uint8) by
    fbgemm's dynamic quantized linear: w ~ q * scale[out]. x [T, in] float32 -> y [T, out] float32 (no bias)."""

    kind = "w8a8"

    def __init__(self, w: Tensor) -> None:
        w = w.detach().float()  # [out, in]
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()  # [out]
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch marks its quantized tensors deprecated; fbgemm's kernels remain
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(q, None)  # fbgemm's packed layout, opaque
        self._nbytes = w.numel() + 8 * w.shape[0]  # int8 weights and float64 scales

    def __call__(self, x: Tensor) -> Tensor:
        y = torch.ops.quantized.linear_dynamic(x.float(), self.packed, W8A8_REDUCE_RANGE)  # [T, out]
        return y.to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self._nbytes


@functools.cache
def w8a8_available() -> bool:
    """Whether this torch has fbgemm's dynamic quantized linear (x86 CPU builds)."""
    try:
        return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized,
                                                                                 "linear_dynamic")
    except (AttributeError, RuntimeError):
        return False


QuantLinear = Int8Linear | Int8GroupLinear | Int4Linear | NF4Linear | W8A8Linear | BF16Linear | BlockLinear


class RescoredHead:
    """The `int4r` LM head: every token's logit from a group-wise 4-bit copy, then the k best of each row scored
    again with the target's own head rows w [V, D] (a reference, never copied or stored), so a draft's proposals
    are ranked as the full-precision head ranks them, for about a quarter of int8g's bytes read. h [N, D] ->
    logits [N, V]; a token outside the shortlist keeps its 4-bit logit."""

    kind = "int4r"

    def __init__(self, coarse: Int4Linear, w: Tensor | BlockLinear) -> None:
        self.coarse = coarse
        self.w = w  # [V, D] the target's LM head (a native target's: its head's blocks)
        self.k = min(SHORTLIST, w.out_features if isinstance(w, BlockLinear) else w.shape[0])

    def __call__(self, h: Tensor) -> Tensor:
        logits = self.coarse(h)  # [N, V]
        _, top = top_k(logits, self.k, SHORTLIST_BLOCK)  # [N, k]
        if isinstance(self.w, BlockLinear):  # (the native head's own bits at the shortlist)
            exact = self.w.scores(h, top)
        else:
            exact = torch.bmm(self.w[top], h.to(self.w.dtype)[:, :, None])[..., 0]  # [N, k, D] @ [N, D, 1] -> [N, k]
        return logits.scatter_(1, top, exact.to(logits.dtype))

    @property
    def nbytes(self) -> int:
        return self.coarse.nbytes  # (the rows are the target's own)


class FusedLinear:
    """One quantized matrix for several projections that share their input (q|k|v, gate|up), stacked by rows:
    x [T, in] -> [T, sum(out)], for Plan.fused (the runtime splits the columns)."""

    def __init__(self, kernel: QuantLinear, sizes: list[int]) -> None:
        self.kernel = kernel
        self.kind = kernel.kind
        self.sizes = sizes  # out features of the parts, in order

    def __call__(self, x: Tensor) -> Tensor:
        return self.kernel(x)  # [T, sum(out)]

    @property
    def nbytes(self) -> int:
        return self.kernel.nbytes


def int4_fits(out: int, n_in: int, group_size: int) -> bool:
    """Whether _convert_weight_to_int4pack_for_cpu / _weight_int4pack_mm_for_cpu take an [out, in] weight."""
    return out % 16 == 0 and n_in % group_size == 0 and group_size in INT4_GROUP_SIZES


def nf4_fits(out: int, n_in: int, blocksize: int) -> bool:
    """Whether bnb's fused CPU NF4 kernel takes an [out, in] weight (its repacking tiles 32 output rows)."""
    return out % 32 == 0 and n_in % blocksize == 0


# ---------------------------------------------------------------------------------------------- helpers
def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _bitsandbytes():
    """(bitsandbytes, bitsandbytes.functional), imported on first use."""
    # its CPU backend warns at import that an optional hub kernel is missing; its own fused kernel is used instead
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        bnb = importlib.import_module("bitsandbytes")
    except ImportError:
        raise CasspecError("nf4 quantization needs bitsandbytes: pip install bitsandbytes") from None
    finally:
        log.setLevel(level)
    return bnb, importlib.import_module("bitsandbytes.functional")
