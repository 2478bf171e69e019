"""What generations learn, kept between processes: the acceptance estimates and the latency model's online fit.

A long-lived engine learns as it decodes: dytc's acceptance estimates per source and bucket (dytc/acceptance.py)
and the latency model's refinement from every timed forward (dytc/latency.py). A one-shot `casspec generate`
would start from priors each time and spend its first steps relearning; instead the engine reads the state the
previous call left in the user cache (`state/<model>-<dtype>-<key>.json`) and writes it back after each
generation (atomically). The key is the machine (CPU model and flags, GPU, torch, threads), the model and the
dtype; inside, each tracker is kept under its router configuration (its levels and lookups), and the latency
model under the profile it grew from, so a new profile starts afresh. A corrupt, stale or foreign file is ignored.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dytc.acceptance import AcceptanceTracker
from dytc.latency import LatencyModel

from .autoprofile import profile_key
from .loading import cache_root
from .usercache import digest, read_json, write_json

STATE_VERSION = 2  # bump when the layout of the file changes: older files are then ignored (2: latency anchors)


@dataclass(frozen=True)
class StateFile:
    path: Path
    key: dict  # machine, model, dtype and dense kernels: the file is only read back under the same key

    @staticmethod
    def of(machine: dict, model: str, dtype: str, kernels: str = "") -> "StateFile":
        key = profile_key(machine, model, dtype, kernels)  # (what the latency part depends on, like a profile)
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", model)[:60]
        return StateFile(cache_root() / "state" / f"{slug}-{dtype}-{digest(key)}.json", key)

    def load(self, latency_source: str) -> tuple[LatencyModel | None, dict[str, AcceptanceTracker]]:
        """(the latency model learned from `latency_source`, or None; the trackers by router configuration)."""
        data = read_json(self.path)
        if data is None or data.get("version") != STATE_VERSION or data.get("key") != self.key:
            return None, {}
        try:
            latency = None
            if data.get("latency_source") == latency_source:
                latency = LatencyModel.from_json(data["latency"])
            trackers = {cfg: AcceptanceTracker.from_json(t) for cfg, t in data["trackers"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            return None, {}
        return latency, trackers

    def save(self, latency: LatencyModel, latency_source: str, trackers: dict[str, AcceptanceTracker]) -> None:
        write_json(self.path, {"version": STATE_VERSION, "key": self.key, "latency_source": latency_source,
                               "latency": latency.to_json(), "trackers": {c: t.to_json() for c, t in trackers.items()}})
