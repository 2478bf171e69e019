"""`casspec levels`'s report: which levels it measures by default, their table. The measurement itself (agreement
with the target along its own answers, cost ratio): calibrate/agreement.py."""
from __future__ import annotations

from dsia.levels import LevelConfig

REPORT_LEVELS = ("int8", "int4", "nf4", "skip0.4", "skip0.6", "exit24", "sparse0.5", "int4+sparse0.5", "int4+vocab")


def format_levels(report: dict) -> str:
    lines = [f"target forward (1 token): {report['target_ms']:.1f} ms",
             "| level | cost ratio | agreement | extra MB | contiguous-skip agreement |",
             "|---|---|---|---|---|"]
    for name, r in report["levels"].items():
        contig = f"{r['contiguous_agreement']:.3f}" if "contiguous_agreement" in r else "-"
        lines.append(f"| {name} | {r['cost_ratio']:.3f} | {r['agreement']:.3f} | {r['extra_bytes'] / 1e6:.1f} | "
                     f"{contig} |")
    return "\n".join(lines)


def parse_levels(spec: str | None) -> list[str]:
    names = [n.strip() for n in (spec.split(",") if spec else REPORT_LEVELS) if n.strip()]
    for n in names:
        LevelConfig.parse(n)  # a clear error before any work
    return names
