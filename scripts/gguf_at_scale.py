"""casspec's native target at real model sizes, beside llama.cpp on the same GGUF file.

`make` writes a GGUF of a real model's shape (Qwen2.5-0.5B, Qwen2.5-1.5B, Llama-7B) whose weights are random
stored blocks laid out as llama.cpp's Q4_K_M quantizer lays them out (llama_tensor_get_type, src/llama-quant.cpp):
Q4_K everywhere; Q6_K for attn_v and ffn_down in the layers where use_more_bits holds; output Q6_K, and a tied
token_embd takes the output's type (an untied one stays Q4_K); a tensor whose rows (GGUF dims[0], its input width)
are not whole blocks of 256 falls back, Q4_K -> Q5_0 and Q6_K -> Q8_0 (an output or tied embedding -> Q8_0); norms
and Qwen2's q/k/v biases F32. The tokenizer is byte-level BPE (256 byte symbols, one merge) padded to the shape's
vocabulary with <padN> tokens. Tensors are generated and written one at a time (memory: the largest tensor).

    python scripts/gguf_at_scale.py make --shape qwen2.5-0.5b --out /tmp/q05.gguf

(--untied-head: an output tensor beside token_embd for a tied shape, as Qwen's own published files store it.)

`measure` times casspec (Engine.from_pretrained(weights="native")) and llama.cpp (llama-cpp-python for load and
memory, llama-bench for forwards) on the file, each in a process of its own:

    python scripts/gguf_at_scale.py measure /tmp/q05.gguf --out results/at-scale-q05.json

It prints a markdown table (load s, resident MB over the process's baseline, weights, file, ms of 1-, 4-, 8- and
16-token forwards on 64 committed tokens, the bandwidth floor) and writes everything to --out as JSON.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dytc.machine import cpu_model, resident_bytes  # (no torch: the llama.cpp child's baseline stays bare)

SCRIPT = Path(__file__).resolve()
QK_K = 256  # a K-quant's super-block: the row lengths Q4_K / Q6_K take
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # llama.cpp's type for rows that are not whole super-blocks
SCALES = {"Q4_K": 2e-4, "Q6_K": 4e-5, "Q5_0": 5e-3, "Q8_0": 8e-4}  # float16 block scales: weights of std ~0.05
CONTEXT = 4096  # both runtimes' context window
COMMITTED = 64  # committed tokens under the timed forwards
FORWARD_TOKENS = (1, 4, 8, 16)  # the forwards timed: a one-token step, chains, a tree's verification
MB = 10**6  # bytes per MB in the reports (decimal, as the other results pages)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's shape as its GGUF header gives it."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    arch: str  # general.architecture: "qwen2" (q/k/v biases) or "llama"
    rope_theta: float
    tied: bool  # no output tensor: the head is token_embd
    context: int = 4096  # the header's context length
    rms_eps: float = 1e-6


SHAPES = {
    "qwen2.5-0.5b": Shape(896, 4864, 24, 14, 2, 151936, "qwen2", 1e6, True, 32768),
    "qwen2.5-1.5b": Shape(1536, 8960, 28, 12, 2, 151936, "qwen2", 1e6, True, 32768),
    "llama-7b": Shape(4096, 11008, 32, 32, 32, 32000, "llama", 10000.0, False, 4096, 1e-5),
}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's layers that Q4_K_M gives attn_v and ffn_down more bits (integer division as in C)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_shapes(s: Shape) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> [rows, row length] (a matrix) or [n] (F32), in the converter's order."""
    hd = s.hidden // s.heads
    q, kv = s.heads * hd, s.kv_heads * hd
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (s.vocab, s.hidden)}
    for i in range(s.layers):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": (s.hidden,), b + "attn_q.weight": (q, s.hidden),
                b + "attn_k.weight": (kv, s.hidden), b + "attn_v.weight": (kv, s.hidden)}
        if s.arch == "qwen2":
            out |= {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
        out |= {b + "attn_output.weight": (s.hidden, q), b + "ffn_norm.weight": (s.hidden,),
                b + "ffn_gate.weight": (s.intermediate, s.hidden), b + "ffn_up.weight": (s.intermediate, s.hidden),
                b + "ffn_down.weight": (s.hidden, s.intermediate)}
    out["output_norm.weight"] = (s.hidden,)
    if not s.tied:
        out["output.weight"] = (s.vocab, s.hidden)
    return out


def q4_k_m_type(name: str, dims: tuple[int, ...], s: Shape) -> str:
    """The GGML type llama.cpp's Q4_K_M quantizer gives a tensor of this name and [rows, row length]."""
    if len(dims) == 1:
        return "F32"
    cols = dims[1]
    if name == "output.weight" or (name == "token_embd.weight" and s.tied):
        return "Q6_K" if cols % QK_K == 0 else "Q8_0"  # (the output's rule: Q8_0 where rows are not whole blocks)
    kind = "Q4_K"
    if name.startswith("blk.") and name.endswith(("attn_v.weight", "ffn_down.weight")):
        kind = "Q6_K" if use_more_bits(int(name.split(".")[1]), s.layers) else "Q4_K"
    return kind if cols % QK_K == 0 else FALLBACK[kind]


def layout(s: Shape) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (GGML type, dims as tensor_shapes gives them) of the whole file."""
    return {name: (q4_k_m_type(name, dims, s), dims) for name, dims in tensor_shapes(s).items()}


def tensor_data(name: str, kind: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A tensor's stored bytes: random blocks (uint8 [rows, bytes per row]) or F32 (norms ~1, biases small)."""
    from casspec.loading.ggufcodes import random_blocks

    if kind != "F32":
        return random_blocks(kind, dims[0], dims[1], rng, SCALES[kind])
    if name.endswith(".bias"):
        return rng.normal(0, 0.02, dims).astype(np.float32)
    return rng.uniform(0.7, 1.3, dims).astype(np.float32)


def add_metadata(w, s: Shape) -> None:
    """The header's model keys and a byte-level BPE tokenizer padded to the shape's vocabulary."""
    from gguf import TokenType
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    pads = s.vocab - 256 - 1 - 2
    tokens = list(bytes_to_unicode().values()) + ["ab"] + [f"<pad{i}>" for i in range(pads)] + ["<s>", "</s>"]
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_vocab_size(s.vocab)
    w.add_rope_dimension_count(s.hidden // s.heads)
    w.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if s.arch == "qwen2" else "default")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.NORMAL] * (s.vocab - 2) + [TokenType.CONTROL] * 2)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(s.vocab - 2)
    w.add_eos_token_id(s.vocab - 1)


