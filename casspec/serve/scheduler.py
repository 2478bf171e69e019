"""The server's queue and the engine's worker: a bounded FIFO queue of jobs (checked calls) and the one thread that
runs them on the engine, one at a time, each until its end, its client's disconnect or its deadline.

A job's cancel event is the engine's (`Engine.stream_ids` reads it between steps): set when its client goes away,
and set of itself once the job's deadline passes, so that a generation stops after the step that is running. A
generation stopped by its deadline ends with finish_reason "length", as at max_tokens. A generation that fails is
a 500 that tells the client nothing but an id; the log has one line under that id.
"""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from .calls import ApiError, Call
from ..runtime.engine import Engine
from .metrics import Metrics

log = logging.getLogger("casspec.serve.app")

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}  # engine -> OpenAI


def internal_error(e: BaseException, what: str) -> ApiError:
    """A 500 that tells the client nothing of the error: the log gets one line with the details, under an id the
    client's message gives (the traceback at debug level)."""
    incident = uuid.uuid4().hex[:12]
    log.error("%s failed [%s]: %s: %s", what, incident, type(e).__name__, " ".join(str(e).split())[:500])
    log.debug("traceback [%s]", incident, exc_info=e)
    return ApiError(500, f"internal error {incident}: the server's log has the details", "internal_error")


class Stop(threading.Event):
    """A job's cancel event as the engine reads it between steps (`is_set`): set when its client goes away, and set
    of itself once the job's deadline (time.monotonic()) has passed."""

    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline

    def is_set(self) -> bool:
        return super().is_set() or time.monotonic() >= self.deadline

    @property
    def timed_out(self) -> bool:
        """Stopped by the deadline alone (its client is still there)."""
        return not super().is_set() and time.monotonic() >= self.deadline


@dataclass
class Job:
    """A call on its way through the queue. The worker reports to the handler's event loop through `events`:
    ("piece", text)... (streaming calls only), then ("done", (Result, OpenAI finish_reason)) or ("error", ApiError)."""
    call: Call
    loop: asyncio.AbstractEventLoop
    deadline: float  # time.monotonic() past which its generation stops, or it is given up while waiting
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    started: bool = False  # the worker took it
    cancel: Stop = field(init=False)

    def __post_init__(self) -> None:
        self.cancel = Stop(self.deadline)

    def send(self, kind: str, payload: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed (shutting down): no one is listening
            self.cancel.set()


class Scheduler:
    """A bounded FIFO queue of jobs and the one worker that runs them on the engine, one at a time: its own thread,
    or (own_thread False) the caller's, which then calls `work` (`casspec serve` runs the engine on the thread that
    loaded it: measured on the AMD EPYC, a float32 dytc generation's level forwards took 2.4x as long on another
    thread, its C++ kernels' OpenMP team then being a second one on the 2 cores, whose threads sleep between
    regions instead of spinning)."""

    def __init__(self, engine: Engine, max_queue: int, metrics: Metrics, own_thread: bool = True) -> None:
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue()  # bounded by submit (None, the stop mark, is not)
        self._submit = threading.Lock()  # makes submit's check-then-put atomic
        self.running: Job | None = None
        self.thread = threading.Thread(target=self.work, name="casspec-engine", daemon=True) if own_thread else None

    @property
    def waiting(self) -> int:
        return self.jobs.qsize()

    def start(self) -> None:
        if self.thread is not None:
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
        if self.thread is not None:
            self.thread.join(timeout=60)

    def check_room(self) -> None:
        """429 when the queue is full (checked again by submit: a call is not read or tokenized for nothing)."""
        if self.jobs.qsize() >= self.max_queue:
            self.metrics.add_queue_full()
            raise ApiError(429, f"the queue is full ({self.max_queue} requests wait for the engine): retry later",
                           "queue_full", headers={"Retry-After": str(self.retry_after())})

    def submit(self, job: Job) -> None:
        with self._submit:
            self.check_room()
            self.jobs.put(job)

    def retry_after(self) -> int:
        """Seconds until a place in the queue is likely free: a generation's mean time so far (at least 1)."""
        return max(1, math.ceil(self.metrics.mean_generation_seconds()))

    def work(self) -> None:
        """Run the jobs as they come, until the stop mark."""
        while (job := self.jobs.get()) is not None:
            if job.cancel.is_set():  # its client went away, or its deadline passed, while it waited
                continue
            job.started, self.running = True, job
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
            self.metrics.add_failed()
            job.send("error", internal_error(e, "generation"))
            return
        finish = FINISH_REASONS.get(result.stats.finish_reason)
        if result.stats.finish_reason == "cancelled" and job.cancel.timed_out:
            finish = "length"  # stopped at its deadline: a truncated answer, as at max_tokens
            self.metrics.add_timeout()
        self.metrics.add_generation(result.stats, finish, started - job.arrived + result.stats.first_token_seconds)
        job.send("done", (result, finish))
