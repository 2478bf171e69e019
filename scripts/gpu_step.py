"""Milliseconds of one target step, eager and replayed from CUDA graphs, against the weights' bandwidth floor.

    python scripts/gpu_step.py [--model random:llama-7b] [--dtype bfloat16] [--device cuda] [--context 512]
        [--tokens 1,2,4,16,64] [--repeats 30] [--configs eager,graphs,graphs+compiled] [--out step.json]

At a committed context of --context tokens, each forward writes T tokens to scratch (a chain) and is timed with
a synchronisation before and after; each cell is the median of --repeats calls after warm-up (the graphs are
captured during warm-up), for each set-up in CONFIGS. The floor is the weights' bytes over the device's
streaming read bandwidth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from casspec.runtime.engine import Engine
from casspec.loading.checkpoints import load
from casspec.calibrate.tune import floor_ms, read_gbs
from dsia.kernels import time_ms
from dytc.machine import machine_info


# the engine set-ups timed: everything eager; CUDA graphs; CUDA graphs with compiled elementwise steps, with the
# target's q|k|v and gate|up as separate products, then fused (the default on a GPU)
CONFIGS = {"eager": dict(graphs=False, compile_pointwise=False),
           "graphs": dict(graphs=True, compile_pointwise=False),
           "graphs+compiled-separate": dict(graphs=True, compile_pointwise=True, fuse_projections=False),
           "graphs+compiled": dict(graphs=True, compile_pointwise=True, fuse_projections=True)}


def step_ms(engine: Engine, context: int, T: int, repeats: int) -> float:
    """Median milliseconds of a T-token chain forward on top of `context` committed tokens."""
    dev = engine.device
    tok = torch.randint(3, 1000, (T,), device=dev)
    pos = torch.arange(context, context + T, device=dev)
    times = [time_ms(lambda: engine.model.forward(engine.cache, tok, pos, context), dev)
             for _ in range(repeats + 3)]
    return statistics.median(times[3:])  # 3 warm-up calls: the graph is captured at the second


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="random:llama-7b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--tokens", default="1,2,4,16,64")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--configs", default=",".join(CONFIGS), help="which engine set-ups to time (CONFIGS)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    configs = {k: CONFIGS[k] for k in args.configs.split(",")}
    tokens = [int(t) for t in args.tokens.split(",")]
    loaded = load(args.model, args.dtype, args.device)
    capacity = args.context + max(tokens) + 1
    ids = torch.randint(3, 1000, (args.context,)).tolist()
    rows = {}
    with torch.inference_mode():
        for name, kw in configs.items():
            engine = Engine(loaded, max_context=capacity, autoprofile=False, keep_state=False, **kw)
            engine.extend_prefix(ids)
            rows[name] = {T: step_ms(engine, args.context, T, args.repeats) for T in tokens}
            del engine
    gbs = read_gbs(torch.device(args.device))
    floor = floor_ms(Engine(loaded, max_context=8, graphs=False, compile_pointwise=False, fuse_projections=False,
                            autoprofile=False, keep_state=False).model, gbs)
    out = {"model": loaded.name, "dtype": args.dtype, "machine": machine_info(torch.device(args.device).type),
           "context": args.context, "read_gbs": gbs, "floor_ms": floor, "ms": rows}
    print(f"{loaded.name} {args.dtype} on {out['machine'].get('gpu') or out['machine']['cpu']}, context {args.context}:"
          f" floor {floor:.2f} ms ({gbs:.0f} GB/s read)")
    best = list(configs)[-1]
    print("| T | " + " | ".join(f"{k} ms" for k in rows) + f" | {best} / floor |")
    print("|---|" + "---|" * (len(rows) + 1))
    for T in tokens:
        print(f"| {T} | " + " | ".join(f"{rows[k][T]:.2f}" for k in rows) + f" | {rows[best][T] / floor:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
