"""llama.cpp as a bench baseline: `lcpp-ar` runs the engine's own GGUF file as it is stored (its quantization),
`lcpp-ar-f32` the same weights dequantized to an F32 GGUF (made once with llama.cpp's own quantizer, kept in the
user cache), each through llama-cpp-python, an optional extra (`pip install "casspec[lcpp]"`, built from source:
README "llama.cpp as a baseline"), never a test dependency.

A turn gets exactly the prompt ids casspec's methods get (the same chat template, the tokenizer read from the same
GGUF), the same max_new_tokens, greedy or the request's temperature / top-k / top-p, and the thread count torch
uses. Like casspec's engine (and llama.cpp's own server) a conversation's later turn reuses the KV of what it has
already evaluated (the longest common prefix); a new question starts from an empty cache.
"""
from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

from dsia.errors import CasspecError
from dytc.sampling import SamplingParams

from ..loading.checkpoints import file_sha256

from ..cache.usercache import cache_root
from ..calibrate.questions import TurnFn
from ..cache.usercache import locked

LCPP_METHODS = ("lcpp-ar", "lcpp-ar-f32")  # the stored file / its F32 dequantization
INSTALL = ('pip install llama-cpp-python (it builds llama.cpp from source; on AVX512 CPUs set CMAKE_ARGS as in the '
           'docs/benchmarking.md)')
LLAMA_FTYPE_ALL_F32 = 0  # llama.cpp's llama_ftype for an all-F32 file


def llama_cpp():
    """The llama_cpp module, or one clear error naming the install command."""
    try:
        return importlib.import_module("llama_cpp")
    except ImportError:
        raise CasspecError(f"the lcpp-ar baselines need llama-cpp-python, which is not installed: {INSTALL}") from None


def f32_gguf(src: Path) -> Path:
    """`src` dequantized to an all-F32 GGUF by llama.cpp's quantizer (allowed to requantize), made once per file
    content and kept in the user cache (`lcpp/`)."""
    lib = llama_cpp()
    dst = cache_root() / "lcpp" / f"{src.stem}-{file_sha256(src)[:16]}-f32.gguf"
    with locked(dst):
        if not dst.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            # written in a private folder of an unpredictable name (llama.cpp opens its output by path, following
            # links: a predictable name in the cache would let a planted link redirect the write)
            folder = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}."))
            tmp = folder / dst.name
            params = lib.llama_model_quantize_default_params()
            params.ftype = LLAMA_FTYPE_ALL_F32
            params.allow_requantize = True
            try:
                if lib.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
                    raise CasspecError(f"llama.cpp could not dequantize {src} to F32: check that llama-cpp-python "
                                       "matches the file's GGUF version")
                os.replace(tmp, dst)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    return dst


def gguf_source(gguf: Path | None, who: str) -> Path:
    """The engine's checkpoint as the GGUF file a llama.cpp baseline runs, or one clear error naming `who` runs it."""
    if gguf is None or gguf.suffix.lower() != ".gguf":
        raise CasspecError(f"{who} a GGUF file, and this engine loaded {gguf or 'no file'}: pass --model FILE.gguf "
                           "(or the embedded default)")
    return gguf


def lcpp_runner(gguf: Path | None, f32: bool, n_ctx: int, eos_ids: frozenset[int], sampling: SamplingParams,
                seed: int) -> TurnFn:
    """A bench turn runner over llama.cpp (see the module docstring); gguf: the engine's checkpoint file."""
    gguf = gguf_source(gguf, "the lcpp-ar baselines run")
    lib = llama_cpp()
    path = f32_gguf(gguf) if f32 else gguf
    threads = torch.get_num_threads()
    llm = lib.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, seed=seed,
                    verbose=False)
    if sampling.greedy:
        decoding = dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0)
    else:
        decoding = dict(temp=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, min_p=0.0)
    last: list[int] = []  # the last turn's prompt

    def run(ids: list[int], max_new_tokens: int) -> tuple[list[int], int, dict]:
        nonlocal last
        if not last or len(ids) <= len(last) or ids[:len(last)] != last:
            llm.reset()  # a new conversation (or the same prompt again): nothing it holds is reused, as in bench's
            # engine methods
        # (else llama.cpp reuses the longest prefix it holds of the conversation so far, as casspec's engine does)
        last = list(ids)
        if not sampling.greedy:
            llm.set_seed(seed)
        out: list[int] = []
        for tok in llm.generate(ids, repeat_penalty=1.0, **decoding):
            out.append(int(tok))
            if out[-1] in eos_ids or len(out) >= max_new_tokens:
                break
        return out, len(out), {}  # one llama.cpp forward per token

    return run
