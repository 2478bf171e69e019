"""`casspec ablate`: CAS-Spec's ablation structure on this machine, as one resumable run.

Rows (bench method specs, see bench.method_request): the HF baseline, ar, pld, each single level alone as `sd` and
as `tree`, the cascades (vc, hc, vc+hc, tree+vc), dytc, dytc with each of its sources left out in turn, dytc with
constant costs instead of the latency predictor (`dytc~const`), dytc without its AR fallback (`dytc~nofallback`), vc
and dytc over the other statistical bottoms (`vc~pld`, `vc~both`, `dytc~pld`, `dytc~both`, and for dytc those with
the recycle and suffix sources: `dytc~maxgram+free`, ...), and each zero-cost source alone under the router
(`dytc~recycle:none`: no level). Every row answers every question (all turns, greedy); its answers and stats go to
OUT/rows/ROW.json as soon as it finishes, and a rerun skips the rows already there (so the ratios of a resumed run
mix two sessions: `results.json` records when each row ran). Then OUT gets results.md (the table), results.json
(the summary behind it) and the plots:
  speedup_by_category.png    speedup over hf-ar per method and question category;
  acceptance_by_depth.png    fraction of steps whose accepted path reached each depth, per level (sd and tree);
  levels_plane.png           the levels in the (cost ratio, agreement) plane over iso-speedup curves of one
                             drafter, max_k (1 - a^(k+1)) / ((1 - a)(1 + k c)) (CS Drafting's expected walltime
                             improvement factor; the 1.0 curve is break-even);
  latency.png                the predictor: predicted vs measured verification and draft time per turn (dytc).
Memory per row: the target's weights and KV cache plus the distinct quantized / sparse / vocabulary copies that
the row's levels hold (shared copies counted once).
"""
from __future__ import annotations

import json
import os
import re
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from dsia.errors import CasspecError
from dytc.sampling import SamplingParams
from dytc.sources import BOTTOMS, DEFAULT_BOTTOM, FREE, LOOKUPS

from .bench import (BASELINE, SAMPLING_SEED, machine_line, make_runner, method_request, run_question, summarize,
                    writable_folder)
from ..calibrate.engine_view import dtype_name
from ..runtime.engine import Engine
from ..runtime.method_table import MULTI_LEVEL, SINGLE_LEVEL
from ..calibrate.questions import Answer, Question
from ..calibrate.agreement import measure_levels

README_BEGIN = "<!-- ablate:begin -->"  # the results page's section of greedy runs (docs/results.md)
README_END = "<!-- ablate:end -->"


def _greedy(summary: dict) -> bool:
    """Whether a summary's rows were decoded greedily."""
    return SamplingParams(**(summary.get("sampling") or {})).greedy


def readme_markers(summary: dict) -> tuple[str, str]:
    """The section of the results page (`--readme`, docs/results.md) a run's table goes to: greedy runs `ablate`,
    sampled runs `ablate-sampling` (so that a sampled run does not replace the greedy table)."""
    if _greedy(summary):
        return README_BEGIN, README_END
    return "<!-- ablate-sampling:begin -->", "<!-- ablate-sampling:end -->"


@dataclass(frozen=True)
class AblateConfig:
    levels: tuple[str, ...] = ("skip0.4", "skip0.6", "exit", "sparse0.5", "int8", "int4", "nf4", "int4+sparse0.5",
                               "int4+vocab")  # single levels run as sd and tree ("exit": after 80% of the layers)
    plane_questions: int = 4  # questions for the levels' cost ratio and agreement (levels_plane.png)
    plane_tokens: int = 64  # continuation length scored per question there


def default_rows(engine: Engine, cfg: AblateConfig = AblateConfig()) -> list[str]:
    n_layers = engine.model.spec.n_layers
    levels = [f"exit{int(0.8 * n_layers)}" if lv == "exit" else lv for lv in cfg.levels]
    dytc = [n for n, _ in engine.drafters.sources(method_request("dytc"))]
    rows = [BASELINE, "ar", "pld"] + [f"sd:{lv}" for lv in levels] + [f"tree:{lv}" for lv in levels]
    rows += ["vc", "hc", "vc+hc", "tree+vc", "dytc"]
    rows += ["dytc:" + "/".join(n for n in dytc if n != left) for left in dytc if len(dytc) > 1]
    rows += ["dytc~none", "dytc~const", "dytc~nofallback"]  # no statistical bottom, constant costs, no AR fallback
    others = [b for b in BOTTOMS if b not in (DEFAULT_BOTTOM, "none")]
    rows += [f"vc~{b}" for b in others if not set(BOTTOMS[b]) & set(FREE)]  # (vc: the lookups over the history)
    rows += [f"dytc~{b}" for b in others]
    return rows + [f"dytc~{name}:none" for name in LOOKUPS]  # each zero-cost source alone (routed, no level)


