"""Load test of an OpenAI-compatible streaming server (issue 34): concurrent clients, latency, nothing lost.

    python scripts/load_test.py (--url http://127.0.0.1:PORT/v1 | --start casspec|llama-server [--model FILE]
        [--weights native] [--llama-spec] [--threads 2] [--server-args "..."]) [--questions FILE] [--limit N]
        [--per-category N] [--clients 1,2,4,8,16] [--requests-per-client N] [--dealing queue|round-robin]
        [--max-tokens 128] [--temperature 0]
        [--warmup 1] [--check-alone] [--burst] [--queue 16] [--api-key KEY] [--timeout 900] [--out results.json]

The server is one already running (--url, its /v1 address: every level on it, a later one perhaps finding its prompts
in the server's prompt cache) or one this script starts on a free local port and stops, afresh for the alone pass,
each level and the burst: `--start casspec` runs `python -m casspec serve --port P --max-queue QUEUE [--model FILE]
[--weights W]` (no --model: the embedded default model), `--start llama-server` the binary $CASSPEC_LLAMA_SERVER
(else llama-server on PATH; docs/benchmarking.md says how to build it) as `-m FILE --host 127.0.0.1 --port P -t
THREADS -np C_MAX [--spec-default]` (no --model: the embedded GGUF; -np: the most clients of --clients).
--server-args adds to the command line; a flag it names (--port, --max-queue, -t, -np, ...) replaces the script's
own. Ready: GET /health answers 200. Its log goes to a temporary file (named in the JSON).

Every request is a streamed chat completion (the openai package's AsyncOpenAI, no retries) of one question's first
turn, with max_tokens, temperature and stream_options.include_usage. For each concurrency level C, C clients run at
once, each sending its requests one after the other. The requests: every question once per level (one a client,
repeating questions, when there are fewer questions than clients), or --requests-per-client N a client. --dealing
queue (the default, as vLLM's benchmark_serving --max-concurrency): the requests wait in one queue and each client
takes the next as its last one ends, so C are in flight while any wait; round-robin: each client sends a fixed share
dealt in turn (26 questions over 8 clients: two clients send 4, six send 3, and these six stand idle at the end; the
"in flight" column shows it). Measured per request: the time to the first non-empty content delta (TTFT), the
times between content deltas (ITL: a delta may carry several tokens), completion tokens (the usage chunk's, else the
content deltas counted), the total time, the HTTP status and the text. A request is completed when its stream ended
with a finish_reason; answered 429 or 503 when the server said so; else lost (an error status, an exception, a
stream cut short). Reported per level: aggregate tokens/s (completed requests' tokens over the level's wall time),
the requests in flight on average (the requests' seconds summed over the wall time),
the median of per-request tokens/s, TTFT and ITL p50 / p99 (linear interpolation), TPOT p50 (time per output token
after the first: (total - TTFT) / (tokens - 1), comparable where a server sends several tokens a delta, as a
speculating one may), tokens per delta, lost, 429s and 503s, and with --check-alone the completed requests whose
text differs from the same question sent alone (all questions one by one, before the levels: with greedy decoding
every text must equal it). --burst then sends 2 x --queue requests at once and counts 200 / 429 / 503 / lost (429 is
allowed, lost is not). --warmup requests (the first question) go before anything is measured.

Prints the CPU (lscpu's Model name), the command lines and one markdown table; --out writes everything, each
request included, as JSON. Exit status: 0, 1 when a request was lost, 2 on bad input (one error line).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Coroutine, Iterable, Iterator, NoReturn, Sequence

import httpx
import openai
from openai import AsyncOpenAI

from casspec.calibrate.questions import read_questions
from casspec.tools.lcppserver import free_port, server_binary
from dsia.errors import CasspecError
from dytc.machine import cpu_model

DEFAULT_QUESTIONS = "../shared/specbench/dev.jsonl"  # the Spec-Bench dev questions beside the checkout
START_TIMEOUT_S = 600.0  # a started server's time to load the model (and measure it on first use) and answer /health
STOP_TIMEOUT_S = 30.0  # a started server's time to shut down after SIGTERM before it is killed
POLL_S = 0.2  # between /health polls while a started server loads
ANSWERED = (429, 503)  # statuses that are the server's answer to load (counted apart, not lost)
ALIASES = {"-t": ("-t", "--threads"), "-np": ("-np", "--parallel")}
# the other spellings of a flag the script sets: one given in --server-args replaces the script's


class BadInput(Exception):
    """Bad input: one error line, exit 2."""


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage) and exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"load_test: error: {message}", file=sys.stderr)
        sys.exit(2)


@dataclass
class Settings:
    """What every request of a run asks and how the clients wait."""

    max_tokens: int
    temperature: float
    api_key: str
    timeout: float


@dataclass
class Outcome:
    """One request: what it asked (question index, client) and what came back."""

    question: int
    client: int
    status: int | None = None  # the HTTP status (None: no answer)
    ttft_s: float | None = None  # to the first non-empty content delta
    itl_s: list[float] = field(default_factory=list)  # between content deltas
    deltas: int = 0  # non-empty content deltas
    tokens: int = 0  # completion tokens
    tokens_from: str = "deltas"  # "usage": the server's usage chunk counted them; "deltas": content deltas counted
    seconds: float = 0.0  # from the call to the stream's end
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.finish_reason is not None and self.error is None

    @property
    def lost(self) -> bool:
        return not self.completed and self.status not in ANSWERED


# ---------------------------------------------------------------------- arguments
def parse_clients(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: integers >= 1, or BadInput."""
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise BadInput(f"--clients must be comma-separated integers >= 1, e.g. 1,2,4 (got {text!r})")
    return levels


