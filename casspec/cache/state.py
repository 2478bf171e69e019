"""What generations learn, kept between processes: the acceptance estimates and the latency model's online fit.

A long-lived engine learns as it decodes: dytc's acceptance estimates per source and bucket (dytc/acceptance.py)
and the latency model's refinement from every timed forward (dytc/latency.py). A one-shot `casspec generate`
would start from priors each time and spend its first steps relearning; instead the engine reads the state the
previous call left in the user cache (`state/<model>-<dtype>-<key>.json`) and writes it back after each
generation (atomically). The key is the machine (CPU model and flags, GPU, torch, threads), the model and the
dtype; inside, each tracker is kept under its router configuration (its levels and lookups), and the latency
model under the profile it grew from, so a new profile starts afresh. The file is written with its checksum
(`<file>.sha256`) and read back only if it matches (usercache.read_verified) and passes the JSON bounds; a corrupt,
stale or foreign file (another user's, a link planted by one) is ignored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dsia.errors import CasspecError
from dytc.acceptance import AcceptanceTracker
from dytc.latency import LatencyModel

from .usercache import entry_path, parse_json, profile_key, read_verified, write_verified

STATE_VERSION = 2  # bump when the layout of the file changes: older files are then ignored (2: latency anchors)


@dataclass(frozen=True)
class StateFile:
    path: Path
    key: dict  # machine, model, dtype and dense kernels: the file is only read back under the same key

    @staticmethod
    def of(machine: dict, model: str, dtype: str, kernels: str = "") -> "StateFile":
        key = profile_key(machine, model, dtype, kernels)  # (what the latency part depends on, like a profile)
        return StateFile(entry_path("state", key), key)

    def load(self, latency_source: str) -> tuple[LatencyModel | None, dict[str, AcceptanceTracker]]:
        """(the latency model learned from `latency_source`, or None; the trackers by router configuration)."""
        try:
            data = parse_json(read_verified(self.path), str(self.path))
        except (OSError, CasspecError):  # none yet, or not what was written
            return None, {}
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION or data.get("key") != self.key:
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
        data = {"version": STATE_VERSION, "key": self.key, "latency_source": latency_source,
                "latency": latency.to_json(), "trackers": {c: t.to_json() for c, t in trackers.items()}}
        write_verified(self.path, json.dumps(data, indent=1).encode())
