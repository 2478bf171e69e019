"""`casspec serve` under abuse, over a tiny random model whose tokenizer knows more words than the model (w97..w99
are out of its vocabulary): huge, streamed and nested bodies, many and long stops, huge and non-finite numbers,
wrong content types and Host headers, out-of-vocabulary prompts, over-long prompts, max_tokens over the limit,
calls past their deadline, clients that stall or leave mid-head, mid-body and mid-stream, more connections than
allowed, an internal error, and random bodies (hypothesis). Each must end in a clear error (OpenAI's shape, the
parameter named) within a bounded time and peak memory (the server runs in this process: its peak resident memory
is measured through /proc), and the next normal request must be served."""
import asyncio
import json
import logging
import re
import select
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from casspec.serve.calls import CHAT_FIELDS, COMPLETION_FIELDS, MAX_JSON_DEPTH, Limits
from casspec.runtime.engine import Engine
from casspec.loading.checkpoints import Loaded
from casspec.serve.scheduler import Job
from casspec.serve.app import JobStream, ServeConfig, background
from tiny import tiny_model, tiny_tokenizer

LIMITS = Limits(max_body_bytes=64 << 10, max_prompt_tokens=1000, default_max_tokens=8, max_tokens_limit=3500,
                max_stops=4, max_stop_chars=32, request_timeout=0.5, client_timeout=1.0, max_connections=6)
LONG = "w10 w20 w30 w40"  # greedy continuation runs past 3000 tokens with no EOS
HOST = "api.example.test"  # the server's --allowed-hosts
FAST = 1.0  # seconds within which a refusal comes
MEMORY_MIB = 24  # peak resident memory an abusive call may add to the server's process (the model: ~1 MiB)
STATUS = Path("/proc/self/status")


@pytest.fixture(scope="module")
def engine():
    model = tiny_model(max_pos=4096)  # vocab 97
    return Engine(Loaded(model, tiny_tokenizer(100), "tiny"), kernels="blas", autoprofile=False, keep_state=False)


@pytest.fixture(scope="module")
def url(engine):
    cfg = ServeConfig(model_name="tiny", max_queue=2, limits=LIMITS, allowed_hosts=(HOST,))
    with background(engine, cfg) as base:
        yield base


@pytest.fixture(autouse=True)
def next_request_served(request):
    """After every test: the server is alive and answers the next normal request."""
    yield
    if "url" in request.fixturenames:
        served(request.getfixturevalue("url"))


def served(base: str) -> None:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "w5", "max_tokens": 3, "temperature": 0}, timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def refused(r: httpx.Response, status: int, code: str, param: str | None, needle: str = "") -> dict:
    err = r.json()["error"]
    assert r.status_code == status and err["code"] == code and err["param"] == param, (r.status_code, err)
    assert set(err) == {"message", "type", "code", "param"} and needle in err["message"], err
    return err


def post(base: str, body, path: str = "/v1/completions", **kw) -> tuple[httpx.Response, float]:
    """(response, seconds) of a POST of a JSON-able body, or of raw bytes / text as they are."""
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    t0 = time.monotonic()
    r = httpx.post(f"{base}{path}", content=content, headers=headers, timeout=10, **kw)
    return r, time.monotonic() - t0


def metric(base: str, name: str) -> float:
    return float(re.search(rf"^casspec:{name} (\S+)$", httpx.get(f"{base}/metrics").text, re.M).group(1))


def kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", STATUS.read_text()).group(1))


@contextmanager
def peak_memory():
    """{"mib": the process's peak resident memory during the block above its resident memory at the start} (the
    peak is reset through /proc/self/clear_refs; None where that is not allowed)."""
    box = {"mib": None}
    try:
        base = kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        yield box
        return
    yield box
    box["mib"] = (kib("VmHWM") - base) / 1024


def bounded(box: dict) -> None:
    assert box["mib"] is None or box["mib"] < MEMORY_MIB, f"peak memory grew by {box['mib']:.1f} MiB"


