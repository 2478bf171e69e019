"""The ablation runner: rows, resumability, the table, the JSON, the plots and the results page's section."""
import json

import pytest

import casspec.tools.ablate as ab
from casspec.tools.bench import BASELINE
from casspec.calibrate.questions import read_questions
from dsia.errors import CasspecError
from dytc.sampling import SamplingParams
from tiny import tiny_engine


def _questions(tmp_path):
    qfile = tmp_path / "q.jsonl"
    qs = [{"question_id": 1, "category": "writing", "turns": ["w5 w6 w7 w5 w6", "w8 w9"]},
          {"question_id": 2, "category": "qa", "turns": ["w10 w11 w12 w10 w11"]}]
    qfile.write_text("\n".join(json.dumps(q) for q in qs) + "\n")
    return read_questions(qfile)


def test_default_rows_cover_the_ablation():
    e = tiny_engine("llama", 0, layers=5)
    rows = ab.default_rows(e)
    assert rows[0] == BASELINE and {"ar", "pld", "vc", "hc", "vc+hc", "dytc"} <= set(rows)
    assert "sd:exit4" in rows and "tree:int4" in rows and "sd:nf4" in rows  # exit after 80% of the 5 layers
    assert {"dytc:int4", "dytc:int4+vocab", "dytc~none", "dytc~const", "dytc~nofallback"} <= set(rows)
    assert {"vc~pld", "vc~both", "dytc~pld", "dytc~both"} <= set(rows)  # the bottoms other than the default
    assert {"dytc~maxgram+free", "dytc~recycle:none", "dytc~suffix:none", "dytc~maxgram:none"} <= set(rows)


def test_ablation_writes_results_resumes_and_fills_the_readme(tmp_path, monkeypatch):
    e = tiny_engine("llama", 0)
    questions = _questions(tmp_path)
    rows = [BASELINE, "ar", "sd:int8", "tree:int8", "dytc:int8", "dytc~const:int8"]
    out = tmp_path / "results"
    summary = ab.ablate(e, questions, rows, 10, out, "float32", progress=False)
    assert list(summary["methods"]) == rows
    for name, m in summary["methods"].items():
        assert m["identical_to_baseline"] is (None if name == BASELINE else True)
        assert m["memory_mb"] > 0 and set(m["by_category"]) == {"writing", "qa"}
    assert summary["methods"]["sd:int8"]["memory_mb"] > summary["methods"]["ar"]["memory_mb"]  # the int8 copy
    assert summary["levels_plane"]["levels"]["int8"]["cost_ratio"] > 0
    assert summary["methods"]["dytc:int8"]["turn_verify"]  # predicted vs measured per turn
    for f in ("results.md", "results.json", "speedup_by_category.png", "acceptance_by_depth.png",
              "levels_plane.png", "latency.png"):
        assert (out / f).is_file(), f
    table = (out / "results.md").read_text()
    assert "| `dytc~const:int8` |" in table and "writing" in table
    # a rerun skips the finished rows
    calls = []
    real = ab.make_runner
    monkeypatch.setattr(ab, "make_runner", lambda engine, row, **kw: calls.append(row) or real(engine, row, **kw))
    ab.ablate(e, questions, rows + ["pld"], 10, out, "float32", progress=False)
    assert calls == ["pld"]
    # sampled rows are measured anew (a greedy row file is not reused), seeded, and say so
    sampled = ab.ablate(e, questions, rows[:3], 10, out, "float32", progress=False,
                        sampling=SamplingParams(temperature=0.8, top_p=0.9), seed=3)
    assert calls[1:] == rows[:3] and sampled["seed"] == 3 and sampled["sampling"]["temperature"] == 0.8
    assert "sampling (temperature 0.8, top_p 0.9, seed 3)" in ab.format_results(sampled)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Results\n{ab.README_BEGIN}\nold\n{ab.README_END}\n\nrest\n")
    ab.update_readme(readme, summary, out)
    text = readme.read_text()
    assert "old" not in text and "| `sd:int8` |" in text and "](results/speedup_by_category.png)" in text
    assert text.endswith("\n\nrest\n")
    page = tmp_path / "docs" / "results.md"  # the results page (`--readme docs/results.md`): plots link ../results/
    page.parent.mkdir()
    page.write_text(f"# Results\n{ab.README_BEGIN}\n{ab.README_END}\n")
    ab.update_readme(page, summary, out)
    assert "](../results/speedup_by_category.png)" in page.read_text() and "| `sd:int8` |" in page.read_text()
    sampled_begin, sampled_end = ab.readme_markers(sampled)
    readme.write_text(text + f"{sampled_begin}\nold sampled\n{sampled_end}\n")
    ab.update_readme(readme, sampled, out)  # a sampled run writes its own section, the greedy table stays
    text = readme.read_text()
    assert "old sampled" not in text and "| `sd:int8` |" in text and "sampling (temperature 0.8" in text
    readme.write_text("no markers")
    with pytest.raises(CasspecError, match="markers"):
        ab.update_readme(readme, summary, out)
