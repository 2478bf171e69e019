"""`casspec tune`: which dense kernel runs the target's products on this machine, measured once and cached.

The choice (dsia/kernels.py) is timed on first use, a few seconds, and kept in the user cache
(`cache_root()/kernels.json`) under a key of everything it depends on: CPU model and ISA flags, GPU, torch
version, threads, dtype, device, the model's weight shapes and the kernels there are to choose from. A machine,
torch build or model it was not measured for is measured anew; nothing measured elsewhere is used.
"""
from __future__ import annotations

import functools
import json
import sys
import math
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from dsia.cxx import source_digest
from dsia.errors import CasspecError
from dsia.kernels import TOKEN_BUCKETS, DenseKernels, candidates, choose, measure, time_ms
from dsia.kvcache import KVCache
from dsia.model import Transformer
from dytc.machine import machine_info

from ..cache.usercache import cache_root, machine_key, read_json, write_json

KERNELS_FILE = "kernels.json"  # in the user cache: key -> {"names", "timings_ms", "created"}


def weight_shapes(model: Transformer) -> list[tuple[int, int]]:
    """[out, in] of the products one layer runs (fused or not) and of the LM head (with the layer count, the
    model's shape key)."""
    return [tuple(w.shape) for w in model.layers[0].products() + [model.lm_head]]


def tuning_key(model: Transformer) -> str:
    """Everything the fastest kernel depends on, as one string: with casspec's own kernel among the candidates, the
    library's sources too (a choice measured against an older library is measured again; on the AMD EPYC a cached
    record of unknown age kept a float32 target on MKL at 30 ms a token where casspec's kernel, measured again,
    took 10 ms)."""
    kernels = sorted(candidates(model.dtype, model.device))
    return json.dumps({**machine_key(machine_info(model.device.type)), "dtype": str(model.dtype),
                       "device": model.device.type, "shapes": weight_shapes(model), "layers": len(model.layers),
                       "kernels": kernels, **({"library": source_digest()} if "casspec" in kernels else {})},
                      sort_keys=True)


