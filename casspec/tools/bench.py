"""Spec-Bench runner: every method over every question (all turns), greedy, batch 1, in one process.

Spec-Bench's metrics: speed of a question = new tokens / wall time (all turns summed); tokens_per_s of a
method = mean of its per-question speeds; speedup = tokens_per_s / the baseline's; mean accepted tokens =
tokens emitted / target forwards (AR = 1.0). The baseline `hf-ar` is HF transformers `generate` on the same
loaded weights and always runs, so every ratio comes from one run on one machine state.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from dsia.errors import CasspecError
from dsia.levels import LevelConfig
from dytc.machine import machine_info
from dytc.ngram import PLD_NUM_TOKENS
from dytc.router import RouterConfig
from dytc.sampling import SamplingParams
from dytc.sources import BOTTOMS

from ..loading.checkpoints import load
from ..runtime.defaults import BENCH_MAX_NEW_TOKENS, LEVEL
from ..runtime.engine import Engine
from .lcpp import LCPP_METHODS, lcpp_runner
from .lcppserver import LCPP_SPEC, lcpp_spec_runner
from ..runtime.method_table import METHODS, MULTI_LEVEL, WITH_BOTTOM, parse_sources
from .divergence import divergences, first_difference
from ..calibrate.questions import Answer, Question, TurnFn
from ..runtime.request import Request
from ..runtime.stats import policy_ms_per_step

BASELINE = "hf-ar"
# dytc ablations: `dytc~const` with the latency predictor replaced by constant costs (verification 1 step whatever
# its size, a draft forward 0.3 step), `dytc~nofallback` never verifying the root alone
DYTC_VARIANTS = {"const": {"router": RouterConfig(constant_cost=0.3)},
                 "nofallback": {"router": RouterConfig(fallback=False)},
                 "nooverhead": {"router": RouterConfig(step_overhead=False)}}
# any method with lookups beneath its levels: `vc~maxgram`, `dytc~both`, ... (the bottom, see sources.BOTTOMS)
BOTTOM_VARIANTS = {name: {"bottom": name} for name in BOTTOMS}
SAMPLING_SEED = 0  # default seed of every sampled generation (so that repeats reproduce their tokens; --seed)
HF_METHODS = {"hf-ar": {}, "hf-pld": {"prompt_lookup_num_tokens": PLD_NUM_TOKENS},  # HF generate kwargs per method
              "hf-ar-compiled": {}}  # over a static cache of the engine's context size, which HF's generate
# compiles (torch.compile, mode "reduce-overhead": CUDA graphs) on a GPU, the fastest HF setup there (GPU only)
HF_COMPILED = "hf-ar-compiled"
BASELINES = tuple(HF_METHODS) + LCPP_METHODS + (LCPP_SPEC,)  # other engines' generation, beside casspec's methods
BENCH_METHODS = BASELINES + METHODS


def writable_folder(path: str | Path) -> Path:
    """The output folder, created and checked writable before any work (one clear error if it is not)."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".casspec-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise CasspecError(f"cannot write to the output folder {str(out)!r} ({e.strerror}): pass a writable --out") \
            from None
    return out


def variants(method: str) -> dict[str, dict]:
    """The `~VARIANT`s a method takes: Request fields they set."""
    return {**(BOTTOM_VARIANTS if method in WITH_BOTTOM else {}), **(DYTC_VARIANTS if method == "dytc" else {})}


def method_request(method: str, level: str = LEVEL, max_new_tokens: int = BENCH_MAX_NEW_TOKENS,
                   sampling: SamplingParams = SamplingParams(), seed: int | None = None, tenant: str = "") -> Request:
    """The Request of a bench method spec: `sd:int8`, `tree:skip0.4` (one level), `dytc:int4/int8`, `vc:int4`
    (levels, strongest first), `hc:int4*4/int4+vocab*3/maxgram*3` (segments); `vc~maxgram`, `dytc~both` (the
    lookups beneath the levels), `dytc~const` (DYTC_VARIANTS). tenant: whose memory of earlier generations the
    recycle and suffix sources use (Request.tenant)."""
    name, _, spec = method.partition(":")
    name, _, variant = name.partition("~")
    fields = variants(name)[variant] if variant else {}
    if name in MULTI_LEVEL:
        levels = tuple(spec.split("/")) if spec else ()
        return Request(max_new_tokens=max_new_tokens, method=name, levels=levels, sampling=sampling, seed=seed,
                       tenant=tenant, **fields)
    return Request(max_new_tokens=max_new_tokens, method=name, level=spec or level, sampling=sampling, seed=seed,
                   tenant=tenant)


