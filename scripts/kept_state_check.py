"""Does DyTC's speed depend on what an engine ran before? (issue 31, per-machine robustness)

`casspec generate` and `casspec serve` keep what the router learned (acceptance estimates, latency refinements) in
the user cache; `casspec bench` neither reads nor writes it. This script runs `dytc` through the Python API with
kept state (keep_state=True) over the bench questions (the first N of each category, first turns) from two
histories, each in a fresh user cache of its own (a temporary folder; the compiled library is shared):

  fresh   the bench questions first (the profile and levels plane measured on first use), then again;
  other   the file's other questions first, then the bench questions in a new process.

    python scripts/kept_state_check.py --questions ../shared/specbench/dev.jsonl --per-category 2

Prints tokens/s (generation time, prefill excluded) of each pass; the `other` history's bench pass should match
the `fresh` one's to within run-to-run noise.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def split(path: Path, per_category: int) -> tuple[list[dict], list[dict]]:
    """(bench questions: the first per_category of each category, the others), in file order."""
    seen: collections.Counter = collections.Counter()
    bench, other = [], []
    for line in path.read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            (bench if seen[q["category"]] < per_category else other).append(q)
            seen[q["category"]] += 1
    return bench, other


def run_pass(questions: list[dict], max_new_tokens: int) -> float:
    """dytc over the questions' first turns with kept state: tokens per second of generation."""
    from casspec.runtime.engine import Engine
    from casspec.loading.checkpoints import embedded_gguf

    engine = Engine.from_pretrained(str(embedded_gguf()), dtype="float32", device="cpu", autoprofile=True,
                                    keep_state=True)
    tokens = seconds = 0.0
    for q in questions:
        r = engine.generate([{"role": "user", "content": q["turns"][0]}], max_new_tokens=max_new_tokens)
        tokens += r.stats.new_tokens
        seconds += r.stats.seconds
    return tokens / seconds


def child(args: argparse.Namespace, which: str, home: str) -> float:
    """One pass in a new process whose user cache lives in `home`."""
    env = dict(os.environ, HOME=home, XDG_CACHE_HOME=str(Path(home) / ".cache"))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    out = subprocess.run([sys.executable, __file__, "--questions", str(args.questions), "--per-category",
                          str(args.per_category), "--max-new-tokens", str(args.max_new_tokens), "--pass", which],
                         env=env, check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--questions", type=Path, required=True, help="Spec-Bench-format JSONL file")
    p.add_argument("--per-category", type=int, default=2, help="bench questions: the first N of every category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--pass", dest="which", choices=("bench", "other"), help=argparse.SUPPRESS)  # (a child's pass)
    args = p.parse_args()
    if not args.questions.is_file() or args.per_category < 1 or args.max_new_tokens < 1:
        p.error("--questions must be a file, --per-category and --max-new-tokens at least 1")
    bench, other = split(args.questions, args.per_category)
    if args.which:
        print(run_pass(bench if args.which == "bench" else other, args.max_new_tokens))
        return
    if not other:
        p.error(f"every question of {args.questions} is a bench question: lower --per-category")
    rows = []
    with tempfile.TemporaryDirectory() as fresh, tempfile.TemporaryDirectory() as warmed:
        rows.append(("fresh", "bench questions (first)", child(args, "bench", fresh)))
        rows.append(("fresh", "bench questions (again)", child(args, "bench", fresh)))
        rows.append(("other", f"other questions ({len(other)})", child(args, "other", warmed)))
        rows.append(("other", "bench questions", child(args, "bench", warmed)))
    print(f"| history | pass ({len(bench)} bench questions, first turns) | dytc tokens/s |")
    print("|---|---|---|")
    for history, what, rate in rows:
        print(f"| {history} | {what} | {rate:.1f} |")


if __name__ == "__main__":
    main()
