"""The oracle replay (issue 31): record, teacher-forced over the target's greedy output, what every draft source
would have drafted at each position and what the target accepts, with this machine's measured costs; run the
methods live on the same prompts, recording each step; then replay offline (dytc/replay.py) and report each
method's regret against the best static policy and the per-step oracle, per question and per category.

    python scripts/oracle_replay.py --questions ../shared/specbench/dev.jsonl --per-category 2 --out results/replay

Every turn of every question (a later turn with ar's earlier answers as history, as the bench runs it), greedy,
float32; the live methods' outputs must equal `ar`'s (a divergence stops the run: it would be a lossless bug).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dsia.errors import CasspecError
from dytc.latency import TARGET_LEVEL
from dytc.ngram import LOOKUP_CLASSES, PLD_NUM_TOKENS
from dytc.policies import DraftContext, Policy
from dytc.costs import MIN_MS
from dytc.replay import LiveStep, Recording, oracle, replay, replay_live, static_policies
from dytc.sources import LOOKUPS
from dytc.tree import DraftTree, is_chain

from .bench import method_request

from ..calibrate.questions import Question
from ..runtime.engine import Engine
from ..calibrate.agreement import teacher_forced
from ..runtime.method_table import MULTI_LEVEL

LIVE_METHODS = ("ar", "sd", "tree", "vc", "hc", "vc+hc", "dytc")  # run for real on every prompt; ar gives y
STATIC_LIVE = ("sd", "tree", "vc", "hc", "vc+hc")  # the fixed methods dytc is held against (issue 31)
ROUTER = "dytc"
COST_TOKENS = 96  # cost tables cover forwards of up to this many tokens (longer ones cost the last entry)


class Recorder(Policy):
    """Wraps a method's policy and records each step it drafts (a LiveStep); drafting is the wrapped policy's."""

    def __init__(self, inner: Policy) -> None:
        self.inner, self.name = inner, inner.name
        self.steps: list[LiveStep] = []
        self.start = 0  # prompt tokens: output position j is len(history) - start
        self._since = 0  # forwards logged before the step being drafted
        self._own = 0.0  # the step's measured policy time so far (ms, level forwards included)
        self._step: LiveStep | None = None

    def begin(self, ctx: DraftContext) -> None:
        ctx.forwards = []
        self.start = len(ctx.history) - 1
        self.inner.begin(ctx)

    def draft(self, ctx: DraftContext) -> DraftTree:
        self._since, ms0, t0 = len(ctx.forwards), ctx.draft_ms, time.perf_counter()
        tree = self.inner.draft(ctx)
        self._own = (time.perf_counter() - t0) * 1e3 - (ctx.draft_ms - ms0)
        self._step = LiveStep(len(ctx.history) - self.start, len(tree), not is_chain(tree.parents), 0, [], 0.0)
        return tree

    def observe(self, ctx: DraftContext, tree: DraftTree, path: list[int], emitted: list[int]) -> None:
        ms0, t0 = ctx.draft_ms, time.perf_counter()
        self.inner.observe(ctx, tree, path, emitted)
        step = self._step
        step.own_ms = self._own + (time.perf_counter() - t0) * 1e3 - (ctx.draft_ms - ms0)
        step.accepted = len(path) - 1
        step.forwards = ctx.forwards[self._since:]
        self.steps.append(step)

    def report(self) -> dict:
        return self.inner.report()


def levels_of(engine: Engine) -> list[str]:
    """The levels the live methods draft with (sd's and tree's, then the multi-level methods' sources)."""
    names = [method_request("sd").level]
    for m in LIVE_METHODS:
        req = method_request(m)
        if m in MULTI_LEVEL:
            names += [n for n, _ in engine.drafters.sources(req) if n not in LOOKUPS]
    return list(dict.fromkeys(names))


def _ranks(engine: Engine, name: str, prompt: list[int], y: list[int]) -> list[int]:
    """rank[j] of y[j] in the level's teacher-forced distribution after y[:j] (rank[0] = -1: the prefill's): one
    1-token forward per position over the target's KV of y[:j - 1], as the first draft of a step at j runs."""
    ranks = [-1]
    for targets, (logits,) in teacher_forced(engine, engine.levels.get(name), prompt, y, [None], chunk=1):
        rows = logits.float()  # [n, V]
        ranks += (rows > rows.gather(1, targets[:, None])).sum(-1).tolist()
    return ranks


def _lookups(names: tuple[str, ...], prompt: list[int], y: list[int], eos: frozenset[int]) -> tuple[dict, dict]:
    """Per lookup: tokens proposed after y[:j] and how many equal y[j:] ([T] each; [0] unused)."""
    proposed, match = {}, {}
    for name in names:
        lk, p, m = LOOKUP_CLASSES[name](prompt + y[:1], eos_ids=eos), [0], [0]
        for j in range(1, len(y)):
            toks, _ = lk.propose_after([], PLD_NUM_TOKENS)
            p.append(len(toks))
            m.append(next((i for i, t in enumerate(toks) if j + i >= len(y) or y[j + i] != t), len(toks)))
            lk.extend([y[j]])
        proposed[name], match[name] = p, m
    return proposed, match


def _costs(engine: Engine, levels: list[str], context: int) -> tuple[list[list[float]], dict]:
    """Predicted ms tables at `context`: verification [tree][N] and each level's forward [tree][n]."""
    T = np.arange(1, COST_TOKENS + 1)
    lat = engine.latency

    def table(level: str) -> list[list[float]]:
        if not lat.known(level):
            raise CasspecError(f"no timing of {level!r} on this machine: the live methods should have run it")
        return [[0.0] + np.maximum(lat.predict_mean(level, T, context, tree=t), MIN_MS).tolist() for t in (False, True)]
    return table(TARGET_LEVEL), {name: table(name) for name in levels}


def record(engine: Engine, prompt: list[int], q: Question, turn: int, levels: list[str], max_new_tokens: int,
           methods: tuple[str, ...] = LIVE_METHODS) -> Recording:
    """One turn's recording: live runs of `methods` on the prompt ids (the first, ar, gives y), then the
    teacher-forced ranks and lookups, and the cost tables at the middle of the output."""
    live, seconds, outputs = {}, {}, {}
    for m in methods:
        engine.forget_prefix()
        rec: list[Recorder] = []
        result = engine.generate_ids(prompt, method_request(m, max_new_tokens=max_new_tokens),
                                     wrap=lambda p: rec.append(Recorder(p)) or rec[-1])
        live[m], outputs[m] = rec[0].steps, result.token_ids
        seconds[m] = result.stats.seconds - result.stats.prefill_seconds  # the steps' time (prefill left out)
    y = outputs[methods[0]]
    diverged = [m for m in methods if outputs[m] != y]
    if diverged:
        raise RuntimeError(f"question {q.question_id} turn {turn + 1}: {', '.join(diverged)} emitted other tokens "
                           f"than {methods[0]}")
    ranks = {name: _ranks(engine, name, prompt, y) for name in levels}
    proposed, match = _lookups(tuple(LOOKUP_CLASSES), prompt, y, engine.eos_ids)  # (those over the history alone)
    verify, level = _costs(engine, levels, len(prompt) + len(y) // 2)
    return Recording(str(q.question_id), q.category, len(prompt), y, ranks, proposed, match, verify, level,
                     live, seconds, turn)


def record_question(engine: Engine, q: Question, levels: list[str], max_new_tokens: int) -> list[Recording]:
    """Every turn of a question, as the bench runs it: a later turn's prompt holds the earlier turns and ar's
    answers to them (every method's, in float32)."""
    messages: list[dict] = []
    out = []
    for i, text in enumerate(q.turns):
        messages.append({"role": "user", "content": text})
        out.append(record(engine, engine.encode(messages), q, i, levels, max_new_tokens))
        messages.append({"role": "assistant", "content": engine.decode(out[-1].target)})
    return out


def evaluate(r: Recording) -> dict:
    """One recording replayed: modelled ms of each live method, each static offline policy and the oracle."""
    live = {m: replay_live(r, m) for m in r.live}
    static = {name: replay(r, pol)[0] for name, pol in static_policies(r).items()}
    best_static = min(static, key=static.get)
    best_live = min((m for m in STATIC_LIVE if m in live), key=lambda m: live[m][0], default=None)
    o_ms, o_steps, o_used = oracle(r)
    return {"question_id": r.question_id, "turn": r.turn, "category": r.category, "tokens": r.steps_needed,
            "live_ms": {m: v[0] for m, v in live.items()}, "own_ms": {m: v[1] for m, v in live.items()},
            "steps": {m: v[2] for m, v in live.items()}, "measured_s": dict(r.live_seconds),
            "best_live_static": best_live, "best_offline_static": best_static,
            "best_offline_static_ms": static[best_static], "oracle_ms": o_ms, "oracle_steps": o_steps,
            "oracle_drafts_by_source": o_used}


def report(rows: list[dict]) -> str:
    """The regret table (markdown): per category, speed ratios (time of the other / time of dytc; geometric means
    over turns): dytc against the best fixed method of each turn (run live, costed by the model), against
    the best fixed offline policy, and the per-step oracle against dytc; then the same against the best fixed
    method with each side's measured own time added; and the own time per step of dytc and vc."""
    def gmean(v: list[float]) -> float:
        return float(np.exp(np.mean(np.log(v))))

    def best(row: dict, own: bool = False) -> float:
        return min(row["live_ms"][m] + own * row["own_ms"][m] for m in STATIC_LIVE if m in row["live_ms"])

    def dytc(row: dict, own: bool = False) -> float:
        return row["live_ms"][ROUTER] + own * row["own_ms"][ROUTER]

    keys = {"dytc vs best fixed method": lambda r: best(r) / dytc(r),
            "dytc vs best offline static": lambda r: r["best_offline_static_ms"] / dytc(r),
            "oracle vs dytc": lambda r: dytc(r) / r["oracle_ms"],
            "dytc vs best fixed, own time counted": lambda r: best(r, True) / dytc(r, True),
            "dytc own ms / step": lambda r: r["own_ms"][ROUTER] / r["steps"][ROUTER],
            "vc own ms / step": lambda r: r["own_ms"]["vc"] / r["steps"]["vc"]}
    keys = {k: f for k, f in keys.items() if all(_usable(f, r) for r in rows)}
    lines = ["| category | turns | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for cat in sorted({r["category"] for r in rows}) + ["all"]:
        sel = [r for r in rows if cat in ("all", r["category"])]
        cells = [f"{gmean([f(r) for r in sel]):.3f}" for f in keys.values()]
        lines.append(f"| {cat} | {len(sel)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _usable(f, row: dict) -> bool:
    try:
        return f(row) > 0
    except (KeyError, ZeroDivisionError):
        return False


def calibration(rows: list[dict]) -> str:
    """Per live method over all questions: the modelled time of its forwards, its measured own time, their sum and
    the measured time of its steps (prefill left out; the rest is the engine's per-step work: acceptance, commits,
    text), so a reader sees how far the cost tables are from the clock."""
    lines = ["| method | steps | modelled forwards s | own s | sum s | measured s | measured / sum |",
             "|---|---|---|---|---|---|---|"]
    for m in rows[0]["live_ms"]:
        model = sum(r["live_ms"][m] for r in rows) / 1e3
        own = sum(r["own_ms"][m] for r in rows) / 1e3
        meas = sum(r["measured_s"][m] for r in rows)
        steps = sum(r["steps"][m] for r in rows)
        lines.append(f"| {m} | {steps} | {model:.2f} | {own:.2f} | {model + own:.2f} | {meas:.2f} | "
                     f"{meas / (model + own):.3f} |")
    return "\n".join(lines)


def oracle_sources(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        for s, n in r["oracle_drafts_by_source"].items():
            out[s] = out.get(s, 0) + n
    return out


def run(engine: Engine, questions: list[Question], levels: list[str], max_new_tokens: int, out: Path) -> list[dict]:
    """Record and evaluate every question; recordings to out/recordings.jsonl, rows to out/rows.json."""
    rows = []
    with open(out / "recordings.jsonl", "w") as f:
        for q in tqdm(questions, desc="replay", unit="q", file=sys.stderr):
            with torch.inference_mode():
                turns = record_question(engine, q, levels, max_new_tokens)
            for r in turns:
                f.write(json.dumps(asdict(r)) + "\n")
                rows.append(evaluate(r))
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    return rows


def load(path: Path) -> list[Recording]:
    """Recordings written by `run`, for a replay of other policies offline."""
    out = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        d["live"] = {m: [LiveStep(**{**s, "forwards": [tuple(f) for f in s["forwards"]]}) for s in steps]
                     for m, steps in d["live"].items()}
        out.append(Recording(**d))
    return out


def summary_text(rows: list[dict]) -> str:
    used = oracle_sources(rows)
    total = sum(used.values()) or 1
    share = ", ".join(f"{s} {n / total:.0%}" for s, n in sorted(used.items(), key=lambda kv: -kv[1]))
    best = statistics.multimode(r["best_live_static"] for r in rows)
    return (f"{report(rows)}\n\nThe oracle's drafted tokens by source: {share}. Most often the best fixed method: "
            f"{', '.join(best)}.\n\n{calibration(rows)}")
