"""A native target forward of N rows over 300 committed positions (logits of every row, as a verification takes
them), median of 40, against the latency model's prediction; and a prompt's forward (logits of its last row only)."""
import random
import time

import torch

from casspec.runtime.engine import Engine
from casspec.runtime.step import prefill
from dytc.costs import cost_tables

eng = Engine.from_pretrained(None, hf=False, weights="native", keep_state=False)
m = eng.model
v, _ = cost_tables(eng.latency, [], 300, 128)
random.seed(0)
with torch.inference_mode():
    c = m.new_cache(2048)
    prefill(m, c, [random.randrange(100, 40000) for _ in range(300)])
    L = c.length
    for n in (1, 4, 8, 16, 24, 32, 48, 64, 128):
        toks, pos = torch.randint(100, 40000, (n,)), torch.arange(L, L + n)
        ts = []
        for _ in range(40):
            t0 = time.perf_counter()
            m.forward(c, toks, pos, L)
            ts.append(time.perf_counter() - t0)
        ts.sort()
        print(f"verify {n} rows at 300: {ts[20] * 1e3:.2f} ms ({ts[20] * 1e3 / n:.3f} a row), predicted {v[n]:.2f}")
    for n in (64, 177):
        ts = []
        for _ in range(20):
            c2 = m.new_cache(2048)
            t0 = time.perf_counter()
            prefill(m, c2, [random.randrange(100, 40000) for _ in range(n)])
            ts.append(time.perf_counter() - t0)
        ts.sort()
        print(f"prompt of {n}: {ts[10] * 1e3:.2f} ms ({ts[10] * 1e3 / n:.3f} a row)")
