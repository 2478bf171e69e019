"""The command line's arguments: one parser per `casspec` command (generate | serve | bench | levels | profile |
ablate | tune), with the options they share; bad arguments give one error line and exit status 2 (`_Parser`)."""
from __future__ import annotations

import argparse
import os

from dsia.kernels import KERNELS
from dsia.spec import DEFAULT_CONTEXT
from dytc.sources import DEFAULT_BOTTOM

from .loading.native import WEIGHTS
from .runtime.defaults import BENCH_MAX_NEW_TOKENS, LEVEL, MAX_NEW_TOKENS, METHOD


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF checkpoint folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (cuda)")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--max-context", type=int, default=None, help="the context window in tokens: the KV cache and "
                   f"RoPE tables are sized by it (default: the model's, at most {DEFAULT_CONTEXT})")
    p.add_argument("--kernels", default="auto", choices=["auto", *KERNELS], help="the target's dense products: "
                   "auto (the fastest on this machine, measured once and cached) or one kernel forced")
    p.add_argument("--no-graphs", action="store_true", help="on a GPU, run every forward eagerly instead of "
                   "replaying CUDA graphs of the small ones")
    p.add_argument("--no-compile", action="store_true", help="on a GPU, run the elementwise steps eagerly "
                   "instead of compiling each into one kernel (torch.compile)")
    p.add_argument("--no-fast-layers", action="store_true", help="on a CPU, run the decoder layers of each "
                   "forward from Python, with ATen's small steps, instead of one C++ call and casspec's ops (built "
                   "once per machine; the same computation, float32 sums may differ in the last bits)")
    p.add_argument("--batch-invariant", action="store_true", help="bfloat16 on a CPU: compute each row of the "
                   "target's forwards alike whatever the rows around it, so that every method's greedy tokens are "
                   "ar's (about 5-30%% slower forwards; see the README)")
    p.add_argument("--weights", default="float", choices=WEIGHTS, help="float: the checkpoint's weights in --dtype "
                   "(a quantized GGUF dequantized); native: a Q4_0/Q4_1/Q8_0 GGUF run in its stored quantization "
                   "by packed int4 kernels (CPU)")


def _autoprofile(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-autoprofile", action="store_true", help="when no latency profile matches this machine, "
                   "model and dtype, fit the latency online instead of measuring one (about a minute, once)")


def _questions(p: argparse.ArgumentParser, help: str = "Spec-Bench-format JSONL file") -> None:
    """The arguments of commands that run over a questions file."""
    p.add_argument("--questions", required=True, help=help)
    p.add_argument("--limit", type=int, default=None, help="first N questions only")
    p.add_argument("--per-category", type=int, default=None, help="the first N questions of every category")
    p.add_argument("--no-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="casspec", description="Lossless self-speculative decoding.")
    parser.add_argument("--version", action="version", version=f"casspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_generate_args, _serve_args, _bench_args, _levels_args, _profile_args, _ablate_args, _tune_args):
        add(sub)
    return parser


def _method_args(p: argparse.ArgumentParser) -> None:
    """The decoding method and its sources (generate, serve)."""
    from dytc.sources import BOTTOMS

    from .runtime.method_table import METHODS

    p.add_argument("--method", default=METHOD, help=f"decoding method: {', '.join(METHODS)} (default {METHOD})")
    p.add_argument("--level", default=LEVEL, help="draft level of sd / tree (e.g. int4, int8+skip0.2)")
    p.add_argument("--levels", default=None, help="comma-separated sources of vc / dytc (e.g. int4,int8) or hc "
                   "segments (e.g. int4*4,int4+vocab*3,pld*3); default: the method's own")
    p.add_argument("--bottom", default=DEFAULT_BOTTOM, choices=list(BOTTOMS), help="statistical lookups beneath "
                   f"the levels of vc, tree+vc, vc+hc, dytc (default {DEFAULT_BOTTOM})")


def _generate_args(sub) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    g.add_argument("prompt")
    _common(g)
    _method_args(g)
    g.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-chat", action="store_true", help="raw continuation, no chat template")
    g.add_argument("--stats", action="store_true", help="print set-up and generation stats to stderr")
    _autoprofile(g)


def _serve_args(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs casspec[serve])")
    _common(s)
    _method_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one, printed)")
    s.add_argument("--max-queue", type=int, default=32, help="requests that may wait while --max-batch generate; "
                   "one more gets 429 with Retry-After (default 32)")
    s.add_argument("--max-batch", type=int, default=8, help="requests generating at once: every step one target "
                   "forward verifies all their drafts (continuous batching; default 8)")
    s.add_argument("--prefill-chunk", type=int, default=128, help="prompt tokens a step of a request that joins "
                   "others runs in their forward, so their streams go on (0: its whole prompt at once, the others "
                   "waiting; default 128)")
    s.add_argument("--prefix-cache-mb", type=int, default=1024, help="KV of finished requests kept per client (API "
                   "key and user), so that a prompt starting with their tokens skips their forward (MB in all, least "
                   "recently used dropped; 0: none; default 1024)")
    s.add_argument("--ray", action="store_true", help="run engine replicas as Ray Serve deployments behind one "
                   "endpoint (needs casspec[ray]; a local Ray instance, or the cluster $RAY_ADDRESS names)")
    s.add_argument("--replicas", type=int, default=1, help="--ray: engine replicas (default 1)")
    s.add_argument("--max-replicas", type=int, default=None, help="--ray: autoscale between --replicas and this "
                   "many, targeting --max-batch requests in flight per replica")
    s.add_argument("--api-key", default=os.environ.get("CASSPEC_API_KEY"), help="require 'Authorization: Bearer "
                   "KEY' on /v1/* (default: $CASSPEC_API_KEY; none: no key)")
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: the "
                   "checkpoint's name)")
    s.add_argument("--allowed-hosts", default="", help="comma-separated names the Host header may give besides "
                   "localhost, 127.0.0.1, ::1 and --host; another gets 421 (against DNS rebinding); '*': any")
    _autoprofile(s)
    _limits_args(s)


