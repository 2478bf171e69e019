import json, sys
runs = [(name, json.load(open(path))["methods"]) for name, path in (a.split("=") for a in sys.argv[1:])]
new = ["dytc~maxgram+suffix", "dytc~maxgram+recycle", "dytc~maxgram+free"]
hdr = "| category |" + "".join(f" {n} dytc | +suffix | +recycle | +free |" for n, _ in runs)
print(hdr); print("|---" * (1 + 4 * len(runs)) + "|")
cats = list(runs[0][1]["dytc"]["by_category"])
order = sorted(cats, key=lambda c: runs[0][1]["dytc"]["by_category"][c]["tokens_per_s"])
for c in order + ["overall"]:
    cells = []
    for _, m in runs:
        get = (lambda k: m[k]["tokens_per_s"]) if c == "overall" else (lambda k: m[k]["by_category"][c]["tokens_per_s"])
        d = get("dytc"); cells += [f"{d:.1f}"] + [f"{get(k) / d:.2f}" for k in new]
    print(f"| {c} | " + " | ".join(cells) + " |")