def make(s: Shape, path: Path, seed: int = 0) -> collections.Counter:
    """Write the GGUF of shape `s` to `path`, tensor by tensor; -> how many tensors of each type."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES

    if s.hidden % s.heads or s.vocab < 259 or s.arch not in ("qwen2", "llama"):
        raise ValueError(f"not a shape this script writes: {s}")
    plan = layout(s)
    w = GGUFWriter(str(path), s.arch)
    add_metadata(w, s)
    for name, (kind, dims) in plan.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        nbytes = int(np.prod(dims)) // block * size
        w.add_tensor_info(name, dims if kind == "F32" else (dims[0], dims[1] // block * size),
                          np.dtype(np.float32 if kind == "F32" else np.uint8), nbytes,
                          raw_dtype=None if kind == "F32" else GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for n, (name, (kind, dims)) in enumerate(plan.items()):
        w.write_tensor_data(tensor_data(name, kind, dims, np.random.default_rng([seed, n])))
    w.close()
    return collections.Counter(kind for kind, _ in plan.values())


def casspec_child(path: Path, repeats: int) -> dict:
    """casspec's load, memory and forwards on the file (run in a process of its own)."""
    import torch  # (the baseline: the process with torch, transformers and the engine imported)
    import transformers  # noqa: F401
    import casspec.runtime.engine
    from casspec.calibrate.tune import STEP_CONTEXT, step_times

    assert STEP_CONTEXT == COMMITTED, "the report names COMMITTED as tune's committed tokens"

    baseline = resident_bytes()
    t0 = time.perf_counter()
    engine = casspec.runtime.engine.Engine.from_pretrained(str(path), weights="native", autoprofile=False,
                                                           keep_state=False, max_context=CONTEXT)
    load_s = time.perf_counter() - t0
    resident = resident_bytes()
    times = step_times(engine.model, engine.cache, repeats, FORWARD_TOKENS)
    resident_run = resident_bytes()  # (after the committed tokens' forward; the floor's buffer freed again)
    return {"load_s": load_s, "baseline_bytes": baseline, "resident_bytes": resident,
            "resident_after_prefill_bytes": resident_run, "weight_bytes": engine.model.weight_bytes(),
            "kv_bytes": (engine.cache.k.numel() + engine.cache.v.numel()) * 4, "threads": torch.get_num_threads(),
            "ms": {k: v for k, v in times.items() if k != "floor"}, "floor_ms": times["floor"]}


