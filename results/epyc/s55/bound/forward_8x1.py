"""The native target's batched forward of 8 sequences (prompts of 100, 800, 200, 600, 150, 900, 300 and 50 random
tokens) x R rows each (`forward_batch`, as a batched serving step runs it), median over DUR seconds."""
import os
import random
import sys
import time

import torch

from casspec.runtime.engine import Engine
from casspec.runtime.step import prefill
from dsia.model import BatchItem

eng = Engine.from_pretrained(None, hf=False, weights=os.environ.get("W", "native"), keep_state=False)
m = eng.model
R = int(sys.argv[1]) if len(sys.argv) > 1 else 1
with torch.inference_mode():
    caches = []
    for s, n in enumerate([100, 800, 200, 600, 150, 900, 300, 50]):
        c = m.new_cache(2048)
        random.seed(s)
        prefill(m, c, [random.randrange(100, 40000) for _ in range(n)])
        caches.append(c)
    gen = [torch.Generator().manual_seed(i) for i in range(8)]
    its = [BatchItem(c, torch.randint(100, 40000, (R,), generator=g), torch.arange(c.length, c.length + R), c.length,
                     None) for c, g in zip(caches, gen)]
    for _ in range(5):
        m.forward_batch(its)
    ts, t1 = [], time.perf_counter()
    while time.perf_counter() - t1 < float(os.environ.get("DUR", "8")):
        t0 = time.perf_counter()
        m.forward_batch(its)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    print(f"8 x {R} rows: median {ts[len(ts) // 2] * 1e3:.2f} ms over {len(ts)} forwards")
