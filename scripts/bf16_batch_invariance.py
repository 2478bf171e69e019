"""bfloat16 batch invariance on the embedded model: which ops make a row's result depend on how many rows its
forward holds, by how much, and what the batch-invariant mode (dsia/invariant.py) costs.

    python scripts/bf16_batch_invariance.py [--context 300] [--repeats 9] [--trials 6] [--threads N]
        [--new-tokens 128] [--generation-repeats 3] [--out results/xeon/bf16-batch-invariance.json]

shapes: products of many shapes through the mode's `invariant_linear`, each row computed over 1 to 70 rows at a
time against all rows at once (the shapes where some row differs; none expected). ops: each op of the target's
forward, mode off and on, at the embedded model's shapes (its own weights, random inputs): a row computed alone
(one token, as `ar` runs it) against the same row among T rows (a chain or tree verification); the fraction of
output elements that differ and the largest difference. forward: the rows of tree and chain verifications on top
of a random prompt against one-token steps over their paths (logits bit for bit). step_ms: one target forward of
1 token and verifications of 4, 8, 16 (chains and binary trees) at --context committed tokens, the median of
--repeats, the modes interleaved. generation: ar and dytc on chat prompts, each mode, --generation-repeats runs
interleaved: tokens/s (the median run), in how many runs dytc's tokens are ar's, and where each mode's ar leaves
float32 ar's tokens.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F

from casspec.tools.divergence import first_difference
from casspec.runtime.engine import Engine
from casspec.loading.checkpoints import load
from casspec.runtime.request import Request
from dsia.invariant import RowKeys, block_attention, invariant_linear
from dsia.kernels import time_ms
from dsia.model import Transformer
from dsia.pointwise import rms_norm
from dytc.machine import machine_info
from dytc.tree import ancestor_mask, position_ids

ROWS = (2, 4, 8, 16, 32)  # row counts a row is compared in
SHAPE_ROWS = (*range(1, 20), 23, 31, 32, 33, 47, 48, 63, 64, 65, 70)  # row counts of the product-shape scan
SHAPES = [(i, o) for i in (16, 32, 64, 128, 192, 576, 960, 1536, 2560) for o in (16, 32, 64, 97, 192, 320, 576, 960,
                                                                                     1536)] + [(576, 49152)]
PROMPTS = ("Explain in a few sentences why the sky is blue.",
           "Write a short Python function that checks whether a number is prime, and explain it.",
           "List five tips for staying focused while studying, one line each.")


def binary_tree(n: int) -> list[int]:
    return [-1] + [(i - 1) // 2 for i in range(1, n)]


def path_to(parents: list[int], i: int) -> list[int]:
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def differences(alone: torch.Tensor, among: torch.Tensor) -> dict:
    """How rows computed alone differ from the same rows computed together (same shapes)."""
    diff = (alone.float() - among.float()).abs()
    return {"elements_differing": float((diff > 0).float().mean()), "max_abs_diff": float(diff.max())}


def worst(cells: list[dict]) -> dict:
    return {"elements_differing": max(c["elements_differing"] for c in cells),
            "max_abs_diff": max(c["max_abs_diff"] for c in cells)}


@torch.inference_mode()
def differing_shapes(model: Transformer, gen: torch.Generator, rows: int = 140) -> list[list[int]]:
    """[in, out] of the products (SHAPES, random weights) where a row computed over M rows at a time (M in
    SHAPE_ROWS, padded by the mode) differs from the same row among `rows`."""
    bad = []
    for i, o in SHAPES:
        w = (torch.randn(o, i, generator=gen) * 0.15).bfloat16()
        x = torch.randn(rows, i, generator=gen).bfloat16()
        full = invariant_linear(model.dense, x, w)
        for M in SHAPE_ROWS:
            y = torch.cat([invariant_linear(model.dense, x[r:r + M], w) for r in range(0, rows, M)])
            if not torch.equal(y, full):
                bad.append([i, o])
                break
    return bad


@torch.inference_mode()
def op_differences(model: Transformer, context: int, gen: torch.Generator) -> dict:
    """Per op, mode off and on: the worst over ROWS of (row alone vs the same row among T rows)."""
    lw = model.layers[0]
    products = {"q": lw.wq, "k": lw.wk, "v": lw.wv, "o": lw.wo, "gate": lw.w_gate, "up": lw.w_up,
                "down": lw.w_down, "head": model.lm_head}
    out: dict[str, dict] = {}
    for name, w in products.items():
        x = torch.randn(max(ROWS), w.shape[1], generator=gen).bfloat16()
        for mode, fn in (("off", model.dense), ("on", lambda x, w: invariant_linear(model.dense, x, w))):
            alone = torch.cat([fn(x[r:r + 1], w) for r in range(len(x))])
            out.setdefault(f"linear {name} {tuple(w.shape)}", {})[mode] = worst(
                [differences(alone[:T], fn(x[:T], w)) for T in ROWS])
    x = torch.randn(max(ROWS), model.spec.dim, generator=gen).bfloat16()
    alone = torch.cat([rms_norm(x[r:r + 1], lw.attn_norm, model.spec.norm_eps) for r in range(len(x))])
    out["rms_norm"] = {"off": worst([differences(alone[:T], rms_norm(x[:T], lw.attn_norm, model.spec.norm_eps))
                                     for T in ROWS])}
    s = model.spec
    scale = s.head_dim ** -0.5
    for shape in ("chain", "tree"):
        cells: dict[str, list[dict]] = {"off": [], "on": []}
        for T in ROWS[:-1]:
            parents = list(range(-1, T - 1)) if shape == "chain" else binary_tree(T)
            keys = torch.randn(s.n_kv_heads, context + T + 64, s.head_dim, generator=gen).bfloat16()
            values = torch.randn(s.n_kv_heads, context + T + 64, s.head_dim, generator=gen).bfloat16()
            q = torch.randn(s.n_heads, T, s.head_dim, generator=gen).bfloat16()
            anc = ancestor_mask(parents)
            mask = torch.cat((torch.ones(T, context, dtype=torch.bool), anc), dim=1)
            together = {"off": F.scaled_dot_product_attention(
                            q[None], keys[None, :, :context + T], values[None, :, :context + T], attn_mask=mask,
                            enable_gqa=True)[0],
                        "on": block_attention(q, keys, values, RowKeys.tree(context, context, anc), scale)}
            for r in range(T):  # row r alone, as ar computes it: its path's keys contiguous after the prefix
                slots = list(range(context)) + [context + j for j in path_to(parents, r)]
                k_r = torch.cat((keys[:, slots], keys[:, -64:]), dim=1)  # (whole blocks for the mode)
                v_r = torch.cat((values[:, slots], values[:, -64:]), dim=1)
                n = len(slots)
                alone = {"off": F.scaled_dot_product_attention(q[None, :, r:r + 1], k_r[None, :, :n],
                                                               v_r[None, :, :n], enable_gqa=True)[0],
                         "on": block_attention(q[:, r:r + 1].contiguous(), k_r, v_r,
                                               RowKeys.causal(n - 1, 1, q.device), scale)}
                for mode in cells:
                    cells[mode].append(differences(alone[mode], together[mode][:, r:r + 1]))
        out[f"attention ({shape}, {context} committed keys)"] = {mode: worst(c) for mode, c in cells.items()}
    return out


@torch.inference_mode()
def forward_rows(model: Transformer, context: int, trials: int, rng: random.Random) -> dict:
    """Rows of verification forwards whose logits differ from one-token steps over their paths."""
    V = model.spec.vocab_size
    differing = rows = 0
    worst_diff = 0.0
    for trial in range(trials):
        n = (4, 8, 16)[trial % 3]
        parents = binary_tree(n) if trial % 2 else list(range(-1, n - 1))
        L = context + rng.randrange(64)
        prompt, tokens = [rng.randrange(V) for _ in range(L)], [rng.randrange(V) for _ in range(n)]
        cache = model.new_cache(L + n + 1)
        model.forward(cache, torch.tensor(prompt), torch.arange(L), 0)
        cache.commit(list(range(L)))
        tree = model.forward(cache, torch.tensor(tokens), position_ids(parents, L), L, ancestor_mask(parents))
        for i in range(n):
            cache.rollback(L)
            for j in path_to(parents, i):
                step = model.forward(cache, torch.tensor([tokens[j]]), torch.tensor([cache.length]), cache.length)
                cache.commit([0])
            differing += not torch.equal(tree[i], step[0])
            worst_diff = max(worst_diff, float((tree[i] - step[0]).abs().max()))
            rows += 1
    return {"rows": rows, "rows_differing": differing, "max_abs_logit_diff": worst_diff}


@torch.inference_mode()
def step_ms(models: dict[str, Transformer], context: int, repeats: int, gen: torch.Generator) -> dict:
    """Median ms of a target forward per (tokens, shape), the modes interleaved."""
    V = next(iter(models.values())).spec.vocab_size
    prompt = torch.randint(0, V, (context,), generator=gen)
    caches = {}
    for mode, m in models.items():
        caches[mode] = m.new_cache(context + 64)
        m.forward(caches[mode], prompt, torch.arange(context), 0)
        caches[mode].commit(list(range(context)))
    out: dict[str, dict] = {}
    for T, shape in ((1, "chain"), (4, "chain"), (4, "tree"), (8, "chain"), (8, "tree"), (16, "chain"),
                     (16, "tree")):
        parents = list(range(-1, T - 1)) if shape == "chain" else binary_tree(T)
        tokens = torch.randint(0, V, (T,), generator=gen)
        pos, mask = position_ids(parents, context), None if shape == "chain" else ancestor_mask(parents)
        times: dict[str, list[float]] = {mode: [] for mode in models}
        for r in range(repeats + 2):  # two warm-up rounds
            for mode, m in models.items():
                ms = time_ms(lambda: m.forward(caches[mode], tokens, pos, context, mask), "cpu")
                if r >= 2:
                    times[mode].append(ms)
        cell = {mode: statistics.median(t) for mode, t in times.items()}
        out[f"{T} {shape}"] = dict(cell, ratio=cell["on"] / cell["off"])
        print(f"step {T:2d} {shape:5s}: off {cell['off']:.1f} ms, on {cell['on']:.1f} ms "
              f"(x{cell['on'] / cell['off']:.2f})", flush=True)
    return out


def first_index(a: list[int], b: list[int]) -> int | None:
    """Where two token lists first differ (None: equal)."""
    return None if a == b else first_difference(a, b)


def generation(new_tokens: int, repeats: int) -> dict:
    """ar and dytc on PROMPTS, each mode, `repeats` runs each, the modes interleaved (tokens/s: the median run);
    both latency models fitted online (no profile), nothing kept. dytc's runs are compared with ar one by one."""
    fp32 = Engine.from_pretrained(dtype="float32", kernels="blas", autoprofile=False, keep_state=False, hf=False)
    reference = [fp32.generate(prompt, max_new_tokens=new_tokens, method="ar").token_ids for prompt in PROMPTS]
    del fp32
    engines = {mode: Engine.from_pretrained(dtype="bfloat16", autoprofile=False, keep_state=False, hf=False,
                                            batch_invariant=mode == "on") for mode in ("off", "on")}
    runs: dict[str, dict] = {mode: {"build": e.build, "prompts": []} for mode, e in engines.items()}
    for k, prompt in enumerate(PROMPTS):
        results: dict[str, dict[str, list]] = {mode: {"ar": [], "dytc": []} for mode in engines}
        for _ in range(repeats):
            for mode, engine in engines.items():
                for method in ("ar", "dytc"):
                    req = Request(max_new_tokens=new_tokens, method=method)
                    results[mode][method].append(engine.generate_ids(engine.prompt_ids(prompt), req))
        for mode, res in results.items():
            ar = res["ar"][0].token_ids
            row = {"prompt": k, "tokens": len(ar),
                   "ar_tok_s": statistics.median(r.stats.new_tokens / r.stats.seconds for r in res["ar"]),
                   "dytc_tok_s": statistics.median(r.stats.new_tokens / r.stats.seconds for r in res["dytc"]),
                   "dytc_runs_equal_to_ar": sum(r.token_ids == ar for r in res["dytc"]), "runs": repeats,
                   "dytc_first_differences": [first_index(r.token_ids, ar) for r in res["dytc"]],
                   "ar_first_difference_from_float32_ar": first_index(ar, reference[k])}
            runs[mode]["prompts"].append(row)
            print(f"{mode}: prompt {k}: ar {row['ar_tok_s']:.1f} tok/s, dytc {row['dytc_tok_s']:.1f} tok/s, dytc = "
                  f"ar in {row['dytc_runs_equal_to_ar']} of {repeats} runs", flush=True)
    for cell in runs.values():
        cell["ar_tok_s_mean"] = statistics.mean(r["ar_tok_s"] for r in cell["prompts"])
        cell["dytc_tok_s_mean"] = statistics.mean(r["dytc_tok_s"] for r in cell["prompts"])
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=300, help="committed tokens under the timed forwards")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--trials", type=int, default=6, help="verification forwards whose rows are checked")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens per generation (0: no generations)")
    p.add_argument("--generation-repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    base = load(None, "bfloat16", "cpu", hf=False).runtime
    models = {"off": base, "on": base.with_batch_invariant()}
    t0 = time.perf_counter()
    out = {"model": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "machine": machine_info("cpu"),
           "context": args.context, "repeats": args.repeats}
    out["shapes_differing"] = differing_shapes(base, gen)
    print(f"product shapes where a row depends on the row count, mode on: {out['shapes_differing']} "
          f"(of {len(SHAPES)})", flush=True)
    out["ops"] = op_differences(base, args.context, gen)
    for name, cell in out["ops"].items():
        print(name, json.dumps(cell), flush=True)
    out["forward"] = {mode: forward_rows(m, args.context, args.trials, random.Random(1)) for mode, m in models.items()}
    print("forward rows:", json.dumps(out["forward"]), flush=True)
    out["step_ms"] = step_ms(models, args.context, args.repeats, gen)
    if args.new_tokens:
        out["generation"] = generation(args.new_tokens, args.generation_repeats)
    out["seconds"] = time.perf_counter() - t0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
