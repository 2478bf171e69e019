"""Long runs and one engine used many times: resident memory and speed must stay flat.

    python scripts/soak.py [--model M] [--dtype float32] [--method dytc] [--long 4096] [--runs 200]
        [--run-tokens 48] [--out soak.json]

Part 1: one generation of --long tokens (the context window set to twice that; the prompt asks for a long text and
EOS is ignored so that it runs to the end). Part 2: --runs back-to-back generations on the same Engine, cycling over
the dev questions' first turns. Reported: resident memory (RSS) after the first generation and at the end (growth
in %), tok/s of the first and last tenth of the runs (medians; different prompts) and of each prompt's last run
over its first (median over prompts), and the sizes of the engine's per-engine caches.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from casspec.runtime.engine import Engine


def rss_mb() -> float:
    """Current resident set size (MB), from /proc (ru_maxrss would be the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompts(path: str) -> list[str]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["turns"][0] for line in lines if line.strip()]


def same_prompt_ratio(speeds: list[float], n_prompts: int) -> float | None:
    """Median over the prompts run more than once (run i used prompt i % n_prompts) of the tok/s of its last run
    over that of its first; None when no prompt ran twice."""
    ratios = [speeds[i] / speeds[i % n_prompts] for i in range(len(speeds) - n_prompts, len(speeds))
              if i >= n_prompts and speeds[i % n_prompts] > 0]
    return statistics.median(ratios) if ratios else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--method", default="dytc")
    p.add_argument("--long", type=int, default=4096, help="tokens of the long generation (0: skip it)")
    p.add_argument("--runs", type=int, default=200, help="back-to-back generations")
    p.add_argument("--run-tokens", type=int, default=48, help="new tokens per back-to-back generation")
    p.add_argument("--questions", default="../shared/specbench/dev.jsonl")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    report: dict = {"method": args.method, "dtype": args.dtype}
    if args.long:
        engine = Engine.from_pretrained(args.model, dtype=args.dtype, max_context=2 * args.long)
        engine.eos_ids = frozenset()  # run to the length asked for
        t0 = time.perf_counter()
        res = engine.generate("Write a very long story about a lighthouse keeper, chapter by chapter.",
                              max_new_tokens=args.long, method=args.method)
        report["long"] = {"tokens": len(res.token_ids), "seconds": time.perf_counter() - t0,
                          "tok_s": res.stats.tokens_per_s, "finish": res.stats.finish_reason, "rss_mb": rss_mb()}
        print(f"long: {len(res.token_ids)} tokens at {res.stats.tokens_per_s:.1f} tok/s, RSS {rss_mb():.0f} MB",
              file=sys.stderr)
        del engine
    engine = Engine.from_pretrained(args.model, dtype=args.dtype)
    texts = prompts(args.questions)
    speeds, rss = [], []
    for i in range(args.runs):
        res = engine.generate(texts[i % len(texts)], max_new_tokens=args.run_tokens, method=args.method)
        speeds.append(res.stats.tokens_per_s)
        rss.append(rss_mb())
        if (i + 1) % 20 == 0:
            print(f"run {i + 1}: {res.stats.tokens_per_s:.1f} tok/s, RSS {rss[-1]:.0f} MB", file=sys.stderr)
    tenth = max(1, args.runs // 10)
    report["runs"] = {"n": args.runs, "rss_first_mb": rss[0], "rss_last_mb": rss[-1],
                      "rss_growth_pct": 100 * (rss[-1] - rss[0]) / rss[0],
                      "tok_s_first_tenth": statistics.median(speeds[:tenth]),
                      "tok_s_last_tenth": statistics.median(speeds[-tenth:]),
                      # the tenths hold different prompts (speed varies by prompt): the same prompt's last run
                      # against its first, median over the prompts run more than once
                      "same_prompt_last_over_first": same_prompt_ratio(speeds, len(texts)),
                      "tok_s": speeds,
                      "levels": len(engine.levels.levels), "trackers": len(engine.drafters.trackers)}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
