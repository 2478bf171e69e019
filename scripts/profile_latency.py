"""Profile the latency of the target's and each draft level's forward and fit the latency predictor.

    python scripts/profile_latency.py [--model M] [--dtype D] [--device cpu|cuda] [--levels a,b,...] [--quick]
        --out profiles/NAME.json [--plot]

The same as `casspec profile` (see casspec/calibrate/latency_grid.py for what is measured and dytc/latency.py for the
fit).
"""
from __future__ import annotations

import sys

from casspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["profile", *sys.argv[1:]]))
