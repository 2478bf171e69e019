"""Server overhead: tokens/s per request and time to first token through `casspec serve` against Engine.generate.

    python scripts/serve_bench.py [--model M] [--dtype float32] [--method dytc] [--questions FILE]
        [--prompts 6] [--max-tokens 128] [--repeats 3] [--no-autoprofile] [--json OUT]

One engine (default: the embedded SmolLM2-135M-Instruct, float32, casspec's runtime alone as `casspec serve` loads
it) serves a real uvicorn server on 127.0.0.1 in a thread of this process. For each prompt (the first turns of
--prompts dev questions, one category after another) and each repeat, the same greedy chat request runs once
through `Engine.generate(stream=True)` and once through the server (POST /v1/chat/completions, streamed, read with
httpx in this process), in alternating order. Both are timed from the call to the last piece: time to first token
is the first text piece, tokens/s is the generated tokens (the server's usage chunk; the Result's) over the whole
time. Reported per prompt: the medians over the repeats; overall: the median of the per-prompt ratios. The server's
time includes HTTP, JSON, the queue and the hop between threads; the client sharing this process (and its GIL)
makes it an upper bound on what a separate client would see. Prints a markdown table and the CPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from casspec.tools.bench import machine_line

from casspec.calibrate.questions import read_questions
from casspec.runtime.engine import Engine
from casspec.serve.app import ServeConfig, background
from dytc.machine import machine_info


def direct(engine: Engine, prompt: str, method: str, max_tokens: int) -> tuple[float, float, int, str]:
    """(seconds to the first piece, seconds in all, tokens, text) of Engine.generate, streamed."""
    t0 = time.perf_counter()
    first, pieces = None, []
    for piece in engine.generate(prompt, max_new_tokens=max_tokens, temperature=0.0, method=method, stream=True):
        first = time.perf_counter() if first is None else first
        pieces.append(piece)
    end = time.perf_counter()
    return (first or end) - t0, end - t0, engine.last_result.stats.new_tokens, "".join(pieces)


def served(http: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int, str]:
    """The same through the server: a streamed chat completion with the usage chunk."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, pieces, tokens = None, [], 0
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            text = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if text:
                first = time.perf_counter() if first is None else first
                pieces.append(text)
    end = time.perf_counter()
    return (first or end) - t0, end - t0, tokens, "".join(pieces)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--method", default="dytc")
    p.add_argument("--questions", default=str(Path(__file__).resolve().parents[2] / "shared/specbench/dev.jsonl"))
    p.add_argument("--prompts", type=int, default=6, help="dev questions, one per category in turn")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-autoprofile", action="store_true")
    p.add_argument("--json", default=None, help="also write the measurements here")
    args = p.parse_args(argv)

    questions = read_questions(args.questions, per_category=1)[:args.prompts]
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, autoprofile=not args.no_autoprofile,
                                    keep_state=False, hf=False)
    rows = []
    with background(engine, ServeConfig(method=args.method)) as url, httpx.Client(timeout=600) as http:
        name = http.get(f"{url}/v1/models").json()["data"][0]["id"]
        warm = questions[0].turns[0]  # first use: levels built or read back, kernels warmed, on both paths
        direct(engine, warm, args.method, args.max_tokens)
        served(http, url, name, warm, args.max_tokens)
        for q in questions:
            prompt = q.turns[0]
            runs: dict[str, list[tuple[float, float, int, str]]] = {"direct": [], "server": []}
            for r in range(args.repeats):
                order = ("direct", "server") if r % 2 == 0 else ("server", "direct")
                for path in order:
                    run = direct(engine, prompt, args.method, args.max_tokens) if path == "direct" else \
                        served(http, url, name, prompt, args.max_tokens)
                    runs[path].append(run)
            row = {"question_id": q.question_id, "category": q.category,
                   "identical": len({run[3] for rs in runs.values() for run in rs}) == 1}
            for path, rs in runs.items():
                row[f"{path}_ttft_ms"] = statistics.median(run[0] for run in rs) * 1e3
                row[f"{path}_tok_s"] = statistics.median(run[2] / run[1] for run in rs)
                row[f"{path}_tokens"] = rs[0][2]
            rows.append(row)
            print(f"{q.category}: direct {row['direct_tok_s']:.1f} tok/s, server {row['server_tok_s']:.1f} tok/s",
                  file=sys.stderr)

    print(f"{engine.name}, {args.dtype}, method {args.method}, greedy, {args.max_tokens} max tokens, median of "
          f"{args.repeats}; {machine_line({'machine': machine_info('cpu')})}\n")
    print("| category | tokens | Engine.generate tok/s | server tok/s | overhead | Engine.generate TTFT ms | "
          "server TTFT ms | same text |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['category']} | {row['direct_tokens']} | {row['direct_tok_s']:.1f} | {row['server_tok_s']:.1f} | "
              f"{1 - row['server_tok_s'] / row['direct_tok_s']:+.1%} | {row['direct_ttft_ms']:.0f} | "
              f"{row['server_ttft_ms']:.0f} | {str(row['identical']).lower()} |")
    ratio = statistics.median(row["server_tok_s"] / row["direct_tok_s"] for row in rows)
    ttft = statistics.median(row["server_ttft_ms"] - row["direct_ttft_ms"] for row in rows)
    print(f"| median | | {statistics.median(r['direct_tok_s'] for r in rows):.1f} | "
          f"{statistics.median(r['server_tok_s'] for r in rows):.1f} | {1 - ratio:+.1%} | "
          f"{statistics.median(r['direct_ttft_ms'] for r in rows):.0f} | "
          f"{statistics.median(r['server_ttft_ms'] for r in rows):.0f} ({ttft:+.0f}) | "
          f"{str(all(r['identical'] for r in rows)).lower()} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info("cpu"), "args": vars(args), "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
