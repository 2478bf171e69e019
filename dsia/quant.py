"""Weight-only quantized copies of a Transformer's linear weights, as kernels for a `Plan`; the `int8` / `int4` /
`nf4` draft strategies.

`quantize_linears(model, QuantConfig("int4"))` builds, once, a quantized copy of every projection (q, k, v, o,
gate, up, down of every layer) and of the LM head, and returns them as `Plan.linears` / `Plan.head` kernels.
The model's own tensors are only read; the embedding lookup stays full precision even when the head is tied.

Kinds (weight-only, activations go through the kernel in `act_dtype`, the output comes back in x's dtype):
  int8      per-output-channel symmetric int8, `torch._weight_int8pack_mm`: w = q * scale[out]
  int4      group-wise asymmetric 4-bit, `torch._weight_int4pack_mm_for_cpu`: w = (q - 8) * scale[g, out] + zero[g, out]
  nf4       bitsandbytes NF4 (block absmax), its fused AVX512-BF16 CPU kernel
  bf16      the weights rounded to bfloat16, a dense bfloat16 product (`F.linear`): half the bytes of float32 and
            nearly its agreement; cheap where the CPU multiplies bfloat16 natively (AMX, AVX512-BF16), which is
            what the levels plane (casspec/plane.py) measures before choosing it
  w8a8      per-output-channel symmetric int8 weights and per-call int8 activations, fbgemm's dynamic quantized
            linear (AVX512-VNNI / AVX2 integer products; CPU only, where torch has it): the activations are
            quantized too, so it drafts less exactly than weight-only int8, but over 4-16 tokens it ran 3-5x
            faster than int4 on an Intel Xeon with AVX512-VNNI (the packed weights are opaque: not kept on disk)
and, for the LM head only (a plain 4-bit head costs most agreement: 0.87 against 0.98 for int4 on SmolLM2):
  int8g     group-wise symmetric int8 (GGUF Q8_0 style), run as two 4-bit planes through the int4 kernel
  int4r     a group-wise 4-bit copy ranks every token; the SHORTLIST best of each row are scored again with the
            target's own head rows (`RescoredHead`): a quarter of int8g's bytes read, and the tokens a draft
            proposes ranked as the full-precision head ranks them (the quantized levels' default head)

On a CPU where casspec's C++ library builds (and group_size is 32), int8, int4, int8g and int4r's 4-bit copy run
casspec's own block kernel instead (dsia/blockq.py, as the native target's GGUF blocks): int4 as Q4_1 blocks (w = d q
+ m per 32 inputs), int8 and int8g as Q8_0 blocks (w = d q per 32 inputs), times the activations quantized to 8 bits
per block, with AVX-512 VNNI, AVX2 and plain paths giving the same bits; the weights are read once for all the rows
of a call. On the AMD EPYC it was built on, SmolLM2's products took 1.4 ms (int4) / 1.7 ms (int8) at one token
against torch's packed kernels' 2.7 / 2.9 ms, and 7.1 / 7.2 ms at 16 tokens against 14.7 / 16.6 ms.
QuantConfig(blocks=False) keeps torch's kernels (the formulas above).

A matrix whose shape a kernel cannot take (int4/int8g: out % 16, in % group_size; nf4: out % 32, in % group_size)
falls back to int8; `QuantizedLinears.kinds` says what each matrix got. Shapes: T = tokens, in/out = features.

With `fuse`, q|k|v and gate|up of a layer are one quantized matrix each (one kernel call per shared input),
handed to the Plan as `Plan.fused` kernels whose output columns the runtime splits (see `FusedLinear`).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .blockq import BLOCK, LAYOUT, BlockLinear, q4_1_blocks, q8_0_blocks
from .cxx import build_error
from .errors import CasspecError
from .layer import FUSED_GROUPS
from .model import Transformer
from .plan import HeadFn, LinearFn, Plan
from .strategy import HasBytes, Resources, Strategy, Switch
from .topk import top_k

KINDS = ("int8", "int4", "nf4", "w8a8", "bf16")  # body kinds, each a level name
HEAD_KINDS = KINDS + ("int8g", "int4r")  # LM head kinds
BLOCK_KINDS = ("int8", "int4", "int8g")  # kinds casspec's block kernel runs (int4r's 4-bit copy too): Q8_0, Q4_1, Q8_0
SHORTLIST = 64  # int4r: tokens per row the 4-bit head ranks best, scored again with the target's own rows (a
# sampled draft's token lies among them nearly always; 16 kept greedy agreement but cost 5 points at temperature 1)
SHORTLIST_BLOCK = 256  # int4r: `top_k`'s block over the 4-bit logits (the shortlist lies in SHORTLIST of them)
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
NF4_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes.functional.quantize_4bit accepts
HEAD = "head"  # key of the LM head in QuantizedLinears.kinds
HALF_SAFE = 6.0e4  # the block kernel takes weights below this magnitude (float16 scales and minima; max 65504)
# w8a8: fbgemm quantizes the activations to 7 bits when True (AVX2's 16-bit multiply-adds can saturate on 8x8 bits);
# with AVX512-VNNI 8 bits do not saturate and draft more exactly (on AVX2 alone a saturated draft is only rejected)
W8A8_REDUCE_RANGE = False


@dataclass(frozen=True)
class QuantConfig:
    kind: str  # body kind, one of KINDS
    group_size: int = 32  # int4/int8g: input columns per scale (32 = GGUF Q4_1/Q8_0 blocks); nf4: bnb blocksize
    act_dtype: torch.dtype = torch.bfloat16  # activations inside the torch int8/int4 kernels (bf16: 10-25x fp32 here)
    head_kind: str | None = "int4r"  # LM head kind; None = same as kind (a plain 4-bit head costs most agreement)
    fuse: bool = True  # one kernel for q|k|v and one for gate|up per layer
    blocks: bool = True  # int8/int4/int8g/int4r on casspec's block kernel (blocks of 32, 8-bit activations per block,
    # as llama.cpp's Q8_0 / Q4_1) where its C++ library builds and group_size is 32; else torch's packed kernels

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CasspecError(f"unknown quantization kind {self.kind!r}: use one of {', '.join(KINDS)}")
        if self.head_kind is not None and self.head_kind not in HEAD_KINDS:
            raise CasspecError(f"unknown LM head quantization kind {self.head_kind!r}: use one of "
                               f"{', '.join(HEAD_KINDS)}")
        if self.group_size < 2:
            raise CasspecError(f"group size must be at least 2, got {self.group_size}")
        if {"int4", "int8g", "int4r"} & {self.kind, self.head_kind} and self.group_size not in INT4_GROUP_SIZES:
            raise CasspecError(f"int4/int8g group size {self.group_size} is not supported: use one of "
                               f"{', '.join(map(str, INT4_GROUP_SIZES))}")
        if "w8a8" in (self.kind, self.head_kind) and not w8a8_available():
            raise CasspecError("w8a8 needs torch's fbgemm quantized kernels (an x86 CPU build of torch); this torch "
                               "has none: use int8 or int4")
        if "nf4" in (self.kind, self.head_kind) and self.group_size not in NF4_BLOCK_SIZES:
            raise CasspecError(f"nf4 block size {self.group_size} is not supported: use one of "
                               f"{', '.join(map(str, NF4_BLOCK_SIZES))}")
        if self.act_dtype not in (torch.bfloat16, torch.float32):
            raise CasspecError(f"activation dtype {self.act_dtype} is not supported: use torch.bfloat16 or float32")

    @property
    def block_kernel(self) -> bool:
        """Whether the BLOCK_KINDS run casspec's block kernel on a CPU (`blocks`, group 32, the library built)."""
        return self.blocks and self.group_size == BLOCK and build_error() is None


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

    def __init__(self, coarse: Int4Linear, w: Tensor) -> None:
        self.coarse = coarse
        self.w = w  # [V, D] the target's LM head
        self.k = min(SHORTLIST, w.shape[0])

    def __call__(self, h: Tensor) -> Tensor:
        logits = self.coarse(h)  # [N, V]
        _, top = top_k(logits, self.k, SHORTLIST_BLOCK)  # [N, k]
        exact = torch.bmm(self.w[top], h.to(self.w.dtype)[:, :, None])[..., 0]  # [N, k, D] @ [N, D, 1] -> [N, k]
        return logits.scatter_(1, top, exact.to(logits.dtype))

    @property
    def nbytes(self) -> int:
        return self.coarse.nbytes  # (the rows are the target's own)