def parser() -> Parser:
    p = Parser(description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="an already running server's /v1 address, e.g. http://127.0.0.1:8000/v1")
    where.add_argument("--start", choices=("casspec", "llama-server"), help="start this server and stop it after")
    p.add_argument("--model", default=None, help="the started server's model file (default: the embedded model)")
    p.add_argument("--weights", choices=("float", "native"), default=None, help="casspec serve --weights")
    p.add_argument("--llama-spec", action="store_true", help="llama-server --spec-default (its n-gram speculation)")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--server-args", default="", help="more arguments for the started server, one string")
    p.add_argument("--questions", default=DEFAULT_QUESTIONS, help="Spec-Bench-format JSONL file")
    p.add_argument("--limit", type=int, default=None, help="the first N questions")
    p.add_argument("--per-category", type=int, default=None, help="the first N questions of each category")
    p.add_argument("--clients", default="1,2,4,8,16", help="concurrency levels, comma-separated")
    p.add_argument("--requests-per-client", type=int, default=None,
                   help="requests each client sends (queue: clients x N in all; default: each question once)")
    p.add_argument("--dealing", choices=("queue", "round-robin"), default="queue",
                   help="queue: each client takes the next question as its last request ends (default); "
                        "round-robin: each client its fixed share, dealt in turn")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before anything is measured")
    p.add_argument("--check-alone", action="store_true",
                   help="send every question alone first; count the texts under load that differ")
    p.add_argument("--burst", action="store_true", help="after the levels, send 2 x --queue requests at once")
    p.add_argument("--queue", type=int, default=16, help="the server's queue (casspec serve --max-queue when started)")
    p.add_argument("--api-key", default=os.environ.get("CASSPEC_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    return p


def check(args: argparse.Namespace) -> None:
    """The arguments argparse cannot check, or BadInput."""
    for flag in ("max_tokens", "queue", "threads", "limit", "per_category", "requests_per_client"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise BadInput(f"--{flag.replace('_', '-')} must be >= 1 (got {value})")
    if args.warmup < 0:
        raise BadInput(f"--warmup must be >= 0 (got {args.warmup})")
    if not args.temperature >= 0 or not math.isfinite(args.temperature):
        raise BadInput(f"--temperature must be a number >= 0 (got {args.temperature})")
    if not args.timeout > 0 or not math.isfinite(args.timeout):
        raise BadInput(f"--timeout must be a number of seconds > 0 (got {args.timeout})")
    if args.url is not None and not args.url.startswith(("http://", "https://")):
        raise BadInput(f"--url must be an http:// or https:// address ending in /v1 (got {args.url!r})")
    if args.url is not None and (args.model or args.weights or args.llama_spec or args.server_args):
        raise BadInput("--model, --weights, --llama-spec and --server-args are for a server --start starts")
    if args.start == "llama-server" and args.weights:
        raise BadInput("--weights is casspec serve's: llama-server runs the file as stored")
    if args.start == "casspec" and args.llama_spec:
        raise BadInput("--llama-spec is llama-server's: casspec serve speculates by default")
    if args.model is not None and not Path(args.model).exists():
        raise BadInput(f"--model {args.model} does not exist")
    if args.out is not None and not Path(args.out).resolve().parent.is_dir():
        raise BadInput(f"--out's folder does not exist: {Path(args.out).resolve().parent}")
    args.levels = parse_clients(args.clients)
    try:
        shlex.split(args.server_args)
    except ValueError as e:
        raise BadInput(f"--server-args is not a command line ({e})") from None


# ---------------------------------------------------------------------- the workload
def assignment(questions: int, clients: int, per_client: int | None) -> list[list[int]]:
    """The question indices each client sends, in order: round-robin over the clients (each question once), or each
    client one when there are fewer questions than clients, or per_client each, continuing round-robin."""
    if per_client is None:
        if questions >= clients:
            return [list(range(c, questions, clients)) for c in range(clients)]
        per_client = 1
    return [[(c + k * clients) % questions for k in range(per_client)] for c in range(clients)]


def workload(questions: int, clients: int, per_client: int | None) -> list[int]:
    """The question indices a level sends through its shared queue, in order: the same requests `assignment` deals
    (each question once; one a client when there are fewer questions than clients; per_client a client)."""
    count = max(questions, clients) if per_client is None else clients * per_client
    return [i % questions for i in range(count)]


def client(url: str, settings: Settings) -> AsyncOpenAI:
    """An async OpenAI client without retries (a 429 must be seen), a fresh connection per request: a kept-alive one
    the server closed between two requests failed the next one before it was sent (llama-server, one client: 4 of 13
    requests "lost" in 2 ms), which is the client's artefact, not the server's answer."""
    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=settings.timeout)
    return AsyncOpenAI(base_url=url, api_key=settings.api_key or "none", max_retries=0, timeout=settings.timeout,
                       http_client=http)


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


async def send(api: AsyncOpenAI, model: str, prompt: str, settings: Settings, question: int, cid: int) -> Outcome:
    """One streamed chat completion, timed (see the module docstring)."""
    out = Outcome(question, cid)
    pieces: list[str] = []
    t0 = time.perf_counter()
    last: float | None = None
    try:
        stream = await api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=settings.max_tokens,
            temperature=settings.temperature, stream=True, stream_options={"include_usage": True})
        out.status = 200
        async for chunk in stream:
            if chunk.usage is not None and chunk.usage.completion_tokens is not None:
                out.tokens, out.tokens_from = chunk.usage.completion_tokens, "usage"
            for choice in chunk.choices:
                if choice.delta is not None and choice.delta.content:
                    now = time.perf_counter()
                    if last is None:
                        out.ttft_s = now - t0
                    else:
                        out.itl_s.append(now - last)
                    last = now
                    pieces.append(choice.delta.content)
                if choice.finish_reason:
                    out.finish_reason = choice.finish_reason
    except openai.APIStatusError as e:
        out.status, out.error = e.status_code, one_line(e)
    except Exception as e:  # (a connection error, a cut stream, an error event, a malformed chunk: lost)
        out.error = one_line(e)
    out.seconds = time.perf_counter() - t0
    out.text = "".join(pieces)
    out.deltas = len(pieces)
    if out.tokens_from == "deltas":
        out.tokens = out.deltas
    return out


def tpot(o: Outcome) -> float | None:
    """Time per output token after the first: (total - TTFT) / (tokens - 1); None with fewer than 2 tokens."""
    return None if o.ttft_s is None or o.tokens < 2 else (o.seconds - o.ttft_s) / (o.tokens - 1)


async def run_clients(url: str, model: str, prompts: list[str], plan: Sequence[Iterable[int]],
                      settings: Settings) -> tuple[float, list[Outcome]]:
    """The clients of `plan` at once, each sending its questions one after the other (clients given one iterator
    share it: each takes the next question as its last request ends): (wall seconds, outcomes)."""
    async with client(url, settings) as api:
        async def one_client(cid: int, questions: Iterable[int]) -> list[Outcome]:
            return [await send(api, model, prompts[q], settings, q, cid) for q in questions]

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one_client(cid, qs) for cid, qs in enumerate(plan)))
        return time.perf_counter() - t0, [o for outs in done for o in outs]