def _file_name(row: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", row) + ".json"


def row_levels(engine: Engine, row: str) -> list[str]:
    """The dsia levels a row drafts with."""
    if row == BASELINE or row.startswith("hf-"):
        return []
    req = method_request(row)
    if req.method in SINGLE_LEVEL:
        return [req.level]
    if req.method in MULTI_LEVEL:
        return [n for n, _ in engine.drafters.sources(req) if n not in LOOKUPS]
    return []


def row_memory_bytes(engine: Engine, row: str) -> int:
    """Target weights + KV cache + the distinct extra copies held by the row's levels."""
    kv = sum(t.numel() * t.element_size() for t in (engine.cache.k, engine.cache.v))
    copies = {}
    for name in row_levels(engine, row):
        lv = engine.levels.get(name)
        for obj in lv.holds:
            copies[id(obj)] = obj.nbytes
    return engine.model.weight_bytes() + kv + sum(copies.values())


def _row_key(engine: Engine, questions: list[Question], max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(), seed: int = SAMPLING_SEED) -> dict:
    """What a finished row was measured with: a row file is reused only when all of it matches."""
    return {"model": engine.name, "dtype": dtype_name(engine), "device": str(engine.device),
            "max_new_tokens": max_new_tokens, "questions": [q.question_id for q in questions],
            "sampling": vars(sampling), "seed": None if sampling.greedy else seed}


def _finished_row(path: Path, key: dict) -> dict | None:
    """The row's record if its file holds a finished run measured like `key`; None to (re)run it (a file that is
    unreadable, say truncated by an interrupt, or measured otherwise is run again, with one warning line)."""
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(rec, dict) or not isinstance(rec.get("answers"), list):
            raise ValueError("not a row record")
    except (OSError, ValueError) as e:
        print(f"casspec: warning: {path} is unreadable ({type(e).__name__}); running the row again", file=sys.stderr)
        return None
    differs = [k for k, v in key.items() if rec.get(k) != v]
    if differs:
        print(f"casspec: warning: {path} was measured with another {', '.join(differs)} (or does not say); running "
              "the row again", file=sys.stderr)
        return None
    return rec


def run_rows(engine: Engine, questions: list[Question], rows: list[str], max_new_tokens: int, out: Path,
             progress: bool = True, sampling: SamplingParams = SamplingParams(),
             seed: int = SAMPLING_SEED) -> dict[str, dict]:
    """Run the rows not finished yet (OUT/rows/ROW.json); return every row's record."""
    folder = out / "rows"
    folder.mkdir(parents=True, exist_ok=True)
    records: dict[str, dict] = {}
    todo = []
    for row in rows:
        rec = _finished_row(folder / _file_name(row), _row_key(engine, questions, max_new_tokens, sampling, seed))
        if rec is not None:
            records[row] = rec
        else:
            todo.append(row)
    bar = tqdm(total=len(rows), initial=len(rows) - len(todo), desc="ablate", unit="run", disable=not progress,
               file=sys.stderr)
    for row in todo:
        bar.set_postfix_str(row)
        run = make_runner(engine, row, sampling=sampling, seed=seed)
        run(engine.encode([{"role": "user", "content": questions[0].turns[0]}]), max_new_tokens)  # warm-up (as bench)
        t0 = time.time()
        answers = [run_question(engine, run, q, max_new_tokens, None) for q in questions]
        rec = {"row": row, **_row_key(engine, questions, max_new_tokens, sampling, seed), "started": t0,
               "seconds": time.time() - t0, "memory_bytes": row_memory_bytes(engine, row),
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "answers": [asdict(a) for a in answers]}
        (folder / _file_name(row)).write_text(json.dumps(rec))
        records[row] = rec
        bar.update(1)
    bar.close()
    return records


def ablate(engine: Engine, questions: list[Question], rows: list[str], max_new_tokens: int, out: str | Path,
           dtype: str, cfg: AblateConfig = AblateConfig(), progress: bool = True,
           sampling: SamplingParams = SamplingParams(), seed: int = SAMPLING_SEED) -> dict:
    """Run (or read back) every row; write results.json, results.md and the plots. sampling: greedy by default;
    sampled rows are seeded with `seed` (HF sampling as the baseline)."""
    if rows[0] != BASELINE:
        raise CasspecError(f"the ablation's first row must be the baseline {BASELINE}")
    out = writable_folder(out)
    records = run_rows(engine, questions, rows, max_new_tokens, out, progress, sampling, seed)
    answers = {row: [Answer(**a) for a in records[row]["answers"]] for row in rows}
    summary = summarize(engine, answers, max_new_tokens, dtype, sampling)
    if not sampling.greedy:
        summary["seed"] = seed
    for row in rows:
        m = summary["methods"][row]
        m["memory_mb"] = records[row]["memory_bytes"] / 1e6
        m["started"] = records[row]["started"]
        turns = [st for a in answers[row] for st in a.stats if st]
        m["turn_verify"] = [(st["predicted_verify_seconds"], st["verify_seconds"]) for st in turns
                            if st.get("predicted_verify_seconds")]
        m["turn_draft"] = [(st["policy"]["predicted_draft_ms"] / 1e3, st["policy"]["measured_draft_ms"] / 1e3)
                           for st in turns if st.get("policy") and st["policy"].get("predicted_draft_ms")]
    plane_path = out / "levels_plane.json"
    if plane_path.is_file():
        plane = json.loads(plane_path.read_text())
    else:
        names = sorted({lv for row in rows for lv in row_levels(engine, row)})
        plane = measure_levels(engine, questions[:cfg.plane_questions], names, cfg.plane_tokens, progress=progress)
        plane_path.write_text(json.dumps(plane, indent=1))
    summary["levels_plane"] = plane
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    (out / "results.md").write_text(format_results(summary))
    plot_results(summary, out)
    return summary


def format_results(summary: dict) -> str:
    methods = summary["methods"]
    cats = sorted({c for m in methods.values() for c in m["by_category"]})
    head = ["method", "tokens/s", "speedup", "MAT"] + cats + ["memory MB", "identical"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in methods.items():
        ident = "-" if m["identical_to_baseline"] is None else str(m["identical_to_baseline"]).lower()
        cells = [f"`{name}`", f"{m['tokens_per_s']:.2f}", f"{m['speedup']:.2f}", f"{m['mean_accepted_tokens']:.2f}"]
        cells += [f"{m['by_category'][c]['speedup']:.2f}" if c in m["by_category"] else "-" for c in cats]
        cells += [f"{m['memory_mb']:.0f}", ident]
        lines.append("| " + " | ".join(cells) + " |")
    return (f"{summary['model']}, {summary['device']} ({machine_line(summary)}), {summary['dtype']}, "
            f"{summary['max_new_tokens']} new tokens, {_decoding(summary)}; speedup over {summary['baseline']} (HF "
            "transformers generate) in the same run.\n\n"
            + "\n".join(lines) + "\n")


def _decoding(summary: dict) -> str:
    """'greedy', or the sampling warp and seed of a sampled run."""
    if _greedy(summary):
        return "greedy"
    sp = summary["sampling"]
    warp = ", ".join(f"{k} {v}" for k, v in sp.items() if (k, v) not in (("top_k", 0), ("top_p", 1.0)))
    return f"sampling ({warp}, seed {summary.get('seed', SAMPLING_SEED)})"


def _ewif(a: float, c: float, max_k: int = 32) -> float:
    """Best expected walltime improvement of one drafter (acceptance a, cost ratio c) over draft lengths k."""
    if a >= 1.0:
        a = 0.999999
    return max((1 - a ** (k + 1)) / ((1 - a) * (1 + k * c)) for k in range(1, max_k + 1))


def plot_results(summary: dict, out: Path) -> list[Path]:
    """Write every figure that the summary has data for; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = (("speedup_by_category.png", plot_speedup_by_category), ("acceptance_by_depth.png",
               plot_acceptance_by_depth), ("levels_plane.png", plot_levels_plane), ("latency.png", plot_latency))
    written = []
    for name, plot in figures:
        fig = plot(summary)
        if fig is not None:
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            written.append(out / name)
    return written


def plot_speedup_by_category(summary: dict):
    """Speedup over the baseline per method (rows) and question category (columns)."""
    import matplotlib.pyplot as plt
    import numpy as np

    methods = summary["methods"]
    cats = sorted({c for m in methods.values() for c in m["by_category"]})
    names = list(methods)
    grid = np.array([[methods[n]["by_category"].get(c, {}).get("speedup", np.nan) for c in cats] for n in names])
    fig, ax = plt.subplots(figsize=(1.1 * len(cats) + 3, 0.32 * len(names) + 1.5))
    im = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    for i in range(len(names)):
        for j in range(len(cats)):
            ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=6.5,
                    color="white" if grid[i, j] < np.nanmax(grid) * 0.6 else "black")
    fig.colorbar(im, ax=ax, label=f"speedup over {summary['baseline']}")
    ax.set_title("speedup by category")
    return fig


def plot_acceptance_by_depth(summary: dict):
    """Fraction of steps whose accepted path reached each depth, per level, for sd and tree."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, kind in zip(axes, ("sd", "tree")):
        for n, m in summary["methods"].items():
            if n.startswith(kind + ":") and m.get("acceptance_by_depth"):
                acc = m["acceptance_by_depth"]
                ax.plot(range(1, len(acc) + 1), acc, "o-", ms=3, label=n.split(":", 1)[1])
        ax.set_title(f"{kind}: steps whose accepted path reached depth d")
        ax.set_xlabel("depth d")
        if ax.lines:  # (an ablation without rows of this kind leaves its panel empty)
            ax.legend(fontsize=7)
    axes[0].set_ylabel("fraction of steps")
    return fig


def plot_levels_plane(summary: dict):
    """The levels in the (cost ratio, agreement) plane over one drafter's iso-speedup curves (None: no plane)."""
    import matplotlib.pyplot as plt
    import numpy as np

    plane = summary.get("levels_plane", {}).get("levels", {})
    if not plane:
        return None
    cs = np.linspace(0.02, 1.2, 60)
    as_ = np.linspace(0.02, 0.995, 60)
    Z = np.array([[_ewif(a, c) for c in cs] for a in as_])
    fig, ax = plt.subplots(figsize=(6.5, 5))
    cont = ax.contour(cs, as_, Z, levels=[1.0, 1.5, 2.0, 3.0, 4.0], cmap="coolwarm")
    ax.clabel(cont, fmt="%.1fx", fontsize=7)
    for name, lv in plane.items():
        ax.plot(lv["cost_ratio"], lv["agreement"], "ko", ms=4)
        ax.annotate(name, (lv["cost_ratio"], lv["agreement"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("cost ratio c (level forward / target forward)")
    ax.set_ylabel("acceptance a (top-1 agreement with the target)")
    ax.set_title("levels vs one-drafter iso-speedup curves (1.0x = break-even)", fontsize=9)
    return fig


def plot_latency(summary: dict):
    """The predictor: predicted vs measured verification and draft seconds per turn of the dytc rows (None: no
    dytc row)."""
    import matplotlib.pyplot as plt

    pts_v, pts_d = [], []
    for n, m in summary["methods"].items():
        if n.startswith("dytc") and "~const" not in n:
            pts_v += m.get("turn_verify", [])
            pts_d += m.get("turn_draft", [])
    if not pts_v:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for pts, label in ((pts_v, "verification"), (pts_d, "draft forwards")):
        if pts:
            ax.plot([p for p, _ in pts], [m for _, m in pts], "o", ms=3, alpha=0.6, label=label)
    hi = max(max(p, m) for p, m in pts_v + pts_d)
    ax.plot([0, hi], [0, hi], "k--", lw=1)
    ax.set_xlabel("predicted seconds per turn")
    ax.set_ylabel("measured seconds per turn")
    ax.set_title("latency predictor (dytc rows)")
    ax.legend()
    return fig


def update_readme(readme: str | Path, summary: dict, out: Path) -> None:
    """Replace the page's section between the run's markers (`readme_markers`) with the table and the plots (linked
    relative to the page: docs/results.md links results/ as ../results/)."""
    readme = Path(readme)
    text = readme.read_text()
    begin, end_marker = readme_markers(summary)
    if begin not in text or end_marker not in text:
        raise CasspecError(f"{readme} has no {begin} ... {end_marker} markers to write the results between")
    here, target = readme.resolve().parent, Path(out).resolve()
    try:
        rel = Path(os.path.relpath(target, here))
    except ValueError:  # another drive (Windows): no relative path
        rel = target
    pngs = [p for p in ("speedup_by_category.png", "acceptance_by_depth.png", "levels_plane.png", "latency.png")
            if (Path(out) / p).is_file()]
    when = time.strftime("%Y-%m-%d", time.gmtime(max(m["started"] for m in summary["methods"].values())))
    images = "\n".join(f"![{p[:-4]}]({(rel / p).as_posix()})" for p in pngs)
    body = f"{begin}\nGenerated by `casspec ablate` on {when}.\n\n{format_results(summary)}\n{images}\n{end_marker}"
    start, end = text.index(begin), text.index(end_marker) + len(end_marker)
    readme.write_text(text[:start] + body + text[end:])
