"""The engine: prompt in, tokens out. `generate` -> `_stream` (the lock) -> `open` (the policy, the prompt's forward,
the drafting context) -> `Decoding.steps` (step.py), the decode loop: draft -> verify -> accept -> update, its blocks
fed to the generation's text side (live.py: stops, the Result). `casspec serve` runs several generations at once
through `open`, `step.verify_batch` and `close` (runtime/batch.py).

Threads: one engine runs one generation at a time (one KV cache; shared levels, acceptance and latency state).
`generate`, `generate_ids`, `stream_ids`, `encode` and `decode` may be called from several threads: a generation
holds the engine's lock from its first step to its last (a stream: until it is read to the end or closed), and
a second thread's generation waits for it; a thread that starts a generation while its own earlier stream is
unfinished gets a CasspecError (waiting would deadlock). `last_result` is per thread. The measuring tools
(bench, profile, levels, autoprofile) drive the cache directly and own the engine while they run.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from numbers import Integral
from typing import Callable, Iterator, Sequence

import torch

from dsia.errors import CasspecError
from dsia.gcpause import paused_gc
from dsia.levels import LevelRegistry
from dytc.machine import machine_info, resident_bytes
from dytc.policies import DraftContext, Policy
from dytc.sampling import SamplingParams
from dytc.shared import SharedDrafts
from dytc.verify import Noise

from .defaults import BOTTOM, LEVEL, MAX_NEW_TOKENS, METHOD, STATE_WRITE_EVERY_S
from .live import CacheSlot, Live
from ..calibrate.engine_view import dtype_name
from ..calibrate.first_use import Calibration, calibrate
from ..calibrate.plane import Plane
from ..loading.levelstore import LevelStore
from ..loading.checkpoints import Loaded, load
from .method_table import default_levels
from .methods import Drafters, make_policy
from .request import Prompt, Request
from ..cache.state import StateFile
from .stats import Result, Stats
from .step import Decoding, Prefilled, pick, prefill, seed_of
from .target import EngineOptions, build_target


def _options(options: EngineOptions | None, overrides: dict[str, object]) -> EngineOptions:
    """options with the given fields replaced (one clear error for a name EngineOptions does not have)."""
    unknown = sorted(set(overrides) - set(EngineOptions.names()))
    if unknown:
        raise CasspecError(f"unknown engine option {unknown[0]!r}: use one of {', '.join(EngineOptions.names())}")
    return replace(options or EngineOptions(), **overrides)


class Engine:
    def __init__(self, loaded: Loaded, options: EngineOptions | None = None, calibration: Calibration | None = None,
                 **overrides: object) -> None:
        """A runtime over a loaded checkpoint, built as `options` say (target.EngineOptions; its fields may also be
        given as keywords: Engine(loaded, kernels="blas", keep_state=False)). `calibration`: what this machine
        measured for the checkpoint (calibrate/first_use.py: the levels plane, the latency model); None: what the
        user cache holds already. Besides the dense kernels' choice where options.kernels is "auto" (part of building
        the target: measured once per machine and cached, calibrate/tune.py), nothing is measured here:
        `from_pretrained` (and so the CLI) measures what is missing on first use, with options.autoprofile
        (`measure_first_use`)."""
        opts = _options(options, overrides)
        t0 = time.perf_counter()
        self.hf_model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.name = loaded.name
        self.source = loaded.source  # the checkpoint file or folder (None: built in memory)
        target = build_target(loaded, opts)
        self.model, self.cache, self.graphs = target.model, target.cache, target.graphs
        self.kernels, self.build = target.kernels, target.build
        self.eos_ids = self._eos_ids(loaded.generation_eos)
        store = LevelStore(loaded.store_dir / "levels", self.dtype, self.device) if loaded.store_dir else None
        self.levels = LevelRegistry(self.model, store=store)  # draft levels, built on first use and reused
        # what the recycle and suffix sources remember of earlier generations, per client (kept across calibrations)
        self.shared = SharedDrafts()
        self.setup = {"kernels": time.perf_counter() - t0}  # seconds of set-up by phase, until a generation reports
        self._keep_state = opts.keep_state
        self.use_calibration(calibration or calibrate(self, False, self._levels_for))
        self._lock = threading.Lock()  # held by the generation that runs (see the module's docstring)
        self._owner: int | None = None  # the thread that holds it
        self._local = threading.local()  # per thread: the Result of its latest generation
        self.reuse_prefix = opts.reuse_prefix
        self.slot = CacheSlot(self.cache)  # the cache and what the last generation left in it

    @classmethod
    def from_pretrained(cls, model: str | None = None, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu", hf: bool = True, options: EngineOptions | None = None,
                        **overrides: object) -> "Engine":
        """model: None (embedded SmolLM2-135M-Instruct), an HF checkpoint folder, or a .gguf file. hf=False: no HF
        model (engine.hf_model None) where the runtime reads the checkpoint itself (a faster start). options: as
        Engine's (its fields may also be given as keywords: max_context=512, kernels="blas", ...)."""
        opts = _options(options, overrides)  # (checked before anything loads)
        t0 = time.perf_counter()
        loaded = load(model, dtype, device, hf, native=opts.weights == "native")
        load_s = time.perf_counter() - t0
        engine = cls(loaded, opts)
        if opts.autoprofile:
            engine.measure_first_use()
        engine.setup = {"load": load_s, **engine.setup}
        return engine

    def measure_first_use(self) -> None:
        """Measure what this machine has not measured yet for the checkpoint (the levels plane, a latency profile:
        about a minute, once, kept in the user cache) and use it (`use_calibration`)."""
        self.use_calibration(calibrate(self, True, self._levels_for))

    def use_calibration(self, cal: Calibration) -> None:
        """Take a calibration: the levels plane chooses the multi-level methods' default sources, the latency model
        is the router's; the state earlier processes kept for that latency model is read back."""
        self.plane, self.latency, self.latency_source = cal.plane, cal.latency, cal.latency_source
        self.setup.update(cal.seconds)
        self.state = (StateFile.of(machine_info(self.device.type), self.name, dtype_name(self), self.build)
                      if self._keep_state else None)
        self._state_origin = self.latency_source  # the latency model the kept state grew from
        self._state_written = time.monotonic()  # when the state was last written (Engine.close)
        learned, trackers = self.state.load(self._state_origin) if self.state else (None, {})
        if learned is not None:
            self.latency, self.latency_source = learned, self.latency_source + ", refined by earlier runs"
        self.drafters = Drafters(self.levels, trackers, self.device.type, self.plane)  # what the policies draw on

    def _levels_for(self, plane: Plane | None) -> tuple[str, ...]:
        """The draft levels a latency profile measures besides the target: those the default methods route."""
        return default_levels(self.device.type, plane)

    @property
    def last_result(self) -> Result | None:
        """The Result of this thread's latest generation (also when streamed; None before the first)."""
        return getattr(self._local, "result", None)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def _eos_ids(self, generation_eos: tuple[int, ...]) -> frozenset[int]:
        ids: set[int] = set(generation_eos)  # generation_config's, where no HF model carries it
        gen_eos = getattr(getattr(self.hf_model, "generation_config", None), "eos_token_id", None)
        for e in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]):
            if e is not None:
                ids.add(int(e))
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt. Chat messages, or text when chat is True (default: when the tokenizer has a
        chat template), go through the tokenizer's chat template with the generation prompt added."""
        if self.tokenizer is None:
            raise CasspecError(f"{self.name} has random weights and no tokenizer (profiling only): load a checkpoint")
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        texts = [prompt] if isinstance(prompt, str) else [m.get("content") for m in prompt if isinstance(m, dict)]
        for text in texts:
            if isinstance(text, str) and not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:  # e.g. bytes that were not UTF-8 on the command line (surrogate escapes)
                    raise CasspecError("the prompt is not valid UTF-8 text: pass it as UTF-8") from None
        if isinstance(prompt, str):
            if not prompt.strip():
                raise CasspecError("the prompt is empty: pass some text")
            if chat is None:
                chat = has_template
            if not chat:
                return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = list(prompt)
            if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                raise CasspecError("chat messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        if not has_template:
            raise CasspecError("this tokenizer has no chat template: pass raw text with chat=False (--no-chat)")
        enc = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ------------------------------------------------------------------ public API
    def generate(self, prompt: Prompt, max_new_tokens: int = MAX_NEW_TOKENS, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] | None = None, seed: int | None = None,
                 method: str = METHOD, level: str = LEVEL, levels: Sequence[str] = (), bottom: str = BOTTOM,
                 stream: bool = False, chat: bool | None = None) -> Result | Iterator[str]:
        """Generate from a prompt. Returns a Result, or with stream=True an iterator of text pieces (the pieces
        concatenate to the final text; the Result is then available as `engine.last_result`)."""
        req = Request(max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature, top_k, top_p),
                      stop=tuple(stop or ()), seed=seed, method=method, level=level, levels=tuple(levels),
                      bottom=bottom)
        pieces = self._stream(self.prompt_ids(prompt, chat), req)
        if stream:
            return pieces
        for _ in pieces:  # (-> _stream -> open -> Decoding.steps: draft, verify, accept, update)
            pass
        return self.last_result

    def generate_ids(self, prompt_ids: Sequence[int], req: Request,
                     wrap: Callable[[Policy], Policy] | None = None) -> Result:
        """Generate from token ids (the bench and tests use this to skip templating). `wrap`: the caller's wrapper
        around the method's drafting policy (the oracle replay records each step through one)."""
        for _ in self.stream_ids(prompt_ids, req, wrap=wrap):
            pass
        return self.last_result

    def stream_ids(self, prompt_ids: Sequence[int], req: Request, cancel: threading.Event | None = None,
                   wrap: Callable[[Policy], Policy] | None = None) -> Iterator[str]:
        """Generate from token ids, yielding text pieces as the steps commit them (the Result is then
        `engine.last_result`). Once `cancel` is set the generation stops after the step that is running
        (finish_reason "cancelled"). The prompt is checked now, before the first step. `wrap`: as generate_ids'."""
        return self._stream(self._checked(list(prompt_ids)), req, cancel, wrap)

    def prompt_ids(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """The token ids of a prompt (see `encode`), checked to be non-empty and to fit the context window."""
        return self._checked(self.encode(prompt, chat))

    def _checked(self, ids: list[int]) -> list[int]:
        if not ids:
            raise CasspecError("the prompt is empty: pass some text")
        if len(ids) >= self.cache.capacity:
            raise CasspecError(f"the prompt has {len(ids)} tokens but the context window holds {self.cache.capacity}:"
                               " shorten the prompt")
        vocab = self.model.spec.vocab_size
        bad = next((i for i in ids if isinstance(i, bool) or not isinstance(i, Integral) or not 0 <= i < vocab), None)
        if bad is not None:
            raise CasspecError(f"the prompt holds the token id {repr(bad)[:40]}: the model's ids are integers in "
                               f"[0, {vocab}); pass ids from its tokenizer")
        return ids

    # ------------------------------------------------------------------ one generation at a time
    @contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the engine for one generation: another thread waits; this thread, if it already holds it (an
        unfinished stream), gets an error instead of a deadlock."""
        me = threading.get_ident()
        if self._owner == me:
            raise CasspecError("this thread has an unfinished generation on this engine (a stream not read to its"
                               " end): finish it or close() it first")
        self._lock.acquire()
        self._owner = me
        try:
            yield
        finally:
            self._owner = None
            self._lock.release()  # (a plain Lock: a stream closed by another thread may release it)

    def _stream(self, prompt_ids: list[int], req: Request, cancel: threading.Event | None = None,
                wrap: Callable[[Policy], Policy] | None = None) -> Iterator[str]:
        """The generation's text pieces, the engine held throughout: blocks of tokens from the decode loop, cut at
        EOS, a stop string or the token budget; its Result is `last_result`."""
        with self.hold(), paused_gc():
            live, dec = self.open(prompt_ids, req, self.slot, cancel, wrap)
            try:
                for block in dec.steps():  # (step.py: draft, verify, accept, update)
                    if piece := live.feed(block):
                        yield piece
                    if live.finished or live.cancelled():
                        break
            finally:  # (also when the caller stops early): what the cache holds, for the next prompt to reuse
                self.slot.keep(dec.ctx.history)
                dec.finish()
            _, last = self.close(live)
            if last:
                yield last

    def open(self, prompt_ids: list[int], req: Request, slot: CacheSlot, cancel: threading.Event | None = None,
             wrap: Callable[[Policy], Policy] | None = None,
             prefilled: Prefilled | None = None) -> tuple[Live, Decoding]:
        """Start a generation on slot's cache (the caller holds the engine): its policy (the levels it uses built
        or read back the first time), the prompt's forward (what the slot holds of it reused; or `prefilled`, run
        already, its KV in the cache), the first token. Returns its text side and its decode loop, whose first
        block is that token."""
        t0 = time.perf_counter()
        started = prefilled.started if prefilled is not None else t0
        stats = Stats(method=req.method, prompt_tokens=len(prompt_ids), latency=self.latency_source,
                      kernels=self.kernels, sources=self.drafters.describe(req))
        policy = make_policy(req, self.drafters)
        if wrap is not None:
            policy = wrap(policy)
        stats.setup, self.setup = dict(self.setup, levels=time.perf_counter() - t0), {}
        stats.resident_mb = resident_bytes() / 2**20
        stats.weights_mb = self.model.weight_bytes() / 2**20
        live = Live(req, stats, self.decode, self.eos_ids, cancel, started)
        return live, self._decoding(prompt_ids, req, stats, policy, slot, prefilled)

    @torch.inference_mode()
    def _decoding(self, prompt_ids: list[int], req: Request, stats: Stats, policy: Policy,
                  slot: CacheSlot, prefilled: Prefilled | None) -> Decoding:
        """The prompt's forward (the rest of what the slot's cache holds of it), unless run already, and the decode
        loop after it."""
        cache = slot.cache
        seed = seed_of(req)
        # draws of drafts sampled from q (sd-rs) and of their checks; deterministic drafts use position noise, which
        # the levels' coupled drafts read too
        generator = None if req.sampling.greedy else torch.Generator().manual_seed(seed)
        noise = None if req.sampling.greedy else Noise(seed, self.model.lm_head.shape[0])
        if prefilled is None:
            stats.reused_tokens = slot.reusable(prompt_ids) if self.reuse_prefix else 0
            cache.rollback(stats.reused_tokens)
            with stats.timer("prefill"):  # the rest of the prompt in one forward; its last row gives the first token
                logits = prefill(self.model, cache, prompt_ids)
        else:
            logits, stats.reused_tokens, stats.prefill_seconds = prefilled.logits, prefilled.reused, prefilled.seconds
        root = pick(logits, req.sampling, noise, len(prompt_ids))
        stats.target_forwards = 1
        ctx = DraftContext(self.model, cache, prompt_ids + [root], req.sampling, generator, self.eos_ids,
                           budget=req.max_new_tokens - 1, latency=self.latency, noise=noise,
                           shared=self.shared, tenant=req.tenant)
        return Decoding(ctx, req, stats, policy, self.latency, generator, noise)

    def close(self, live: Live, busy: bool = False) -> tuple[Result, str]:
        """End a generation: its Result (also this thread's `last_result`) and the text it still held back; the
        state learned is kept: written now, or where other generations still run (busy: a batch's), once
        STATE_WRITE_EVERY_S have passed since it was last written (the write, ~3.4 ms natively on the AMD EPYC,
        stalls them)."""
        kernels = f"{live.stats.kernels}; {self.graphs.stats}" if self.graphs is not None else None
        result, last = live.close(kernels)
        self._local.result = result
        if self.state is not None and (not busy or time.monotonic() - self._state_written >= STATE_WRITE_EVERY_S):
            self.state.save(self.latency, self._state_origin, self.drafters.trackers)
            self._state_written = time.monotonic()
        return result, last

    def forget_prefix(self) -> None:
        """The next generation prefills its whole prompt (a new conversation: nothing left in the cache is reused)."""
        self.slot.forget()

    def extend_prefix(self, ids: Sequence[int]) -> torch.Tensor:
        """Commit the target's KV for ids[cache.length:] (ids must start with the committed tokens) in one
        forward; returns the logits of the last token [1, V]."""
        return prefill(self.model, self.cache, ids)