def parse_methods(spec: str | Sequence[str]) -> list[str]:
    """Method names, baseline first. A method may name its level(s): `sd:int8`, `dytc:int4/int8`, `hc:int4*4/pld*3`."""
    names = [m.strip() for m in (spec.split(",") if isinstance(spec, str) else spec) if m.strip()]
    def known(m: str) -> bool:
        name, _, variant = m.split(":")[0].partition("~")
        if variant and variant not in variants(name):
            return False
        return name in BENCH_METHODS and not (":" in m and name in BASELINES)

    unknown = [m for m in names if not known(m)]
    if unknown or not names:
        raise CasspecError(f"unknown method(s) {', '.join(unknown) or '(none given)'}: "
                           f"use any of {', '.join(BENCH_METHODS)} (sd and tree take a level: sd:int8; "
                           "vc and dytc levels: dytc:int4/int8; hc segments: hc:int4*4/pld*3; the lookups beneath vc, "
                           f"tree+vc, vc+hc, dytc: {', '.join('~' + v for v in BOTTOM_VARIANTS)}; dytc variants: "
                           f"{', '.join('dytc~' + v for v in DYTC_VARIANTS)})")
    for m in names:
        if ":" in m:
            name, _, lv = m.partition(":")
            name = name.partition("~")[0]
            if name in MULTI_LEVEL:
                parse_sources(name, lv.split("/"))
            else:
                LevelConfig.parse(lv)
    if BASELINE in names:
        names.remove(BASELINE)
    return [BASELINE] + list(dict.fromkeys(names))  # the baseline always runs, first


STAT_SUMS = ("reused_tokens", "prefill_seconds", "draft_seconds", "draft_forward_seconds", "verify_seconds",
             "predicted_verify_seconds", "draft_forwards", "tree_nodes", "noise_seconds")


def _hf_runner(engine: Engine, kwargs: dict, sampling: SamplingParams, static_cache: bool = False,
               seed: int = SAMPLING_SEED) -> TurnFn:
    # (a native engine holds no float model: the HF baseline loads the same file's, dequantized)
    model = engine.hf_model if engine.hf_model is not None else load(engine.source, "float32", engine.device).model
    cache = None
    if static_cache:  # one cache for every turn: a fixed shape, so HF compiles its step once
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=engine.cache.capacity)
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    eos = sorted(engine.eos_ids)
    if sampling.greedy:
        decoding = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        decoding = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)

    @torch.inference_mode()
    def run(ids: list[int], max_new_tokens: int) -> tuple[list[int], int, dict]:
        x = torch.tensor([ids], device=engine.device)
        calls[0] = 0
        torch.manual_seed(seed)
        extra = dict(kwargs)
        if cache is not None:
            cache.reset()
            extra["past_key_values"] = cache
            max_new_tokens = min(max_new_tokens, engine.cache.capacity - len(ids))
        with warnings.catch_warnings():  # (newer transformers name the argument `cache`; both accept this one)
            warnings.simplefilter("ignore", FutureWarning)
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=eos[0], **decoding, **extra)
        return out[0, len(ids):].tolist(), calls[0], {}

    return run


def _engine_runner(engine: Engine, method: str, level: str, sampling: SamplingParams,
                   seed: int = SAMPLING_SEED) -> TurnFn:
    def run(ids: list[int], max_new_tokens: int) -> tuple[list[int], int, dict]:
        req = method_request(method, level, max_new_tokens, sampling, seed=None if sampling.greedy else seed,
                             tenant=f"bench {method}")  # (each method remembers only its own earlier generations)
        res = engine.generate_ids(ids, req)
        st = res.stats
        return res.token_ids, st.target_forwards, {k: getattr(st, k) for k in STAT_SUMS + ("accepted_by_depth",
                                                                                           "policy")}

    return run


