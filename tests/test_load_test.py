"""scripts/load_test.py against a real `casspec serve` (a tiny engine on a local port, in a thread of this process,
as tests/test_serve.py serves it): 1 and 2 concurrent streaming clients over 3 short questions, every request
completed with its tokens, TTFT and ITL, the table's rows, and no text unlike the same request alone; the shared
queue and the round-robin deal, a started server afresh for each level, the percentiles, the started server's
command line, and bad input as one error line with exit 2."""
import argparse
import importlib.util
import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from casspec.serve.app import ServeConfig, background
from casspec.tools.lcppserver import SERVER_ENV
from tiny import tiny_engine

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "load_test.py"
QUESTIONS = ("w5 w17 w33", "w8 w9 w10", "w40 w41")  # tiny-tokenizer words (tests/tiny.py)


def load():
    """The script as a module (registered first: its dataclasses look their module up)."""
    if "load_test" not in sys.modules:
        spec = importlib.util.spec_from_file_location("load_test", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["load_test"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["load_test"]


@pytest.fixture(scope="module")
def url():
    with background(tiny_engine(max_pos=1024), ServeConfig(model_name="tiny", max_queue=4)) as base:
        yield f"{base}/v1"


@pytest.fixture
def questions(tmp_path) -> Path:
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [q, "later turn"]}) + "\n"
                            for i, q in enumerate(QUESTIONS)))
    return path


