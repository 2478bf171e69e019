"""`--weights native`: a quantized GGUF target run in its stored quantization instead of dequantized to float.

Each projection stored in a quantized type casspec reads (ggufcodes.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the
K-quants Q2_K .. Q6_K) keeps its codes, multipliers and float16 scales as the file holds them and runs through
casspec's block kernel (dsia/blockq.py, csrc/blockq.cpp: activations quantized per block of 32 to 8 bits, as
llama.cpp's q8_0); where casspec's C++ did not build, Q4_0 / Q4_1 / Q8_0 run through torch's packed int4 kernel and
any other type is refused with one line. q|k|v and gate|up run as one kernel each where their types agree. F32 / F16
/ BF16 tensors stay dense; IQ and other types are refused with one line. The head is the file's `output` tensor, or
the embedding where the head is tied. The result is a Plan of kernels that `Transformer.with_native` makes the
target's own: every method verifies against it, and every level is a plan over it (what a level does not replace
runs natively).

The dense float32 weights the loader dequantized from the same file stay loaded: the blocks are matched to them
row for row (which also undoes llama.cpp's reordering of the q/k rows for RoPE), and levels that build from
weights (a quantized copy, a sparse gather) read them. The blocks are read by casspec's bounded reader
(casspec/loading/ggufcheck.py: each tensor's bytes checked to lie inside the file), not by gguf's reader, whose parse
of the whole header (the tokenizer's arrays) cost about 3 s a start.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from dsia.blockq import WEIGHTS_PER_BLOCK, BlockLinear, exact_in_half
from dsia.errors import CasspecError
from dsia.cxx import build_error
from dsia.layer import FUSED_GROUPS
from dsia.model import Transformer
from dsia.plan import Plan
from dsia.qkernels import FusedLinear, Int4Linear, Int8GroupLinear, QuantLinear, int4_fits

from .ggufcheck import GGUFFile
from .ggufcodes import QUANT_TYPES, Codes, cat, decode

WEIGHTS = ("float", "native")  # what --weights takes
NATIVE_TYPES = QUANT_TYPES  # run as stored (casspec's block kernel)
TORCH_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # also by torch's packed kernels, where casspec's C++ did not build
DENSE_TYPES = ("F32", "F16", "BF16")  # left to the dense products
GGUF_PROJECTIONS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
               "ffn_down": "down"}  # GGUF tensor name in a block -> the runtime's projection name


def unpermute(w: Tensor, heads: int) -> Tensor:
    """llama.cpp's converter stores a q (or k) projection [heads * hd, in] with each head's rows reordered for its
    RoPE (the rotated pairs interleaved); this puts them back in transformers' order (the halves of the head)."""
    out = w.shape[0]
    return w.reshape(heads, out // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def block_kernel() -> bool:
    """Whether the native target's products run casspec's block kernel (its C++ library built on this machine)."""
    return build_error() is None


def kernel(codes: Codes) -> QuantLinear | BlockLinear:
    """The kernel of decoded blocks: casspec's block product where its C++ library builds (the blocks as stored,
    activations quantized to 8 bits per block as llama.cpp's), else torch's packed int4 kernel for Q4_0 / Q4_1 / Q8_0
    (Int4Linear: w = (q - 8) scale + zero, or Int8GroupLinear's two planes; other types are refused)."""
    if block_kernel():
        if not exact_in_half(codes.D) or (codes.Dm is not None and not exact_in_half(codes.Dm)):
            raise CasspecError(f"a {codes.kind} tensor of the GGUF file has block scales that are not finite float16 "
                               "values: the file is corrupt; use another file")
        return codes.kernel()
    if codes.kind not in TORCH_TYPES:
        raise CasspecError(f"--weights native runs {codes.kind} tensors with casspec's C++ block kernel, which did not "
                           f"build here ({build_error()}); use --weights float")
    if codes.kind == "Q8_0":
        return Int8GroupLinear.from_codes(codes.u.to(torch.int16) - 128, codes.D, WEIGHTS_PER_BLOCK)
    zero = codes.Dm + 8 * codes.D if codes.Dm is not None else torch.zeros_like(codes.D)
    return Int4Linear.from_codes(codes.u, codes.D, zero, WEIGHTS_PER_BLOCK)


def fits(out: int, n_in: int) -> bool:
    """Whether `kernel` takes an [out, in] weight of decoded blocks (else it stays dense)."""
    return block_kernel() or int4_fits(out, n_in, WEIGHTS_PER_BLOCK)


ROWS_CHECKED = 8  # rows of a tensor whose order is tried before the whole tensor is compared (spread evenly)


def _row_order(codes: Codes, dense: Tensor, name: str, heads: int) -> Tensor:
    """perm with the decoded blocks' rows [perm] == dense (llama.cpp stores the q/k rows reordered for its RoPE:
    `unpermute`). The stored order and llama.cpp's are tried on ROWS_CHECKED rows (dequantizing a tensor whole for
    its order was a third of a native start), equal to float32's rounding (transformers dequantizes the K-quants
    with gguf's numpy code, whose order of operations may differ by a unit in the last place); where neither gives
    them, every row is matched by its bytes."""
    out = dense.shape[0]
    rows = torch.linspace(0, out - 1, min(out, ROWS_CHECKED)).long()
    candidates = [torch.arange(out)]
    if heads > 0 and out % (2 * heads) == 0:
        candidates.append(unpermute(torch.arange(out)[:, None], heads)[:, 0])
    for perm in candidates:
        w, ref = codes.rows(perm[rows]).dequantize(), dense[rows]
        if torch.equal(w, ref) or torch.allclose(w, ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max())):
            return perm
    native = codes.dequantize() + 0.0  # -0.0 -> 0.0: rows are compared by their bytes
    index = {row.numpy().tobytes(): i for i, row in enumerate(native)}
    perm = [index.get(row.numpy().tobytes()) for row in dense + 0.0]
    if any(p is None for p in perm):
        raise CasspecError(f"the GGUF tensor {name} does not match the weights loaded from it: --weights native "
                           "cannot map it; use --weights float")
    return torch.tensor(perm)


