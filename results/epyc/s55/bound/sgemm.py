"""oneDNN's float32 matrix product rate through torch (2 threads), n x n x n, best of 5: GMAC/s = n^3 / seconds."""
import time
import torch
torch.set_num_threads(2)
for n in (1024, 2048, 3072):
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t0)
    print(n, f"{n ** 3 / min(ts) / 1e9:.1f} GMAC/s")
