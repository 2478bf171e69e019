"""The engine: prompt in, tokens out. The decode loop is draft -> verify -> accept -> update.

Invariant: the KV cache holds every committed token except the last one (the tree root); each step runs ONE
target forward over [root, draft nodes...], accepts a path, commits the path's KV and emits the accepted
draft tokens plus the target's own next token (the bonus token), which becomes the next root.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

import torch

from dsia.errors import CasspecError
from dsia.kvcache import KVCache
from dsia.levels import LevelConfig, LevelRegistry
from dsia.model import Transformer
from dytc.acceptance import PLD, AcceptanceTracker
from dytc.cascade import Cascade, CascadeConfig
from dytc.latency import TARGET as TARGET_LEVEL
from dytc.latency import FeatureSpec, LatencyModel, machine_info, select_profile
from dytc.policies import ChainPolicy, DraftContext, PldPolicy, Policy, TreePolicy
from dytc.router import DyTC, RouterConfig
from dytc.sampling import SamplingParams, warp
from dytc.tree import DraftTree, ancestor_mask, is_chain, position_ids
from dytc.verify import coupled_sample, gumbel_noise, verify_coupled, verify_greedy, verify_sampling

from .loading import Loaded, load

METHODS = ("ar", "pld", "sd", "tree", "vc", "tree+vc", "hc", "vc+hc", "dytc")  # decoding methods (drafting policies)
SINGLE_LEVEL = ("sd", "tree")  # methods drafting with Request.level
MULTI_LEVEL = ("vc", "tree+vc", "hc", "vc+hc", "dytc")  # methods drafting with Request.levels (empty: their defaults)

Prompt = str | Sequence[dict]  # raw text or chat messages [{"role": ..., "content": ...}]


@dataclass(frozen=True)
class Request:
    max_new_tokens: int = 256  # hard cap on emitted tokens
    sampling: SamplingParams = SamplingParams()  # greedy by default
    stop: tuple[str, ...] = ()  # stop strings: generation ends once the text contains one (excluded from text)
    seed: int | None = None  # seed of the sampling generator; None = fresh randomness
    method: str = "ar"  # decoding method, one of METHODS
    level: str = "int4"  # the draft level of the single-level methods (sd, tree)
    levels: tuple[str, ...] = ()  # sources of vc / dytc (level names, strongest first) and of hc / vc+hc
    # (segments "LEVEL*K" or "pld*K", in chain order); empty = the method's defaults
    router: RouterConfig | None = None  # dytc's settings (its `levels` are replaced by the request's); None = default

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise CasspecError(f"max_new_tokens must be an integer >= 1 (got {self.max_new_tokens!r})")
        if self.method not in METHODS:
            raise CasspecError(f"unknown method {self.method!r}: use one of {', '.join(METHODS)}")
        LevelConfig.parse(self.level)  # a clear error for a bad level name, before any work
        if self.levels:
            if self.method not in MULTI_LEVEL:
                raise CasspecError(f"levels are for {', '.join(MULTI_LEVEL)}; {self.method} takes one level")
            parse_sources(self.method, self.levels)
        if any(not s for s in self.stop):
            raise CasspecError("stop strings must not be empty: drop the empty --stop")


def parse_sources(method: str, levels: Sequence[str]) -> list[tuple[str, int]]:
    """Request.levels of a multi-level method -> [(source, segment tokens or 0)]; one clear error if malformed."""
    out = []
    for item in levels:
        name, star, k = item.partition("*")
        if method in ("hc", "vc+hc"):
            if not star or not k.isdigit() or int(k) < 1:
                raise CasspecError(f"hc segment {item!r} must be SOURCE*K with K >= 1 tokens, e.g. int4*4 or pld*3")
        elif star:
            raise CasspecError(f"{method} takes level names without *K (got {item!r}); segments are for hc")
        if name != PLD:
            LevelConfig.parse(name)
        elif method in ("vc", "tree+vc", "dytc"):
            raise CasspecError(f"{method} always uses prompt lookup at the bottom: list only dsia levels")
        out.append((name, int(k) if star else 0))
    return out


@dataclass
class Stats:
    method: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0  # wall time of the whole generation, prefill included
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    target_forwards: int = 0  # target forwards that emitted tokens (the prefill emits the first token)
    draft_forwards: int = 0  # draft-level forwards (0 for ar and pld)
    tree_nodes: int = 0  # draft nodes verified, over all steps (root excluded)
    finish_reason: str = ""  # eos | stop | length | context
    latency: str = ""  # where the latency predictor comes from (a profile, or online fitting)
    predicted_verify_seconds: float = 0.0  # what the predictor expected the verification forwards to take
    accepted_by_depth: list[int] = field(default_factory=list)  # steps whose accepted path reached depth d+1
    policy: dict = field(default_factory=dict)  # the drafting policy's own report (dytc: levels, fallbacks, ...)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens emitted per target forward, counting the bonus token (AR = 1.0)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d.update(tokens_per_s=self.tokens_per_s, mean_accepted_tokens=self.mean_accepted_tokens)
        return d

    def summary(self) -> str:
        return (f"[{self.method}] {self.new_tokens} tokens in {self.seconds:.2f}s ({self.tokens_per_s:.1f} tok/s); "
                f"prompt {self.prompt_tokens} tokens, prefill {self.prefill_seconds:.2f}s; "
                f"{self.target_forwards} target forwards, mean accepted {self.mean_accepted_tokens:.2f}; "
                f"draft {self.draft_seconds:.2f}s, verify {self.verify_seconds:.2f}s "
                f"(predicted {self.predicted_verify_seconds:.2f}s); finish: {self.finish_reason}; "
                f"latency: {self.latency}" + (f"; {json.dumps(self.policy)}" if self.policy else ""))


@dataclass
class Result:
    text: str  # the generated text (special tokens and the stop string excluded)
    token_ids: list[int]  # the generated token ids (an EOS that ended generation included)
    stats: Stats


class Engine:
    def __init__(self, loaded: Loaded, max_context: int | None = None) -> None:
        self.hf_model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.name = loaded.name
        self.model = Transformer.from_hf(loaded.model)
        if max_context is not None and max_context < 2:
            raise CasspecError(f"max_context must be >= 2 (got {max_context})")
        self.cache: KVCache = self.model.new_cache(max_context)
        self.eos_ids = self._eos_ids()
        self.levels = LevelRegistry(self.model)  # draft levels, built on first use and reused
        self.latency, self.latency_source = self._latency_model()
        self.trackers: dict[str, AcceptanceTracker] = {}  # dytc acceptance estimates, per router configuration
        self.last_result: Result | None = None  # the Result of the latest generation (also when streamed)

    @classmethod
    def from_pretrained(cls, model: str | None = None, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu", max_context: int | None = None) -> "Engine":
        """model: None (embedded SmolLM2-135M-Instruct), an HF checkpoint folder, or a .gguf file."""
        return cls(load(model, dtype, device), max_context)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def _latency_model(self) -> tuple[LatencyModel, str]:
        """The predictor of the profile measured on this machine for this model and dtype; without one, an
        empty model that learns online from this engine's own timings."""
        dtype = str(self.dtype).removeprefix("torch.")
        path = select_profile(machine_info(self.device.type), self.name, dtype)
        if path is not None:
            return LatencyModel.from_json(json.loads(path.read_text())["predictor"]), f"profile {path.name}"
        s = self.model.spec
        elem = self.model.embed.element_size()
        spec = FeatureSpec.for_model(self.model.weight_bytes() // elem, s.n_layers, s.n_heads, s.n_kv_heads,
                                     s.head_dim, elem)
        return LatencyModel(spec), "no profile for this machine, model and dtype: fitting online from own timings"

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
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
    def generate(self, prompt: Prompt, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, stop: Sequence[str] | None = None, seed: int | None = None, method: str = "dytc",
                 level: str = "int4", levels: Sequence[str] = (), stream: bool = False,
                 chat: bool | None = None) -> Result | Iterator[str]:
        """Generate from a prompt. Returns a Result, or with stream=True an iterator of text pieces (the pieces
        concatenate to the final text; the Result is then available as `engine.last_result`)."""
        req = Request(max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature, top_k, top_p),
                      stop=tuple(stop or ()), seed=seed, method=method, level=level, levels=tuple(levels))
        ids = self._checked(self.encode(prompt, chat))
        if stream:
            return self._stream(ids, req)
        return self.generate_ids(ids, req)

    def generate_ids(self, prompt_ids: Sequence[int], req: Request) -> Result:
        """Generate from token ids (the bench and tests use this to skip templating)."""
        for _ in self._stream(self._checked(list(prompt_ids)), req):
            pass
        return self.last_result

    def _checked(self, ids: list[int]) -> list[int]:
        if not ids:
            raise CasspecError("the prompt is empty: pass some text")
        if len(ids) >= self.cache.capacity:
            raise CasspecError(f"the prompt has {len(ids)} tokens but the context window holds {self.cache.capacity}:"
                               " shorten the prompt")
        return ids

    # ------------------------------------------------------------------ text and stops
    def _stream(self, prompt_ids: list[int], req: Request) -> Iterator[str]:
        stats = Stats(method=req.method, prompt_tokens=len(prompt_ids), latency=self.latency_source)
        out: list[int] = []
        hold = max((len(s) for s in req.stop), default=1) - 1  # chars a stop string could still claim
        sent = 0
        text = ""
        t0 = time.perf_counter()
        for block in self._decode(prompt_ids, req, stats):
            for tok in block:
                out.append(tok)
                if tok in self.eos_ids:
                    stats.finish_reason = "eos"
                    break
                if req.stop:
                    text = self.decode(out)
                    cut = min((i for i in (text.find(s) for s in req.stop) if i >= 0), default=-1)
                    if cut >= 0:
                        text = text[:cut]
                        stats.finish_reason = "stop"
                        break
                if len(out) >= req.max_new_tokens:
                    stats.finish_reason = "length"
                    break
            if stats.finish_reason:
                break
            text = self.decode(out)
            safe = len(text) - hold
            while safe > sent and text[safe - 1] == "\ufffd":  # an unfinished UTF-8 sequence: wait for more
                safe -= 1
            if safe > sent:
                yield text[sent:safe]
                sent = safe
        if stats.finish_reason != "stop":
            text = self.decode(out)
        stats.new_tokens = len(out)
        stats.seconds = time.perf_counter() - t0
        if not stats.finish_reason:
            stats.finish_reason = "context"
        self.last_result = Result(text=text, token_ids=out, stats=stats)
        if len(text) > sent:
            yield text[sent:]

    # ------------------------------------------------------------------ the decode loop
    def policy(self, req: Request) -> Policy:
        """The drafting policy of a method (a fresh one per generation; levels are shared)."""
        if req.method == "ar":
            return Policy()
        if req.method == "pld":
            return PldPolicy()
        if req.method in SINGLE_LEVEL:
            level = self.levels.get(req.level)
            if req.method == "sd":
                return ChainPolicy(level, latency=self.latency)
            return TreePolicy(level, latency=self.latency)
        sources = parse_sources(req.method, req.levels) or self.default_sources(req.method)
        if req.method == "dytc":
            names = tuple(n for n, _ in sources)
            cfg = replace(req.router or RouterConfig(), levels=names)
            tracker = self.trackers.setdefault(repr(cfg), AcceptanceTracker())  # estimates carry over generations
            return DyTC([self.levels.get(n) for n in names], self.latency, tracker, cfg)
        if req.method in ("vc", "tree+vc"):
            return Cascade.vc([self.levels.get(n) for n, _ in sources], tree=req.method == "tree+vc")
        segments = sources
        levels = {n: self.levels.get(n) for n, _ in segments if n != PLD}
        return Cascade.hc(levels, segments, vertical=req.method == "vc+hc")

    def default_sources(self, method: str) -> list[tuple[str, int]]:
        """The levels (and hc segments) of a multi-level method when the request names none. On the CPU the int4
        kernels are the cheapest drafts; on a GPU a small model's forward costs its kernel launches, whatever the
        weights' precision, so fewer layers (a skip level) is what makes a draft cheaper there."""
        cpu = self.device.type == "cpu"
        if method == "dytc":
            return [(n, 0) for n in (RouterConfig.levels if cpu else ("skip0.4",))]
        if method in ("vc", "tree+vc"):
            return [("int4" if cpu else "skip0.4", 0)]
        return list(CascadeConfig.hc_segments) if cpu else [("skip0.4", 4), (PLD, 4)]

    @torch.inference_mode()
    def _decode(self, prompt_ids: list[int], req: Request, stats: Stats) -> Iterator[list[int]]:
        """Yield blocks of committed tokens until the caller stops or the context window is full."""
        model, cache = self.model, self.cache
        generator = None
        seed = 0
        if not req.sampling.greedy:
            seed = req.seed if req.seed is not None else int(torch.randint(0, 2**62, ()).item())
            generator = torch.Generator(device="cpu")  # draws of drafts sampled from q (sd, tree) and their checks
            generator.manual_seed(seed)
        cache.rollback(0)
        policy = self.policy(req)

        # prefill: the whole prompt in one forward; its last row gives the first token
        t = time.perf_counter()
        logits = self.extend_prefix(prompt_ids)
        root = self._pick(logits, req.sampling, seed, len(prompt_ids))
        stats.prefill_seconds = time.perf_counter() - t
        stats.target_forwards = 1
        ctx = DraftContext(model, cache, prompt_ids + [root], req.sampling, generator, self.eos_ids,
                           budget=req.max_new_tokens - 1)
        t = time.perf_counter()
        policy.begin(ctx)
        stats.draft_seconds += time.perf_counter() - t
        yield [root]

        while cache.length + 1 < cache.capacity:
            t = time.perf_counter()
            tree = policy.draft(ctx)  # draft
            stats.draft_seconds += time.perf_counter() - t
            t = time.perf_counter()
            chain = is_chain(tree.parents)
            if self.latency.known(TARGET_LEVEL):
                stats.predicted_verify_seconds += self.latency.predict_ms(TARGET_LEVEL, len(tree), cache.length,
                                                                          not chain)[0] / 1e3
            logits = self._verify_forward(tree)  # verify: one target forward over the whole tree
            verify_ms = (time.perf_counter() - t) * 1e3
            context = cache.length
            path, bonus = self._accept(tree, logits, req.sampling, generator, seed, context)  # accept
            cache.commit(path)  # update: the accepted path's KV joins the committed prefix
            stats.verify_seconds += time.perf_counter() - t
            self.latency.observe(TARGET_LEVEL, len(tree), context, verify_ms, not chain)
            emitted = [tree.tokens[i] for i in path[1:]] + [bonus]
            ctx.history.extend(emitted)
            ctx.budget -= len(emitted)
            t = time.perf_counter()
            policy.observe(ctx, tree, path, emitted)
            stats.draft_seconds += time.perf_counter() - t
            stats.target_forwards += 1
            stats.tree_nodes += len(tree) - 1
            depth = len(path) - 1
            while len(stats.accepted_by_depth) < depth:
                stats.accepted_by_depth.append(0)
            for d in range(depth):
                stats.accepted_by_depth[d] += 1
            stats.draft_forwards = ctx.draft_forwards
            stats.policy = policy.report()
            yield emitted

    @torch.inference_mode()
    def extend_prefix(self, ids: Sequence[int]) -> torch.Tensor:
        """Commit the target's KV for ids[cache.length:] (ids must start with the committed tokens) in one
        forward; returns the logits of the last token [1, V]."""
        cache, dev = self.cache, self.device
        start, n = cache.length, len(ids)
        logits = self.model.forward(cache, torch.tensor(ids[start:], device=dev), torch.arange(start, n, device=dev),
                                    start, logits_rows=slice(n - 1 - start, n - start))
        cache.commit(list(range(n - start)))
        return logits

    def _verify_forward(self, tree: DraftTree) -> torch.Tensor:
        """One target forward over the flattened tree, written to scratch. Returns logits [N, V]."""
        cache, dev = self.cache, self.device
        tokens = torch.tensor(tree.tokens, device=dev)
        pos = position_ids(tree.parents, cache.length, dev)
        mask = None if is_chain(tree.parents) else ancestor_mask(tree.parents, dev)
        return self.model.forward(cache, tokens, pos, cache.length, mask)

    # sampling runs on the CPU (a few [N, V] rows per step). Deterministic drafts (ar, pld, vc, tree+vc, hc, dytc) are
    # checked against position-owned Gumbel noise (dytc.verify.verify_coupled): a seed then gives the same tokens
    # whatever was drafted. Drafts sampled from q (sd, tree when sampling) go through recursive rejection sampling.
    @staticmethod
    def _pick(logits: torch.Tensor, sampling: SamplingParams, seed: int, position: int) -> int:
        if sampling.greedy:
            return int(logits[-1].argmax())
        return coupled_sample(warp(logits[-1:].cpu(), sampling)[0], gumbel_noise(seed, position, logits.shape[-1]))

    @staticmethod
    def _accept(tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None,
                seed: int, root_position: int) -> tuple[list[int], int]:
        if sampling.greedy:
            return verify_greedy(tree, logits)
        probs = warp(logits.cpu(), sampling)  # [N, V]
        if all(q is None for q in tree.q):
            return verify_coupled(tree, probs, seed, root_position)
        return verify_sampling(tree, probs, generator)