def test_two_levels_lose_nothing_and_every_text_equals_alone(url, questions, tmp_path, capsys):
    out = tmp_path / "results.json"
    rc = load().main(["--url", url, "--questions", str(questions), "--clients", "1,2", "--max-tokens", "8",
                      "--temperature", "0", "--check-alone", "--burst", "--queue", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads(out.read_text())
    assert [r["clients"] for r in report["levels"]] == [1, 2]
    for row in [report["alone"], *report["levels"]]:
        assert row["requests"] == row["completed"] == 3 and row["lost"] == row["http_429"] == row["http_503"] == 0
        assert row["tokens_from_usage"] and 3 <= row["tokens"] <= 24 and row["tokens_per_s"] > 0
        assert row["ttft_p50_s"] > 0 and row["ttft_p99_s"] >= row["ttft_p50_s"]
        assert row["itl_p50_s"] > 0 and row["itl_p99_s"] >= row["itl_p50_s"]
        for o in row["outcomes"]:
            assert o["status"] == 200 and o["finish_reason"] in ("stop", "length") and o["text"] and o["tokens"] >= 1
    assert [r["differ_from_alone"] for r in report["levels"]] == [0, 0]
    level2 = report["levels"][1]  # a shared queue: each question once, the two clients taking them as they end
    assert sorted(o["question"] for o in level2["outcomes"]) == [0, 1, 2]
    assert {o["client"] for o in level2["outcomes"]} == {0, 1} and 0 < level2["in_flight_mean"] <= 2.0 + 1e-6
    burst = report["burst"]  # 4 at once on a queue of 2: the first runs, 2 wait, the rest may get 429
    assert burst["requests"] == 4 and burst["lost"] == 0
    assert burst["completed_200"] + burst["http_429"] + burst["http_503"] == 4 and burst["completed_200"] >= 3
    assert report["server"]["model"] == "tiny" and report["cpu"]
    lines = printed.splitlines()
    assert lines[0].startswith("CPU: ") and "--clients 1,2" in lines[1] and f"already running at {url}" in lines[2]
    rows = [line for line in lines if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2 and all(row.count("|") == 17 for row in rows), rows  # 16 columns
    assert all(row.endswith("| 0 | 0 | 0 | 0 |") for row in rows), rows  # lost, 429, 503, != alone
    assert any(line.startswith("burst: 4 requests at once") and line.endswith("0 lost") for line in lines)


def test_round_robin_dealing_gives_each_client_its_fixed_share(url, questions, tmp_path, capsys):
    out = tmp_path / "results.json"
    rc = load().main(["--url", url, "--questions", str(questions), "--clients", "2", "--max-tokens", "4",
                      "--temperature", "0", "--dealing", "round-robin", "--warmup", "0", "--out", str(out)])
    assert rc == 0, capsys.readouterr().out
    level = json.loads(out.read_text())["levels"][0]
    assert sorted((o["client"], o["question"]) for o in level["outcomes"]) == [(0, 0), (0, 2), (1, 1)]
    assert level["lost"] == 0 and level["completed"] == 3


def test_a_started_server_is_fresh_for_each_level(url, questions, tmp_path, monkeypatch, capsys):
    """With --start, the alone pass, each level and the burst each go through a server start of their own (a later
    level on the same server would find its prompts in the prefix cache)."""
    mod = load()
    starts = []

    @contextmanager
    def fake_started(args, levels):  # (the module's test server stands in for each start)
        starts.append(levels)
        yield url, ["casspec", "serve"], None

    monkeypatch.setattr(mod, "started", fake_started)
    out = tmp_path / "results.json"
    rc = mod.main(["--start", "casspec", "--questions", str(questions), "--clients", "1,2", "--max-tokens", "4",
                   "--temperature", "0", "--check-alone", "--burst", "--queue", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads(out.read_text())
    assert len(starts) == 4 and report["servers_started"] == 4  # alone, level 1, level 2, burst
    assert "a fresh one for each of 4 runs" in printed.splitlines()[2]
    assert [r["differ_from_alone"] for r in report["levels"]] == [0, 0]


def test_the_deal_and_the_percentiles():
    mod = load()
    assert mod.assignment(5, 2, None) == [[0, 2, 4], [1, 3]]
    assert mod.assignment(2, 4, None) == [[0], [1], [0], [1]]
    assert mod.assignment(3, 2, 3) == [[0, 2, 1], [1, 0, 2]]
    assert mod.workload(5, 2, None) == [0, 1, 2, 3, 4]  # the same requests through one queue
    assert mod.workload(2, 4, None) == [0, 1, 0, 1]
    assert mod.workload(3, 2, 3) == [0, 1, 2, 0, 1, 2]
    assert mod.percentile([], 50) is None
    assert mod.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert mod.percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_started_servers_command_lines(tmp_path, monkeypatch):
    mod = load()
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv(SERVER_ENV, str(fake))
    args = argparse.Namespace(start="llama-server", model="m.gguf", weights=None, llama_spec=True, threads=2,
                              queue=16, server_args="--parallel 3 -c 4096")
    assert mod.server_argv(args, [1, 2, 8], 1234) == [str(fake), "-m", "m.gguf", "--spec-default", "--host",
                                                      "127.0.0.1", "--port", "1234", "-t", "2", "--parallel", "3",
                                                      "-c", "4096"]
    args = argparse.Namespace(start="casspec", model=None, weights="native", llama_spec=False, threads=2, queue=16,
                              server_args="--max-queue=4 --method ar")
    argv = mod.server_argv(args, [1, 2], 1234)
    assert argv[1:] == ["-m", "casspec", "serve", "--weights", "native", "--host", "127.0.0.1", "--port", "1234",
                        "--max-queue=4", "--method", "ar"]
    assert mod.port_of(argv, 0) == 1234


BAD_INPUT = [
    (["--url", "http://127.0.0.1:1/v1", "--clients", "1,two"], "--clients must be comma-separated integers >= 1"),
    (["--url", "http://127.0.0.1:1/v1", "--clients", "0"], "--clients must be comma-separated integers >= 1"),
    (["--url", "127.0.0.1:1"], "--url must be an http:// or https:// address"),
    (["--start", "casspec", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--start", "casspec", "--llama-spec"], "--llama-spec is llama-server's"),
]


def test_bad_input_is_one_error_line_and_exit_2():
    """Each bad command line in its own process (all at once: each is mostly the interpreter's start)."""
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for args, _ in BAD_INPUT]
    for proc, (args, needle) in zip(procs, BAD_INPUT):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and out == "", (args, err)
        assert len(err.strip().splitlines()) == 1 and needle in err, (args, err)