# ---------------------------------------------------------------------- raw connections
def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def head(path: str, **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of a response (read to its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < length(data):
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection without an answer: {data!r}"
        data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def length(data: bytes) -> int:
    return int(re.search(rb"(?i)content-length: (\d+)", data).group(1))


def closed_by_server(sock: socket.socket, within: float) -> float:
    """Seconds until the server closes the connection (fails past `within`)."""
    t0 = time.monotonic()
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


# ---------------------------------------------------------------------- bodies
def test_a_huge_declared_body_gets_413_before_it_is_read(url):
    """The review's 4.8 MB body of 100k stops: refused on its Content-Length, the rest never read."""
    stops = json.dumps({"prompt": "w5", "stop": [f"w{i} " * 8 for i in range(100_000)]}).encode()
    with peak_memory() as mem, connect(url) as s:
        t0 = time.monotonic()
        s.sendall(head("/v1/completions", Content_Length=str(len(stops))) + stops[:4096])
        status, body = answer(s)
        took = time.monotonic() - t0
    assert status == 413 and body["error"]["code"] == "request_too_large" and took < FAST
    assert "limit of 65536 bytes" in body["error"]["message"]
    bounded(mem)


def test_an_endless_chunked_body_is_cut_at_the_limit(url):
    """No Content-Length: the body is read as it comes and refused once over the limit; the client, still
    sending, is cut off. The server reads (and holds) about the limit, not what was sent."""
    chunk = b"%x\r\n%s\r\n" % (16384, b" " * 16384)
    sent = 0
    with peak_memory() as mem, connect(url) as s:
        s.sendall(head("/v1/completions", Transfer_Encoding="chunked") + b"%x\r\n{\r\n" % 1)
        t0 = time.monotonic()
        while not select.select([s], [], [], 0)[0] and time.monotonic() - t0 < 5:
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        status, body = answer(s)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert time.monotonic() - t0 < 2 and sent >= LIMITS.max_body_bytes
    bounded(mem)


@pytest.mark.parametrize("body,status,code,param,needle", [
    ("[" * 50_000, 400, "invalid_json", None, f"nests deeper than {MAX_JSON_DEPTH} levels"),  # the parser's limit
    ('{"a":' * 10_000 + "1" + "}" * 10_000, 400, "invalid_json", None, "nests deeper"),
    ('{"prompt": "w5", "stop": ' + "[" * 20 + "]" * 20 + "}", 400, "invalid_json", None, "nests deeper"),
    (b"\xff\xfe{not json", 400, "invalid_json", None, "not valid JSON"),
    ('{"prompt": "w5", "max_tokens": ' + "9" * 5000 + "}", 400, "invalid_json", None, "not valid JSON"),
    ("", 400, "invalid_json", None, "not valid JSON"),
])
def test_malformed_and_deeply_nested_json_get_400(url, caplog, body, status, code, param, needle):
    with peak_memory() as mem:
        r, took = post(url, body)
    refused(r, status, code, param, needle)
    assert took < FAST and not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    bounded(mem)


# ---------------------------------------------------------------------- fields
HUGE = "9" * 400


@pytest.mark.parametrize("path,field,value,code,needle", [
    ("/v1/completions", "temperature", HUGE, "invalid_parameter", "temperature must be a finite number"),
    ("/v1/completions", "temperature", "1e400", "invalid_parameter", "temperature must be a finite number (got "
     "Infinity)"),
    ("/v1/completions", "temperature", "NaN", "invalid_parameter", "temperature must be a finite number (got NaN)"),
    ("/v1/completions", "top_p", "-Infinity", "invalid_parameter", "top_p must be a finite number"),
    ("/v1/completions", "top_p", HUGE, "invalid_parameter", "top_p must be a finite number"),
    ("/v1/completions", "top_k", HUGE, "invalid_parameter", "top_k must be at most the vocabulary's 97 tokens"),
    ("/v1/completions", "seed", HUGE, "invalid_parameter", "seed must be an integer in [0, 2**64)"),
    ("/v1/completions", "max_tokens", HUGE, "invalid_parameter", "this server generates at most 3500 tokens"),
    ("/v1/completions", "max_tokens", "NaN", "invalid_type", "max_tokens must be an integer (got NaN)"),
    ("/v1/completions", "max_tokens", "3501", "invalid_parameter", "max_tokens is 3501: this server generates at "
     "most 3500 tokens per call"),
    ("/v1/chat/completions", "max_completion_tokens", "3501", "invalid_parameter", "at most 3500"),
    ("/v1/completions", "presence_penalty", "NaN", "unsupported_parameter", "penalties are not supported"),
    ("/v1/completions", "stop", json.dumps(["a", "b", "c", "d", "e"]), "invalid_parameter",
     "stop holds 5 strings: this server takes at most 4"),
    ("/v1/completions", "stop", json.dumps(["w5", "w" * 33]), "invalid_parameter",
     "a stop string has 33 characters: this server takes at most 32"),
    ("/v1/completions", "stop", json.dumps([1]), "invalid_type", "stop must be a string or a list of strings"),
    ("/v1/completions", "x" * 10_000, "1", "unknown_parameter", "unknown field 'xxxx"),
])
def test_huge_non_finite_and_over_limit_values_get_400_naming_the_field(url, path, field, value, code, needle):
    chat = path.endswith("chat/completions")
    start = '{"messages": [{"role": "user", "content": "w5"}]' if chat else '{"prompt": "w5"'
    r, took = post(url, f'{start}, "{field}": {value}}}', path)
    err = refused(r, 400, code, field[:60], needle)
    assert took < FAST and len(err["message"]) < 400  # what is echoed is cut


@pytest.mark.parametrize("path,body,code,param,needle", [
    ("/v1/completions", {"prompt": "w5 w98"}, "invalid_parameter", "prompt", "token id 98"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w97 w5"}]}, "invalid_parameter", "messages",
     "token id 97"),
    ("/v1/completions", {"prompt": [5, 6, 10**30]}, "unsupported_parameter", "prompt", "prompts of token ids"),
    ("/v1/completions", {"prompt": "w5 " * 8000}, "context_length_exceeded", "prompt", "24000 characters"),
    ("/v1/completions", {"prompt": "w5 " * 1200}, "context_length_exceeded", "prompt", "at most 1000"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}] * 1001}, "context_length_exceeded",
     "messages", "1001 messages"),
    ("/v1/completions", {"prompt": "w5 " * 900, "max_tokens": 3500}, "context_length_exceeded", "prompt",
     "context window holds 4096"),
])
def test_out_of_vocabulary_and_over_long_prompts_get_400(url, path, body, code, param, needle):
    with peak_memory() as mem:
        r, took = post(url, body, path)
    refused(r, 400, code, param, needle)
    assert took < FAST
    bounded(mem)


