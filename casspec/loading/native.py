"""`--weights native`: a quantized GGUF target run in its stored quantization instead of dequantized to float.

Each projection stored in a quantized type casspec reads (ggufcodes.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the
K-quants Q2_K .. Q6_K) keeps its codes, multipliers and float16 scales as the file holds them and runs through
casspec's block kernel (dsia/blockq.py, csrc/blockq.cpp: activations quantized per block of 32 to 8 bits, as
llama.cpp's q8_0; it needs casspec's C++ library). q|k|v and gate|up run as one kernel each where their types agree.
F32 / F16 / BF16 tensors stay dense; IQ and other types are refused with one line. The head is the file's `output`
tensor, or the embedding's own blocks where the head is tied. The result is a Plan of kernels that
`Transformer.with_native` makes the target's own: every method verifies against it, and every level is a plan over
it (what a level does not replace runs natively). nativeload.py reads the file into it without float copies.
"""
from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from dsia.blockq import BlockLinear, exact_in_half
from dsia.errors import CasspecError
from dsia.cxx import build_error
from dsia.layer import FUSED_GROUPS
from dsia.plan import Plan
from dsia.qkernels import FusedLinear

from .ggufcodes import QUANT_TYPES, Codes, cat

WEIGHTS = ("float", "native")  # what --weights takes
NATIVE_TYPES = QUANT_TYPES  # run as stored (casspec's block kernel)
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


def kernel(codes: Codes) -> BlockLinear:
    """casspec's block product of decoded blocks (as stored; activations quantized to 8 bits per block of 32, as
    llama.cpp's q8_0), after checking that its scales are finite float16 values."""
    if not exact_in_half(codes.D) or (codes.Dm is not None and not exact_in_half(codes.Dm)):
        raise CasspecError(f"a {codes.kind} tensor of the GGUF file has block scales that are not finite float16 "
                           "values: the file is corrupt; use another file")
    return codes.kernel()


def native_plan(stored: dict[tuple[int, str], Codes], layers: Iterable[int], head: BlockLinear | None = None) -> Plan:
    """The kernels of `layers`: each projection's decoded blocks (stored[(layer, projection)], in the runtime's row
    order) in casspec's block kernel, q|k|v and gate|up as one kernel each where their types agree; the head's
    kernel as given (a tied head: the embedding's own blocks)."""
    linears, fused = {}, {}
    for i in layers:
        for group, parts in FUSED_GROUPS.items():
            blocks = [stored.get((i, p)) for p in parts]
            if all(b is not None for b in blocks) and len({b.kind for b in blocks}) == 1:
                fused[(i, group)] = FusedLinear(kernel(cat(blocks)), [b.u.shape[0] for b in blocks])
                continue
            for p in parts:
                if stored.get((i, p)) is not None:
                    linears[(i, p)] = kernel(stored[(i, p)])
        for p in ("o", "down"):
            if stored.get((i, p)) is not None:
                linears[(i, p)] = kernel(stored[(i, p)])
    return Plan(linears=linears, fused=fused, head=head)
