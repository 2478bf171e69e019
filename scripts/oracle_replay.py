"""The oracle replay (issue 31): audit the DyTC router's decisions against the fixed methods and a per-step oracle.

Records, over every turn of each question (greedy, float32), the live steps of ar, sd, tree, vc, hc, vc+hc and dytc,
and teacher-forced along the target's output what every level and lookup would have drafted at each position, with
this machine's latency model as costs (casspec/tools/replay.py, dytc/replay.py); then prints the regret table and writes
out/recordings.jsonl, out/rows.json and out/replay.md.

    python scripts/oracle_replay.py --questions ../shared/specbench/dev.jsonl --per-category 2 --out results/replay
    python scripts/oracle_replay.py --replay results/replay/recordings.jsonl     # the offline replay only
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--questions", type=Path, help="Spec-Bench-format JSONL file")
    p.add_argument("--per-category", type=int, default=2, help="the first N questions of every category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--out", type=Path, default=Path("replay-out"), help="folder for the recordings and the table")
    p.add_argument("--replay", type=Path, help="recordings.jsonl of an earlier run: replay offline, record nothing")
    args = p.parse_args()

    from dsia.errors import CasspecError
    from casspec.tools import replay
    try:
        if args.replay is not None:
            if not args.replay.is_file():
                _fail(f"{args.replay} is not a file: pass the recordings.jsonl an earlier run wrote")
            rows = [replay.evaluate(r) for r in replay.load(args.replay)]
        else:
            if args.questions is None:
                _fail("pass --questions FILE (a Spec-Bench JSONL file) or --replay RECORDINGS")
            if args.max_new_tokens < 2:
                _fail(f"--max-new-tokens must be at least 2 (got {args.max_new_tokens})")
            rows = _record(args, replay)
    except CasspecError as e:
        _fail(str(e))
    if not rows:
        _fail("no question was recorded")
    text = replay.summary_text(rows)
    print(text)
    if args.replay is None:
        (args.out / "replay.md").write_text(text + "\n")


def _record(args: argparse.Namespace, replay) -> list[dict]:
    from casspec.tools.bench import writable_folder
    from casspec.calibrate.questions import read_questions
    from casspec.runtime.engine import Engine

    questions = read_questions(args.questions, per_category=args.per_category)
    out = writable_folder(args.out)
    engine = Engine.from_pretrained(args.model, dtype="float32", device="cpu", autoprofile=True, keep_state=False)
    return replay.run(engine, questions, replay.levels_of(engine), args.max_new_tokens, out)


if __name__ == "__main__":
    main()
