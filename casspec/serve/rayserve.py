"""`casspec serve --ray`: engine replicas as Ray Serve deployments behind one OpenAI-compatible ingress (the optional
extra `casspec[ray]`).

Each replica (`EngineReplica`) loads the engine and runs the single server's app (app.py: the same endpoints, checks,
errors, streaming, continuous batching and /metrics) in its own process; it takes HTTP requests through Ray as ASGI
calls (`forward`), not on a port of its own. The ingress (`Ingress`, Ray Serve's HTTP proxy in front) reads a request
(its body bounded as the server bounds it), names its conversation (`affinity_key`: the chat's first messages, or the
prompt's opening) and passes it on with that name (as Ray Serve's multiplexed model id), which `AffinityRouter`
hashes to a replica, so that the requests of one conversation go to the replica that served it before and holds its
KV prefix (and its lookups' history); the replica's response streams back as it is made, and a client that leaves
cancels its generation there. /metrics sums every replica's counters and gauges (each replica posts its own to a
small Ray actor, `MetricsHub`, once a second and after every request).

Scaling: `--replicas N` replicas, or with `--max-replicas M` Ray Serve's autoscaling between N and M, targeting
`--max-batch` requests in flight per replica. On a Ray cluster: `ray.init(address=...)`, then
`serve.run(casspec.serve.rayserve.application(...))` deploys the same application.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections import defaultdict
from typing import AsyncIterator

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from starlette.requests import Request as HttpRequest
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from dsia.errors import CasspecError

from .app import Api, ServeConfig
from .calls import ApiError
from .guard import read_body
from .metrics import CONTENT_TYPE, number
from ..runtime.engine import Engine

HUB = "casspec-metrics"  # the Ray actor the replicas post their metrics to
NAMESPACE = "casspec"  # the Ray namespace of the hub (and of `casspec serve --ray`'s driver)
POST_EVERY_S = 1.0  # a replica posts its metrics at least this often
AFFINITY_CHARS = 256  # a completion prompt's opening that names its conversation (shorter prompts: none)


@ray.remote(num_cpus=0)
class MetricsHub:
    """Every replica's latest metrics text, by replica."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}

    def post(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.time(), text)

    def texts_since(self, after: float) -> list[str]:
        """The texts of the replicas that posted since `after` (time.time()): those alive."""
        return [text for at, text in self.texts.values() if at >= after]


def summed(texts: list[str]) -> str:
    """Prometheus texts of several replicas as one: each sample (name and labels) summed over the replicas (counters,
    gauges and histogram buckets all add up), the HELP and TYPE lines once, in the first text's order."""
    order: list[str] = []
    values: dict[str, float] = defaultdict(float)
    for text in texts:
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                if line not in order:
                    order.append(line)
                continue
            key, _, value = line.rpartition(" ")
            if key not in values:
                order.append(key)
            values[key] += float(value)
    out = [line if line.startswith("#") or not line.strip() else f"{line} {number(values[line])}" for line in order]
    return "\n".join(out) + "\n"


def affinity_key(path: str, body: bytes) -> str:
    """The conversation a request belongs to: a digest of a chat's first two messages (every later turn starts with
    them) or of a completion prompt's first AFFINITY_CHARS characters; "" where the body names none (any replica
    answers it)."""
    try:
        given = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(given, dict):
        return ""
    if path.endswith("/chat/completions"):
        opening = given.get("messages")
        opening = opening[:2] if isinstance(opening, list) else None
    else:
        prompt = given.get("prompt")  # (a shorter one has little KV to reuse: any replica)
        opening = prompt[:AFFINITY_CHARS] if isinstance(prompt, str) and len(prompt) >= AFFINITY_CHARS else None
    if not opening:
        return ""
    return hashlib.sha256(json.dumps(opening, sort_keys=True).encode()).hexdigest()[:24]