# ---------------------------------------------------------------------- statistics
def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), interpolated linearly between the closest ranks; None without values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(clients: int, wall: float, outs: list[Outcome], alone: dict[int, str] | None) -> dict:
    """One level's row (module docstring), each request's outcome with it."""
    done = [o for o in outs if o.completed]
    tokens = sum(o.tokens for o in done)
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    itl = [t for o in done for t in o.itl_s]
    per_token = [t for o in done if (t := tpot(o)) is not None]
    deltas = sum(o.deltas for o in done)
    rates = sorted(o.tokens / o.seconds for o in done if o.seconds > 0)
    differ = None if alone is None else sum(1 for o in done if o.question in alone and o.text != alone[o.question])
    return {"clients": clients, "requests": len(outs), "completed": len(done), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "in_flight_mean": sum(o.seconds for o in outs) / wall if wall > 0 else 0.0,
            "request_tokens_per_s_median": percentile(rates, 50),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "tpot_p50_s": percentile(per_token, 50), "tpot_p99_s": percentile(per_token, 99),
            "tokens_per_delta": tokens / deltas if deltas else None,
            "lost": sum(o.lost for o in outs), "http_429": sum(o.status == 429 for o in outs),
            "http_503": sum(o.status == 503 for o in outs), "differ_from_alone": differ,
            "tokens_from_usage": all(o.tokens_from == "usage" for o in done),
            "outcomes": [{**asdict(o), "completed": o.completed, "lost": o.lost} for o in outs]}


