"""scripts/kept_state_check.py: its split of a question file into bench and other questions, and its bad input."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "kept_state_check.py"


def load():
    spec = importlib.util.spec_from_file_location("kept_state_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_bench_questions_are_the_first_of_each_category_in_file_order(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}"]} for i, c in enumerate("aabacbbca")]
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    bench, other = load().split(path, 2)
    assert [q["question_id"] for q in bench] == [0, 1, 2, 4, 5, 7]
    assert [q["question_id"] for q in other] == [3, 6, 8]


def test_bad_input_is_one_error_and_exit_2(tmp_path):
    for args in (["--questions", str(tmp_path / "missing.jsonl")],
                 ["--questions", str(SCRIPT), "--per-category", "0"]):
        out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert "--questions must be a file" in out.stderr.splitlines()[-1]