def native_plan(gguf: Path, model: Transformer) -> Plan:
    """The target's kernels from the GGUF's stored blocks (module docstring); the model holds the dense weights
    loaded from the same file."""
    if model.device.type != "cpu":
        raise CasspecError("--weights native runs casspec's CPU kernels: use --device cpu (or --weights float)")
    names = {f"blk.{i}.{g}.weight": (i, p) for i in range(model.spec.n_layers) for g, p in GGUF_PROJECTIONS.items()}
    with GGUFFile(gguf) as src:
        header = src.header()  # casspec's bounded reader (ggufcheck.py): the tensors' bytes lie inside the file
        tensors = {t.name: t for t in header.tensors}
        names["output.weight" if "output.weight" in tensors else "token_embd.weight"] = "head"
        raw = src.tensor_bytes(header, [n for n in names if n in tensors and tensors[n].kind in NATIVE_TYPES])
    stored: dict[object, Codes] = {}  # (layer, projection) or "head" -> its blocks in the runtime's row order
    targets = {(i, p): w for i, lw in enumerate(model.layers) for p, w in lw.projections().items()}
    targets["head"] = model.lm_head
    for name, key in names.items():
        t = tensors.get(name)
        if t is None:
            raise CasspecError(f"{gguf} has no tensor {name}: --weights native needs every projection; use "
                               "--weights float")
        if t.kind in DENSE_TYPES:
            continue
        if t.kind not in NATIVE_TYPES:
            raise CasspecError(f"--weights native runs {', '.join(NATIVE_TYPES)} tensors, and {name} is {t.kind}: "
                               "use --weights float (dequantized)")
        codes = decode(t.kind, raw.pop(name))
        dense = targets[key].float().cpu()
        if tuple(codes.u.shape) != tuple(dense.shape):
            raise CasspecError(f"the GGUF tensor {name} has shape {tuple(codes.u.shape)} where the model has "
                               f"{tuple(dense.shape)}: use --weights float")
        part = key[1] if isinstance(key, tuple) else key
        heads = model.spec.n_heads if part == "q" else model.spec.n_kv_heads if part == "k" else 0
        stored[key] = codes.rows(_row_order(codes, dense, name, heads))
    linears, fused = {}, {}
    for i in range(model.spec.n_layers):
        for group, parts in FUSED_GROUPS.items():
            blocks = [stored.get((i, p)) for p in parts]
            if all(b is not None for b in blocks) and len({b.kind for b in blocks}) == 1:
                joined = cat(blocks)
                if fits(*joined.u.shape):
                    fused[(i, group)] = FusedLinear(kernel(joined), [b.u.shape[0] for b in blocks])
                    continue
            for p in parts:
                _add(linears, (i, p), stored.get((i, p)))
        _add(linears, (i, "o"), stored.get((i, "o")))
        _add(linears, (i, "down"), stored.get((i, "down")))
    head = {}
    _add(head, "head", stored.get("head"))
    return Plan(linears=linears, fused=fused, head=head.get("head"))


def _add(into: dict, key, codes: Codes | None) -> None:
    """A kernel for one projection's decoded blocks where the kernel takes its shape (else it stays dense)."""
    if codes is not None and fits(*codes.u.shape):
        into[key] = kernel(codes)
