"""`casspec profile`'s report: the measured grid's fit re-done from a saved profile (refit), its table, plots and
files, and the grid the command line asks for (config_for). The measurement itself: calibrate/latency_grid.py."""
from __future__ import annotations

import json
import os
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from dsia.errors import CasspecError
from dsia.levels import LevelConfig
from dytc.latency import LatencyModel, Point, heldout_mape

from ..calibrate.latency_grid import QUICK, ProfileConfig


def refit(prof: dict) -> dict:
    """The profile with its predictor re-fitted on its own stored grid (same held-out points), e.g. after the
    predictor changed; the measurements are not repeated."""
    points = [Point(p["level"], p["tokens"], p["context"], p["tree"], p["ms"]) for p in prof["grid"]]
    train = [p for p, g in zip(points, prof["grid"]) if not g["heldout"]]
    held = [p for p, g in zip(points, prof["grid"]) if g["heldout"]]
    old = LatencyModel.from_json(prof["predictor"])
    weight_bytes = {n: f.weight_bytes for n, f in old.levels.items() if f.weight_bytes is not None}
    predictor = LatencyModel.fit(old.spec, train, weight_bytes=weight_bytes)
    return dict(prof, predictor=predictor.to_json(), heldout_mape=heldout_mape(predictor, held),
                refitted=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def plot_profile(prof: dict, path: str | Path, n_contexts: int = 3) -> None:
    """Latency vs tokens per level (chain mask) at a few context lengths: measurements and the fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = LatencyModel.from_json(prof["predictor"])
    grid = [p for p in prof["grid"] if not p["tree"]]
    levels = list(dict.fromkeys(p["level"] for p in grid))
    contexts = sorted({p["context"] for p in grid})
    picked = sorted({contexts[round(i * (len(contexts) - 1) / max(n_contexts - 1, 1))] for i in range(n_contexts)})
    cols = min(3, len(levels))
    rows = -(-len(levels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.5 * rows), squeeze=False)
    for ax, level in zip(axes.flat, levels):
        for C in picked:
            pts = sorted((p["tokens"], p["ms"]) for p in grid if p["level"] == level and p["context"] == C)
            line = ax.plot([t for t, _ in pts], [m for _, m in pts], "o", ms=4, label=f"C={C}")[0]
            ts = list(range(1, max(t for t, _ in pts) + 1))
            pred = [model.predict_ms(level, t, C) for t in ts]
            mean = [m for m, _ in pred]
            ax.plot(ts, mean, "-", color=line.get_color())
            ax.fill_between(ts, [m - s for m, s in pred], [m + s for m, s in pred], color=line.get_color(), alpha=0.15)
        ax.set_title(f"{level} (MAPE {prof['heldout_mape'].get(level, float('nan')):.1%})")
        ax.set_xlabel("tokens in the forward")
        ax.set_ylabel("ms")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(levels):]:
        ax.axis("off")
    fig.suptitle(f"{prof['model']} {prof['dtype']} on {prof['machine']['gpu'] or prof['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_out(out: str | Path) -> Path:
    """Fail before any measuring when the profile cannot be written there."""
    out = Path(out)
    if out.suffix != ".json":
        raise CasspecError(f"--out must name a .json file (got {str(out)!r})")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CasspecError(f"cannot create the folder of {str(out)!r}: {e.strerror}") from None
    if out.is_dir() or not os.access(out.parent, os.W_OK):
        raise CasspecError(f"cannot write {str(out)!r}")
    return out


def write_profile(prof: dict, out: str | Path, plot: bool = False) -> list[Path]:
    """Write the profile JSON (and with plot, a PNG beside it); returns the paths written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prof, indent=1))
    written = [out]
    if plot:
        png = out.with_suffix(".png")
        plot_profile(prof, png)
        written.append(png)
    return written


def config_for(quick: bool, levels: str | None, default_levels: tuple[str, ...]) -> ProfileConfig:
    """The grid of the command line: full or quick (by default over `default_levels`: those the default methods
    route on this device), with the given comma-separated levels."""
    cfg = replace(QUICK, levels=default_levels) if quick else ProfileConfig()
    if levels is not None:
        names = tuple(n.strip() for n in levels.split(",") if n.strip())
        for n in names:
            LevelConfig.parse(n)  # a clear error before any work
        cfg = replace(cfg, levels=names)
    return cfg


def format_profile(prof: dict) -> str:
    lines = [f"{prof['model']} {prof['dtype']} on {prof['machine']['gpu'] or prof['machine']['cpu']}: "
             f"{len(prof['grid'])} points in {prof.get('seconds', float('nan')):.0f} s", "",
             "| level | held-out MAPE | 1-token ms at min context |", "|---|---|---|"]
    model = LatencyModel.from_json(prof["predictor"])
    c0 = min(p["context"] for p in prof["grid"])
    for level, mape in prof["heldout_mape"].items():
        lines.append(f"| {level} | {mape:.1%} | {model.predict_ms(level, 1, c0)[0]:.2f} |")
    return "\n".join(lines)