def burst_counts(outs: list[Outcome]) -> dict:
    """A burst's answers: completed (200), 429, 503, lost, each request's outcome."""
    return {"requests": len(outs), "completed_200": sum(o.completed for o in outs),
            "http_429": sum(o.status == 429 for o in outs), "http_503": sum(o.status == 503 for o in outs),
            "lost": sum(o.lost for o in outs),
            "outcomes": [{**asdict(o), "completed": o.completed, "lost": o.lost} for o in outs]}


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(levels: list[dict]) -> str:
    """The levels as a markdown table."""
    lines = ["| clients | requests | tokens | tok/s | in flight | req tok/s p50 | TTFT p50 ms | TTFT p99 ms | "
             "ITL p50 ms | ITL p99 ms | TPOT p50 ms | tok/delta | lost | 429 | 503 | != alone |", "|" + "---|" * 16]
    for r in levels:
        differ = "-" if r["differ_from_alone"] is None else str(r["differ_from_alone"])
        cells = [r["clients"], r["requests"], r["tokens"], num(r["tokens_per_s"]), num(r["in_flight_mean"]),
                 num(r["request_tokens_per_s_median"]), ms(r["ttft_p50_s"]), ms(r["ttft_p99_s"]), ms(r["itl_p50_s"]),
                 ms(r["itl_p99_s"]), ms(r["tpot_p50_s"]), num(r["tokens_per_delta"]), r["lost"], r["http_429"],
                 r["http_503"], differ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- one run
async def warm(url: str, model: str, prompts: list[str], settings: Settings, warmup: int) -> None:
    """--warmup requests (the first question), unmeasured."""
    if warmup:
        await run_clients(url, model, prompts, [[0] * warmup], settings)


async def run_level(url: str, model: str, prompts: list[str], clients: int, settings: Settings,
                    per_client: int | None, dealing: str, warmup: int, alone: dict[int, str] | None) -> dict:
    """One concurrency level (after the warm-up): its row."""
    await warm(url, model, prompts, settings, warmup)
    if dealing == "queue":  # (one iterator shared by every client; one event loop: next() is never interleaved)
        plan: Sequence[Iterable[int]] = [iter(workload(len(prompts), clients, per_client))] * clients
    else:
        plan = assignment(len(prompts), clients, per_client)
    wall, outs = await run_clients(url, model, prompts, plan, settings)
    row = summarize(clients, wall, outs, alone)
    print(f"{clients} clients: {row['tokens_per_s']:.1f} tok/s, lost {row['lost']}, 429 {row['http_429']}, "
          f"503 {row['http_503']}", file=sys.stderr)
    return row


async def run_alone(url: str, model: str, prompts: list[str], settings: Settings, warmup: int) -> dict:
    """Every question alone, one after the other (after the warm-up): the row, its texts compared with later."""
    await warm(url, model, prompts, settings, warmup)
    wall, outs = await run_clients(url, model, prompts, [list(range(len(prompts)))], settings)
    return summarize(1, wall, outs, None)


async def run_burst(url: str, model: str, prompts: list[str], settings: Settings, warmup: int, size: int) -> dict:
    """`size` requests at once (after the warm-up): what came back."""
    await warm(url, model, prompts, settings, warmup)
    _, outs = await run_clients(url, model, prompts, [[i % len(prompts)] for i in range(size)], settings)
    return burst_counts(outs)


# ---------------------------------------------------------------------- the server
def named(flag: str, extra: list[str]) -> bool:
    """Whether --server-args names the flag (or another spelling of it), as FLAG or FLAG=VALUE."""
    return any(a == f or a.startswith(f + "=") for f in ALIASES.get(flag, (flag,)) for a in extra)


def with_defaults(defaults: list[tuple[str, str]], extra: list[str]) -> list[str]:
    """(flag, value) pairs the script sets, less those --server-args names, then --server-args."""
    return [x for flag, value in defaults if not named(flag, extra) for x in (flag, value)] + extra


def llama_binary() -> str:
    """$CASSPEC_LLAMA_SERVER, else llama-server on PATH (one error saying how to build it if neither)."""
    return server_binary()


def server_argv(args: argparse.Namespace, levels: list[int], port: int) -> list[str]:
    """The command line of the server --start names."""
    extra = shlex.split(args.server_args)
    if args.start == "casspec":
        head = [sys.executable, "-m", "casspec", "serve"]
        if args.model:
            head += ["--model", args.model]
        if args.weights:
            head += ["--weights", args.weights]
        return head + with_defaults([("--host", "127.0.0.1"), ("--port", str(port)), ("--max-queue", str(args.queue))],
                                    extra)
    from casspec.loading.checkpoints import embedded_gguf  # (only here: it finds the embedded model's package)

    model = args.model or str(embedded_gguf())
    head = [llama_binary(), "-m", model] + (["--spec-default"] if args.llama_spec else [])
    return head + with_defaults([("--host", "127.0.0.1"), ("--port", str(port)), ("-t", str(args.threads)),
                                 ("-np", str(max(levels)))], extra)


def port_of(argv: list[str], default: int) -> int:
    """The port a server command line names (--server-args may have set it)."""
    for i, a in enumerate(argv):
        if a == "--port" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--port="):
            return int(a.split("=", 1)[1])
    return default


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "no message"


def wait_ready(root: str, proc: subprocess.Popen, log: Path) -> None:
    """Poll GET root/health until it answers 200; one error if the server exits or takes too long."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise CasspecError(f"the server exited ({proc.returncode}) before it answered: {last_line(log)} "
                               f"(log: {log})")
        try:
            if httpx.get(f"{root}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise CasspecError(f"the server did not answer {root}/health within {START_TIMEOUT_S:.0f} s (log: {log})")
        time.sleep(POLL_S)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def started(args: argparse.Namespace, levels: list[int]) -> Iterator[tuple[str, list[str], str | None]]:
    """(the /v1 address, the server's command line, its log file): --url's, or a server started and stopped."""
    if args.url is not None:
        yield args.url.rstrip("/"), [], None
        return
    argv = server_argv(args, levels, free_port())
    port = port_of(argv, 0)
    log = Path(tempfile.mkstemp(prefix=f"load_test-{args.start}-", suffix=".log")[1])
    print(f"starting: {shlex.join(argv)} (log: {log})", file=sys.stderr)
    with open(log, "w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, log)
        yield f"http://127.0.0.1:{port}/v1", argv, str(log)
    finally:
        stop(proc)


def model_name(url: str, api_key: str | None) -> str:
    """The first model /v1/models lists (one error if the server does not answer)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url}/models", headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise CasspecError(f"{url}/models did not list a model ({one_line(e)}): is the server at --url running?") \
            from None


def cpu_name() -> str:
    """lscpu's Model name (else /proc/cpuinfo's)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, env={**os.environ, "LC_ALL": "C"})
        for line in out.stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return cpu_model()


# ---------------------------------------------------------------------- main
def load_test(args: argparse.Namespace) -> dict:
    """The whole run on checked arguments: the report (printed by main). With --start, the alone pass, each level and
    the burst each run on a server of their own, started afresh: on one server, a level after another would find its
    prompts in the server's prompt (prefix) cache and skip their prefill (casspec 8 clients, native: 435 tok/s after
    the 1-client level against 280-350 on a fresh server, AMD EPYC)."""
    levels = args.levels
    questions = read_questions(args.questions, limit=args.limit, per_category=args.per_category)
    prompts = [q.turns[0] for q in questions]
    settings = Settings(args.max_tokens, args.temperature, args.api_key, args.timeout)
    servers: list[dict] = []

    def on_server(run: Callable[[str, str], Coroutine[Any, Any, dict]]) -> dict:
        """run(url, model) on a freshly started server (--start), or on --url's."""
        with started(args, levels) as (url, argv, log):
            model = model_name(url, args.api_key)
            servers.append({"url": url, "start": args.start, "argv": argv, "log": log, "model": model})
            return asyncio.run(run(url, model))

    report: dict = {"alone": None, "levels": [], "burst": None}
    if args.check_alone:
        report["alone"] = on_server(lambda url, model: run_alone(url, model, prompts, settings, args.warmup))
    alone = None if report["alone"] is None else \
        {o["question"]: o["text"] for o in report["alone"]["outcomes"] if o["completed"]}
    for c in levels:
        report["levels"].append(on_server(lambda url, model: run_level(
            url, model, prompts, c, settings, args.requests_per_client, args.dealing, args.warmup, alone)))
    if args.burst:
        report["burst"] = on_server(lambda url, model: run_burst(url, model, prompts, settings, args.warmup,
                                                                 2 * args.queue))
    report.update({"cpu": cpu_name(), "cores": os.cpu_count(), "command": shlex.join([sys.argv[0], *args.argv]),
                   "server": servers[0], "servers_started": len(servers) if args.start else 0,
                   "questions": [{"question_id": q.question_id, "category": q.category} for q in questions],
                   "settings": {k: v for k, v in vars(args).items() if k not in ("api_key", "argv", "levels")}})
    return report