def make_runner(engine: Engine, method: str, level: str = LEVEL,
                sampling: SamplingParams = SamplingParams(), seed: int = SAMPLING_SEED) -> TurnFn:
    """A turn runner for a bench method spec (HF baselines or engine methods, see method_request); sampled
    generations are seeded with `seed`."""
    if method == HF_COMPILED and engine.device.type != "cuda":
        raise CasspecError(f"{HF_COMPILED} needs --device cuda: HF compiles its generation step only on a GPU")
    if method in HF_METHODS:
        return _hf_runner(engine, HF_METHODS[method], sampling, static_cache=method == HF_COMPILED, seed=seed)
    if method == LCPP_SPEC:
        return lcpp_spec_runner(engine.source, engine.cache.capacity, engine.eos_ids, sampling, seed)
    if method in LCPP_METHODS:
        return lcpp_runner(engine.source, method.endswith("-f32"), engine.cache.capacity, engine.eos_ids, sampling,
                           seed)
    return _engine_runner(engine, method, level, sampling, seed)


def run_question(engine: Engine, run: TurnFn, q: Question, max_new_tokens: int, answer: Answer | None) -> Answer:
    """All turns of one question; the method's own earlier answers go back in as chat history. A question starts a
    new conversation: its first turn prefills from scratch (nothing another method or question left in the KV cache
    is reused); its later turns reuse what its own earlier turns left, as in a chat."""
    first = answer is None
    if first:
        answer = Answer(q.question_id, q.category)
    engine.forget_prefix()
    messages: list[dict] = []
    for i, turn in enumerate(q.turns):
        messages.append({"role": "user", "content": turn})
        ids = engine.encode(messages)
        t0 = time.perf_counter()
        new, forwards, stats = run(ids, max_new_tokens)
        dt = time.perf_counter() - t0
        text = engine.decode(new)
        messages.append({"role": "assistant", "content": text})
        if first:
            answer.turns.append(text)
            answer.token_ids.append(new)
            answer.new_tokens.append(len(new))
            answer.forwards.append(forwards)
            answer.stats.append(stats)
            answer.wall_time.append([dt])
        else:
            if new != answer.token_ids[i]:
                raise RuntimeError(f"question {q.question_id}: a repeat produced different tokens (nondeterminism)")
            answer.wall_time[i].append(dt)
    return answer


def summarize(engine: Engine, answers: dict[str, list[Answer]], max_new_tokens: int, dtype: str,
              sampling: SamplingParams = SamplingParams()) -> dict:
    def speeds(ans: list[Answer]) -> dict[str, list[float]]:
        by: dict[str, list[float]] = {}
        for a in ans:
            by.setdefault(a.category, []).append(a.speed())
        return by

    base = answers[BASELINE]
    base_tps = statistics.fmean(a.speed() for a in base)
    base_cat = {c: statistics.fmean(v) for c, v in speeds(base).items()}
    methods = {}
    for name, ans in answers.items():
        tps = statistics.fmean(a.speed() for a in ans)
        tokens = sum(sum(a.new_tokens) for a in ans)
        forwards = sum(sum(a.forwards) for a in ans)
        identical = None if name == BASELINE or not sampling.greedy else all(
            a.token_ids == b.token_ids for a, b in zip(ans, base, strict=True))
        first_diff = None if identical is not False else [
            (a.question_id, first_difference(ta, tb))
            for a, b in zip(ans, base) for ta, tb in zip(a.token_ids, b.token_ids) if ta != tb]
        methods[name] = {
            "tokens_per_s": tps,
            "speedup": tps / base_tps if base_tps else 0.0,
            "mean_accepted_tokens": tokens / forwards if forwards else 0.0,
            "identical_to_baseline": identical,
            "differing_turns": first_diff,  # (question id, first differing token index) per differing turn
            "questions": len(ans),
            "by_category": {c: {"tokens_per_s": statistics.fmean(v), "speedup": statistics.fmean(v) / base_cat[c]}
                            for c, v in speeds(ans).items()},
            "new_tokens": tokens,
            "target_forwards": forwards,
        }
        methods[name].update(_engine_stats(ans))
    return {"model": engine.name, "device": str(engine.device), "machine": machine_info(engine.device.type),
            "kernels": engine.kernels, "build": engine.build, "dtype": dtype,
            "levels_plane": None if engine.plane is None else {"created": engine.plane.created,
                                                                "verify_ratio": engine.plane.verify_ratio,
                                                                "ranked": [vars(r) for r in engine.plane.ranked]},
            "max_new_tokens": max_new_tokens,
            "sampling": vars(sampling), "baseline": BASELINE, "methods": methods}