def tuned_kernels(model: Transformer, path: Path | None = None, refresh: bool = False) -> tuple[DenseKernels, dict]:
    """The measured kernel choice for this model on this machine (cached), and its record: {"names",
    "timings_ms": {kernel: [ms per bucket]}, "created", "source": "cached" | "measured"}."""
    path = path or cache_root() / KERNELS_FILE
    key = tuning_key(model)
    store = read_json(path) or {}  # missing or unreadable: measure again
    rec = store.get(key)
    valid = isinstance(rec, dict) and isinstance(rec.get("names"), list) and len(rec["names"]) == len(TOKEN_BUCKETS)
    if valid and not refresh:
        try:
            return DenseKernels(tuple(rec["names"])), dict(rec, source="cached")
        except CasspecError:
            pass  # a kernel this version does not know: measure again
    print(f"casspec: choosing the dense kernels for {len(model.layers)} layers of {weight_shapes(model)[0]} on this "
          f"machine (once, a few seconds; cached in {path})", file=sys.stderr)
    *layers, head = model.dense_weights()
    timings = measure(layers, head)
    chosen = choose(timings)
    rec = {"names": list(chosen.names), "timings_ms": timings, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    store[key] = rec
    write_json(path, store)
    return chosen, dict(rec, source="measured")


def format_tuning(rec: dict) -> str:
    """The timing table behind a choice: ms of one pass over every projection and the head, per kernel and token
    bucket."""
    timings = rec["timings_ms"]
    head = "| tokens | " + " | ".join(f"{k} ms" for k in timings) + " | chosen |"
    lines = [head, "|" + "---|" * (len(timings) + 2)]
    for j, top in enumerate(TOKEN_BUCKETS):
        cells = [f"{timings[k][j]:.3f}" if math.isfinite(timings[k][j]) else "-" for k in timings]  # (-: not timed)
        lines.append(f"| {top} | " + " | ".join(cells) + f" | {rec['names'][j]} |")
    return "\n".join(lines)


def read_gbs(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """The machine's streaming read bandwidth (GB/s): a reduction over an `nbytes` buffer (the best of `repeats`)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best_ms = min(time_ms(buf.sum, device) for _ in range(repeats + 1))  # (the first run pays page faults)
    return nbytes / (best_ms / 1e3) / 1e9


def floor_ms(model: Transformer, gbs: float) -> float:
    """The memory-bandwidth floor of one target step: its weights' bytes read once at `gbs` GB/s."""
    return model.weight_bytes() / (gbs * 1e9) * 1e3


STEP_TOKENS = (1, 4, 16)  # the forwards `step_report` times: a one-token step, a short chain, a tree's verification
STEP_CONTEXT = 64  # committed tokens under the timed forwards


@torch.inference_mode()
def step_times(model: Transformer, cache: KVCache, repeats: int = 20,
               tokens: tuple[int, ...] = STEP_TOKENS) -> dict[str, float]:
    """Median ms of the target's forwards over `tokens` tokens on STEP_CONTEXT committed ones (written to the
    cache's scratch, never committed), and of the floor: a streaming read of as many bytes as a step reads, with
    the machine's threads (torch.sum over one buffer), timed in turn with the forwards so that the machine's drift
    (its memory bandwidth varies run to run) hits them alike. {"floor": ms, "1": ms, "4": ms, "16": ms}."""
    dev = model.device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.spec.vocab_size, (STEP_CONTEXT + max(tokens),), generator=gen).to(dev)
    cache.rollback(0)
    model.forward(cache, ids[:STEP_CONTEXT], torch.arange(STEP_CONTEXT, device=dev), 0)
    cache.commit(list(range(STEP_CONTEXT)))
    buf = torch.ones(model.weight_bytes() // 4, device=dev)
    runs: dict[str, Callable[[], object]] = {"floor": buf.sum}
    for T in tokens:
        rows, positions = ids[STEP_CONTEXT:STEP_CONTEXT + T], torch.arange(STEP_CONTEXT, STEP_CONTEXT + T, device=dev)
        runs[str(T)] = functools.partial(model.forward, cache, rows, positions, STEP_CONTEXT)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(repeats + 2):  # (2 warm-up rounds)
        for k, fn in runs.items():
            ms = time_ms(fn, dev)
            if r >= 2:
                times[k].append(ms)
    cache.rollback(0)
    return {k: statistics.median(v) for k, v in times.items()}


def format_steps(times: dict[str, float], weight_bytes: int) -> str:
    """The forwards against the floor and against a one-token step, as a table."""
    floor, one = times["floor"], times["1"]
    lines = ["| forward | ms | x floor | x one-token step |", "|---|---|---|---|"]
    for T in STEP_TOKENS:
        ms = times[str(T)]
        lines.append(f"| {T} token{'s' if T > 1 else ''} | {ms:.2f} | {ms / floor:.2f} | {ms / one:.2f} |")
    lines.append(f"floor: {floor:.2f} ms ({weight_bytes / 1e6:.0f} MB, a step's weights, streamed at "
                 f"{weight_bytes / floor / 1e6:.1f} GB/s)")
    return "\n".join(lines)


def kernels_for(model: Transformer, choice: str, invariant: bool = False) -> tuple[DenseKernels, str]:
    """`choice`: "auto" (measured, cached) or a kernel name forced for every token count; and a description.
    invariant: a batch-invariant target whose C++ library runs: "auto" then takes casspec's own kernel wherever it
    computes the model's dtype (its rows the same bits whatever the row count, by construction, on every CPU)."""
    if choice == "auto" and invariant and "casspec" in candidates(model.dtype, model.device):
        return DenseKernels.forced("casspec"), "casspec (batch-invariant by construction)"
    if choice == "auto":
        kernels, rec = tuned_kernels(model)
        return kernels, f"{kernels.describe()} ({rec['source']})"
    kernels = DenseKernels.forced(choice)
    return kernels, f"{kernels.describe()} (forced)"
