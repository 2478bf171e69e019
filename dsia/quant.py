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
            what the levels plane (casspec/calibrate/plane.py) measures before choosing it
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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from .blockq import WEIGHTS_PER_BLOCK, LAYOUT, BlockLinear, q2_blocks, q3_blocks, q4_1_blocks, q8_0_blocks
from .cxx import build_error
from .errors import CasspecError
from .layer import FUSED_GROUPS
from .model import Transformer
from .plan import PROJECTIONS, HeadFn, LinearFn, Plan
from .qkernels import (INT4_GROUP_SIZES, NF4_BLOCK_SIZES, BF16Linear, FusedLinear, Int4Linear, Int8GroupLinear,
                       Int8Linear, NF4Linear, QuantLinear, RescoredHead, W8A8Linear, _bitsandbytes, int4_fits, nf4_fits,
                       w8a8_available)
from .strategy import HasBytes, Resources, Strategy, Switch

KINDS = ("int8", "int4", "int3", "int2", "nf4", "w8a8", "bf16")  # body kinds, each a level name
HEAD_KINDS = KINDS + ("int8g", "int4r")  # LM head kinds
BLOCK_KINDS = ("int8", "int4", "int3", "int2", "int8g")  # kinds casspec's block kernel runs (int4r's 4-bit copy
# too): Q8_0, Q4_1, 3 and 2 bits a weight (blockq.q3_blocks / q2_blocks), Q8_0
BLOCK_ONLY = ("int3", "int2")  # kinds only casspec's block kernel runs
HEAD = "head"  # key of the LM head in QuantizedLinears.kinds
HALF_SAFE = 6.0e4  # the block kernel takes weights below this magnitude (float16 scales and minima; max 65504)


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
        return self.blocks and self.group_size == WEIGHTS_PER_BLOCK and build_error() is None


def quantize_head(w: Tensor, kind: str, cfg: QuantConfig, rows: Tensor | BlockLinear | None = None
                  ) -> QuantLinear | RescoredHead:
    """The LM head w [V, D] as `kind` (int4r where the 4-bit kernel takes it, else int8g's fallbacks); rows: what an
    int4r head scores its shortlist with (default w; a native target's head blocks)."""
    if kind != "int4r":
        return quantize_weight(w, kind, cfg)
    if blocks_for(w, "int4", cfg):
        return RescoredHead(q4_1_blocks(w), w if rows is None else rows)
    if w.device.type != "cpu" or not int4_fits(*w.shape, cfg.group_size):
        return quantize_weight(w, "int8g", cfg)
    return RescoredHead(Int4Linear(w, cfg.group_size, cfg.act_dtype), w)


def blocks_for(w: Tensor, kind: str, cfg: QuantConfig) -> bool:
    """Whether w [out, in] of `kind` runs casspec's block kernel (see QuantConfig.blocks; its float16 scales hold
    weights up to HALF_SAFE)."""
    return (cfg.block_kernel and kind in BLOCK_KINDS and w.shape[1] % WEIGHTS_PER_BLOCK == 0 and w.device.type == "cpu"
            and float(w.abs().max()) < HALF_SAFE)


def quantize_weight(w: Tensor, kind: str, cfg: QuantConfig) -> QuantLinear:
    """One quantized copy of w [out, in]: casspec's block kernel where `blocks_for`; else torch's kernels, where
    int4/int8g/nf4 fall back to int8 for shapes theirs cannot take."""
    if blocks_for(w, kind, cfg):
        build = {"int4": q4_1_blocks, "int3": q3_blocks, "int2": q2_blocks}.get(kind, q8_0_blocks)
        return build(w, kind)
    if kind in BLOCK_ONLY:
        raise CasspecError(f"{kind} runs on casspec's block kernel (a CPU where its C++ library builds, rows of whole "
                           f"blocks of 32); this weight [{w.shape[0]}, {w.shape[1]}] on {w.device} cannot: use int4")
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
        weights = {n: model.layers[i].dense(n) for n in PROJECTIONS}  # (a native target's: dequantized, temporaries)
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
        # a copy (the embedding is untouched); an int4r head rescores with the target's own head (never a float copy)
        q.head = quantize_head(model.dense_head(), cfg.head_kind or cfg.kind, cfg, model.head_source())
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
    rows: Tensor | BlockLinear | None = field(default=None, compare=False)  # the target's LM head [V, D] (a native
    # target's: its blocks), for an int4r head

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
        codec = (QuantCodec(cfg, resources.model.head_source()) if not {"nf4", "w8a8"} & {cfg.kind, cfg.head_kind}
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


