"""bench's lcpp-spec baseline (casspec/tools/lcppserver.py) against a stand-in llama-server: a small Python HTTP
server that records its command line and requests. What is tested is casspec's side: the binary found, its
arguments (the default speculation, one slot, torch's threads), each turn's request (prompt ids, n_predict, greedy or
the warp, prompt reuse within a conversation only), the end-of-generation token counted, the errors, and the
process stopped."""
import json
import os
import sys
import textwrap

import pytest
import torch

from casspec.tools import lcppserver
from casspec.tools.bench import parse_methods, run_bench
from dsia.errors import CasspecError
from dytc.sampling import SamplingParams
from tiny import tiny_engine

EOS = 2
FAKE = textwrap.dedent('''
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    log = os.environ["FAKE_SERVER_LOG"]
    with open(log, "a") as f:
        f.write(json.dumps({"argv": sys.argv[1:]}) + "\\n")
    if os.environ.get("FAKE_SERVER_FAIL"):
        print("error: failed to load model", file=sys.stderr)
        sys.exit(1)
    port = int(sys.argv[sys.argv.index("--port") + 1])

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({"status": "ok"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(log, "a") as f:
                f.write(json.dumps({"request": body}) + "\\n")
            last, out, stop = body["prompt"][-1], [], "limit"
            for i in range(body["n_predict"]):
                last = (last + 1) % 90 + 3
                if last % 10 == 1:  # (an end-of-generation: the server leaves it out of its tokens)
                    stop = "eos"
                    break
                out.append(last)
            self._send({"tokens": out, "stop_type": stop, "timings": {"draft_n": 4, "draft_n_accepted": 1}})

    HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def server(tmp_path, monkeypatch):
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable}\n" + FAKE)
    exe.chmod(0o755)
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv(lcppserver.SERVER_ENV, str(exe))
    monkeypatch.setenv("FAKE_SERVER_LOG", str(log))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF stand-in")

    def entries(key):
        return [json.loads(line)[key] for line in log.read_text().splitlines() if key in json.loads(line)]

    return gguf, entries


def test_the_server_runs_the_default_speculation_one_slot_and_torchs_threads(server):
    gguf, entries = server
    run = lcppserver.lcpp_spec_runner(gguf, 256, frozenset({EOS}), SamplingParams(), seed=0)
    try:
        (argv,) = entries("argv")
        assert "--spec-default" in argv and argv[argv.index("-m") + 1] == str(gguf)
        assert argv[argv.index("-t") + 1] == argv[argv.index("-tb") + 1] == str(torch.get_num_threads())
        assert argv[argv.index("--parallel") + 1] == "1" and argv[argv.index("-c") + 1] == "256"
        out, forwards, stats = run([5, 11, 12], 4)
        assert out == [16, 20, 24, 28] and forwards == 3 and stats == {}  # one drafted token accepted
        (req,) = entries("request")
        assert req["prompt"] == [5, 11, 12] and req["n_predict"] == 4 and req["return_tokens"]
        assert (req["temperature"], req["top_k"], req["repeat_penalty"]) == (0.0, 1, 1.0)
        assert run([5, 11, 12, 3], 10)[0] == [7, EOS]  # the end of generation counted, as casspec counts it
    finally:
        run.close()


def test_a_conversation_reuses_its_prompt_and_a_new_question_does_not(server):
    gguf, entries = server
    run = lcppserver.lcpp_spec_runner(gguf, 256, frozenset({EOS}), SamplingParams(0.7, 20, 0.9), seed=5)
    try:
        run([5, 6], 3)
        run([5, 6, 9, 10, 11], 3)  # the same conversation, one turn on
        run([7, 8], 3)  # another question
        reqs = entries("request")
        assert [r["cache_prompt"] for r in reqs] == [False, True, False]
        assert all((r["temperature"], r["top_k"], r["top_p"], r["seed"]) == (0.7, 20, 0.9, 5) for r in reqs)
    finally:
        run.close()
    assert run.close() is None  # (twice: harmless)


def test_a_missing_or_failing_server_is_one_clear_error(server, monkeypatch, tmp_path):
    gguf, _ = server
    monkeypatch.setenv("FAKE_SERVER_FAIL", "1")
    with pytest.raises(CasspecError, match="llama-server exited .* failed to load model"):
        lcppserver.lcpp_spec_runner(gguf, 256, frozenset({EOS}), SamplingParams(), seed=0)
    monkeypatch.setenv(lcppserver.SERVER_ENV, str(tmp_path / "nothing"))
    with pytest.raises(CasspecError, match="lcpp-spec needs llama.cpp's server .* build llama-server"):
        lcppserver.lcpp_spec_runner(gguf, 256, frozenset({EOS}), SamplingParams(), seed=0)
    with pytest.raises(CasspecError, match="runs a GGUF file"):
        lcppserver.lcpp_spec_runner(None, 256, frozenset({EOS}), SamplingParams(), seed=0)


def test_bench_runs_lcpp_spec_beside_the_other_methods_and_stops_it(server, tmp_path):
    gguf, entries = server
    assert parse_methods("lcpp-spec,ar") == ["hf-ar", "lcpp-spec", "ar"]
    from casspec.calibrate.questions import Question

    e = tiny_engine()
    e.source = gguf
    qs = [Question(1, "writing", ["w5 w6 w7", "w8 w9"]), Question(2, "coding", ["w10 w11"])]
    summary = run_bench(e, qs, ["hf-ar", "lcpp-spec", "ar"], 6, tmp_path / "out", "float32", progress=False)
    row = summary["methods"]["lcpp-spec"]
    assert row["questions"] == 2 and row["new_tokens"] > 0 and row["identical_to_baseline"] is False
    (argv,) = entries("argv")
    port = argv[argv.index("--port") + 1]
    import urllib.request
    with pytest.raises(OSError):  # the bench stopped the server
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    assert os.environ[lcppserver.SERVER_ENV]
