import json
f = json.load(open('results/epyc/s55/bench/float32/summary.json'))['methods']
n = json.load(open('results/epyc/s55/bench/native/summary.json'))['methods']
cats = list(f['hf-ar']['by_category'])
print("| category | float32 hf-ar | ar | dytc (x hf-ar) | native hf-ar | ar | dytc (x hf-ar) |")
print("|---|---|---|---|---|---|---|")
def row(name, get):
    cells = []
    for m in (f, n):
        h, a, d = (get(m[k]) for k in ('hf-ar', 'ar', 'dytc'))
        cells += [f"{h:.2f}", f"{a:.1f}", f"{d:.1f} ({d / h:.2f})"]
    print(f"| {name} | " + " | ".join(cells) + " |")
for c in cats:
    row(c, lambda m: m['by_category'][c]['tokens_per_s'])
row("overall", lambda m: m['tokens_per_s'])
