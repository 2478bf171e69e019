"""Per draft level, its cost ratio vs the target, its top-1 agreement and its extra memory (the levels plane's
measurement, calibrate/plane.py; `casspec levels` and its report, tools/levels_report.py).

- cost ratio: median wall time of the level's forward over one token at the question's full context, divided
  by the target's (same token, same context), interleaved so that machine drift hits both alike;
- agreement: teacher-forced along the target's own greedy continuation of each prompt, in chunks of 8 tokens
  as a draft sees them: the level reads the target's committed KV for everything before the chunk;
- extra memory: what the level holds beyond the target's weights.
Levels that learn on the fly (the skip search) first learn on a fixed warm-up prompt that is not measured.
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from typing import Iterator

import torch
from tqdm import tqdm

from dsia.kernels import time_ms
from dsia.levels import Level
from dsia.skip import SkipSwitch, contiguous_skips, skip_plan

from .engine_view import EngineView
from .questions import Question

WARMUP_PROMPT = "Write a few paragraphs about the history of printing, from woodblocks to laser printers."
CHUNK = 8  # tokens teacher-forced per draft forward when measuring agreement
TIMING_TOKEN = 7  # the token a cost-ratio forward runs (any id: a dense forward's time does not depend on it)


@dataclass
class Measured:
    agree: int = 0  # teacher-forced top-1 hits
    total: int = 0  # tokens scored
    ratios: list[float] = field(default_factory=list)  # per question: level ms / target ms
    contiguous_agree: int = 0  # skip levels: hits with the same count of sublayers skipped contiguously


def greedy_answer(engine: EngineView, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target's greedy continuation of prompt (one-token forwards, as `ar` runs; ends with EOS where it stops),
    straight on the engine's cache: no generation machinery, so an engine still being set up can measure."""
    engine.cache.rollback(0)
    ids, out = list(prompt), []
    logits = engine.extend_prefix(ids)  # [1, V]
    while len(out) < max_new_tokens:
        out.append(int(logits[-1].argmax()))
        if out[-1] in engine.eos_ids:
            break
        ids.append(out[-1])
        logits = engine.extend_prefix(ids)
    return out


def _learn(engine: EngineView, level: Level, tokens: int) -> None:
    """Let a level learn on the warm-up prompt: run its on-the-fly search to the end."""
    ids = engine.encode(WARMUP_PROMPT)
    cont = greedy_answer(engine, ids, tokens)
    cache = engine.cache
    cache.rollback(0)
    hist = ids + cont
    engine.extend_prefix(hist[:-1])
    level.begin(engine.model, cache, hist)
    while level.searching:
        level.observe(engine.model, cache, hist, [])


def teacher_forced(engine: EngineView, level: Level, prompt: list[int], cont: list[int], plans: list,
                   chunk: int = CHUNK) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
    """The level's logits along the target's continuation `cont` of `prompt`, in chunks of `chunk` tokens as a
    draft sees them (reading the target's committed KV before each chunk): per chunk, (the tokens predicted [n], one
    logits [n, V] per plan in `plans`, None = the level's own plan). Row i predicts cont[s + 1 + i]."""
    model, cache = engine.model, engine.cache
    cache.rollback(0)
    engine.extend_prefix(prompt)
    level.begin(model, cache, prompt + cont[:1])
    for s in range(0, len(cont) - 1, chunk):
        targets = cont[s + 1:s + 1 + chunk]
        inputs = cont[s:s + len(targets)]
        L, dev = cache.length, engine.device
        tok = torch.tensor(inputs, device=dev)
        pos = torch.arange(L, L + len(inputs), device=dev)
        yield (torch.tensor(targets, device=dev),
               [model.forward(cache, tok, pos, L, plan=plan or level.plan) for plan in plans])
        level.observe(model, cache, prompt + cont[:s + len(inputs) + 1], inputs)
        engine.extend_prefix(prompt + cont[:s + len(inputs)])


def _agreement(engine: EngineView, level: Level, prompt: list[int], cont: list[int], plans: list) -> list[int]:
    """Teacher-forced top-1 agreement counts, one per plan in `plans` (None = the level's own plan)."""
    hits = [0] * len(plans)
    for targets, logits in teacher_forced(engine, level, prompt, cont, plans):
        for j, rows in enumerate(logits):
            hits[j] += int((rows.argmax(-1) == targets).sum())
    return hits


def _cost_ratio(engine: EngineView, level: Level, repeats: int) -> tuple[float, float]:
    """(median level ms, median target ms) of a 1-token forward at the current context."""
    model, cache = engine.model, engine.cache
    L = cache.length
    tok, pos = torch.tensor([TIMING_TOKEN], device=engine.device), torch.tensor([L], device=engine.device)
    lt, tt = [], []
    for r in range(repeats + 2):
        level_ms = time_ms(lambda: model.forward(cache, tok, pos, L, plan=level.plan), engine.device)
        target_ms = time_ms(lambda: model.forward(cache, tok, pos, L), engine.device)
        if r >= 2:  # the first two are warm-up
            lt.append(level_ms)
            tt.append(target_ms)
    return statistics.median(lt), statistics.median(tt)


@torch.inference_mode()
def measure_levels(engine: EngineView, questions: list[Question], names: list[str], max_new_tokens: int = 128,
                   repeats: int = 15, progress: bool = True) -> dict:
    levels = [engine.levels.get(n) for n in names]  # builds quantized copies once; bad names fail here
    for level in levels:
        if level.searching:
            _learn(engine, level, max_new_tokens)
    data = {lv.name: Measured() for lv in levels}
    target_ms = []
    for q in tqdm(questions, desc="levels", unit="q", disable=not progress, file=sys.stderr):
        prompt = engine.encode(q.turns[0])  # through the chat template where the tokenizer has one
        cont = greedy_answer(engine, prompt, max_new_tokens)
        for level in levels:
            m = data[level.name]
            plans = [None]
            skip = level.switch(SkipSwitch)
            if skip is not None:
                plans.append(skip_plan(contiguous_skips(engine.model.spec.n_layers, skip.search.count)))
            hits = _agreement(engine, level, prompt, cont, plans)
            m.agree += hits[0]
            m.total += len(cont) - 1
            if len(plans) > 1:
                m.contiguous_agree += hits[1]
            lms, tms = _cost_ratio(engine, level, repeats)
            m.ratios.append(lms / tms)
            target_ms.append(tms)
    out = {"target_ms": statistics.median(target_ms), "levels": {}}
    for level in levels:
        m = data[level.name]
        row = {"cost_ratio": statistics.median(m.ratios), "agreement": m.agree / max(m.total, 1),
               "extra_bytes": level.extra_bytes}
        skip = level.switch(SkipSwitch)
        if skip is not None:
            row["contiguous_agreement"] = m.contiguous_agree / max(m.total, 1)
            row["skipped_sublayers"] = sorted(f"{k}{i}" for k, i in skip.search.skips)
        out["levels"][level.name] = row
    return out