def _engine_stats(ans: list[Answer]) -> dict:
    """Draft / verify time split and acceptance by depth, summed over every turn (engine methods only).

    acceptance_by_depth[d] = fraction of verification steps whose accepted path reached depth d + 1."""
    turns = [st for a in ans for st in a.stats if st]
    if not turns:
        return {}
    out = {k: sum(st[k] for st in turns) for k in STAT_SUMS if all(k in st for st in turns)}  # (rows run by an
    # older version may lack a newer key)
    steps = sum(f - 1 for a in ans for f in a.forwards)  # verification forwards (the prefill excluded)
    depth = max((len(st["accepted_by_depth"]) for st in turns), default=0)
    reached = [sum(st["accepted_by_depth"][d] for st in turns if d < len(st["accepted_by_depth"]))
               for d in range(depth)]
    out["acceptance_by_depth"] = [r / steps for r in reached] if steps else []
    out["mean_tree_nodes"] = out["tree_nodes"] / steps if steps else 0.0
    if "draft_forward_seconds" in out and steps:
        out["policy_ms_per_step"] = policy_ms_per_step(out["draft_seconds"], out["draft_forward_seconds"], steps)
    reports = [st["policy"] for st in turns if st.get("policy")]
    if reports:  # dytc: fallbacks, tokens and acceptance per source, predicted vs measured draft time
        pol: dict = {k: sum(r[k] for r in reports) for k in ("steps", "fallback_steps", "explore_steps",
                                                             "predicted_draft_ms", "measured_draft_ms")}
        tested: dict[str, int] = {}
        accepted: dict[str, float] = {}
        drafted: dict[str, int] = {}
        for r in reports:
            for src, n in r["tested_by_source"].items():
                tested[src] = tested.get(src, 0) + n
                accepted[src] = accepted.get(src, 0) + n * r["acceptance_by_source"][src]
            for src, n in r["drafted_by_source"].items():
                drafted[src] = drafted.get(src, 0) + n
        pol.update(drafted_by_source=drafted, tested_by_source=tested,
                   accepted_by_source={s: round(k) for s, k in accepted.items()})
        pol["acceptance_by_source"] = {s: round(accepted[s] / n, 4) for s, n in tested.items() if n}
        pol["first_estimate_origins"] = reports[0]["estimate_origins"]  # where the first turn started
        out["policy"] = pol
    return out


def machine_line(summary: dict) -> str:
    """The CPU (model, cores, fast-kernel flags) and GPU a summary was measured on, in a few words."""
    m = summary.get("machine") or {}
    words = [f"{m.get('cpu', 'unknown CPU')}, {m.get('cores', '?')} cores"]
    if m.get("cpu_flags"):
        words.append(" ".join(m["cpu_flags"]))
    if m.get("gpu"):
        words.append(m["gpu"])
    return "; ".join(words)


def format_table(summary: dict) -> str:
    rows = [("method", "tokens/s", "speedup", "MAT", "identical", "= ar", "questions", "draft s / verify s",
             "policy ms/step")]
    for name, m in summary["methods"].items():
        ident = "-" if m["identical_to_baseline"] is None else str(m["identical_to_baseline"]).lower()
        if m.get("differing_turns"):
            ident += f" ({len(m['differing_turns'])} turns differ)"
        same = "-" if m.get("identical_to_ar") is None else str(m["identical_to_ar"]).lower()
        if m.get("ar_divergences"):
            gaps = [abs(d["gap"]) for d in m["ar_divergences"] if d["gap"] is not None]
            same += f" ({len(m['ar_divergences'])} questions" + (f", max gap {max(gaps):.3g})" if gaps else ")")
        split = f"{m['draft_seconds']:.1f} / {m['verify_seconds']:.1f}" if "draft_seconds" in m else "-"
        policy = f"{m['policy_ms_per_step']:.2f}" if "policy_ms_per_step" in m else "-"
        rows.append((name, f"{m['tokens_per_s']:.2f}", f"{m['speedup']:.3f}", f"{m['mean_accepted_tokens']:.2f}",
                     ident, same, str(m["questions"]), split, policy))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    head = (f"model {summary['model']}, {summary['device']} ({machine_line(summary)}), {summary['dtype']}, "
            f"max_new_tokens {summary['max_new_tokens']}, baseline {summary['baseline']}")
    return head + "\n" + "\n".join(lines) + format_sources(summary)


