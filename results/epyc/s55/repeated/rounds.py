import sys, os, collections, time
from casspec.calibrate.questions import read_questions
from casspec.runtime.engine import Engine
from casspec.tools.bench import method_request
from dytc.shared import SharedDrafts
from dytc.suffix import SuffixConfig
sys.path.insert(0, "scripts")
from repeated_workload import FOLLOW_UP, ROUNDS
qs = read_questions(os.environ.get("QUESTIONS", "../shared/specbench/dev.jsonl"), per_category=2)
eng = Engine.from_pretrained(None, weights=os.environ.get("W", "native"))
eng.shared = SharedDrafts(SuffixConfig())
K = ("seconds", "prefill_seconds", "draft_seconds", "draft_forward_seconds", "verify_seconds", "predicted_verify_seconds", "target_forwards", "tree_nodes", "new_tokens")
def run(m, rep):
    tenant = f"r {m} {rep}"; eng.shared.forget(tenant); answers = {}
    tot = {r: collections.Counter() for r in ROUNDS}
    for q in qs:
        for rnd in ROUNDS:
            msgs = [{"role": "user", "content": q.turns[0]}]
            if rnd == "revise":
                msgs += [{"role": "assistant", "content": answers[q.question_id]}, {"role": "user", "content": FOLLOW_UP}]
            if rnd == "first": eng.forget_prefix()
            res = eng.generate_ids(eng.encode(msgs), method_request(m, max_new_tokens=128, tenant=tenant))
            if rnd == "first": answers[q.question_id] = res.text
            for k in K: tot[rnd][k] += getattr(res.stats, k)
    out = []
    for rnd in ROUNDS:
        t = tot[rnd]; st = t["target_forwards"]
        out.append(f"{rnd}: {t['seconds']:.2f} s (pf {t['prefill_seconds']:.2f}) steps {st} nodes/st {t['tree_nodes']/st:.2f} tok/st {t['new_tokens']/st:.2f} pol {1e3*(t['draft_seconds']-t['draft_forward_seconds'])/st:.2f} lev {1e3*t['draft_forward_seconds']/st:.2f} ver {1e3*t['verify_seconds']/st:.2f} (pred {1e3*t['predicted_verify_seconds']/st:.2f})")
    total = sum(tot[r]["seconds"] for r in ROUNDS)
    print(f"== {m} total {total:.2f} s\n  " + "\n  ".join(out), flush=True)
for rep in range(int(os.environ.get("REPS", "1"))):
    for m in sys.argv[1].split(","):
        run(m, rep)
