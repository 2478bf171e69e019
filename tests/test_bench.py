"""The Spec-Bench runner: schema of summary.json, answers files, identity with the baseline, multi-turn."""
import json

from casspec.tools.bench import BASELINE, format_table, parse_methods, run_bench

from casspec.calibrate.questions import Question, read_questions
from tiny import tiny_engine


def test_bench_on_tiny_model(tmp_path):
    qfile = tmp_path / "q.jsonl"
    qs = [{"question_id": 1, "category": "writing", "turns": ["w5 w6 w7", "w8 w9"]},
          {"question_id": 2, "category": "qa", "turns": ["w10 w11 w12 w10 w11"]},
          {"question_id": 3, "category": "qa", "turns": ["w13"]}]
    qfile.write_text("\n".join(json.dumps(q) for q in qs) + "\n")
    questions = read_questions(qfile, limit=3)
    assert [q.question_id for q in questions] == [1, 2, 3]
    assert len(read_questions(qfile, limit=1)) == 1
    methods = parse_methods("ar,hf-pld,sd:int8")
    assert methods == [BASELINE, "ar", "hf-pld", "sd:int8"]
    engine = tiny_engine("llama", 0)
    summary = run_bench(engine, questions, methods, 12, tmp_path / "out", "float32", repeats=2, progress=False)
    assert set(summary) >= {"model", "device", "dtype", "max_new_tokens", "baseline", "methods"}
    assert summary["baseline"] == BASELINE and summary["max_new_tokens"] == 12
    assert summary["kernels"] == engine.kernels == "blas (T 1+) (forced)" and summary["build"] == engine.build
    assert summary["machine"]["cpu"] and "torch" in summary["machine"]
    for name, m in summary["methods"].items():
        assert set(m) >= {"tokens_per_s", "speedup", "mean_accepted_tokens", "identical_to_baseline",
                          "questions", "by_category"}
        assert m["questions"] == 3 and m["tokens_per_s"] > 0
        assert set(m["by_category"]) == {"writing", "qa"}
        assert m["identical_to_baseline"] is (None if name == BASELINE else True)
    assert summary["methods"][BASELINE]["speedup"] == 1.0
    assert summary["methods"]["ar"]["mean_accepted_tokens"] == 1.0
    assert summary["methods"][BASELINE]["mean_accepted_tokens"] == 1.0
    sd = summary["methods"]["sd:int8"]
    assert sd["draft_forwards"] > 0 and sd["verify_seconds"] > 0 and "draft_seconds" in sd
    assert all(0 <= a <= 1 for a in sd["acceptance_by_depth"])
    assert sd["acceptance_by_depth"] == sorted(sd["acceptance_by_depth"], reverse=True)  # reaching d+1 needs d
    on_disk = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert on_disk["methods"].keys() == summary["methods"].keys()
    lines = (tmp_path / "out" / "answers-ar.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert first["question_id"] == 1 and len(first["choices"][0]["turns"]) == 2  # both turns answered
    assert len(first["choices"][0]["wall_time_repeats"][0]) == 2
    assert "| ar " in format_table(summary)
    assert sd["identical_to_ar"] is True and sd["ar_divergences"] == []  # float32: equal to casspec's own ar
    assert "identical_to_ar" not in summary["methods"]["hf-pld"]


def test_a_divergence_from_ar_is_located_with_the_target_logit_gap(tmp_path):
    """A method whose second turn leaves ar's tokens at index 3 is reported there, with the two tokens and the
    target's logit gap from a forward over the turn's prompt (ar's first answer as history) plus the common tokens."""
    import torch

    from casspec.tools.bench import BASELINES, make_runner, run_question
    from casspec.tools.divergence import divergences

    from casspec.calibrate.questions import Question

    engine = tiny_engine("llama", 0)
    q = Question(7, "writing", ["w5 w6 w7", "w8 w9"])
    ar = run_question(engine, make_runner(engine, "ar"), q, 8, None)
    other = run_question(engine, make_runner(engine, "ar"), q, 8, None)
    wrong = (other.token_ids[1][3] + 1) % 40 + 3
    other.token_ids[1] = other.token_ids[1][:3] + [wrong] + other.token_ids[1][4:]
    found = divergences(engine, [q], {BASELINE: [ar], "ar": [ar], "sd": [other]}, BASELINES)
    assert set(found) == {"sd"} and found["sd"]["identical_to_ar"] is False
    (d,) = found["sd"]["ar_divergences"]
    assert (d["question_id"], d["turn"], d["index"]) == (7, 1, 3)
    assert d["reference_token"] == ar.token_ids[1][3] and d["token"] == wrong
    prompt = engine.encode([{"role": "user", "content": "w5 w6 w7"}, {"role": "assistant", "content": ar.turns[0]},
                            {"role": "user", "content": "w8 w9"}])
    with torch.inference_mode():
        logits = engine.hf_model(torch.tensor([prompt + ar.token_ids[1][:3]])).logits[0, -1]  # [V]
    assert abs(d["gap"] - float(logits[d["reference_token"]] - logits[wrong])) < 1e-4
    assert d["gap"] >= 0 and d["margin"] >= 0  # ar took the argmax
    # no ar in the run: nothing to compare
    assert divergences(engine, [q], {BASELINE: [ar], "sd": [other]}, BASELINES) == {}


def test_method_specs_with_variants():
    from casspec.tools.bench import method_request
    from dytc.sources import BOTTOMS, DEFAULT_BOTTOM

    (DEFAULT_LOOKUP,) = BOTTOMS[DEFAULT_BOTTOM]
    assert parse_methods("vc~maxgram,dytc~both,vc+hc~none,dytc~pld") == [
        BASELINE, "vc~maxgram", "dytc~both", "vc+hc~none", "dytc~pld"]
    assert method_request("vc~maxgram").lookups == ("maxgram",)
    assert method_request("dytc~both:int4").lookups == ("pld", "maxgram")
    assert method_request("dytc~none").lookups == ()
    assert method_request("dytc").lookups == (DEFAULT_LOOKUP,)
    assert method_request("dytc~const").router.constant_cost is not None
    assert method_request("hc:int4*2/maxgram*3").levels == ("int4*2", "maxgram*3")


def test_per_category_takes_the_first_questions_of_every_category(tmp_path):
    qfile = tmp_path / "q.jsonl"
    cats = ["writing", "qa", "writing", "rag", "qa", "writing", "qa"]
    qfile.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"w{i}"]})
                               for i, c in enumerate(cats)) + "\n")
    assert [q.question_id for q in read_questions(qfile, per_category=2)] == [0, 1, 2, 3, 4]
    assert [q.question_id for q in read_questions(qfile, per_category=1)] == [0, 1, 3]
    assert [q.question_id for q in read_questions(qfile, limit=3, per_category=1)] == [0, 1]