def quantize_head(w: Tensor, kind: str, cfg: QuantConfig) -> QuantLinear | RescoredHead:
    """The LM head w [V, D] as `kind` (int4r where the 4-bit kernel takes it, else int8g's fallbacks)."""
    if kind != "int4r":
        return quantize_weight(w, kind, cfg)
    if blocks_for(w, "int4", cfg):
        return RescoredHead(q4_1_blocks(w), w)
    if w.device.type != "cpu" or not int4_fits(*w.shape, cfg.group_size):
        return quantize_weight(w, "int8g", cfg)
    return RescoredHead(Int4Linear(w, cfg.group_size, cfg.act_dtype), w)


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


def blocks_for(w: Tensor, kind: str, cfg: QuantConfig) -> bool:
    """Whether w [out, in] of `kind` runs casspec's block kernel (see QuantConfig.blocks; its float16 scales hold
    weights up to HALF_SAFE)."""
    return (cfg.block_kernel and kind in BLOCK_KINDS and w.shape[1] % BLOCK == 0 and w.device.type == "cpu"
            and float(w.abs().max()) < HALF_SAFE)


def quantize_weight(w: Tensor, kind: str, cfg: QuantConfig) -> QuantLinear:
    """One quantized copy of w [out, in]: casspec's block kernel where `blocks_for`; else torch's kernels, where
    int4/int8g/nf4 fall back to int8 for shapes theirs cannot take."""
    if blocks_for(w, kind, cfg):
        return q4_1_blocks(w, kind) if kind == "int4" else q8_0_blocks(w, kind)
    out, n_in = w.shape
    if kind == "int8g" and w.device.type != "cpu":
        kind = "int8"  # the grouped int8 kernel is CPU-only; per-channel int8 is its GPU stand-in (e.g. for heads)
    if kind in ("int4", "int8g") and int4_fits(out, n_in, cfg.group_size):
        if w.device.type != "cpu":
            raise CasspecError(f"{kind} kernels run on cpu only, the model is on {w.device}: use int8")
        cls = Int4Linear if kind == "int4" else Int8GroupLinear
        return cls(w, cfg.group_size, cfg.act_dtype)
    if kind == "nf4" and nf4_fits(out, n_in, cfg.group_size):
        return NF4Linear(w, cfg.group_size)
    if kind == "w8a8":
        if w.device.type != "cpu":
            raise CasspecError(f"w8a8 kernels run on cpu only, the model is on {w.device}: use int8")
        return W8A8Linear(w)
    if kind == "bf16":
        return BF16Linear(w)
    return Int8Linear(w, cfg.act_dtype)


