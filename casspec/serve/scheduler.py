"""The server's queue and the engine's worker: a bounded FIFO queue of jobs (checked calls) and the one thread that
runs them on the engine, up to `max_batch` at once (continuous batching, casspec/runtime/batch.py: every step each
running job drafts, one target forward verifies all their trees; a job joins between steps, with its prompt's
forward alone or, where others run, a chunk of it in each step's forward (--prefill-chunk), and leaves at its end,
its client's disconnect or its deadline).

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
from ..runtime.batch import Batch, Running
from ..runtime.engine import Engine
from ..runtime.prefixes import PrefixStore
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
    started_at: float = 0.0  # perf_counter() then
    cancel: Stop = field(init=False)

    def __post_init__(self) -> None:
        self.cancel = Stop(self.deadline)

    def send(self, kind: str, payload: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed (shutting down): no one is listening
            self.cancel.set()


class Scheduler:
    """A bounded FIFO queue of jobs and the one worker that runs them on the engine, up to max_batch at once: its own
    thread, or (own_thread False) the caller's, which then calls `work` (`casspec serve` runs the engine on the
    thread that loaded it: measured on the AMD EPYC, a float32 dytc generation's level forwards took 2.4x as long on
    another thread, its C++ kernels' OpenMP team then being a second one on the 2 cores, whose threads sleep between
    regions instead of spinning)."""

    def __init__(self, engine: Engine, max_queue: int, metrics: Metrics, own_thread: bool = True,
                 max_batch: int = 1, prefix_mb: int = 0, prefill_chunk: int = 0) -> None:
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self.batch = Batch(engine, max_batch, prefixes=PrefixStore(prefix_mb << 20) if prefix_mb else None,
                           prefill_chunk=prefill_chunk)
        self.joining: Job | None = None  # the job whose generation is starting (its prompt's forward)
        self.jobs: queue.Queue[Job | None] = queue.Queue()  # bounded by submit (None, the stop mark, is not)
        self._submit = threading.Lock()  # makes submit's check-then-put atomic
        self.thread = threading.Thread(target=self.work, name="casspec-engine", daemon=True) if own_thread else None

    @property
    def waiting(self) -> int:
        return self.jobs.qsize()

    @property
    def running(self) -> int:
        """Jobs generating (one starting included)."""
        return len(self.batch.running) + len(self.batch.joining) + (self.joining is not None)

    def start(self) -> None:
        if self.thread is not None:
            self.thread.start()

    def stop(self) -> None:
        """Cancel the running jobs, turn the waiting ones away, and end the worker."""
        for job in [r.owner for r in [*self.batch.running, *self.batch.joining]] + [self.joining]:
            if job is not None:
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
        """429 when the queue is full: max_queue calls wait beyond those the batch has room for (checked again by
        submit: a call is not read or tokenized for nothing)."""
        free = max(0, self.batch.max_batch - self.running)  # (places the worker fills at its next step)
        if self.jobs.qsize() >= self.max_queue + free:
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
        """Run the jobs as they come, up to max_batch at once, until the stop mark (the running ones then end as
        cancelled: stop() set their cancels)."""
        stopping = False
        while not stopping or self.batch.busy:
            while not stopping and not self.batch.full:  # join the waiting jobs (wait for one when none runs)
                try:
                    job = self.jobs.get(block=not self.batch.busy)
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                elif not job.cancel.is_set():  # (its client went away, or its deadline passed, while it waited)
                    self._join(job)
            if self.batch.busy:
                self._step()

    def _join(self, job: Job) -> None:
        job.started, job.started_at, self.joining = True, time.perf_counter(), job
        try:
            started = self.batch.join(job.call.prompt_ids, job.call.request, job.cancel, job)
        except Exception as e:  # the call was checked: the server's set-up, a bug or the device. Report, keep serving
            self.metrics.add_failed()
            job.send("error", internal_error(e, "generation"))
            return
        finally:
            self.joining = None
        if started is not None:  # (None: its prompt runs in chunks with the next steps, which start it)
            self._deliver(*started)

    def _step(self) -> None:
        try:
            out = self.batch.step()
        except Exception as e:  # every running or joining job fails with it (their caches are left unreused)
            for run in [*self.batch.running, *self.batch.joining]:
                self.batch.drop(run)
                self.metrics.add_failed()
                run.owner.send("error", internal_error(e, "generation"))
            return
        for job in self.batch.take_given_up():  # (cancelled before its first token: its deadline, its client gone
            # (no one reads this), or the server stopping)
            if job.cancel.timed_out:
                self.metrics.add_timeout()
                why = ("the call's deadline passed before its prompt's forward ended: retry later", "timeout")
            else:
                why = ("the call was cancelled before its first token (the server is shutting down)", "shutting_down")
            job.send("error", ApiError(503, *why, headers={"Retry-After": str(self.retry_after())}))
        for run, piece in out:
            self._deliver(run, piece)
        for run in [r for r in self.batch.running if r.done]:  # (also a job whose window is full: no step ran it)
            self._deliver(run, "")

    def _deliver(self, run: Running, piece: str) -> None:
        """A job's piece of text (streaming calls); its end, where it is done."""
        job: Job = run.owner
        if piece and job.call.stream:
            job.send("piece", piece)
        if not run.done:
            return
        result, last = self.batch.leave(run)
        if last and job.call.stream:
            job.send("piece", last)
        finish = FINISH_REASONS.get(result.stats.finish_reason)
        if result.stats.finish_reason == "cancelled" and job.cancel.timed_out:
            finish = "length"  # stopped at its deadline: a truncated answer, as at max_tokens
            self.metrics.add_timeout()
        self.metrics.add_generation(result.stats, finish,
                                    job.started_at - job.arrived + result.stats.first_token_seconds)
        job.send("done", (result, finish))
