"""MACs a run of the load test needs at least: every prompt row and every output row through the layers, a head row per
output token, each row's attention at its position (the sizes from the model's spec: SmolLM2-135M, 30 layers, d 576,
9 heads, 3 kv heads, hd 64, I 1536, vocab 49152). The shared leading prefix of all prompts counted once."""
import json, sys, collections
from casspec.runtime.engine import Engine
d = json.load(open(sys.argv[1])); lvl = [l for l in d["levels"] if l["clients"] == 8][0]
qs = [json.loads(l) for l in open("../shared/specbench/dev.jsonl")]
by = collections.defaultdict(list)
for q in qs: by[q["category"]].append(q)
sel = [q for c in by for q in by[c][:2]]
eng = Engine.from_pretrained(None, hf=False, weights="float", keep_state=False)
prompts = [eng.prompt_ids([{"role": "user", "content": q["turns"][0]}]) for q in sel]
shared = 0
while all(len(p) > shared and p[shared] == prompts[0][shared] for p in prompts): shared += 1
out = {o["question"]: o["tokens"] for o in lvl["outcomes"]}
sp = eng.model.spec
q, kv = sp.n_heads * sp.head_dim, sp.n_kv_heads * sp.head_dim  # (q and o: dim x q; k and v: dim x kv)
layer = sp.n_layers * (2 * sp.dim * q + 2 * sp.dim * kv + 3 * sp.dim * sp.intermediate)
head, att = sp.vocab_size * sp.dim, sp.n_layers * sp.n_heads * sp.head_dim * 2  # (att: per key seen, q.k and p.v)
total = 0; rows = 0
for i, p in enumerate(prompts):
    n, first = len(p), (0 if i == 0 else shared)
    positions = list(range(first, n)) + list(range(n, n + out[i] - 1))  # rows through the layers
    total += len(positions) * layer + sum((t + 1) * att for t in positions) + out[i] * head
    rows += len(positions)
print(f"shared prefix {shared} tokens; prompt tokens {sum(map(len, prompts))}; output tokens {sum(out.values())}; "
      f"rows through the layers {rows}; {total / 1e9:.1f} GMAC")
