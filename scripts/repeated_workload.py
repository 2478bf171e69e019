"""A repeated workload: what the global suffix tree (dytc/suffix.py) is for, measured against dytc without it.

    python scripts/repeated_workload.py --questions ../shared/specbench/dev.jsonl [--per-category 2]
        [--max-new-tokens 128] [--methods dytc,dytc~maxgram+suffix] [--model M] [--weights native]
        [--suffix-max-nodes N] [--out repeated.json]

Every method (in turn, on one engine, each as its own client with an empty memory) runs three rounds over the
questions: (1) each question's first turn, a new conversation; (2) a follow-up in that conversation asking to revise
the answer (`FOLLOW_UP`); (3) each question again, a new conversation. Greedy. Reported per method and round:
tokens/s (new tokens over wall time, prefill included), the mean accepted tokens per step, and per source the
tokens drafted and accepted; at the end the client's global suffix tree: nodes, sequences, tokens, evictions and
its Python objects' bytes (sys.getsizeof over the tree), against its node budget. Every method's tokens must equal
the first method's (the tokens of a greedy lossless method; a mismatch is reported and the exit status is 1).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from casspec.calibrate.questions import read_questions
from casspec.runtime.engine import Engine
from casspec.tools.bench import method_request
from dytc.machine import cpu_model
from dytc.shared import SharedDrafts
from dytc.suffix import SUFFIX_MAX_NODES

FOLLOW_UP = "Please revise your answer: keep what is right, fix what is wrong, and make it clearer."
ROUNDS = ("first", "revise", "again")


def run_method(engine: Engine, method: str, questions: list, max_new_tokens: int) -> dict:
    """The three rounds of one method, as one client; its tokens and statistics per round."""
    tenant = f"repeated {method}"
    engine.shared.forget(tenant)
    out: dict = {"rounds": {}, "tokens": {}}
    answers: dict[str, str] = {}
    for rnd in ROUNDS:
        new = wall = steps = accepted = prefill = 0.0
        drafted_by: dict[str, int] = {}
        accepted_by: dict[str, int] = {}
        for q in questions:
            messages = [{"role": "user", "content": q.turns[0]}]
            if rnd == "revise":
                messages += [{"role": "assistant", "content": answers[q.question_id]},
                             {"role": "user", "content": FOLLOW_UP}]
            engine.forget_prefix()  # (each request prefills its whole prompt, as a new server connection would)
            req = method_request(method, max_new_tokens=max_new_tokens, tenant=tenant)
            t0 = time.perf_counter()
            res = engine.generate_ids(engine.encode(messages), req)
            wall += time.perf_counter() - t0
            if rnd == "first":
                answers[q.question_id] = res.text
            out["tokens"][f"{rnd} {q.question_id}"] = res.token_ids
            spec = res.stats.speculative()
            new += len(res.token_ids)
            prefill += res.stats.prefill_seconds
            steps += spec["num_drafts"]
            accepted += spec["num_accepted_tokens"]
            for s, n in res.stats.policy.get("drafted_by_source", {}).items():
                drafted_by[s] = drafted_by.get(s, 0) + n
            for s, n in res.stats.policy.get("accepted_by_source", {}).items():
                accepted_by[s] = accepted_by.get(s, 0) + n
        out["rounds"][rnd] = {"tokens_per_s": new / wall, "new_tokens": new, "seconds": wall,
                              "decode_tokens_per_s": new / (wall - prefill), "prefill_seconds": prefill,
                              "mean_accepted_tokens": (steps + accepted) / max(steps, 1),  # (tokens per step)
                              "drafted_by_source": drafted_by, "accepted_by_source": accepted_by}
    mem = engine.shared.memory(tenant)
    out["suffix_tree"] = dict(mem.suffixes.stats(), bytes=mem.suffixes.nbytes()) if mem.suffixes else None
    rounds = out["rounds"].values()
    new = sum(r["new_tokens"] for r in rounds)
    out["total_tokens_per_s"] = new / sum(r["seconds"] for r in rounds)
    out["total_decode_tokens_per_s"] = new / sum(r["seconds"] - r["prefill_seconds"] for r in rounds)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--questions", required=True)
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="dytc,dytc~maxgram+suffix")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--weights", default="float", choices=["float", "native"])
    p.add_argument("--suffix-max-nodes", type=int, default=SUFFIX_MAX_NODES, help="each client's suffix tree budget")
    p.add_argument("--out", default="repeated.json")
    args = p.parse_args(argv)
    questions = read_questions(args.questions, per_category=args.per_category)
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, weights=args.weights)
    engine.shared = SharedDrafts(max_nodes=args.suffix_max_nodes)
    methods = args.methods.split(",")
    engine.generate_ids(engine.encode([{"role": "user", "content": questions[0].turns[0]}]),
                        method_request(methods[0], max_new_tokens=args.max_new_tokens, tenant="warm-up"))
    results = {m: run_method(engine, m, questions, args.max_new_tokens) for m in methods}
    first = results[methods[0]]["tokens"]
    differ = {m: sum(r["tokens"][k] != first[k] for k in first) for m, r in results.items()}
    print(f"{len(questions)} questions x {len(ROUNDS)} rounds, {args.max_new_tokens} new tokens, {args.weights} "
          f"weights, {cpu_model()}; per round tokens/s end to end / without the prefill (tokens per step); overall;"
          f" requests unlike {methods[0]}'s")
    print("| method | " + " | ".join(ROUNDS) + " | overall | vs " + methods[0] + " | != |")
    print("|---" * (len(ROUNDS) + 4) + "|")
    base = results[methods[0]]
    for m, r in results.items():
        cells = [f"{x['tokens_per_s']:.1f} / {x['decode_tokens_per_s']:.1f} ({x['mean_accepted_tokens']:.2f})"
                 for x in (r["rounds"][name] for name in ROUNDS)]
        ratio = (r["total_tokens_per_s"] / base["total_tokens_per_s"],
                 r["total_decode_tokens_per_s"] / base["total_decode_tokens_per_s"])
        print(f"| {m} | " + " | ".join(cells) + f" | {r['total_tokens_per_s']:.1f} / "
              f"{r['total_decode_tokens_per_s']:.1f} | {ratio[0]:.2f}x / {ratio[1]:.2f}x | {differ[m]} |")
    for m, r in results.items():
        if r["suffix_tree"]:
            print(f"{m}: global suffix tree {json.dumps(r['suffix_tree'])}")
    summary = {m: {k: v for k, v in r.items() if k != "tokens"} for m, r in results.items()}
    summary["config"] = dict(vars(args), questions_run=len(questions), cpu=cpu_model())
    summary["differ"] = differ
    Path(args.out).write_text(json.dumps(summary, indent=1))
    return 1 if any(differ.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
