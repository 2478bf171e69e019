"""Spec-Bench-format questions: a JSONL file of {"question_id", "category", "turns": [str, ...]} per line, read and
checked (bench, the levels plane's agreement measurement, ablations, the oracle replay); the signature of what
runs one turn of one (bench's methods, llama.cpp's); and the answers a method gave them (`Answer`)."""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dsia.errors import CasspecError

# one turn: prompt ids, max new tokens -> (new token ids, target forwards, engine stats or {})
TurnFn = Callable[[list[int], int], tuple[list[int], int, dict]]


@dataclass
class Question:
    question_id: int | str
    category: str
    turns: list[str]


def read_questions(path: str | Path, limit: int | None = None, per_category: int | None = None) -> list[Question]:
    """Read a Spec-Bench-format JSONL file: {"question_id", "category", "turns": [str, ...]} per line. `limit`
    keeps the first N questions; `per_category` the first N of every category (in file order), so that a short
    run still covers every category of the file."""
    p = Path(path)
    if not p.is_file():
        raise CasspecError(f"questions file {str(p)!r} does not exist: pass a Spec-Bench JSONL file")
    for flag, value in (("--limit", limit), ("--per-category", per_category)):
        if value is not None and value < 1:
            raise CasspecError(f"{flag} must be >= 1 (got {value})")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CasspecError(f"questions file {p} is not UTF-8 text (byte {e.start}): save it as UTF-8") from None
    except OSError as e:
        raise CasspecError(f"cannot read questions file {p} ({e.strerror}): check the path and permissions") from None
    questions = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            turns = obj["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
                raise ValueError("turns must be a non-empty list of non-empty strings")
            questions.append(Question(obj["question_id"], str(obj.get("category", "all")), turns))
        except (ValueError, KeyError, TypeError) as e:
            raise CasspecError(f"{p}:{n} is not a Spec-Bench question ({type(e).__name__}: {e}); each line needs "
                               "question_id, category and turns") from None
        if limit is not None and len(questions) >= limit:
            break
    if not questions:
        raise CasspecError(f"{p} holds no questions")
    if per_category is not None:
        taken: dict[str, int] = {}
        kept = []
        for q in questions:
            taken[q.category] = taken.get(q.category, 0) + 1
            if taken[q.category] <= per_category:
                kept.append(q)
        questions = kept
    return questions


@dataclass
class Answer:
    question_id: int | str
    category: str
    turns: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    wall_time: list[list[float]] = field(default_factory=list)  # per turn: one wall time per repeat
    forwards: list[int] = field(default_factory=list)  # target forwards per turn
    stats: list[dict] = field(default_factory=list)  # per turn: the engine's stats (empty for HF methods)

    def speed(self) -> float:
        """New tokens / wall time over all turns, with each turn's median wall time over repeats."""
        seconds = sum(statistics.median(w) for w in self.wall_time)
        return sum(self.new_tokens) / seconds if seconds > 0 else 0.0
