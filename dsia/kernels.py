"""The dense kernels of the target's linears (and LM head), chosen per token count by measurement.

Every candidate computes x @ w.T (+ b) in the weights' own dtype, so whichever runs, the forward is the target's;
they differ only in speed, and which is faster depends on the CPU and the token count: oneDNN's inner product (the
op torch.compile's CPU backend emits) read the row-major float32 weights 1.5-2x faster than BLAS for the few-token
products of decoding on an AMD EPYC with AVX512-BF16, and about 1.9x slower than BLAS on an Intel Xeon with AMX and
a 300 MB L3; there MKL's sgemm over weights packed once (`mkl`) verified a 14-token tree in 50 ms where BLAS took
80, but one token in 40 ms where BLAS took 28. So the choice is measured on the machine it runs on (`measure` +
`choose`), per token-count bucket, and cached by the caller (casspec/calibrate/tune.py). Their float32 results differ
from BLAS's in the last bits (another summation order), as a tree verification's do from a one-token step's.
"""
from __future__ import annotations

import math
import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .cxx import LIBRARY_DTYPES, build_error
from .errors import CasspecError
from .gcpause import paused_gc

DenseFn = Callable[[Tensor, Tensor, Tensor | None], Tensor]  # x [T, in], w [out, in], b [out] | None -> [T, out]
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 256)  # token-count buckets (upper bounds); larger counts (prompts) use the
# last
MKL_PACK_ROWS = 16  # the row count MKL is told when packing a weight; the packed layout serves any row count


def _onednn_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _onednn(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")


def _mkl_available() -> bool:
    try:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    except (AttributeError, RuntimeError):
        return False


class PackedCopies:
    """Each weight's copy in a kernel's own layout, made once by `pack_fn` (on its first product, or ahead by
    `pack`), kept as long as the weight lives and made again where the weight was changed in place since (its
    version counter moved; an inference tensor has none, and is taken as unchanged)."""

    def __init__(self, pack_fn: Callable[[Tensor], Tensor]) -> None:
        self.pack_fn = pack_fn
        self._packed: dict[int, tuple[int, Tensor]] = {}  # id(weight) -> (its version when packed, its packed copy)

    def pack(self, w: Tensor) -> Tensor:
        found, version = self._packed.get(id(w)), -1 if w.is_inference() else w._version
        if found is not None and found[0] == version:
            return found[1]
        if found is None:
            weakref.finalize(w, self._packed.pop, id(w), None)  # (an id is reused once its weight is gone)
        packed = self.pack_fn(w.contiguous())
        self._packed[id(w)] = (version, packed)
        return packed

    def drop(self, w: Tensor) -> None:
        self._packed.pop(id(w), None)


class PackedSgemm(PackedCopies):
    """MKL's sgemm (cblas_sgemm_compute) over each weight packed once into MKL's blocked layout (cblas_sgemm_pack,
    through the ops torch.compile's CPU backend emits for frozen float32 linears); the packed copy is about the
    weight's size."""

    def __init__(self) -> None:
        super().__init__(lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, MKL_PACK_ROWS))

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        x = x.contiguous()  # [T, in]
        return torch.ops.mkl._mkl_linear(x, self.pack(w), w, b, x.shape[0])  # [T, out]


def _casspec_available() -> bool:
    return build_error() is None and hasattr(torch.ops.casspec, "dense_linear")


