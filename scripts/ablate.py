"""Ablations of DSIA strategies and cascade algorithms on this machine: one resumable run, a table and plots.

    python scripts/ablate.py --questions ../shared/specbench/dev.jsonl [--limit 12] [--max-new-tokens 128]
        [--model M] [--dtype float32] [--rows a,b,...] [--out results] [--readme README.md]

The same as `casspec ablate` (see casspec/tools/ablate.py for the rows, the columns and the plots).
"""
from __future__ import annotations

import sys

from casspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["ablate", *sys.argv[1:]]))
