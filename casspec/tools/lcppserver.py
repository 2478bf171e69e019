"""llama.cpp's own speculation as a bench baseline: `lcpp-spec` runs `llama-server --spec-default` (llama.cpp's
draftless n-gram speculation, `ngram-mod`: a rolling-hash pool of the n-grams it has seen, shared across requests)
on the engine's own GGUF file as stored. llama-cpp-python does not expose it, so the server binary is built from the
llama.cpp source its sdist vendors (docs/benchmarking.md says how) and found as $CASSPEC_LLAMA_SERVER or
`llama-server` on PATH.

A turn is one POST to the server's /completion with exactly the prompt ids casspec's methods get, n_predict =
max_new_tokens, greedy (top-k 1) or the request's temperature / top-k / top-p and seed, no repeat penalty; the
server runs one slot with the thread count torch uses. Like the lcpp-ar runner a conversation's later turn reuses the
server's KV of the turn before (cache_prompt); a new question's first turn reuses nothing. The server stops at the
model's end-of-generation tokens; that token is counted as a new token, as casspec's methods count it.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from dsia.errors import CasspecError
from dytc.sampling import SamplingParams

from ..calibrate.questions import TurnFn
from .lcpp import gguf_source

LCPP_SPEC = "lcpp-spec"  # the bench method
SERVER_ENV = "CASSPEC_LLAMA_SERVER"  # the llama-server binary (else `llama-server` on PATH)
SPEC_ARGS = ("--spec-default",)  # llama.cpp's default speculation (ngram-mod), as users turn it on
START_TIMEOUT_S = 300.0  # how long the server may take to load a model and answer /health
TURN_TIMEOUT_S = 3600.0  # one turn's request
BUILD = ("build llama-server from the llama.cpp source llama-cpp-python's sdist vendors (docs/benchmarking.md, "
         f"\"llama.cpp's own speculation\") and set {SERVER_ENV} to it")


def server_binary() -> str:
    """The llama-server binary, or one clear error saying how to build it."""
    path = os.environ.get(SERVER_ENV) or shutil.which("llama-server")
    if not path or not os.access(path, os.X_OK) or not os.path.isfile(path):
        where = f"{SERVER_ENV}={path}" if os.environ.get(SERVER_ENV) else "no llama-server on PATH"
        raise CasspecError(f"lcpp-spec needs llama.cpp's server ({where} is not an executable file): {BUILD}")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (the system's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """One llama-server process on a free local port, stopped when closed (or at exit)."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [server_binary(), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-c", str(n_ctx),
                "-t", str(threads), "-tb", str(threads), "--parallel", "1", "--no-webui", *SPEC_ARGS]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        atexit.register(self.close)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                tail = (self.proc.stderr.read() or "").strip().splitlines()[-1:] if self.proc.stderr else []
                raise CasspecError(f"llama-server exited ({self.proc.returncode}) before it served {gguf}: "
                                   f"{tail[0] if tail else 'no message'}; check that it was built from a llama.cpp "
                                   "that reads this file")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise CasspecError(f"llama-server did not answer within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)

    def complete(self, body: dict) -> dict:
        return _post(self.url + "/completion", body, TURN_TIMEOUT_S)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()


def lcpp_spec_runner(gguf: Path | None, n_ctx: int, eos_ids: frozenset[int], sampling: SamplingParams,
                     seed: int) -> TurnFn:
    """A bench turn runner over llama-server with its default speculation (module docstring)."""
    server = Server(gguf_source(gguf, "lcpp-spec runs"), n_ctx, torch.get_num_threads())
    if sampling.greedy:
        decoding = dict(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0)
    else:
        decoding = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, min_p=0.0,
                        seed=seed)
    last: list[int] = []  # the last turn's prompt

    def run(ids: list[int], max_new_tokens: int) -> tuple[list[int], int, dict]:
        nonlocal last
        reuse = bool(last) and len(ids) > len(last) and ids[:len(last)] == last  # a conversation's later turn
        last = list(ids)
        out = server.complete({"prompt": ids, "n_predict": max_new_tokens, "cache_prompt": reuse,
                               "return_tokens": True, "repeat_penalty": 1.0, **decoding})
        tokens = [int(t) for t in out.get("tokens", [])]
        if out.get("stop_type") == "eos" and (not tokens or tokens[-1] not in eos_ids) and eos_ids:
            tokens.append(min(eos_ids))  # (the server drops the end-of-generation token it stopped at)
        timings = out.get("timings", {})
        accepted = int(timings.get("draft_n_accepted", 0))
        # forwards: one per emitted token, less the drafted tokens its verifications accepted
        return tokens, max(1, len(tokens) - accepted), {}

    run.close = server.close  # type: ignore[attr-defined]
    return run
