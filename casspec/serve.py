"""`casspec serve`: an OpenAI-compatible HTTP server over one Engine (Starlette + uvicorn: `casspec[serve]`).

Endpoints: GET /health, GET /metrics (Prometheus text), GET /v1/models, POST /v1/completions and
POST /v1/chat/completions, blocking or streamed as server-sent events.

Scheduling: a handler checks a call (the CLI's checks and messages), templates and tokenizes its prompt, and puts
it in a bounded FIFO queue (full: 429 with Retry-After). One worker thread takes the calls in arrival order and
runs each to its end on the engine, one at a time: several requests are not batched into one forward (yet).
A client that disconnects cancels its call: a waiting one is dropped, a running one stops after the engine step
that is running (the cancel event of `Engine.stream_ids`).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import queue
import socket
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dsia.errors import CasspecError
from dytc.sources import DEFAULT_BOTTOM

from .calls import ApiError, Call, parse_call
from .engine import Engine
from .metrics import CONTENT_TYPE, Metrics
from .request import Request
from .stats import Result, Stats

log = logging.getLogger("casspec.serve")

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}  # engine -> OpenAI


@dataclass(frozen=True)
class ServeConfig:
    model_name: str | None = None  # the name clients pass as "model" (None: the checkpoint's name)
    method: str = "dytc"  # decoding method of every call
    level: str = "int4"  # draft level of sd / tree
    levels: tuple[str, ...] = ()  # sources of the multi-level methods (empty: the method's defaults)
    bottom: str = DEFAULT_BOTTOM  # statistical lookups beneath the levels
    max_queue: int = 32  # calls that may wait behind the running one; one more gets 429
    api_key: str | None = None  # when set, /v1/* need the header "Authorization: Bearer <key>"

    def __post_init__(self) -> None:
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise CasspecError(f"max_queue must be an integer >= 1 (got {self.max_queue!r})")
        if self.api_key is not None and not self.api_key.strip():
            raise CasspecError("the API key is empty: pass a non-empty --api-key, or none to serve without one")
        self.template  # a bad method, level or source list is refused here, before any work

    @property
    def template(self) -> Request:
        """The Request every call starts from (method and sources); a call sets its tokens, sampling, stops, seed."""
        return Request(method=self.method, level=self.level, levels=self.levels, bottom=self.bottom)


# ---------------------------------------------------------------------- the queue and the engine's worker
@dataclass
class Job:
    """A call on its way through the queue. The worker reports to the handler's event loop through `events`:
    ("piece", text)... (streaming calls only), then ("done", Result) or ("error", ApiError)."""
    call: Call
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)  # set: its client went away
    arrived: float = field(default_factory=time.perf_counter)

    def send(self, kind: str, payload: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed (shutting down): no one is listening
            self.cancel.set()


class Scheduler:
    """A bounded FIFO queue of jobs and the one worker thread that runs them on the engine, one at a time."""

    def __init__(self, engine: Engine, max_queue: int, metrics: Metrics) -> None:
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue()  # bounded by submit (None, the stop mark, is not)
        self._submit = threading.Lock()  # makes submit's check-then-put atomic
        self.running: Job | None = None
        self.thread = threading.Thread(target=self._work, name="casspec-engine", daemon=True)

    @property
    def waiting(self) -> int:
        return self.jobs.qsize()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Cancel the running job, turn the waiting ones away, and end the worker."""
        if (job := self.running) is not None:
            job.cancel.set()
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.send("error", ApiError(503, "the server is shutting down", "shutting_down"))
        self.jobs.put(None)
        self.thread.join(timeout=60)

    def submit(self, job: Job) -> None:
        with self._submit:
            if self.jobs.qsize() >= self.max_queue:
                self.metrics.add_queue_full()
                raise ApiError(429, f"the queue is full ({self.max_queue} requests wait for the engine): retry later",
                               "queue_full", headers={"Retry-After": str(self.retry_after())})
            self.jobs.put(job)

    def retry_after(self) -> int:
        """Seconds until a place in the queue is likely free: a generation's mean time so far (at least 1)."""
        return max(1, math.ceil(self.metrics.mean_generation_seconds()))

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancel.is_set():  # its client went away while it waited
                continue
            self.running = job
            try:
                self._run(job)
            finally:
                self.running = None

    def _run(self, job: Job) -> None:
        started = time.perf_counter()
        try:
            for piece in self.engine.stream_ids(job.call.prompt_ids, job.call.request, job.cancel):
                if job.call.stream:
                    job.send("piece", piece)
            result = self.engine.last_result
        except Exception as e:  # the call was checked: the server's set-up, a bug or the device. Report, keep serving
            if not isinstance(e, CasspecError):
                log.exception("generation failed")
            self.metrics.add_failed()
            job.send("error", ApiError(500, f"the generation failed ({type(e).__name__}: {e})", "internal_error"))
            return
        self.metrics.add_generation(result.stats, FINISH_REASONS.get(result.stats.finish_reason),
                                    started - job.arrived + result.stats.first_token_seconds)
        job.send("done", result)


