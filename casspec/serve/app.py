"""`casspec serve`: an OpenAI-compatible HTTP server over one Engine (Starlette + uvicorn: `casspec[serve]`).

Endpoints: GET /health, GET /metrics (Prometheus text), GET /v1/models, POST /v1/completions and
POST /v1/chat/completions, blocking or streamed as server-sent events.

Scheduling: a handler checks a call (the CLI's checks and messages), templates and tokenizes its prompt in a thread
of the event loop's pool, and puts it in a bounded FIFO queue (full: 429 with Retry-After). One worker (`serve`: the
main thread, HTTP on another; `background`: a thread) takes the calls in arrival order and runs each to its end on
the engine, one at a time (`scheduler.py`): several requests are not batched into one forward (yet). A client that
disconnects cancels its call: a waiting one is dropped, a running one stops after the engine step that is running
(the cancel event of `Engine.stream_ids`).

Bounds: a call is measured against `calls.Limits` before any work (body, prompt, stops, max_tokens); it has a
deadline (`request_timeout`); a client may stall `client_timeout` seconds at most (a request's head or body, or a
stream it does not read); connections are capped (uvicorn's limit_concurrency); the Host header must name this
server (against DNS rebinding) and a POST must be application/json. An unexpected error is a 500 with a generic
message and one log line; the server keeps serving.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import signal
import socket
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import AsyncIterator, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from dsia.errors import CasspecError

from ..runtime.defaults import BOTTOM, LEVEL, METHOD
from .calls import ApiError, Call, Limits, check_positive, parse_call, read_json
from ..runtime.engine import Engine
from ..runtime.prefixes import check_megabytes
from .guard import ANY_HOST, LOCAL_HOSTS, Guard, HeadTimeoutProtocol, check_json, hostname, read_body
from .metrics import CONTENT_TYPE, Metrics
from ..runtime.request import Request
from .scheduler import Job, Scheduler
from ..runtime.stats import Stats

log = logging.getLogger("casspec.serve.app")


@dataclass(frozen=True)
class ServeConfig:
    model_name: str | None = None  # the name clients pass as "model" (None: the checkpoint's name)
    method: str = METHOD  # decoding method of every call
    level: str = LEVEL  # draft level of sd / tree
    levels: tuple[str, ...] = ()  # sources of the multi-level methods (empty: the method's defaults)
    bottom: str = BOTTOM  # statistical lookups beneath the levels
    max_queue: int = 32  # calls that may wait while max_batch run; one more gets 429
    max_batch: int = 8  # calls generating at once (continuous batching; each its own KV cache, made on first use)
    prefix_cache_mb: int = 1024  # finished calls' KV kept per client for prompts that start with it (0: none)
    prefill_chunk: int = 128  # prompt tokens a step of a call joining others runs in their forward (0: all at once,
    # the others waiting; docs/serving.md: 128 against 64 and 0, inter-token and first-token p99 at 8 clients)
    api_key: str | None = None  # when set, /v1/* need the header "Authorization: Bearer <key>"
    limits: Limits = Limits()  # what one call and its client may cost: body, prompt, stops, max_tokens, deadline,
    # stalls, connections (calls.Limits)
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides LOCAL_HOSTS and the bound address ("*": any)

    def __post_init__(self) -> None:
        check_positive("max_queue", self.max_queue)
        check_positive("max_batch", self.max_batch)
        check_positive("prefill_chunk", self.prefill_chunk, least=0)
        check_megabytes(self.prefix_cache_mb)
        for host in self.allowed_hosts:
            if not host or any(c.isspace() or c in "/@?#" for c in host):
                raise CasspecError(f"allowed host {host!r} is not a host name: give names like example.com or "
                                   f"10.0.0.5, or {ANY_HOST!r} for any")
        if self.api_key is not None and not self.api_key.strip():
            raise CasspecError("the API key is empty: pass a non-empty --api-key, or none to serve without one")
        self.template  # a bad method, level or source list is refused here, before any work

    @property
    def template(self) -> Request:
        """The Request every call starts from (method and sources); a call sets its tokens, sampling, stops, seed."""
        return Request(method=self.method, level=self.level, levels=self.levels, bottom=self.bottom)

    def hosts(self, bound: str) -> frozenset[str] | None:
        """The Host names a server bound to `bound` answers (None: any)."""
        if ANY_HOST in self.allowed_hosts:
            return None
        return frozenset(hostname(h) for h in (*LOCAL_HOSTS, bound, *self.allowed_hosts))


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
    """A job's server-sent events. However the response ends (the job done, the client gone, or a client that took
    nothing for `send_timeout` seconds: dropped) the job is cancelled: its generation stops at the next step."""

    def __init__(self, chunks: AsyncIterator[str], job: Job, send_timeout: float) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job, self.send_timeout = job, send_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed(message: Message) -> None:
            await asyncio.wait_for(send(message), self.send_timeout)

        try:
            await super().__call__(scope, receive, timed)
        except TimeoutError:
            log.warning("dropped a client that took no stream data for %g s", self.send_timeout)
        finally:
            self.job.cancel.set()


async def _disconnected(request: HttpRequest) -> None:
    """Return once the client has gone (the body was read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass




class Api:
    """The endpoints over one engine."""

    def __init__(self, engine: Engine, cfg: ServeConfig, bound: str = "127.0.0.1", own_thread: bool = True) -> None:
        self.engine, self.cfg, self.name = engine, cfg, cfg.model_name or engine.name
        self.template, self.hosts, self.metrics = cfg.template, cfg.hosts(bound), Metrics()
        self.scheduler = Scheduler(engine, cfg.max_queue, self.metrics, own_thread, cfg.max_batch, cfg.prefix_cache_mb,
                                   cfg.prefill_chunk)
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
        return Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(Guard, hosts=self.hosts)],
                         exception_handlers={ApiError: _api_error, HTTPException: _http_error})

    # ------------------------------------------------------------------ endpoints
    async def health(self, request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", "model": self.name, "waiting": self.scheduler.waiting,
                             "running": self.scheduler.running})

    async def prometheus(self, request: HttpRequest) -> Response:
        text = self.metrics.render(self.scheduler.waiting, self.scheduler.running, self.scheduler.batch.stats)
        return Response(text, media_type=CONTENT_TYPE)

    async def models(self, request: HttpRequest) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HttpRequest) -> Response:
        self._authorize(request)
        if request.path_params["model"] != self.name:
            raise ApiError(404, f"the model {request.path_params['model'][:60]!r} does not exist: this server serves "
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
        """Check a call, queue it and answer it. The key, the content type and the queue's room are checked before
        the body is read (a body refused is not read by the app: uvicorn discards it, for at most client_timeout
        seconds); the prompt is templated and tokenized in the loop's thread pool, not on the engine's thread."""
        deadline = time.monotonic() + self.cfg.limits.request_timeout
        self._authorize(request)
        check_json(request)
        self.scheduler.check_room()
        raw = await read_body(request, self.cfg.limits.max_body_bytes, self.cfg.limits.client_timeout)
        call = await run_in_threadpool(self._parse, raw, chat, self._key(request))
        job = Job(call, asyncio.get_running_loop(), deadline)
        self.scheduler.submit(job)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.name}
        if call.stream:
            head["object"] = "chat.completion.chunk" if chat else "text_completion"
            return JobStream(self._chunks(job, chat, head), job, self.cfg.limits.client_timeout)
        head["object"] = "chat.completion" if chat else "text_completion"
        return await self._answer(request, job, chat, head)

    def _parse(self, raw: bytes, chat: bool, key: str) -> Call:
        return parse_call(read_json(raw), chat, self.engine, self.template, self.name, self.cfg.limits, key)

    def _key(self, request: HttpRequest) -> str:
        """Whose call it is, for the memory the recycle and suffix sources keep per client (dytc/shared.py): a
        digest of the API key it presented ("" without one)."""
        key = request.headers.get("authorization", "").partition(" ")[2].strip()
        return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""

    async def _next(self, job: Job) -> tuple[str, object]:
        """The job's next event; a job still waiting for the engine at its deadline is given up (503)."""
        if not job.started:
            try:
                return await asyncio.wait_for(job.events.get(), max(0.0, job.deadline - time.monotonic()))
            except TimeoutError:
                if not job.started:
                    job.cancel.set()
                    self.metrics.add_timeout()
                    raise ApiError(503, f"the call waited for the engine past its deadline "
                                   f"({self.cfg.limits.request_timeout:g} s): retry later", "timeout",
                                   headers={"Retry-After": str(self.scheduler.retry_after())}) from None
        return await job.events.get()

    async def _answer(self, request: HttpRequest, job: Job, chat: bool, head: dict) -> Response:
        """A blocking call's response; a client that goes away while it waits cancels its job."""
        gone = asyncio.ensure_future(_disconnected(request))
        event = asyncio.ensure_future(self._next(job))
        try:
            await asyncio.wait({gone, event}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                return Response(status_code=499)  # no one reads it
            kind, payload = event.result()
            if kind == "error":
                raise payload
            result, finish = payload
            return JSONResponse({**head, "choices": [_choice(chat, result.text, finish, delta=False)],
                                 "usage": usage(result.stats), "casspec": result.stats.speculative()})
        finally:
            gone.cancel()
            event.cancel()
            job.cancel.set()

    async def _chunks(self, job: Job, chat: bool, head: dict) -> AsyncIterator[str]:
        """The stream: (chat: the role first) a chunk per text piece, then the finish_reason with the `casspec`
        statistics, then (stream_options.include_usage) a chunk with the usage, then [DONE]. An error (a job given
        up at its deadline, a failed generation) is an event of its own, then [DONE]."""
        if job.call.include_usage:
            head = {**head, "usage": None}
        if chat:
            yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        while True:
            try:
                kind, payload = await self._next(job)
            except ApiError as e:
                kind, payload = "error", e
            if kind == "piece":
                yield _sse({**head, "choices": [_choice(chat, payload, None, delta=True)]})
                continue
            if kind == "error":
                yield _sse(payload.body())
            else:
                result, finish = payload
                yield _sse({**head, "choices": [_choice(chat, None, finish, delta=True)],
                            "casspec": result.stats.speculative()})
                if job.call.include_usage:
                    yield _sse({**head, "choices": [], "usage": usage(result.stats)})
            break
        yield "data: [DONE]\n\n"


async def _api_error(request: HttpRequest, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: HttpRequest, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path[:200]}",
                    {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")).response()


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


def server(engine: Engine, cfg: ServeConfig, sock: socket.socket, log_level: str = "info",
           api: Api | None = None) -> uvicorn.Server:
    """uvicorn over the app; limit_concurrency counts the connection it answers: one more than max_connections."""
    app = (api or Api(engine, cfg, bound=sock.getsockname()[0])).app()
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5,
                                         limit_concurrency=cfg.limits.max_connections + 1,
                                         http=partial(HeadTimeoutProtocol, head_timeout=cfg.limits.client_timeout)))


