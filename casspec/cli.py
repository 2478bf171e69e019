"""`casspec` command line: generate | serve | bench | levels | profile | ablate | tune (their arguments:
cli_args.py).

Bad input: one error line on stderr, exit status 2."""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Sequence

from dsia.cxx import check_isa_env
from dsia.errors import CasspecError
from dsia.levels import LevelConfig

from .cli_args import build_parser

RUNTIME_ONLY = ("generate", "serve")  # commands that run casspec's runtime alone: no HF model, and they keep what
# generations learn in the user cache (bench and ablate start fresh, so that their rows do not depend on earlier runs)


def _engine_kwargs(args: argparse.Namespace, options: object) -> dict:
    """Engine.from_pretrained's keywords besides the model (`casspec serve --ray` passes them to its replicas)."""
    return dict(dtype=args.dtype, device=args.device, hf=args.command not in RUNTIME_ONLY, options=options)


def _options(args: argparse.Namespace):
    """The engine options the common arguments ask for."""
    from .runtime.target import EngineOptions

    return EngineOptions(max_context=args.max_context, kernels=args.kernels,
                         autoprofile=not getattr(args, "no_autoprofile", True),
                         keep_state=args.command in RUNTIME_ONLY, graphs=False if args.no_graphs else None,
                         compile_pointwise=False if args.no_compile else None,
                         batch_invariant=args.batch_invariant, weights=args.weights,
                         fast_layers=False if args.no_fast_layers else None)


def _engine(args: argparse.Namespace):
    """The engine the common arguments ask for (the slow part: loading, kernel choice)."""
    from .runtime.engine import Engine

    engine = Engine.from_pretrained(args.model, **_engine_kwargs(args, _options(args)))
    # what was loaded (modules, tokenizer, weights) lives as long as the command: out of the garbage collector's
    # sight, each collection visits only what generation allocates (a full one walked the whole heap: 8% of a
    # float32 generate's samples on the AMD EPYC)
    gc.collect()
    gc.freeze()
    return engine


def _levels_list(levels: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in levels.split(",") if x.strip()) if levels else ()


def cmd_tune(args: argparse.Namespace) -> int:
    from dsia.model import Transformer

    from .loading.checkpoints import load
    from .calibrate.tune import format_steps, format_tuning, step_times, tuned_kernels

    if args.weights == "native":  # (no float model is loaded or cached for a native target)
        print("--weights native: the file's blocks run casspec's block kernel, and any product it keeps dense "
              "casspec's own dense kernel (batch-invariant by construction): no dense kernel choice to measure")
    else:
        model = Transformer.from_hf(load(args.model, args.dtype, args.device).model)
        kernels, rec = tuned_kernels(model, refresh=args.refresh)
        print(format_tuning(rec))
        print(f"chosen: {kernels.describe()} ({rec['source']}, {rec['created']})")
        del model
    engine = _engine(args)  # the target as generate runs it (--weights, --batch-invariant, the kernels chosen)
    print(f"the target's forwards ({engine.kernels}):")
    print(format_steps(step_times(engine.model, engine.cache), engine.model.weight_bytes()))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from dytc.sampling import SamplingParams

    from .runtime.request import Request

    if not args.prompt.strip():
        raise CasspecError("the prompt is empty: pass some text")
    levels = _levels_list(args.levels)
    # validate everything before the (slow) load
    Request(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(args.temperature, args.top_k, args.top_p),
            stop=tuple(args.stop), seed=args.seed, method=args.method, level=args.level, levels=levels,
            bottom=args.bottom)
    engine = _engine(args)
    pieces = engine.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_p=args.top_p, top_k=args.top_k, stop=args.stop, seed=args.seed,
                             method=args.method, level=args.level, levels=levels,
                             bottom=args.bottom, stream=True,
                             chat=False if args.no_chat else None)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats:
        print(engine.last_result.stats.setup_summary(), file=sys.stderr)
        print(engine.last_result.stats.summary(), file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .serve.app import ServeConfig, bind, serve
    except ImportError as e:
        raise CasspecError(f"casspec serve needs its extra ({e.name} is missing): pip install 'casspec[serve]'") \
            from None
    from dataclasses import fields

    from .serve.calls import Limits

    # validate everything and take the port before the (slow) load
    limits = Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})
    hosts = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    cfg = ServeConfig(model_name=args.served_model_name, method=args.method, level=args.level,
                      levels=_levels_list(args.levels), bottom=args.bottom, max_queue=args.max_queue,
                      max_batch=args.max_batch, prefix_cache_mb=args.prefix_cache_mb,
                      prefill_chunk=args.prefill_chunk, api_key=args.api_key, limits=limits,
                      allowed_hosts=(*hosts, args.host))
    if args.ray:  # engine replicas on Ray Serve (casspec[ray]) behind one ingress on host:port
        try:
            from .serve.rayserve import run
        except ImportError as e:
            raise CasspecError(f"casspec serve --ray needs its extra ({e.name} is missing): pip install "
                               "'casspec[ray]'") from None
        run(args.model, _engine_kwargs(args, _options(args)), cfg, args.host, args.port, args.replicas,
            args.max_replicas)
        return 0
    if args.replicas != 1 or args.max_replicas is not None:
        raise CasspecError("--replicas and --max-replicas run engine replicas on Ray Serve: add --ray")
    sock = bind(args.host, args.port)
    serve(_engine(args), cfg, sock)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from dytc.sampling import SamplingParams

    from .tools.bench import format_table, parse_methods, run_bench

    from .calibrate.questions import read_questions

    methods = parse_methods(args.methods)
    LevelConfig.parse(args.level)
    questions = read_questions(args.questions, args.limit, args.per_category)
    if args.max_new_tokens < 1:
        raise CasspecError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    engine = _engine(args)
    summary = run_bench(engine, questions, methods, args.max_new_tokens, args.out, args.dtype,
                        repeats=args.repeats, progress=not args.no_progress, level=args.level, sampling=sampling,
                        seed=args.seed)
    print(format_table(summary))
    print(f"answers and summary.json in {args.out}", file=sys.stderr)
    return 0


