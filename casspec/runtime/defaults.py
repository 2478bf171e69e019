"""The defaults every entry point reads (Engine.generate, Request, the CLI, the server, bench and ablations): one home
for each, so that a generation asked for the same way gets the same method, level and length everywhere."""
from __future__ import annotations

from dytc.sources import DEFAULT_BOTTOM, PLD

METHOD = "dytc"  # decoding method: the DyTC router (`ar` is plain one-token decoding)
LEVEL = "int4"  # the draft level of the single-level methods (sd, tree)
BOTTOM = DEFAULT_BOTTOM  # lookups beneath the multi-level methods' levels (dytc.sources: measured there)
MAX_NEW_TOKENS = 256  # tokens a generation may emit (generate, the Python API, a server call's default max_tokens cap
# is the server's own limit)
# the multi-level methods' sources where no levels plane measured this machine (calibrate/plane.py) chose them: on a
# CPU the int4 kernels were the cheapest drafts where measured; on a GPU a small model's forward costs its kernel
# launches, whatever the weights' precision, so fewer layers (a skip level) make a draft cheaper there (issue 18)
ROUTED_LEVELS = (LEVEL, "int4+vocab")  # dytc's levels on a CPU
HC_SEGMENTS = ((LEVEL, 4), ("int4+vocab", 3), (PLD, 3))  # hc's k-matrix row on a CPU (level or lookup, tokens)
GPU_LEVEL = "skip0.4"  # the draft level of every multi-level method on a GPU
BENCH_MAX_NEW_TOKENS = 128  # tokens per turn in bench, ablations and the levels report (Spec-Bench's own runs)
STATE_WRITE_EVERY_S = 60.0  # a generation ending while others run (a batch's) writes the learned state only this
# long after the last write (the write stalls them); one ending alone writes it at once