# ---------------------------------------------------------------------------------------------- whole model


@dataclass
class QuantizedLinears:
    linears: dict[tuple[int, str], LinearFn]  # (layer, projection) -> kernel, for Plan.linears (unfused ones)
    head: HeadFn | None  # LM head kernel (h [N, D] -> logits [N, V]), for Plan.head; None when not quantized
    nbytes: int  # extra memory held: packed weights + scales/zeros/absmax of every copy
    kinds: dict[tuple[int, str] | str, str] = field(default_factory=dict)  # key (or HEAD) -> kind actually used
    fused: dict[tuple[int, str], FusedLinear] = field(default_factory=dict)  # (layer, "qkv"|"gate_up") -> kernel

    def plan(self, **kw) -> Plan:
        """A Plan running these kernels (extra Plan fields, e.g. skip_mlp, pass through)."""
        return Plan(linears=self.linears, fused=self.fused, head=self.head, **kw)


@torch.no_grad()
def quantize_linears(model: Transformer, cfg: QuantConfig, layers: Iterable[int] | None = None,
                     include_head: bool = True) -> QuantizedLinears:
    """Quantized copies of every projection of `layers` (None = all) and, if asked, of the LM head.

    Built once; the model's tensors are only read (a fused matrix is a new concatenation). Returns kernels keyed
    like `Plan.linears`; `.plan()` wraps them in a Plan.
    """
    if "nf4" in (cfg.kind, cfg.head_kind):
        _bitsandbytes()  # fail early, with the install hint
    idx = range(model.spec.n_layers) if layers is None else sorted(set(layers))
    q = QuantizedLinears(linears={}, head=None, nbytes=0)
    for i in idx:
        weights = model.layers[i].projections()
        groups = list(FUSED_GROUPS.items()) if cfg.fuse else []
        for gname, names in groups:
            ws = [weights.pop(n) for n in names]
            stacked = torch.cat(ws)  # [sum(out), in], a temporary copy
            fused = FusedLinear(quantize_weight(stacked, cfg.kind, cfg), [w.shape[0] for w in ws])
            q.fused[(i, gname)] = fused
            q.nbytes += fused.nbytes
            for n in names:
                q.kinds[(i, n)] = fused.kind
        for n, w in weights.items():
            k = quantize_weight(w, cfg.kind, cfg)
            q.linears[(i, n)], q.kinds[(i, n)] = k, k.kind
            q.nbytes += k.nbytes
    if include_head:
        q.head = quantize_head(model.lm_head, cfg.head_kind or cfg.kind, cfg)  # a copy: the embedding is untouched
        q.kinds[HEAD] = q.head.kind
        q.nbytes += q.head.nbytes
    return q