# ---------------------------------------------------------------------- responses
def usage(stats: Stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


def _choice(chat: bool, text: str | None, finish: str | None, delta: bool) -> dict:
    """One choice of a response (delta: of a stream chunk); text None: the last chunk's empty delta."""
    if not chat:
        body: dict = {"text": text or ""}
    elif delta:
        body = {"delta": {} if text is None else {"content": text}}
    else:
        body = {"message": {"role": "assistant", "content": text}}
    return {"index": 0, **body, "logprobs": None, "finish_reason": finish}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class JobStream(StreamingResponse):
    """A job's server-sent events. However the response ends (the job done, or the client gone) the job is
    cancelled: a client that disconnects stops its generation at the next step."""

    def __init__(self, chunks: AsyncIterator[str], job: Job) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel.set()


async def _disconnected(request: HttpRequest) -> None:
    """Return once the client has gone (the body was read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Api:
    """The endpoints over one engine."""

    def __init__(self, engine: Engine, cfg: ServeConfig) -> None:
        self.engine, self.cfg = engine, cfg
        self.name = cfg.model_name or engine.name
        self.template = cfg.template
        self.metrics = Metrics()
        self.scheduler = Scheduler(engine, cfg.max_queue, self.metrics)
        self.created = int(time.time())

    def app(self) -> Starlette:
        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            self.scheduler.start()
            yield
            await asyncio.to_thread(self.scheduler.stop)

        routes = [Route("/health", self.health), Route("/metrics", self.prometheus),
                  Route("/v1/models", self.models), Route("/v1/models/{model:path}", self.model),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"])]
        return Starlette(routes=routes, lifespan=lifespan,
                         exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _crash})

    # ------------------------------------------------------------------ endpoints
    async def health(self, request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", "model": self.name, "waiting": self.scheduler.waiting,
                             "running": int(self.scheduler.running is not None)})

    async def prometheus(self, request: HttpRequest) -> Response:
        text = self.metrics.render(self.scheduler.waiting, int(self.scheduler.running is not None))
        return Response(text, media_type=CONTENT_TYPE)

    async def models(self, request: HttpRequest) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HttpRequest) -> Response:
        self._authorize(request)
        if request.path_params["model"] != self.name:
            raise ApiError(404, f"the model {request.path_params['model']!r} does not exist: this server serves "
                           f"{self.name!r}", "model_not_found", "model")
        return JSONResponse(self._model_card())

    async def completions(self, request: HttpRequest) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: HttpRequest) -> Response:
        return await self._complete(request, chat=True)

    # ------------------------------------------------------------------ helpers
    def _model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "casspec"}

    def _authorize(self, request: HttpRequest) -> None:
        if self.cfg.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'", "invalid_api_key")
        if not hmac.compare_digest(key.strip().encode(), self.cfg.api_key.encode()):
            raise ApiError(401, "wrong API key", "invalid_api_key")

    async def _complete(self, request: HttpRequest, chat: bool) -> Response:
        self._authorize(request)
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON", "invalid_json") from None
        call = await run_in_threadpool(parse_call, body, chat, self.engine, self.template, self.name)
        job = Job(call, asyncio.get_running_loop())
        self.scheduler.submit(job)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.name}
        if call.stream:
            head["object"] = "chat.completion.chunk" if chat else "text_completion"
            return JobStream(self._chunks(job, chat, head), job)
        head["object"] = "chat.completion" if chat else "text_completion"
        return await self._answer(request, job, chat, head)

    async def _answer(self, request: HttpRequest, job: Job, chat: bool, head: dict) -> Response:
        """A blocking call's response; a client that goes away while it waits cancels its job."""
        gone = asyncio.ensure_future(_disconnected(request))
        event = asyncio.ensure_future(job.events.get())
        try:
            await asyncio.wait({gone, event}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                return Response(status_code=499)  # no one reads it
            kind, payload = event.result()
            if kind == "error":
                raise payload
            result: Result = payload
            finish = FINISH_REASONS.get(result.stats.finish_reason)
            return JSONResponse({**head, "choices": [_choice(chat, result.text, finish, delta=False)],
                                 "usage": usage(result.stats), "casspec": result.stats.speculative()})
        finally:
            gone.cancel()
            event.cancel()
            job.cancel.set()

    async def _chunks(self, job: Job, chat: bool, head: dict) -> AsyncIterator[str]:
        """The stream: (chat: the role first) a chunk per text piece, then the finish_reason with the `casspec`
        statistics, then (stream_options.include_usage) a chunk with the usage, then [DONE]."""
        if job.call.include_usage:
            head = {**head, "usage": None}
        if chat:
            yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        while True:
            kind, payload = await job.events.get()
            if kind == "piece":
                yield _sse({**head, "choices": [_choice(chat, payload, None, delta=True)]})
                continue
            if kind == "error":
                yield _sse(payload.body())
            else:
                stats = payload.stats
                finish = FINISH_REASONS.get(stats.finish_reason)
                yield _sse({**head, "choices": [_choice(chat, None, finish, delta=True)],
                            "casspec": stats.speculative()})
                if job.call.include_usage:
                    yield _sse({**head, "choices": [], "usage": usage(stats)})
            break
        yield "data: [DONE]\n\n"


async def _api_error(request: HttpRequest, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: HttpRequest, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    return ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                    codes.get(exc.status_code, "http_error")).response()


async def _crash(request: HttpRequest, exc: Exception) -> Response:
    log.error("request failed", exc_info=exc)
    return ApiError(500, f"internal error ({type(exc).__name__}: {exc})", "internal_error").response()


# ---------------------------------------------------------------------- running it
def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: a free port), made before the model loads: a taken port is one clear
    error and not a stack trace after a long load."""
    if not 0 <= port <= 65535:
        raise CasspecError(f"--port must be in 0..65535 (got {port})")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise CasspecError(f"cannot listen on {host}:{port} ({e.strerror or e}): pick another --host or --port") \
            from None
    return sock


def server(engine: Engine, cfg: ServeConfig, log_level: str = "info") -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(Api(engine, cfg).app(), log_level=log_level, timeout_graceful_shutdown=5))


def serve(engine: Engine, cfg: ServeConfig, sock: socket.socket) -> None:
    """Serve until interrupted (Ctrl+C: uvicorn shuts down gracefully, the running generation is cancelled and
    waiting calls get 503)."""
    host, port = sock.getsockname()[:2]
    print(f"casspec: serving {cfg.model_name or engine.name} (method {cfg.method}) at http://{host}:{port}/v1 "
          f"(queue {cfg.max_queue}{', API key required' if cfg.api_key else ''})", file=sys.stderr, flush=True)
    try:
        server(engine, cfg).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl+C it shut down for
        pass
    print("casspec: stopped", file=sys.stderr)


@contextmanager
def background(engine: Engine, cfg: ServeConfig, log_level: str = "warning") -> Iterator[str]:
    """A real server on 127.0.0.1 and a free port, in a thread of this process (tests, scripts/serve_bench.py);
    yields its base URL and stops it after."""
    sock = bind("127.0.0.1", 0)
    srv = server(engine, cfg, log_level)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, name="casspec-serve", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
        sock.close()