def format_sources(summary: dict) -> str:
    """Per dytc method, each source's draft tokens: drafted / tested (the parent accepted) / accepted."""
    lines = []
    for name, m in summary["methods"].items():
        pol = m.get("policy") or {}
        tested, accepted = pol.get("tested_by_source", {}), pol.get("accepted_by_source", {})
        cells = [f"{s} {n}/{tested.get(s, 0)}/{accepted.get(s, 0)}"
                 for s, n in sorted(pol.get("drafted_by_source", {}).items(), key=lambda x: -x[1])]
        lines += [f"  {name}: " + ", ".join(cells)] if cells else []
    return "\ndraft tokens per source, drafted/tested/accepted:\n" + "\n".join(lines) if lines else ""


def run_bench(engine: Engine, questions: list[Question], methods: Sequence[str], max_new_tokens: int,
              out_dir: str | Path, dtype: str, repeats: int = 1, progress: bool = True, level: str = LEVEL,
              sampling: SamplingParams = SamplingParams(), seed: int = SAMPLING_SEED) -> dict:
    """Run every method over every question `repeats` times (median wall time per turn); write the answers,
    summary.json and return the summary. Sampled generations are seeded with `seed`."""
    if max_new_tokens < 1:
        raise CasspecError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    if repeats < 1:
        raise CasspecError(f"--repeats must be >= 1 (got {repeats})")
    out = writable_folder(out_dir)
    runners = {m: make_runner(engine, m, level, sampling, seed) for m in methods}
    # warm-up: one untimed generation per method, as long as a timed turn, so that what a method builds on first use
    # (levels, a skip set's search, CUDA graphs per plan and token bucket, HF's compiled step) is not timed
    for m, run in runners.items():
        run(engine.encode([{"role": "user", "content": questions[0].turns[0]}]), max_new_tokens)
    answers: dict[str, list[Answer]] = {m: [] for m in methods}
    # one bar per method; methods interleave per question so that machine drift hits them all alike
    bars = {m: tqdm(total=len(questions) * repeats, desc=m, unit="q", position=i, leave=True,
                    disable=not progress, file=sys.stderr) for i, m in enumerate(methods)}
    for rep in range(repeats):
        # each pass starts with no memory of earlier generations (neither the warm-up's nor an earlier pass's: a
        # repeat would find its own answer in the suffix tree); within a pass a method draws on the questions before
        engine.shared.forget()
        for qi, q in enumerate(questions):
            for m, run in runners.items():
                a = run_question(engine, run, q, max_new_tokens, answers[m][qi] if rep else None)
                if not rep:
                    answers[m].append(a)
                bars[m].update(1)
    for bar in bars.values():
        bar.close()
    for run in runners.values():  # (a runner over another process, llama-server, stops it)
        getattr(run, "close", lambda: None)()
    for m, ans in answers.items():
        with open(out / f"answers-{m}.jsonl", "w", encoding="utf-8") as f:
            for a in ans:
                f.write(json.dumps({"question_id": a.question_id, "category": a.category, "method": m,
                                    "model_id": engine.name,
                                    "choices": [{"index": 0, "turns": a.turns, "new_tokens": a.new_tokens,
                                                 "wall_time": [statistics.median(w) for w in a.wall_time],
                                                 "wall_time_repeats": a.wall_time, "forwards": a.forwards,
                                                 "token_ids": a.token_ids}]}) + "\n")
    summary = summarize(engine, answers, max_new_tokens, dtype, sampling)
    if sampling.greedy:  # (after the timed runs)
        for m, d in divergences(engine, questions, answers, BASELINES).items():
            summary["methods"][m].update(d)
    else:
        summary["seed"] = seed
    summary["repeats"] = repeats
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
