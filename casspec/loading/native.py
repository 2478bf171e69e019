"""`--weights native`: a quantized GGUF target run in its stored quantization instead of dequantized to float.

Each projection stored as Q4_0, Q4_1 or Q8_0 keeps its 4-bit / 8-bit codes as they are in the file and runs through
torch's packed int4 CPU kernel (dsia.quant: Int4Linear for Q4_0 / Q4_1, Int8GroupLinear's two 4-bit planes for
Q8_0), its per-block scales rounded to bfloat16 (what the kernel holds) and the activations multiplied in bfloat16;
q|k|v and gate|up run as one kernel each where their types agree. F32 / F16 / BF16 tensors stay dense; any other
type (the K-quants, IQ) is refused with one line. The head is the file's `output` tensor, or the embedding where
the head is tied. The result is a Plan of kernels that `Transformer.with_native` makes the target's own: every
method verifies against it, and every level is a plan over it (what a level does not replace runs natively).

The dense float32 weights the loader dequantized from the same file stay loaded: the blocks are matched to them
row for row (which also undoes llama.cpp's reordering of the q/k rows for RoPE), and levels that build from
weights (a quantized copy, a sparse gather) read them. The blocks are read by casspec's bounded reader
(casspec/loading/ggufcheck.py: each tensor's bytes checked to lie inside the file), not by gguf's reader, whose parse
of the whole header (the tokenizer's arrays) cost about 3 s a start.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
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

WEIGHTS = ("float", "native")  # what --weights takes
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # run by packed kernels
DENSE_TYPES = ("F32", "F16", "BF16")  # left to the dense products
GGUF_PROJECTIONS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
               "ffn_down": "down"}  # GGUF tensor name in a block -> the runtime's projection name


def decode_blocks(kind: str, data: np.ndarray) -> tuple[Tensor, Tensor, Tensor | None]:
    """One tensor's raw blocks [out, bytes per row] -> (codes [out, in] uint8 in [0, 15], or int8 (Q8_0), d [out,
    n_blocks] float32, m [out, n_blocks] float32 or None): w = d q + m (Q4_1), d (q - 8) (Q4_0), d q (Q8_0)."""
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]  # bytes per block: fp16 d (and m), then the codes
    out = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(out, -1, size)  # [out, n_blocks, size]
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))  # [out, n_blocks]
    m = None
    if kind == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8))  # [out, n_blocks, 32]
    else:
        if kind == "Q4_1":
            m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        qs = torch.from_numpy(blocks[..., size - 16:].copy())  # [out, n_blocks, 16] uint8
        q = torch.cat((qs & 15, qs >> 4), dim=-1)  # element j in the low nibble of byte j, j + 16 in the high
    return q.reshape(out, -1), d, m


def unpermute(w: Tensor, heads: int) -> Tensor:
    """llama.cpp's converter stores a q (or k) projection [heads * hd, in] with each head's rows reordered for its
    RoPE (the rotated pairs interleaved); this puts them back in transformers' order (the halves of the head)."""
    out = w.shape[0]
    return w.reshape(heads, out // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def dequantize(kind: str, q: Tensor, d: Tensor, m: Tensor | None) -> Tensor:
    """The float32 weight [out, in] of decoded blocks, as llama.cpp (and the loader) computes it."""
    g = q.reshape(q.shape[0], -1, WEIGHTS_PER_BLOCK).float()  # [out, n_blocks, 32]
    if kind == "Q4_0":
        g = g - 8
    w = g * d[..., None] + (m[..., None] if m is not None else 0)
    return w.reshape(q.shape[0], -1)


def block_kernel() -> bool:
    """Whether the native target's products run casspec's block kernel (its C++ library built on this machine)."""
    return build_error() is None


def kernel(kind: str, q: Tensor, d: Tensor, m: Tensor | None) -> QuantLinear | BlockLinear:
    """The kernel of decoded blocks: casspec's block product where its C++ library builds (the blocks as stored,
    activations quantized to 8 bits per block as llama.cpp's), else torch's packed int4 kernel (Int4Linear: w =
    (q - 8) scale + zero, or Int8GroupLinear's two planes)."""
    if block_kernel():
        offset = -8 * d if kind == "Q4_0" else m  # Q4_0: w = d (q - 8)
        if not exact_in_half(d) or (offset is not None and not exact_in_half(offset)):
            raise CasspecError(f"a {kind} tensor of the GGUF file has block scales that are not finite float16 "
                               "values (or overflow at -8 d): the file is corrupt; use another file")
        return BlockLinear(q, d, offset, 8 if kind == "Q8_0" else 4)
    if kind == "Q8_0":
        return Int8GroupLinear.from_codes(q, d, WEIGHTS_PER_BLOCK)
    zero = m + 8 * d if m is not None else torch.zeros_like(d)
    return Int4Linear.from_codes(q, d, zero, WEIGHTS_PER_BLOCK)


def fits(out: int, n_in: int) -> bool:
    """Whether `kernel` takes an [out, in] weight (else it stays dense)."""
    return n_in % WEIGHTS_PER_BLOCK == 0 if block_kernel() else int4_fits(out, n_in, WEIGHTS_PER_BLOCK)


ROWS_CHECKED = 8  # rows of a tensor whose order is tried before the whole tensor is compared (spread evenly)


def _row_order(blocks: tuple[str, Tensor, Tensor, Tensor | None], dense: Tensor, name: str, heads: int) -> Tensor:
    """perm with the decoded blocks' rows [perm] == dense exactly (llama.cpp stores the q/k rows reordered for its
    RoPE: `unpermute`). The stored order and llama.cpp's are tried on ROWS_CHECKED rows (dequantizing a tensor whole
    for its order was a third of a native start); where neither gives them, every row is matched by its bytes."""
    kind, q, d, m = blocks
    out = dense.shape[0]
    rows = torch.linspace(0, out - 1, min(out, ROWS_CHECKED)).long()
    candidates = [torch.arange(out)]
    if heads > 0 and out % (2 * heads) == 0:
        candidates.append(unpermute(torch.arange(out)[:, None], heads)[:, 0])
    for perm in candidates:
        p = perm[rows]
        if torch.equal(dequantize(kind, q[p], d[p], None if m is None else m[p]), dense[rows]):
            return perm
    native = dequantize(kind, q, d, m) + 0.0  # -0.0 -> 0.0: rows are compared by their bytes
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
        raise CasspecError("--weights native runs torch's packed CPU kernels: use --device cpu (or --weights float)")
    names = {f"blk.{i}.{g}.weight": (i, p) for i in range(model.spec.n_layers) for g, p in GGUF_PROJECTIONS.items()}
    with GGUFFile(gguf) as src:
        header = src.header()  # casspec's bounded reader (ggufcheck.py): the tensors' bytes lie inside the file
        tensors = {t.name: t for t in header.tensors}
        names["output.weight" if "output.weight" in tensors else "token_embd.weight"] = "head"
        raw = src.tensor_bytes(header, [n for n in names if n in tensors and tensors[n].kind in NATIVE_TYPES])
    stored = {}  # (layer, projection) or "head" -> (kind, q, d, m) in the runtime's row order
    targets = {(i, p): w for i, lw in enumerate(model.layers) for p, w in lw.projections().items()}
    targets["head"] = model.lm_head
    for name, key in names.items():
        t = tensors.get(name)
        if t is None:
            raise CasspecError(f"{gguf} has no tensor {name}: --weights native needs every projection; use "
                               "--weights float")
        kind = t.kind
        if kind in DENSE_TYPES:
            continue
        if kind not in NATIVE_TYPES:
            raise CasspecError(f"--weights native runs {', '.join(NATIVE_TYPES)} tensors, and {name} is {kind}: "
                               "use --weights float (dequantized)")
        q, d, m = decode_blocks(kind, raw.pop(name))
        dense = targets[key].float().cpu()
        if q.shape != dense.shape:
            raise CasspecError(f"the GGUF tensor {name} has shape {tuple(q.shape)} where the model has "
                               f"{tuple(dense.shape)}: use --weights float")
        part = key[1] if isinstance(key, tuple) else key
        heads = model.spec.n_heads if part == "q" else model.spec.n_kv_heads if part == "k" else 0
        perm = _row_order((kind, q, d, m), dense, name, heads)
        stored[key] = (kind, q[perm], d[perm], None if m is None else m[perm])
    linears, fused = {}, {}
    for i in range(model.spec.n_layers):
        for group, parts in FUSED_GROUPS.items():
            blocks = [stored.get((i, p)) for p in parts]
            if all(b is not None for b in blocks) and len({b[0] for b in blocks}) == 1 and all(
                    (b[3] is None) == (blocks[0][3] is None) for b in blocks):
                kind = blocks[0][0]
                cat = [torch.cat([b[j] for b in blocks]) for j in (1, 2)]
                m = torch.cat([b[3] for b in blocks]) if blocks[0][3] is not None else None
                if fits(*cat[0].shape):
                    fused[(i, group)] = FusedLinear(kernel(kind, cat[0], cat[1], m), [b[1].shape[0] for b in blocks])
                    continue
            for p in parts:
                _add(linears, (i, p), stored.get((i, p)))
        _add(linears, (i, "o"), stored.get((i, "o")))
        _add(linears, (i, "down"), stored.get((i, "down")))
    head = {}
    _add(head, "head", stored.get("head"))
    return Plan(linears=linears, fused=fused, head=head.get("head"))


def _add(into: dict, key, block: tuple | None) -> None:
    """A kernel for one projection's decoded blocks where the kernel takes its shape (else it stays dense)."""
    if block is not None and fits(*block[1].shape):
        into[key] = kernel(*block)