def render(report: dict) -> str:
    """The header lines and the table, then the burst's line."""
    s = report["server"]
    fresh = f"; a fresh one for each of {report['servers_started']} runs" if report["servers_started"] > 1 else ""
    server = shlex.join(s["argv"]) + fresh if s["argv"] else f"already running at {s['url']}"
    cfg = report["settings"]
    lines = [f"CPU: {report['cpu']}, {report['cores']} cores", f"load test: {report['command']}",
             f"server: {server} (model {s['model']})",
             f"{len(report['questions'])} questions, max_tokens {cfg['max_tokens']}, temperature {cfg['temperature']}"
             f"{', != alone: texts unlike the same question sent alone' if cfg['check_alone'] else ''}", "",
             table(report["levels"])]
    b = report["burst"]
    if b:
        lines += ["", f"burst: {b['requests']} requests at once: {b['completed_200']} x 200, {b['http_429']} x 429, "
                      f"{b['http_503']} x 503, {b['lost']} lost"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    args.argv = list(argv)
    try:
        check(args)
        report = load_test(args)
    except (BadInput, CasspecError) as e:
        print(f"load_test: error: {e}", file=sys.stderr)
        return 2
    print(render(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    lost = sum(r["lost"] for r in report["levels"]) + (report["burst"] or {}).get("lost", 0) \
        + (report["alone"] or {}).get("lost", 0)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