def serve(engine: Engine, cfg: ServeConfig, sock: socket.socket) -> None:
    """Serve until interrupted (Ctrl+C: uvicorn shuts down gracefully, the running generation is cancelled and
    waiting calls get 503)."""
    host, port = sock.getsockname()[:2]
    hosts = cfg.hosts(host)
    print(f"casspec: serving {cfg.model_name or engine.name} (method {cfg.method}) at http://{host}:{port}/v1 "
          f"(batch {cfg.max_batch}, queue {cfg.max_queue}{', API key required' if cfg.api_key else ''}; Host names "
          "answered: "
          f"{'any' if hosts is None else ', '.join(sorted(hosts))})", file=sys.stderr, flush=True)
    # the engine runs on this thread (the one that loaded it: Scheduler's docstring says why), the HTTP side on another.
    # Ctrl+C or SIGTERM asks uvicorn to shut down, as it does on its own main thread: gracefully, then its lifespan
    # stops the scheduler (the running generation cancelled at its next step, waiting calls 503, the stop mark that
    # ends `work`); whatever ends the HTTP side stops the scheduler too, so this thread never waits on nothing
    api = Api(engine, cfg, bound=host, own_thread=False)
    srv = server(engine, cfg, sock, api=api)

    def run_http() -> None:
        try:
            srv.run(sockets=[sock])
        finally:
            api.scheduler.stop()

    def shut_down(signum: int, frame: object) -> None:
        srv.should_exit = True

    previous = {sig: signal.signal(sig, shut_down) for sig in (signal.SIGINT, signal.SIGTERM)}
    http = threading.Thread(target=run_http, name="casspec-http", daemon=True)
    http.start()
    try:
        api.scheduler.work()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        srv.should_exit = True
        http.join(timeout=30)
    print("casspec: stopped", file=sys.stderr)


@contextmanager
def background(engine: Engine, cfg: ServeConfig, log_level: str = "warning") -> Iterator[str]:
    """A real server on 127.0.0.1 and a free port, in a thread of this process (tests, scripts/serve_bench.py);
    yields its base URL and stops it after."""
    sock = bind("127.0.0.1", 0)
    srv = server(engine, cfg, sock, log_level)
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
