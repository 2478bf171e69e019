"""Micro-benchmark: one forward's MLP sublayers, dense (the target's kernels) vs a sparse level's kernels.

    python scripts/mlp_microbench.py [--model M] [--level sparse0.5] [--tokens 1] [--repeats 200]

Runs every layer's MLP in turn (so weights come from memory, as in a real forward) over the normed hidden
states of a real prompt, interleaving dense and sparse rounds; prints the median milliseconds of each and the
speedup. The sparse thresholds are calibrated on the same prompt, as a level does.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from casspec.engine import Engine, Request
from dsia.model import rms_norm
from dsia.plan import TARGET


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--level", default="sparse0.5")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per MLP call")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()

    engine = Engine.from_pretrained(args.model)
    model, cache = engine.model, engine.cache
    prompt = engine.encode("Explain how a refrigerator works, step by step, for a curious child.")
    cont = engine.generate_ids(prompt, Request(max_new_tokens=64)).token_ids
    level = engine.levels.get(args.level)
    hist = prompt + cont
    with torch.inference_mode():
        cache.rollback(0)
        model.forward(cache, torch.tensor(hist[:-1]), torch.arange(len(hist) - 1), 0)
        cache.commit(list(range(len(hist) - 1)))
        level.begin(model, cache, hist)
        mlps = level.plan.mlps
        # MLP inputs: the normed hidden states of the last tokens, one per layer (random-free, realistic scale)
        x = torch.nn.functional.embedding(torch.tensor(hist[-args.tokens:]), model.embed)
        inputs = [rms_norm(x, lw.mlp_norm, model.spec.norm_eps) for lw in model.layers]
        layers = sorted(mlps)
        dense_ms, sparse_ms = [], []
        for r in range(args.repeats + 5):
            t0 = time.perf_counter()
            for i in layers:
                model._mlp(i, model.layers[i], inputs[i], TARGET)
            t1 = time.perf_counter()
            for i in layers:
                mlps[i](inputs[i])
            t2 = time.perf_counter()
            if r >= 5:
                dense_ms.append((t1 - t0) * 1e3)
                sparse_ms.append((t2 - t1) * 1e3)
    d, s = statistics.median(dense_ms), statistics.median(sparse_ms)
    print(f"{len(layers)} MLPs over {args.tokens} token(s), {args.repeats} interleaved rounds: "
          f"dense {d:.2f} ms, {args.level} {s:.2f} ms, speedup {d / s:.2f}x "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