class AffinityRouter(RequestRouter):
    """Ray Serve's choice of a replica for a request: rendezvous hashing of its conversation (`affinity_key`, sent
    as the multiplexed model id) over the replicas, so that every request of a conversation has the same first
    choice while the replicas stay (one added or gone moves only its own share of the conversations); the others
    follow where that one is full. A request of no conversation: the least busy replica."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not key or len(candidate_replicas) < 2:
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, reverse=True, key=lambda r: hashlib.sha256(
            f"{key}|{r.replica_id.unique_id}".encode()).digest())
        return [ranked[:1], ranked[1:]]


@serve.deployment
class EngineReplica:
    """One engine and the single server's app over it (its scheduler on a thread of its own)."""

    def __init__(self, model: str | None, engine_options: dict, cfg: ServeConfig, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.api = Api(Engine.from_pretrained(model, **engine_options), cfg)
        self.app = self.api.app()  # (its lifespan is not run: the scheduler starts here)
        self.api.scheduler.start()
        self.name = serve.get_replica_context().replica_tag
        self.hub = ray.get_actor(HUB, namespace=NAMESPACE)
        self._poster = asyncio.get_event_loop().create_task(self._post_forever())

    def __del__(self) -> None:
        self.api.scheduler.stop()

    def _metrics(self) -> str:
        s = self.api.scheduler
        return self.api.metrics.render(s.waiting, s.running, s.batch.stats)

    async def _post_forever(self) -> None:
        while True:
            self.hub.post.remote(self.name, self._metrics())
            await asyncio.sleep(POST_EVERY_S)

    async def forward(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> AsyncIterator[tuple]:
        """One HTTP request through this replica's app: ("start", status, headers), then ("body", bytes)... as the
        app sends them. Closed early (the client left): the app sees its client disconnect."""
        sent, gone = asyncio.Event(), asyncio.Event()
        messages: asyncio.Queue = asyncio.Queue()

        async def receive() -> dict:
            if not sent.is_set():
                sent.set()
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
                 "root_path": "", "headers": headers, "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 0)}
        task = asyncio.ensure_future(self.app(scope, receive, messages.put))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":  # (which replica answered: x-casspec-replica)
                    yield ("start", message["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                                        for k, v in message.get("headers", [])]
                           + [("x-casspec-replica", self.name)])
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield ("body", bytes(message["body"]))
                    if not message.get("more_body"):
                        break
        finally:
            gone.set()
            await asyncio.wait({task}, timeout=5)
            self.hub.post.remote(self.name, self._metrics())


@serve.deployment
class Ingress:
    """The one endpoint: each request to the replica holding its conversation; /metrics summed over replicas."""

    def __init__(self, replicas: serve.handle.DeploymentHandle, cfg: ServeConfig) -> None:
        self.replicas, self.cfg = replicas, cfg
        self.hub = ray.get_actor(HUB, namespace=NAMESPACE)

    async def __call__(self, request: HttpRequest) -> Response:
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            texts = await self.hub.texts_since.remote(time.time() - 10 * POST_EVERY_S)
            return PlainTextResponse(summed(texts), media_type=CONTENT_TYPE)
        body = b""
        if request.method == "POST":
            try:
                body = await read_body(request, self.cfg.limits.max_body_bytes, self.cfg.limits.client_timeout)
            except ApiError as e:
                return e.response()
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()]
        call = self.replicas.options(stream=True, multiplexed_model_id=affinity_key(path, body))
        events = call.forward.remote(request.method, path, request.url.query.encode(), headers, body)
        _, status, head = await events.__anext__()

        async def rest() -> AsyncIterator[bytes]:
            async for _, chunk in events:
                yield chunk

        kept = {k: v for k, v in head if k.lower() not in ("content-length", "transfer-encoding")}
        return StreamingResponse(rest(), status_code=status, headers=kept)


def check_replicas(replicas: int, max_replicas: int | None) -> None:
    if replicas < 1 or (max_replicas is not None and max_replicas < replicas):
        raise CasspecError(f"--replicas must be >= 1 and --max-replicas >= --replicas (got {replicas} and "
                           f"{max_replicas})")


def application(model: str | None, engine_options: dict, cfg: ServeConfig, replicas: int = 2,
                max_replicas: int | None = None, cpus_per_replica: int | None = None) -> serve.Application:
    """The Ray Serve application: `replicas` engine replicas (autoscaled up to max_replicas, targeting cfg.max_batch
    requests in flight each, where max_replicas is more) behind the ingress. cpus_per_replica: each replica's CPUs
    and torch threads (None: this machine's CPUs shared among the replicas)."""
    check_replicas(replicas, max_replicas)
    cpus = cpus_per_replica or max(1, (os.cpu_count() or 1) // replicas)
    scaling: dict = ({"autoscaling_config": {"min_replicas": replicas, "max_replicas": max_replicas,
                                             "target_ongoing_requests": cfg.max_batch}}
                     if max_replicas is not None and max_replicas > replicas else {"num_replicas": replicas})
    engine = EngineReplica.options(ray_actor_options={"num_cpus": cpus}, max_ongoing_requests=cfg.max_batch
                                   + cfg.max_queue, request_router_config=RequestRouterConfig(
                                       request_router_class=AffinityRouter), **scaling)
    MetricsHub.options(name=HUB, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote()
    return Ingress.options(ray_actor_options={"num_cpus": 0}).bind(engine.bind(model, engine_options, cfg, cpus), cfg)


def run(model: str | None, engine_options: dict, cfg: ServeConfig, host: str, port: int, replicas: int,
        max_replicas: int | None) -> None:
    """`casspec serve --ray`: a local Ray instance (or the cluster RAY_ADDRESS names), the application on
    host:port, until Ctrl+C."""
    check_replicas(replicas, max_replicas)
    ray.init(address=os.environ.get("RAY_ADDRESS"), namespace=NAMESPACE, include_dashboard=False,
             log_to_driver=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(model, engine_options, cfg, replicas, max_replicas), name="casspec",
                  route_prefix="/")
        print(f"casspec: serving {cfg.model_name or model or 'the embedded model'} on Ray Serve, {replicas} "
              f"replicas, at http://{host}:{port}/v1 (Ctrl+C stops)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