# ---------------------------------------------------------------------------------------------- on disk
# kernels a QuantCodec keeps
_STORED = {cls.__name__: cls for cls in (Int8Linear, Int4Linear, Int8GroupLinear, BF16Linear, BlockLinear)}


def _encode_kernel(k: QuantLinear, prefix: str, tensors: dict[str, Tensor]) -> dict:
    """A kernel's tensors go to `tensors` under prefix.field; its other fields (ints, dtypes) to the layout."""
    fields: dict[str, object] = {}
    for name, v in vars(k).items():
        if isinstance(v, Tensor):
            tensors[f"{prefix}.{name}"] = v.contiguous()
        else:
            fields[name] = str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v
    return {"class": type(k).__name__, "fields": fields}


def _decode_kernel(spec: dict, prefix: str, tensors: dict[str, Tensor]) -> QuantLinear:
    cls = _STORED[spec["class"]]
    k = cls.__new__(cls)  # the fields as quantized before: nothing to recompute
    for name, v in spec["fields"].items():
        setattr(k, name, getattr(torch, v) if name == "act_dtype" else v)
    for key, t in tensors.items():
        if key.startswith(prefix + "."):
            setattr(k, key[len(prefix) + 1:], t)
    return k


@dataclass(frozen=True)
class QuantCodec:
    """A QuantizedLinears as tensors plus a JSON layout, so a store (casspec's user cache) can keep the packed
    copies between processes instead of quantizing again (an int4r head keeps its 4-bit copy; the rows it scores
    again with are the model's, `rows`)."""
    cfg: QuantConfig
    rows: Tensor | None = field(default=None, compare=False)  # the target's LM head [V, D], for an int4r head

    @property
    def name(self) -> str:  # what the copy depends on besides the model's weights
        c = self.cfg
        blocks = LAYOUT if c.block_kernel else 0  # (the kernels it holds)
        return (f"quant-{c.kind}-g{c.group_size}-{str(c.act_dtype).removeprefix('torch.')}-{c.head_kind}"
                f"-fuse{c.fuse:d}-blocks{blocks}")

    def encode(self, q: QuantizedLinears) -> tuple[dict[str, Tensor], dict]:
        tensors: dict[str, Tensor] = {}
        kinds = [[list(k) if isinstance(k, tuple) else k, v] for k, v in q.kinds.items()]
        layout = {"nbytes": q.nbytes, "kinds": kinds,
                  "linears": {f"{i}.{n}": _encode_kernel(k, f"L{i}.{n}", tensors) for (i, n), k in q.linears.items()},
                  "fused": {f"{i}.{g}": dict(_encode_kernel(f.kernel, f"F{i}.{g}", tensors), sizes=f.sizes)
                            for (i, g), f in q.fused.items()},
                  "head": _encode_head(q.head, tensors) if q.head is not None else None}
        return tensors, layout

    def decode(self, tensors: dict[str, Tensor], layout: dict) -> QuantizedLinears:
        def key(s: str) -> tuple[int, str]:
            i, n = s.split(".")
            return int(i), n

        linears = {key(s): _decode_kernel(spec, f"L{s}", tensors) for s, spec in layout["linears"].items()}
        fused = {key(s): FusedLinear(_decode_kernel(spec, f"F{s}", tensors), spec["sizes"])
                 for s, spec in layout["fused"].items()}
        head = self._decode_head(layout["head"], tensors) if layout["head"] is not None else None
        kinds = {tuple(k) if isinstance(k, list) else k: v for k, v in layout["kinds"]}
        return QuantizedLinears(linears, head, layout["nbytes"], kinds, fused)

    def _decode_head(self, spec: dict, tensors: dict[str, Tensor]) -> QuantLinear | RescoredHead:
        kernel = _decode_kernel(spec, "head", tensors)
        if "rescore" not in spec:
            return kernel
        if self.rows is None:
            raise ValueError("an int4r head needs the model's LM head rows (QuantCodec.rows)")  # (a store rebuilds)
        return RescoredHead(kernel, self.rows)