def meta_child(path: Path) -> dict:
    """casspec's first use of a file: its sha256 and transformers' parse of its tokenizer and config, cached in the
    user cache (so that the timed load is a warm one; the file is read once, into the page cache, too)."""
    from casspec.loading.ggufcheck import GGUFFile
    from casspec.loading.nativeload import meta_entry

    t0 = time.perf_counter()
    with GGUFFile(path) as src:
        src.header()
        meta_entry(src, src.sha256())
    return {"first_use_s": time.perf_counter() - t0}


def llama_cpp_child(path: Path) -> dict:
    """llama.cpp's load and memory (llama-cpp-python, mmap as its default) before and after a COMMITTED-token
    prompt."""
    import llama_cpp

    baseline = resident_bytes()
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=CONTEXT, n_threads=2, n_threads_batch=2, verbose=False)
    load_s = time.perf_counter() - t0
    resident = resident_bytes()
    llm.eval(list(range(3, 3 + COMMITTED)))
    return {"load_s": load_s, "baseline_bytes": baseline, "resident_bytes": resident,
            "resident_after_prefill_bytes": resident_bytes()}


CHILDREN = {"casspec": casspec_child, "meta": meta_child, "llama.cpp": llama_cpp_child}  # measured in a process each


def run_child(kind: str, path: Path, repeats: int) -> dict:
    """One CHILDREN measurement in a new process: its JSON (the last line it prints)."""
    out = subprocess.run([sys.executable, str(SCRIPT), "child", kind, str(path), "--repeats", str(repeats)],
                         capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        raise SystemExit(f"gguf_at_scale: the {kind} measurement failed: {last}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_bench(binary: str, path: Path, repeats: int) -> dict:
    """llama-bench's forwards on the file (2 threads, COMMITTED tokens of depth): ms per forward of each token count
    (tg: one token; pp N: one forward of N), its model size and build."""
    cmd = [binary, "-m", str(path), "-t", "2", "-p", ",".join(str(t) for t in FORWARD_TOKENS[1:]),
           "-n", str(max(FORWARD_TOKENS)), "-d", str(COMMITTED), "-r", str(repeats), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        raise SystemExit(f"gguf_at_scale: llama-bench failed: {last}")
    rows = json.loads(out.stdout)
    ms = {}
    for r in rows:
        tokens = 1 if r["n_gen"] else r["n_prompt"]
        ms[str(tokens)] = (1 if r["n_gen"] else tokens) * 1000 / r["avg_ts"]
    return {"ms": {str(t): ms.get(str(t)) for t in FORWARD_TOKENS}, "weight_bytes": rows[0]["model_size"],
            "build": rows[0].get("build_commit"), "command": " ".join(cmd)}


def table(rec: dict) -> str:
    """The file's markdown table: casspec and llama.cpp."""
    cols = ["runtime", "load s", "resident MB (baseline)", "weights MB", "KV MB", "file MB"]
    cols += [f"{t}-token ms" for t in FORWARD_TOKENS] + ["floor ms"]
    lines = [f"{rec['file']} ({rec['shape_summary']}), CPU: {rec['cpu']}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    gbs = rec["casspec"]["weight_bytes"] / rec["casspec"]["floor_ms"]  # bytes per ms the floor streamed
    for name in ("casspec", "llama.cpp"):
        r = rec[name]
        kv = f"{r['kv_bytes'] / MB:.0f}" if "kv_bytes" in r else "-"
        resident = f"{(r['resident_bytes'] - r['baseline_bytes']) / MB:.0f} ({r['baseline_bytes'] / MB:.0f})"
        cells = [name, f"{r['load_s']:.2f}", resident, f"{r['weight_bytes'] / MB:.0f}", kv,
                 f"{rec['file_bytes'] / MB:.0f}"]
        cells += ["-" if r["ms"].get(str(t)) is None else f"{r['ms'][str(t)]:.1f}" for t in FORWARD_TOKENS]
        cells.append(f"{r['weight_bytes'] / gbs:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"casspec's first use of the file (sha256, tokenizer and config parse, cached): "
              f"{rec['meta']['first_use_s']:.1f} s; floor: the weights read at {gbs / 1e6:.1f} GB/s (measured by "
              "casspec's floor, applied to llama.cpp's model size too)"]
    return "\n".join(lines)


def shape_summary(path: Path) -> str:
    """"arch, layers x hidden, vocab" from the file's header."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def val(key: str) -> int:
        return int(r.fields[f"{arch}.{key}"].parts[-1][0])
    vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    return f"{arch}, {val('block_count')} layers x {val('embedding_length')}, {vocab} tokens"


def measure(path: Path, binary: str, repeats: int) -> dict:
    """Every measurement of the file, each in its own process."""
    rec = {"file": str(path), "file_bytes": path.stat().st_size, "cpu": cpu_model(),
           "shape_summary": shape_summary(path), "date": time.strftime("%Y-%m-%d"), "context": CONTEXT,
           "committed": COMMITTED, "repeats": repeats}
    rec["meta"] = run_child("meta", path, repeats)
    rec["casspec"] = run_child("casspec", path, repeats)
    rec["llama.cpp"] = {**run_child("llama.cpp", path, repeats), **llama_bench(binary, path, min(repeats, 3))}
    return rec


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write a Q4_K_M-layout GGUF of a real model's shape, random weights")
    mk.add_argument("--shape", choices=sorted(SHAPES), required=True)
    mk.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--untied-head", action="store_true", help="write an output tensor even where the shape ties "
                    "it to token_embd (as Qwen's own published Qwen2.5 GGUFs do)")
    me = sub.add_parser("measure", help="casspec's native target and llama.cpp on a GGUF file")
    me.add_argument("gguf", type=Path)
    me.add_argument("--llama-bench", default=os.environ.get("CASSPEC_LLAMA_BENCH") or shutil.which("llama-bench"))
    me.add_argument("--out", type=Path, help="JSON of every measurement")
    me.add_argument("--repeats", type=int, default=10, help="timed rounds of casspec's forwards (llama-bench: <= 3)")
    ch = sub.add_parser("child")  # (one measurement, in its own process)
    ch.add_argument("kind", choices=sorted(CHILDREN))
    ch.add_argument("gguf", type=Path)
    ch.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    if args.cmd == "child":
        fn = CHILDREN[args.kind]
        print(json.dumps(fn(args.gguf, args.repeats) if args.kind == "casspec" else fn(args.gguf)))
    elif args.cmd == "make":
        if args.out.suffix != ".gguf" or not args.out.parent.is_dir():
            p.error(f"--out must be a .gguf file in an existing folder (got {args.out})")
        shape = dataclasses.replace(SHAPES[args.shape], tied=SHAPES[args.shape].tied and not args.untied_head)
        counts = make(shape, args.out, args.seed)
        print(f"{args.out}: {args.out.stat().st_size / MB:.0f} MB, {sum(counts.values())} tensors: "
              + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
    else:
        if not args.gguf.is_file() or args.gguf.suffix != ".gguf" or args.repeats < 1:
            p.error(f"measure takes an existing .gguf file and --repeats >= 1 (got {args.gguf})")
        if not (args.llama_bench and os.path.isfile(args.llama_bench) and os.access(args.llama_bench, os.X_OK)):
            where = f"at {args.llama_bench}" if args.llama_bench else "on PATH"
            p.error(f"no llama-bench binary {where}: pass --llama-bench PATH or set CASSPEC_LLAMA_BENCH")
        if args.out is not None and not args.out.parent.is_dir():
            p.error(f"--out's folder does not exist: {args.out.parent}")
        rec = measure(args.gguf, args.llama_bench, args.repeats)
        print(table(rec))
        if args.out is not None:
            args.out.write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
