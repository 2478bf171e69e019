"""The dense kernels of the target's linears (and LM head), chosen per token count by measurement.

Every candidate computes x @ w.T (+ b) in the weights' own dtype, so whichever runs, the forward is the target's;
they differ only in speed, and which is faster depends on the CPU: oneDNN's inner product (the op torch.compile's
CPU backend emits) read the row-major float32 weights 1.5-2x faster than BLAS for the few-token products of
decoding on an AMD EPYC with AVX512-BF16, and about 1.9x slower than BLAS on an Intel Xeon with AMX and a 300 MB
L3. So the choice is measured on the machine it runs on (`measure` + `choose`), per token-count bucket, and
cached by the caller (casspec/tune.py).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import CasspecError

DenseFn = Callable[[Tensor, Tensor, Tensor | None], Tensor]  # x [T, in], w [out, in], b [out] | None -> [T, out]
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # token-count buckets (upper bounds); larger counts use the last one


def _onednn_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _onednn(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")


KERNELS: dict[str, DenseFn] = {"blas": F.linear, "onednn": _onednn}  # every dense kernel by name


def candidates(dtype: torch.dtype, device: torch.device | str) -> dict[str, DenseFn]:
    """The kernels that compute in `dtype` on this device: BLAS `F.linear` always; oneDNN's inner product for
    float32 on a CPU where torch has it."""
    onednn = torch.device(device).type == "cpu" and dtype == torch.float32 and _onednn_available()
    return {name: fn for name, fn in KERNELS.items() if name == "blas" or onednn}


def time_ms(fn: Callable[[], object], device: torch.device | str) -> float:
    """Milliseconds of one call of fn, synchronised on a GPU (the one timer of every measurement)."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def bucket_of(tokens: int) -> int:
    """Index of the bucket a product over `tokens` rows falls in."""
    return next((i for i, top in enumerate(BUCKETS) if tokens <= top), len(BUCKETS) - 1)


@dataclass(frozen=True)
class DenseKernels:
    """Which kernel runs a dense product over T rows: names[bucket_of(T)]; callable like F.linear."""
    names: tuple[str, ...] = ("blas",) * len(BUCKETS)  # per bucket of BUCKETS, a key of candidates()

    def __post_init__(self) -> None:
        assert len(self.names) == len(BUCKETS), self.names
        unknown = sorted(set(self.names) - set(KERNELS))
        if unknown:
            raise CasspecError(f"unknown kernel {unknown[0]!r}: use auto or one of {', '.join(KERNELS)}")

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        """x [..., in] @ w [out, in]^T (+ b) -> [..., out]."""
        name = self.names[bucket_of(x.shape[0])] if x.dim() == 2 else "blas"
        if name == "onednn" and (x.dtype != torch.float32 or x.device.type != "cpu"):
            name = "blas"  # a product outside the measured dtype/device (e.g. a bf16 copy) goes to BLAS
        return KERNELS[name](x, w, b)

    @staticmethod
    def default(dtype: torch.dtype, device: torch.device | str) -> "DenseKernels":
        """Without a measurement: oneDNN where it computes this dtype on this device, else BLAS."""
        return DenseKernels.forced("onednn" if "onednn" in candidates(dtype, device) else "blas")

    @staticmethod
    def forced(name: str) -> "DenseKernels":
        """One kernel for every bucket (tests, and `--kernels` overrides)."""
        return DenseKernels((name,) * len(BUCKETS))

    def describe(self) -> str:
        """e.g. 'onednn (T 1-4), blas (T 5+)': each kernel with the token counts it runs."""
        parts, lo = [], 1
        for j, name in enumerate(self.names):
            if j + 1 < len(BUCKETS) and self.names[j + 1] == name:
                continue
            last = j + 1 == len(BUCKETS)
            span = f"{lo}+" if last else str(lo) if lo == BUCKETS[j] else f"{lo}-{BUCKETS[j]}"
            parts.append(f"{name} (T {span})")
            lo = BUCKETS[j] + 1
        return ", ".join(parts)


@torch.inference_mode()
def measure(shapes: list[tuple[int, int]], dtype: torch.dtype, device: torch.device | str, repeats: int = 7,
            seed: int = 0) -> dict[str, list[float]]:
    """Milliseconds of one pass over every [out, in] weight shape in `shapes` (e.g. one layer's projections and
    the LM head), per candidate kernel and bucket: {kernel: [ms per bucket]}, the median of `repeats` passes,
    kernels interleaved so that machine drift hits them alike. Random weights: only the shapes matter."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o, i, generator=gen).to(dtype=dtype, device=device) for o, i in shapes]
    kernels = candidates(dtype, device)
    times: dict[str, list[list[float]]] = {k: [[] for _ in BUCKETS] for k in kernels}
    for j, T in enumerate(BUCKETS):
        xs = [torch.randn(T, w.shape[1], generator=gen).to(dtype=dtype, device=device) for w in weights]
        for r in range(repeats + 1):  # the first pass warms up
            for name, fn in kernels.items():
                ms = time_ms(lambda: [fn(x, w, None) for x, w in zip(xs, weights)], device)
                if r:
                    times[name][j].append(ms)
    return {name: [statistics.median(ms) for ms in per_bucket] for name, per_bucket in times.items()}


def choose(timings: dict[str, list[float]], margin: float = 0.03) -> DenseKernels:
    """The fastest kernel per bucket; BLAS (what HF transformers runs) unless another is faster by `margin`."""
    names = []
    for j in range(len(BUCKETS)):
        best = min(timings, key=lambda k: timings[k][j])
        if "blas" in timings and timings[best][j] > (1 - margin) * timings["blas"][j]:
            best = "blas"
        names.append(best)
    return DenseKernels(tuple(names))
