"""The server's Prometheus metrics (text exposition format 0.0.4), named like vLLM's with the prefix `casspec:`.

Every counter is a sum over the generations the server ran (cancelled ones included) of one number of their
Stats (`Stats.speculative()`, the per-request `casspec` object): the speculative counters are vLLM's
spec_decode_num_drafts / num_draft_tokens / num_accepted_tokens / num_accepted_tokens_per_pos. Queue depth and
the running requests are gauges read at scrape time, the batch's steps counters its own; time to first token is a
histogram.
"""
from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter

from ..runtime.batch import BatchStats
from ..runtime.stats import Stats

PREFIX = "casspec:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # seconds, vLLM's time_to_first_token buckets
SPEC_COUNTERS = {  # Stats.speculative() key -> help text; exported as casspec:spec_decode_<key>_total
    "num_drafts": "Verification steps, one draft tree each (a fallback step verifies the root alone).",
    "num_draft_tokens": "Draft tokens verified.",
    "num_accepted_tokens": "Draft tokens accepted.",
    "draft_seconds": "Seconds spent drafting (the policy's time, level forwards included).",
    "verify_seconds": "Seconds spent in target verification forwards, acceptance and commits.",
}

BATCH_COUNTERS = {  # BatchStats field -> help text; exported as casspec:batch_<field>_total
    "steps": "Engine steps (one target forward verifying every running request's tree).",
    "sequences": "Requests in those steps, summed (steps x their batch width).",
    "rows": "Rows the steps' target forwards verified (each request's root and draft tokens).",
    "drafted": "Draft tokens in those forwards (speculation sized to the load: fewer as the batch widens).",
    "root_only": "Requests' steps that verified their root alone (no draft paid at that load).",
    "prefix_hits": "Prompts that started with a kept prefix of their client's (--prefix-cache-mb) and copied its KV.",
    "prefix_tokens": "Prompt tokens whose forward those copies saved.",
    "prompt_chunks": "Chunks of joining prompts run in the steps' forwards (--prefill-chunk).",
    "undrafted": "Steps of several requests that drafted nothing (their measured goodput the better at that width).",
}


class Metrics:
    """Counters of one server; thread-safe (the engine's worker adds, scrapes read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spec: Counter[str] = Counter()  # SPEC_COUNTERS key -> sum
        self.accepted_per_pos: Counter[int] = Counter()  # draft position -> accepted tokens there
        self.finished: Counter[str] = Counter()  # OpenAI finish_reason (stop | length) -> requests
        self.cancelled = 0  # generations stopped because their client went away
        self.failed = 0  # generations that raised
        self.queue_full = 0  # requests turned away with 429
        self.timed_out = 0  # requests past their deadline: generations stopped (finish_reason length) and waiting
        # calls given up (503)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.generation_seconds = 0.0  # wall time of the generations (prefill included; queueing not)
        self.ttft = [0] * (len(TTFT_BUCKETS) + 1)  # time to first token: observations per bucket, the
        # last one above every bound (not cumulative)
        self.ttft_sum = 0.0
        self.ttft_count = 0

    def add_generation(self, stats: Stats, finish_reason: str | None, first_token_seconds: float) -> None:
        """A generation that ended: finish_reason is the OpenAI one, or None when it was cancelled;
        first_token_seconds from its request's arrival (queueing included) to its first token."""
        spec = stats.speculative()
        with self._lock:
            self.ttft[bisect_left(TTFT_BUCKETS, first_token_seconds)] += 1  # the first bucket whose bound is >=
            self.ttft_sum += first_token_seconds
            self.ttft_count += 1
            for key in SPEC_COUNTERS:
                self.spec[key] += spec[key]
            for pos, n in enumerate(spec["num_accepted_tokens_per_pos"]):
                self.accepted_per_pos[pos] += n
            if finish_reason is None:
                self.cancelled += 1
            else:
                self.finished[finish_reason] += 1
            self.prompt_tokens += stats.prompt_tokens
            self.generation_tokens += stats.new_tokens
            self.generation_seconds += stats.seconds

    def add_failed(self) -> None:
        with self._lock:
            self.failed += 1

    def add_queue_full(self) -> None:
        with self._lock:
            self.queue_full += 1

    def add_timeout(self) -> None:
        with self._lock:
            self.timed_out += 1

    def mean_generation_seconds(self) -> float:
        """Mean wall time of the generations so far (0 before the first)."""
        with self._lock:
            n = sum(self.finished.values()) + self.cancelled
            return self.generation_seconds / n if n else 0.0

    def render(self, waiting: int, running: int, batch: BatchStats | None = None) -> str:
        """The exposition text; the gauges and the batch's counters are passed in (the scheduler owns them)."""
        with self._lock:
            out: list[str] = []

            def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
                out.extend([f"# HELP {PREFIX}{name} {help}", f"# TYPE {PREFIX}{name} {kind}"])
                out.extend(f"{PREFIX}{name}{labels} {number(v)}" for labels, v in samples)

            metric("num_requests_running", "gauge", "Requests generating now (at most --max-batch).", [("", running)])
            metric("num_requests_waiting", "gauge", "Requests waiting in the queue.", [("", waiting)])
            metric("request_success_total", "counter", "Requests that finished, by OpenAI finish_reason.",
                   [(f'{{finished_reason="{r}"}}', self.finished[r]) for r in ("stop", "length")])
            metric("request_cancelled_total", "counter", "Generations stopped because their client disconnected.",
                   [("", self.cancelled)])
            metric("request_failed_total", "counter", "Generations that failed with an error.", [("", self.failed)])
            metric("request_queue_full_total", "counter", "Requests refused with 429 because the queue was full.",
                   [("", self.queue_full)])
            metric("request_timeout_total", "counter", "Requests past their deadline: generations stopped there "
                   "(finish_reason length) and waiting requests given up (503).", [("", self.timed_out)])
            metric("prompt_tokens_total", "counter", "Prompt tokens of the generations.", [("", self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "Tokens generated.", [("", self.generation_tokens)])
            metric("request_generation_seconds_total", "counter", "Wall time of the generations (queueing not "
                   "included).", [("", self.generation_seconds)])
            for key, help in SPEC_COUNTERS.items():
                metric(f"spec_decode_{key}_total", "counter", help, [("", self.spec[key])])
            metric("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted draft tokens by position "
                   "in the draft (0 = the first token after the root).",
                   [(f'{{position="{p}"}}', self.accepted_per_pos[p]) for p in sorted(self.accepted_per_pos)])
            for key, help in BATCH_COUNTERS.items():  # (continuous batching: what the steps verified)
                metric(f"batch_{key}_total", "counter", help, [("", getattr(batch, key) if batch else 0)])
            cumulative, buckets = 0, []
            for bound, n in zip(TTFT_BUCKETS, self.ttft):
                cumulative += n
                buckets.append((f'_bucket{{le="{bound}"}}', cumulative))
            buckets += [('_bucket{le="+Inf"}', self.ttft_count), ("_sum", self.ttft_sum), ("_count", self.ttft_count)]
            metric("time_to_first_token_seconds", "histogram", "Seconds from a request's arrival (queueing included) "
                   "to its first generated token.", buckets)
        return "\n".join(out) + "\n"


def number(v: float) -> str:
    """A sample's value as the exposition text writes it (integers without a point)."""
    return str(int(v)) if float(v).is_integer() else repr(float(v))