def _casspec(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """casspec's own product (csrc/dense.cpp; float32, or bfloat16 summed in float32 and rounded once) over the
    weight's panels (64 outputs by every input, packed once: `casspec_panels`): each output summed in input order
    with fused multiply-adds, so a row's bits do not depend on the rows beside it, the call's row count or the
    CPU's instruction set."""
    return torch.ops.casspec.dense_panels(x, _PANELS.pack(w), w.shape[0], b)


# kernels that run on a CPU only and compute only these dtypes (a product outside them goes to BLAS)
CPU_DTYPES = {"onednn": (torch.float32,), "mkl": (torch.float32,), "casspec": LIBRARY_DTYPES}
_PACKED = PackedSgemm()  # the one store of MKL's packed weights
_PANELS = PackedCopies(lambda w: torch.ops.casspec.dense_pack(w))  # the one store of casspec's panels
KERNELS: dict[str, DenseFn] = {"blas": F.linear, "onednn": _onednn, "mkl": _PACKED,
                               "casspec": _casspec}  # every dense kernel by name


def mkl_packed(w: Tensor) -> Tensor:
    """w's copy in MKL's packed layout, the one `mkl` multiplies (packed now unless it is already)."""
    return _PACKED.pack(w)


def casspec_panels(w: Tensor) -> Tensor:
    """w [N, K]'s panels [ceil(N / 64), K, 64], the layout `casspec` multiplies (packed now unless it is already)."""
    return _PANELS.pack(w)


def kernel_for(dense: DenseKernels, tokens: int, dtype: torch.dtype, device: torch.device) -> str:
    """The kernel `dense` runs a product over `tokens` rows in dtype on device with (as DenseKernels.__call__)."""
    name = dense.names[bucket_of(tokens)]
    ok = name not in CPU_DTYPES or (device.type == "cpu" and dtype in CPU_DTYPES[name])
    return name if ok else "blas"


def candidates(dtype: torch.dtype, device: torch.device | str) -> dict[str, DenseFn]:
    """The kernels that compute in `dtype` on this device: BLAS `F.linear` always; on a CPU, for float32 oneDNN's
    inner product and MKL's packed sgemm where torch has them, and for float32 and bfloat16 casspec's own where its
    library builds."""
    on = {name: torch.device(device).type == "cpu" and dtype in dtypes for name, dtypes in CPU_DTYPES.items()}
    ok = {"blas": True, "onednn": on["onednn"] and _onednn_available(), "mkl": on["mkl"] and _mkl_available(),
          "casspec": on["casspec"] and _casspec_available()}
    return {name: fn for name, fn in KERNELS.items() if ok[name]}


def time_ms(fn: Callable[[], object], device: torch.device | str) -> float:
    """Milliseconds of one call of fn, synchronised on a GPU (the one timer of every measurement), the cyclic
    collector paused as a generation pauses it (no full collection lands in a timing)."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    with paused_gc():
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e3


def bucket_of(tokens: int) -> int:
    """Index of the bucket a product over `tokens` rows falls in."""
    return next((i for i, top in enumerate(TOKEN_BUCKETS) if tokens <= top), len(TOKEN_BUCKETS) - 1)


@dataclass(frozen=True)
class DenseKernels:
    """Which kernel runs a dense product over T rows: names[bucket_of(T)]; callable like F.linear."""
    names: tuple[str, ...] = ("blas",) * len(TOKEN_BUCKETS)  # per bucket of TOKEN_BUCKETS, a key of candidates()

    def __post_init__(self) -> None:
        assert len(self.names) == len(TOKEN_BUCKETS), self.names
        unknown = sorted(set(self.names) - set(KERNELS))
        if unknown:
            raise CasspecError(f"unknown kernel {unknown[0]!r}: use auto or one of {', '.join(KERNELS)}")

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        """x [..., in] @ w [out, in]^T (+ b) -> [..., out]."""
        # (a product outside the measured dtype/device, e.g. a bf16 copy, goes to BLAS)
        name = kernel_for(self, x.shape[0], x.dtype, x.device) if x.dim() == 2 else "blas"
        return KERNELS[name](x, w, b)

    def row_invariant(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether every product in dtype on device runs casspec's own kernel (`kernel_for`), whose rows are the
        same bits whatever the row count (by construction: the batch-invariant mode then needs no padding)."""
        return all(kernel_for(self, top, dtype, device) == "casspec" for top in TOKEN_BUCKETS)

    def keeps_copy(self, name: str, w: Tensor) -> bool:
        """Whether kernel `name` ("mkl" or "casspec", each keeping a weight in its own layout) runs some product of
        w: chosen for some bucket, and computing w's dtype on w's device."""
        return name in self.names and w.dtype in CPU_DTYPES[name] and w.device.type == "cpu"

    def prepare(self, weights: list[Tensor], others: list[Tensor] = ()) -> None:
        """Pack ahead the weights a chosen kernel keeps in its own layout (set-up time, not the first step's), and
        free the packed copies of those no chosen kernel reads (e.g. packed while measuring), and of `others`,
        weights whose products no forward runs here (a native target's dense copies)."""
        for w in weights:
            for name, store in (("mkl", _PACKED), ("casspec", _PANELS)):
                if self.keeps_copy(name, w):
                    store.pack(w)
                elif name not in self.names:
                    store.drop(w)
        for w in others:
            _PACKED.drop(w)
            _PANELS.drop(w)

    @staticmethod
    def default(dtype: torch.dtype, device: torch.device | str) -> "DenseKernels":
        """Without a measurement: oneDNN where it computes this dtype on this device, else BLAS."""
        return DenseKernels.forced("onednn" if "onednn" in candidates(dtype, device) else "blas")

    @staticmethod
    def forced(name: str) -> "DenseKernels":
        """One kernel for every bucket (tests, and `--kernels` overrides)."""
        return DenseKernels((name,) * len(TOKEN_BUCKETS))

    def describe(self) -> str:
        """e.g. 'onednn (T 1-4), blas (T 5+)': each kernel with the token counts it runs."""
        parts, lo = [], 1
        for j, name in enumerate(self.names):
            if j + 1 < len(TOKEN_BUCKETS) and self.names[j + 1] == name:
                continue
            last = j + 1 == len(TOKEN_BUCKETS)
            span = f"{lo}+" if last else str(lo) if lo == TOKEN_BUCKETS[j] else f"{lo}-{TOKEN_BUCKETS[j]}"
            parts.append(f"{name} (T {span})")
            lo = TOKEN_BUCKETS[j] + 1
        return ", ".join(parts)


SLOWER_DROPPED = 1.3  # a kernel this much slower than a bucket's fastest after one timed pass is not timed again
# in that bucket; this much slower than a bucket's fastest, in no larger bucket (on the AMD EPYC, BLAS and MKL ran
# 2-6x casspec's time from 1 to 64 rows: their first passes were 1.6 of a first use's 3.7 s of timing)
SLOWER_GONE = 2.0


@torch.inference_mode()
def measure(layers: list[Tensor], head: Tensor, repeats: int = 5, seed: int = 0) -> dict[str, list[float]]:
    """Milliseconds of one pass over a model's weights [out, in] (every projection of every layer, and the LM head
    but in the prompt bucket, whose prefill computes one row's logits; all of them, so that the pass streams them
    from memory as a forward does: a few layers' alone would sit in a large L3 and favour another kernel), per
    candidate kernel and bucket: {kernel: [ms per bucket]}, the median of `repeats` passes (one for the prompt
    bucket, whose forward runs once a generation: three were half of a first use's kernel timing), kernels
    interleaved so that machine drift hits them alike. One untimed pass first warms up every kernel (and packs). A
    kernel SLOWER_DROPPED times the fastest after a bucket's first pass keeps that one time, and one SLOWER_GONE
    times the fastest bucket's time is not timed in the larger ones (inf: first use is shorter, and a choice is not
    in doubt there)."""
    dtype, device = head.dtype, head.device
    gen = torch.Generator().manual_seed(seed)
    kernels = candidates(dtype, device)
    times: dict[str, list[list[float]]] = {k: [[math.inf] for _ in TOKEN_BUCKETS] for k in kernels}  # (inf: not timed)
    for j, T in enumerate(TOKEN_BUCKETS):
        weights = layers if j + 1 == len(TOKEN_BUCKETS) else layers + [head]
        xs = {i: torch.randn(T, i, generator=gen).to(dtype=dtype, device=device) for i in {w.shape[1] for w in weights}}
        timed = dict(kernels)
        for r in range(-1 if j == 0 else 0, repeats if T <= 64 else 1):  # (r -1: the warm-up pass)
            for name, fn in timed.items():
                ms = time_ms(lambda: [fn(xs[w.shape[1]], w, None) for w in weights], device)
                if r == 0:
                    times[name][j] = [ms]
                elif r > 0:
                    times[name][j].append(ms)
            if r == 0:
                best = min(times[name][j][0] for name in timed)
                timed = {name: fn for name, fn in timed.items() if times[name][j][0] <= SLOWER_DROPPED * best}
        best = min(statistics.median(times[name][j]) for name in kernels)
        kernels = {name: fn for name, fn in kernels.items() if statistics.median(times[name][j]) <= SLOWER_GONE * best}
    return {name: [statistics.median(ms) for ms in per_bucket] for name, per_bucket in times.items()}


def choose(timings: dict[str, list[float]], margin: float = 0.03) -> DenseKernels:
    """The fastest kernel per bucket; BLAS (what HF transformers runs) unless another is faster by `margin`."""
    names = []
    for j in range(len(TOKEN_BUCKETS)):
        best = min(timings, key=lambda k: timings[k][j])
        if "blas" in timings and timings[best][j] > (1 - margin) * timings["blas"][j]:
            best = "blas"
        names.append(best)
    return DenseKernels(tuple(names))
