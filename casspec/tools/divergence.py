"""Where a method's greedy answer first leaves casspec's own one-token decoding (`ar`), and how close the target's
logits were there (bench's "= ar" column: a float32 run differs nowhere; a bfloat16 one by near-ties)."""
from __future__ import annotations

from typing import Collection

import torch

from ..runtime.engine import Engine
from ..calibrate.questions import Answer, Question


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where two different token lists differ (the shorter one's length if it is a prefix)."""
    return next(i for i, (x, y) in enumerate(zip(a + [None], b + [None])) if x != y)


REFERENCE = "ar"  # casspec's own one-token decoding: what every engine method's greedy output is compared with


def first_divergence(engine: Engine, q: Question, ref: Answer, ans: Answer) -> dict | None:
    """Where a greedy answer first leaves the reference's (None: every turn equal): the turn, the token index, the
    two tokens, and the target's logits there, from one forward over the turn's prompt (the reference's earlier
    answers as history, equal to the method's) plus the tokens both emitted: gap = logit[reference's token] -
    logit[method's token] (> 0 where the reference took the target's argmax), margin = top-1 - top-2 logit."""
    messages: list[dict] = []
    for t, (mine, theirs) in enumerate(zip(ans.token_ids, ref.token_ids)):
        messages.append({"role": "user", "content": q.turns[t]})
        if mine != theirs:
            i = first_difference(mine, theirs)
            # (None where one answer stopped and the other went on)
            a, b = (theirs[i] if i < len(theirs) else None), (mine[i] if i < len(mine) else None)
            with torch.inference_mode():
                engine.cache.rollback(0)
                logits = engine.extend_prefix(engine.encode(messages) + theirs[:i])[-1].float()  # [V]
            top2 = logits.topk(2).values
            gap = None if a is None or b is None else float(logits[a] - logits[b])
            return {"question_id": q.question_id, "turn": t, "index": i, "reference_token": a, "token": b,
                    "gap": gap, "margin": float(top2[0] - top2[1])}
        messages.append({"role": "assistant", "content": ref.turns[t]})
    return None


def divergences(engine: Engine, questions: list[Question], answers: dict[str, list[Answer]],
                baselines: Collection[str]) -> dict:
    """Per engine method (not one of `baselines`): whether its greedy output equals `ar`'s (REFERENCE) and, per
    question that differs, the first divergence (`first_divergence`). Empty unless the run holds `ar`."""
    if REFERENCE not in answers:
        return {}
    ref = answers[REFERENCE]
    out = {}
    for m, ans in answers.items():
        if m in baselines or m == REFERENCE:
            continue
        found = [d for q, r, a in zip(questions, ref, ans) if (d := first_divergence(engine, q, r, a)) is not None]
        out[m] = {"identical_to_ar": not found, "ar_divergences": found}
    return out
