"""A repeated workload: what the global suffix tree (dytc/suffix.py) is for, measured against dytc without it.

    python scripts/repeated_workload.py --questions ../shared/specbench/dev.jsonl [--per-category 2]
        [--max-new-tokens 128] [--methods dytc,dytc~maxgram+suffix] [--order question|rounds] [--model M]
        [--weights native]
        [--suffix-depth 24] [--suffix-max-match 12] [--suffix-min-prob 0.1] [--suffix-max-nodes N]
        [--out repeated.json]

Every method (in turn, on one engine, each as its own client with an empty memory) sends three requests per
question: (1) its first turn, a new conversation; (2) a follow-up in that conversation asking to revise the answer
(`FOLLOW_UP`); (3) the question again, a new conversation. `--order question` (default) sends each question's three
in a row, as one user would (the engine reuses the KV of a prompt's cached prefix, as `casspec serve` does);
`--order rounds` sends every question's first, then every follow-up, then every question again, each prefilled
whole. Greedy. Reported per method and round: tokens/s (new tokens over wall time, prefill included, and without the
prefill), the mean tokens per step, and per source the tokens drafted and accepted; at the end the client's global
suffix tree: nodes, sequences, tokens, evictions and its Python objects' bytes (sys.getsizeof over the tree),
against its node budget. Every method's tokens must equal the first method's (the tokens of a greedy lossless
method; a mismatch is reported and the exit status is 1).
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
from dytc.suffix import SuffixConfig

FOLLOW_UP = "Please revise your answer: keep what is right, fix what is wrong, and make it clearer."
ROUNDS = ("first", "revise", "again")


def run_method(engine: Engine, method: str, questions: list, max_new_tokens: int, order: str) -> dict:
    """The three requests per question of one method, as one client; its tokens and statistics per round."""
    tenant = f"repeated {method}"
    engine.shared.forget(tenant)
    rounds = {r: {"new_tokens": 0, "seconds": 0.0, "prefill_seconds": 0.0, "steps": 0, "accepted": 0,
                  "reused_tokens": 0, "drafted_by_source": {}, "accepted_by_source": {}} for r in ROUNDS}
    jobs = [(r, q) for q in questions for r in ROUNDS] if order == "question" else \
        [(r, q) for r in ROUNDS for q in questions]
    tokens: dict[str, list[int]] = {}
    answers: dict[str, str] = {}
    for rnd, q in jobs:
        messages = [{"role": "user", "content": q.turns[0]}]
        if rnd == "revise":
            messages += [{"role": "assistant", "content": answers[q.question_id]},
                         {"role": "user", "content": FOLLOW_UP}]
        if order == "rounds" or rnd == "first":  # (a question's requests in a row reuse the cached prefix, as a
            engine.forget_prefix()  # server's would; by rounds, each prefills its whole prompt)
        t0 = time.perf_counter()
        res = engine.generate_ids(engine.encode(messages), method_request(method, max_new_tokens=max_new_tokens,
                                                                           tenant=tenant))
        r, st = rounds[rnd], res.stats
        r["seconds"] += time.perf_counter() - t0
        if rnd == "first":
            answers[q.question_id] = res.text
        tokens[f"{rnd} {q.question_id}"] = res.token_ids
        spec = st.speculative()
        r["new_tokens"] += len(res.token_ids)
        r["prefill_seconds"] += st.prefill_seconds
        r["reused_tokens"] += st.reused_tokens
        r["steps"] += spec["num_drafts"]
        r["accepted"] += spec["num_accepted_tokens"]
        for key in ("drafted_by_source", "accepted_by_source"):
            for s, n in st.policy.get(key, {}).items():
                r[key][s] = r[key].get(s, 0) + n
    for r in rounds.values():
        r["tokens_per_s"] = r["new_tokens"] / r["seconds"]
        r["decode_tokens_per_s"] = r["new_tokens"] / (r["seconds"] - r["prefill_seconds"])
        r["mean_accepted_tokens"] = (r["steps"] + r["accepted"]) / max(r["steps"], 1)  # (tokens per step)
    mem = engine.shared.memory(tenant)
    new = sum(r["new_tokens"] for r in rounds.values())
    return {"rounds": rounds, "tokens": tokens,
            "suffix_tree": dict(mem.suffixes.stats(), bytes=mem.suffixes.nbytes()) if mem.suffixes else None,
            "total_tokens_per_s": new / sum(r["seconds"] for r in rounds.values()),
            "total_decode_tokens_per_s": new / sum(r["seconds"] - r["prefill_seconds"] for r in rounds.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--questions", required=True)
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="dytc,dytc~maxgram+suffix")
    p.add_argument("--order", default="question", choices=["question", "rounds"], help="question: each question's "
                   "three requests in a row (the cached prefix reused between them); rounds: every question's first "
                   "turn, then every follow-up, then every question again (each prefilled whole)")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--weights", default="float", choices=["float", "native"])
    for name, value in vars(SuffixConfig()).items():  # (dytc.suffix.SuffixConfig's fields)
        p.add_argument(f"--suffix-{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--out", default="repeated.json")
    args = p.parse_args(argv)
    questions = read_questions(args.questions, per_category=args.per_category)
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, weights=args.weights)
    engine.shared = SharedDrafts(SuffixConfig(**{k: getattr(args, f"suffix_{k}") for k in vars(SuffixConfig())}))
    methods = args.methods.split(",")
    engine.generate_ids(engine.encode([{"role": "user", "content": questions[0].turns[0]}]),
                        method_request(methods[0], max_new_tokens=args.max_new_tokens, tenant="warm-up"))
    results = {m: run_method(engine, m, questions, args.max_new_tokens, args.order) for m in methods}
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
