"""Inputs that used to pass silently or raise a traceback: non-finite and tiny temperatures, out-of-range seeds,
non-UTF-8 prompts and question files, unwritable output folders, truncated or foreign ablation rows."""
import json
import os

import pytest

from casspec.tools.ablate import _finished_row, _row_key
from casspec.tools.bench import run_bench, writable_folder
from casspec.calibrate.questions import read_questions
from casspec.runtime.engine import Request
from casspec.cli import main
from dsia.errors import CasspecError
from dytc.sampling import GREEDY_BELOW, SamplingParams
from tiny import tiny_engine


@pytest.mark.parametrize("t", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_temperature_is_refused(t):
    with pytest.raises(CasspecError, match="finite"):
        SamplingParams(temperature=t)


def test_tiny_temperature_is_greedy_and_never_gives_nan():
    e = tiny_engine("llama", 0)
    greedy = e.generate("w5 w6 w7", max_new_tokens=12)
    for t in (GREEDY_BELOW / 2, 1e-30):
        assert SamplingParams(temperature=t).greedy
        assert e.generate("w5 w6 w7", max_new_tokens=12, temperature=t, seed=3).token_ids == greedy.token_ids
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    res = e.generate("w5 w6 w7", max_new_tokens=12, temperature=GREEDY_BELOW, seed=3)
    assert len(res.token_ids) == 12  # sampled at the floor: finite probabilities, no NaN error


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True])
def test_seed_out_of_range_is_refused(seed):
    with pytest.raises(CasspecError, match="seed must be an integer"):
        Request(seed=seed)
    Request(seed=2**64 - 1)


def test_cli_refuses_bad_sampling_values_in_one_line(capsys):
    for argv, needle in ((["--temperature", "inf"], "finite"), (["--seed", str(2**70)], "seed"),
                         (["--top-k", "-1"], "top_k")):
        rc = main(["generate", "w5", "--model", "random:none", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_an_unknown_engine_option_is_refused_before_loading(monkeypatch):
    """Engine options (target.EngineOptions) given as keywords are checked by name before any checkpoint loads."""
    import casspec.runtime.engine as engine_mod

    monkeypatch.setattr(engine_mod, "load", lambda *a, **k: pytest.fail("loaded before checking the options"))
    with pytest.raises(CasspecError, match="unknown engine option 'max_ctx'.*max_context"):
        engine_mod.Engine.from_pretrained(None, max_ctx=512)
    e = tiny_engine()
    with pytest.raises(CasspecError, match="unknown engine option 'graph'"):
        engine_mod.Engine(engine_mod.Loaded(e.hf_model, e.tokenizer, "tiny"), graph=True)


def test_non_utf8_prompt_is_refused():
    e = tiny_engine("llama", 0)
    bad = b"w5 \xff w6".decode("utf-8", "surrogateescape")  # what argv holds for such bytes
    with pytest.raises(CasspecError, match="not valid UTF-8"):
        e.generate(bad)
    with pytest.raises(CasspecError, match="not valid UTF-8"):
        e.generate([{"role": "user", "content": bad}])


def test_non_utf8_questions_file_is_refused(tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_bytes(b'{"question_id": 1, "category": "qa", "turns": ["caf\\u00e9 \xe9"]}\n')
    with pytest.raises(CasspecError, match="not UTF-8"):
        read_questions(q)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_out_is_refused_before_any_work(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(CasspecError, match="pass a writable --out"):
        writable_folder(ro / "out")


def test_out_that_is_a_file_is_refused_before_any_work(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(CasspecError, match="pass a writable --out"):
        run_bench(tiny_engine("llama", 0), [], ["hf-ar"], 8, f / "out", "float32", progress=False)


def test_ablation_rows_truncated_or_measured_otherwise_are_run_again(tmp_path, capsys):
    e = tiny_engine("llama", 0)
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["w5 w6"]}) + "\n")
    key = _row_key(e, read_questions(qfile), 8)
    row = tmp_path / "row.json"
    row.write_text(json.dumps({**key, "answers": []})[:-7])  # an interrupted write
    assert _finished_row(row, key) is None
    assert "unreadable" in capsys.readouterr().err
    row.write_text(json.dumps({**key, "dtype": "bfloat16", "answers": []}))
    assert _finished_row(row, key) is None
    assert "another dtype" in capsys.readouterr().err
    row.write_text(json.dumps({**key, "answers": []}))
    assert _finished_row(row, key) == {**key, "answers": []}
    sampled = _row_key(e, read_questions(qfile), 8, SamplingParams(temperature=0.7), seed=1)
    assert _finished_row(row, sampled) is None  # a greedy row is not a sampled one
    assert "another sampling, seed" in capsys.readouterr().err


@pytest.mark.parametrize("hf", [True, False])
def test_a_checkpoint_missing_weight_tensors_is_refused(tmp_path, hf):
    from safetensors.torch import load_file, save_file

    from casspec.loading.checkpoints import load
    from tiny import tiny_model, tiny_tokenizer

    tiny_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    (f,) = tmp_path.glob("*.safetensors")
    state = load_file(f)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, f, metadata={"format": "pt"})
    with pytest.raises(CasspecError, match="missing weight tensors model.layers.1.mlp.up_proj.weight"):
        load(str(tmp_path), "float32", "cpu", hf)