def _limits_args(s: argparse.ArgumentParser) -> None:
    """serve's bounds on what one call and its client may cost: an option per calls.Limits field, its default."""
    from dataclasses import fields

    from .serve.calls import LIMITS_HELP, Limits

    g = s.add_argument_group("limits", "what one call and its client may cost (a call over a limit gets 400 naming "
                             "the parameter)")
    for f in fields(Limits):
        default = "" if f.default is None else " (default %(default)s)"
        g.add_argument(f"--{f.name.replace('_', '-')}", type=float if isinstance(f.default, float) else int,
                       default=f.default, help=LIMITS_HELP[f.name] + default)


def _run_sampling(p) -> None:
    """Sampling options of the measuring commands (bench, ablate): greedy by default, sampled runs seeded."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (sampled runs are seeded)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="seed of every sampled generation")


def _bench_args(sub) -> None:
    b = sub.add_parser("bench", help="Spec-Bench run: methods vs the HF transformers baseline")
    _questions(b)
    b.add_argument("--methods", default="hf-ar,hf-pld,ar", help="comma-separated methods (baselines: hf-ar, hf-pld, "
                   "hf-ar-compiled, with llama-cpp-python lcpp-ar, lcpp-ar-f32, with llama-server lcpp-spec)")
    b.add_argument("--max-new-tokens", type=int, default=BENCH_MAX_NEW_TOKENS)
    b.add_argument("--level", default=LEVEL, help="draft level of sd / tree (or per method: sd:int8)")
    b.add_argument("--repeats", type=int, default=1, help="runs per question; wall time is the median")
    _run_sampling(b)
    b.add_argument("--out", default="bench-out", help="output folder")
    _common(b)
    _autoprofile(b)


def _levels_args(sub) -> None:
    lv = sub.add_parser("levels", help="cost, agreement and memory of draft levels")
    _questions(lv, "Spec-Bench-format JSONL file (first turns are used)")
    lv.add_argument("--levels", default=None, help="comma-separated level names (default: a standard set)")
    lv.add_argument("--max-new-tokens", type=int, default=BENCH_MAX_NEW_TOKENS,
                    help="continuation length scored per prompt")
    lv.add_argument("--json", action="store_true", help="print the JSON report")
    _common(lv)


def _profile_args(sub) -> None:
    pr = sub.add_parser("profile", help="latency of the target and draft levels over a grid, and its predictor")
    pr.add_argument("--levels", default=None, help="comma-separated level names (default: a standard set)")
    pr.add_argument("--quick", action="store_true", help="a reduced grid (under a minute)")
    pr.add_argument("--out", required=True, help="profile JSON to write, e.g. profiles/NAME.json")
    pr.add_argument("--refit", action="store_true", help="re-fit the predictor of the existing --out profile from "
                    "its stored grid (no measuring)")
    pr.add_argument("--plot", action="store_true", help="also write a PNG beside the JSON")
    pr.add_argument("--no-progress", action="store_true")
    _common(pr)


def _ablate_args(sub) -> None:
    ab = sub.add_parser("ablate", help="ablations of levels and cascade algorithms: table, JSON and plots")
    _questions(ab)
    ab.add_argument("--max-new-tokens", type=int, default=BENCH_MAX_NEW_TOKENS)
    ab.add_argument("--rows", default=None, help="comma-separated bench method specs (default: the full ablation)")
    ab.add_argument("--out", default="results", help="results folder (finished rows there are skipped)")
    ab.add_argument("--readme", default=None, help="also write the table and plots into this page's 'ablate' "
                    "section (the results page: docs/results.md)")
    _run_sampling(ab)
    _common(ab)
    _autoprofile(ab)


def _tune_args(sub) -> None:
    tu = sub.add_parser("tune", help="measure which dense kernel is fastest on this machine, per token count")
    tu.add_argument("--refresh", action="store_true", help="measure again even if a choice is cached")
    _common(tu)