def _encode_head(head: QuantLinear | RescoredHead, tensors: dict[str, Tensor]) -> dict:
    """The head's kernel (an int4r head: its 4-bit copy, marked; not the rows)."""
    if isinstance(head, RescoredHead):
        return dict(_encode_kernel(head.coarse, "head", tensors), rescore=True)
    return _encode_kernel(head, "head", tensors)


# ---------------------------------------------------------------------------------------------- strategy
@dataclass(frozen=True)
class Quant(Strategy):
    """`int8` | `int4` | `nf4` | `w8a8` | `bf16`: every projection and the LM head (int8g) run quantized copies."""

    kind: str  # body kind, one of KINDS

    FORMS: ClassVar[tuple[str, ...]] = KINDS
    KEY: ClassVar[str] = "quant"

    def __post_init__(self) -> None:
        QuantConfig(self.kind)  # checks the kind (QuantConfig is its one home)

    @classmethod
    def parse(cls, part: str) -> Quant | None:
        return cls(part) if part in KINDS else None

    @property
    def name(self) -> str:
        return self.kind

    def bind(self, resources: Resources) -> Switch:
        cfg = QuantConfig(self.kind)
        # bnb's state and fbgemm's packed weights are opaque: they stay in memory
        codec = (QuantCodec(cfg, resources.model.lm_head) if not {"nf4", "w8a8"} & {cfg.kind, cfg.head_kind}
                 else None)
        return QuantSwitch(resources.get(("quant", cfg), lambda model: quantize_linears(model, cfg), codec))


class QuantSwitch(Switch):
    def __init__(self, q: QuantizedLinears) -> None:
        self.q = q  # shared by every level of this kind

    def extend(self, plan: Plan) -> Plan:
        return dataclasses.replace(plan, linears=self.q.linears, fused=self.q.fused, head=self.q.head)

    @property
    def holds(self) -> tuple[HasBytes, ...]:
        return (self.q,)


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
