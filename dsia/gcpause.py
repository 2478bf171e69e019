"""Python's cyclic garbage collector paused while forwards run (a generation; every timed call: `kernels.time_ms`).

A decode step allocates a few hundred short-lived Python objects (tensors' wrappers, tuples, dicts of a tree); every
700 of them start a young collection, and every hundredth of those a full one over the whole heap (torch's and
transformers' modules: some 400 thousand objects). On a 2-core AMD EPYC that was about 6% of a native step (perf:
gc_collect_main 4.1% of the samples; SmolLM2 Q4_1 one-token step 2.44 -> 2.27 ms with the collector out of the way).
(casspec's CLI also freezes what it loaded out of the collector's sight; a program on the Python API gets this
pause.) The step's objects are freed by their reference counts all the same; anything cyclic waits for
the first collection after the pause. The pause is counted, so overlapping generations on other threads (a
server's) keep it until the last one ends, and a collector the program had turned off stays off.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_holders = 0  # pauses open now, on every thread
_resume = False  # whether the collector was on when the first of them began


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic collector off inside the block (and any overlapping one), as it was after the last ends."""
    global _holders, _resume
    with _lock:
        if _holders == 0:
            _resume = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _resume:
                gc.enable()