def test_hf_static_cache_baseline_matches_hf_ar_and_needs_a_gpu():
    import pytest

    from casspec.tools.bench import _hf_runner, make_runner
    from dsia.errors import CasspecError
    from dytc.sampling import SamplingParams

    engine = tiny_engine("llama", 0, max_context=64)
    if engine.device.type != "cuda":
        with pytest.raises(CasspecError, match="needs --device cuda"):
            make_runner(engine, "hf-ar-compiled")
    plain = make_runner(engine, BASELINE)
    static = _hf_runner(engine, {}, SamplingParams(), static_cache=True)  # (compiled by HF on a GPU only)
    for ids in ([5, 6, 7], [8, 9, 10, 11, 12, 13]):  # the one cache is reset between turns
        assert static(ids, 20)[0] == plain(ids, 20)[0]


def test_each_question_starts_a_new_conversation():
    """A question's first turn prefills from scratch even where the cache holds its prompt (another method just ran
    the same question: the bench must not time that), and its second turn reuses what its first left."""
    from casspec.tools.bench import make_runner, run_question
    from casspec.calibrate.questions import Question

    engine = tiny_engine("llama", 0)
    q = Question(7, "writing", ["w5 w6 w7", "w8 w9"])
    for method in ("ar", "dytc"):
        a = run_question(engine, make_runner(engine, method), q, 8, None)
        first, second = a.stats
        assert first["reused_tokens"] == 0 and second["reused_tokens"] > 0


def test_bench_reports_draft_tokens_per_source_and_each_pass_starts_without_memory(tmp_path):
    """dytc with the suffix and recycle sources: the summary and the printed table give each source's drafted,
    tested and accepted tokens; every method remembers only its own earlier questions, and a repeat pass starts with
    no memory (a repeat never finds its own answer in the suffix tree, so its tokens per step are the first pass's)."""
    qs = [Question(i, "qa", [f"w{5 + i} w6 w7 w5 w6 w7 w5"]) for i in range(3)]
    engine = tiny_engine("llama", 0)
    seen = []
    real = engine.shared.forget

    def forget(tenant=None):
        seen.append(sorted(engine.shared.clients))
        real(tenant)

    engine.shared.forget = forget
    methods = [BASELINE, "dytc~maxgram+free"]
    summary = run_bench(engine, qs, methods, 16, tmp_path / "out", "float32", repeats=2, progress=False)
    pol = summary["methods"]["dytc~maxgram+free"]["policy"]
    assert sum(pol["drafted_by_source"].values()) > 0
    assert set(pol["tested_by_source"]) <= set(pol["drafted_by_source"])
    assert all(pol["accepted_by_source"][s] <= n for s, n in pol["tested_by_source"].items())
    table = format_table(summary)
    assert "drafted/tested/accepted" in table and "dytc~maxgram+free:" in table
    assert seen[0] == ["bench dytc~maxgram+free"] and seen[1] == ["bench dytc~maxgram+free"]  # (warm-up; pass 1)
    assert len(seen) == 2