def cmd_levels(args: argparse.Namespace) -> int:
    import json

    from .calibrate.questions import read_questions
    from .calibrate.agreement import measure_levels
    from .tools.levels_report import format_levels, parse_levels

    names = parse_levels(args.levels)
    questions = read_questions(args.questions, args.limit, args.per_category)
    if args.max_new_tokens < 2:
        raise CasspecError(f"--max-new-tokens must be >= 2 (got {args.max_new_tokens})")
    engine = _engine(args)
    report = measure_levels(engine, questions, names, args.max_new_tokens, progress=not args.no_progress)
    print(json.dumps(report, indent=1) if args.json else format_levels(report))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from .runtime.method_table import default_levels
    from .calibrate.latency_grid import profile
    from .tools.profile_report import check_out, config_for, format_profile, write_profile

    if args.refit:
        import json

        from .tools.profile_report import refit

        try:
            prof = refit(json.loads(Path(args.out).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CasspecError(f"cannot re-fit {args.out!r} ({e.__class__.__name__}: {e}): pass a profile JSON "
                               "written by casspec profile") from None
        print(format_profile(prof))
        print(f"wrote {', '.join(map(str, write_profile(prof, args.out, args.plot)))}", file=sys.stderr)
        return 0
    cfg = config_for(args.quick, args.levels, default_levels(args.device.split(":")[0]))
    check_out(args.out)
    engine = _engine(args)
    prof = profile(engine, cfg, progress=not args.no_progress)
    print(format_profile(prof))
    print(f"wrote {', '.join(map(str, write_profile(prof, args.out, args.plot)))}", file=sys.stderr)
    return 0


def cmd_ablate(args: argparse.Namespace) -> int:
    from dytc.sampling import SamplingParams

    from .tools.ablate import ablate, default_rows, format_results, update_readme
    from .tools.bench import BASELINE, parse_methods
    from .calibrate.questions import read_questions

    questions = read_questions(args.questions, args.limit, args.per_category)
    if args.max_new_tokens < 1:
        raise CasspecError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    rows = parse_methods(args.rows) if args.rows else None
    if args.readme is not None and not Path(args.readme).is_file():
        raise CasspecError(f"--readme {args.readme!r} is not a file")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    engine = _engine(args)
    rows = rows or default_rows(engine)
    assert rows[0] == BASELINE
    summary = ablate(engine, questions, rows, args.max_new_tokens, args.out, args.dtype, progress=not args.no_progress,
                     sampling=sampling, seed=args.seed)
    print(format_results(summary))
    if args.readme:
        update_readme(args.readme, summary, Path(args.out))
    print(f"results.md, results.json and plots in {args.out}", file=sys.stderr)
    return 0


COMMANDS = {"generate": cmd_generate, "serve": cmd_serve, "bench": cmd_bench, "levels": cmd_levels,
            "profile": cmd_profile, "ablate": cmd_ablate, "tune": cmd_tune}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_isa_env()  # (before any slow step)
        return COMMANDS[args.command](args)
    except CasspecError as e:
        print(f"casspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("casspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