def test_max_tokens_defaults_to_the_limit_not_the_context(url):
    r, _ = post(url, {"prompt": LONG, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == LIMITS.default_max_tokens


# ---------------------------------------------------------------------- the HTTP envelope
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_post_that_is_not_json_gets_415(url, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = httpx.post(f"{url}/v1/completions", content=json.dumps({"prompt": "w5", "max_tokens": 2}), headers=headers)
    refused(r, 415, "unsupported_media_type", None, "Content-Type: application/json")


def test_json_content_types_with_parameters_pass(url):
    r, _ = post(url, {"prompt": "w5", "max_tokens": 2}, headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200


@pytest.mark.parametrize("host,status", [("evil.example", 421), ("evil.example:8000", 421), ("127.0.0.2", 421),
                                         ("localhost.evil.example", 421), (HOST, 200), (f"{HOST.upper()}:443", 200),
                                         ("localhost:1234", 200), ("[::1]:80", 200)])
def test_the_host_header_must_name_this_server(url, host, status):
    """DNS rebinding: a page on evil.example, whose name now resolves to 127.0.0.1, must not read the answers."""
    r, _ = post(url, {"prompt": "w5", "max_tokens": 2}, headers={"Host": host})
    assert r.status_code == status
    if status == 421:
        refused(r, 421, "invalid_host", None, "--allowed-hosts")
        assert httpx.get(f"{url}/metrics", headers={"Host": host}).status_code == 421


# ---------------------------------------------------------------------- deadlines
def test_a_generation_past_its_deadline_ends_with_length(url):
    timeouts = metric(url, "request_timeout_total")
    r, took = post(url, {"prompt": LONG, "max_tokens": 3000, "temperature": 0})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "length"
    assert 0 < r.json()["usage"]["completion_tokens"] < 3000 and took < LIMITS.request_timeout + FAST
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": LONG, "max_tokens": 3000, "temperature": 0,
                                                             "stream": True}, timeout=10) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert metric(url, "request_timeout_total") == timeouts + 2


def test_a_call_that_waits_past_its_deadline_gets_503(url, engine):
    """The engine held (a generation of this process's own): the first call is taken but cannot start, the second
    waits in the queue past its deadline and gets 503; then the first runs one step and ends with length."""
    hold = engine.generate("w5", max_new_tokens=50, method="ar", stream=True, chat=False)
    next(hold)
    got: dict = {}
    first = threading.Thread(target=lambda: got.update(first=post(url, {"prompt": LONG, "max_tokens": 100})[0]))
    first.start()
    while httpx.get(f"{url}/health").json()["running"] == 0:
        time.sleep(0.01)
    try:
        r, took = post(url, {"prompt": "w5", "max_tokens": 2})
        refused(r, 503, "timeout", None, "past its deadline")
        assert int(r.headers["Retry-After"]) >= 1 and took < LIMITS.request_timeout + FAST
    finally:
        hold.close()
        first.join(timeout=10)
    assert got["first"].json()["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------- slow and vanishing clients
def test_a_client_that_stalls_mid_body_gets_408(url):
    with connect(url) as s:
        t0 = time.monotonic()
        s.sendall(head("/v1/completions", Content_Length="1000") + b'{"prompt": "w5')
        status, body = answer(s)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert LIMITS.client_timeout <= time.monotonic() - t0 < LIMITS.client_timeout + FAST


def test_clients_that_stall_in_their_head_or_say_nothing_are_closed(url):
    """Each would otherwise hold one of the max_connections places for ever."""
    with connect(url) as silent, connect(url) as half:
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        assert closed_by_server(silent, LIMITS.client_timeout + FAST) < LIMITS.client_timeout + FAST
        assert closed_by_server(half, FAST) < FAST


def test_a_client_that_leaves_mid_body_or_mid_stream(url, caplog):
    with connect(url) as s:
        s.sendall(head("/v1/completions", Content_Length="1000") + b'{"prompt": "w5')
    served(url)
    cancelled = metric(url, "request_cancelled_total")
    with httpx.stream("POST", f"{url}/v1/completions", timeout=10,
                      json={"prompt": LONG, "max_tokens": 3000, "temperature": 0, "stream": True}) as stream:
        assert next(line for line in stream.iter_lines() if line.startswith("data: ")).startswith('data: {"id"')
    deadline = time.monotonic() + 5
    while metric(url, "request_cancelled_total") < cancelled + 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


def test_a_client_that_stops_reading_its_stream_holds_nothing(url):
    with connect(url) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({"prompt": LONG, "max_tokens": 3000, "temperature": 0, "stream": True}).encode()
        s.sendall(head("/v1/completions", Content_Length=str(len(body))) + body)
        t0 = time.monotonic()
        served(url)  # behind the unread stream, which its deadline ends
        assert time.monotonic() - t0 < LIMITS.request_timeout + FAST


def test_a_stream_no_one_takes_is_dropped_and_its_job_cancelled():
    async def run() -> tuple[float, bool]:
        async def chunks():
            while True:
                yield "data: {}\n\n"

        async def never(message) -> None:  # a client whose window never opens
            await asyncio.sleep(3600)

        async def no_disconnect() -> dict:
            await asyncio.sleep(3600)

        job = Job(None, asyncio.get_running_loop(), time.monotonic() + 60)
        t0 = time.monotonic()
        await JobStream(chunks(), job, send_timeout=0.2)({"type": "http", "asgi": {"spec_version": "2.3"}},
                                                        no_disconnect, never)
        return time.monotonic() - t0, threading.Event.is_set(job.cancel)

    took, cancelled = asyncio.run(run())
    assert 0.2 <= took < 0.2 + FAST and cancelled


def test_connections_over_the_limit_get_503(url):
    idle = [connect(url) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.1)  # accepted
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.text == "Service Unavailable"
    finally:
        for s in idle:
            s.close()
    time.sleep(0.1)
    assert httpx.get(f"{url}/health").status_code == 200


# ---------------------------------------------------------------------- errors
def test_an_internal_error_is_a_generic_500_and_one_log_line(url, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("secret detail /home/someone/model\nline two")

    monkeypatch.setattr("casspec.serve.app.parse_call", broken)
    with caplog.at_level(logging.INFO, logger="casspec.serve.app"):
        r, _ = post(url, {"prompt": "w5"})
    monkeypatch.undo()
    err = refused(r, 500, "internal_error", None, "the server's log has the details")
    assert "secret" not in r.text and "RuntimeError" not in r.text
    lines = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(lines) == 1 and lines[0].exc_info is None and "\n" not in lines[0].getMessage()
    incident = re.search(r"internal error (\w+):", err["message"]).group(1)
    assert "secret detail" in lines[0].getMessage() and f"[{incident}]" in lines[0].getMessage()


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
FIELD = st.sampled_from(sorted({*CHAT_FIELDS, *COMPLETION_FIELDS, "n", "logprobs", "logit_bias", "x"}))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool", 3]),
                                 "content": st.text(max_size=30) | JSON})
BODY = st.dictionaries(FIELD, JSON, max_size=6) | st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=3)}, optional={f: JSON for f in ("max_tokens", "stop", "temperature")})


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODY | JSON, chat=st.booleans())
def test_random_json_bodies_never_get_a_500(url, body, chat):
    r, took = post(url, json.dumps(body), "/v1/chat/completions" if chat else "/v1/completions")
    assert r.status_code in (200, 400, 404), r.text
    assert r.status_code == 200 or set(r.json()["error"]) == {"message", "type", "code", "param"}
    assert took < LIMITS.request_timeout + FAST


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_random_bytes_never_get_a_500(url, raw):
    r, _ = post(url, raw)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "code", "param"}, r.text
