"""The engine's options (`EngineOptions`, one dataclass the CLI, `Engine.from_pretrained`, serve and bench pass
along) and the target they build from a loaded checkpoint (`build_target`): context window, native weights, fused
projections, the dense kernels measured for this machine, batch invariance, compiled or C++ elementwise steps, the C++
layer loop, CUDA graphs, and the KV cache."""
from __future__ import annotations

import sys
from dataclasses import dataclass, fields

from dsia.cxx import LIBRARY_DTYPES, build_error, built, source_digest
from dsia.errors import CasspecError
from dsia.fastloop import Stacks, cxx_pointwise
from dsia.graphs import GRAPH_TOKENS, Graphs
from dsia.kvcache import KVCache
from dsia.model import Transformer
from dsia.pointwise import compiled_pointwise
from dsia.spec import DEFAULT_CONTEXT

from ..loading.checkpoints import Loaded
from ..loading.native import WEIGHTS, block_kernel
from ..calibrate.tune import kernels_for


@dataclass(frozen=True)
class EngineOptions:
    """How an engine runs its checkpoint (the CLI's flags of the same names)."""
    max_context: int | None = None  # context window in tokens: KV cache and RoPE tables (None: the model's, at most
    # dsia.spec.DEFAULT_CONTEXT)
    kernels: str = "auto"  # the target's dense products: "auto" (measured on this machine, cached) or one kernel
    # forced for every token count ("blas" | "onednn" | "mkl" | "casspec")
    graphs: bool | None = None  # replay small forwards from CUDA graphs (None: on a GPU; without CUDA, True runs
    # the graphs' static-shape forward eagerly, as the tests do)
    compile_pointwise: bool | None = None  # one compiled kernel per elementwise step (None: on a GPU)
    autoprofile: bool = True  # Engine.from_pretrained (and the CLI): measure the levels plane and a latency profile
    # when none matches (about a minute, once per machine, model and dtype; user cache)
    keep_state: bool = True  # read the acceptance and latency state earlier processes learned, keep this one's
    fuse_projections: bool | None = None  # q|k|v and gate|up as one product each (None: on a GPU, where the wider
    # products come closer to the memory's bandwidth)
    reuse_prefix: bool = True  # a prompt starting with tokens the last generation left in the KV cache prefills
    # only the rest (llama.cpp's prompt cache, vLLM's prefix caching); that KV's float32 bits may differ from one
    # prefill's in the last place, as a tree verification's differ from a one-token step's
    batch_invariant: bool = False  # each row of a target forward computed alike whatever the rows around it
    # (dsia/invariant.py: every method's greedy tokens are ar's in bfloat16 too; bfloat16 on a CPU, eager)
    weights: str = "float"  # "float": the checkpoint in the model's dtype (a quantized GGUF dequantized);
    # "native": a Q4_0 / Q4_1 / Q8_0 GGUF in its stored quantization (casspec/loading/native.py; CPU; batch-invariant)
    fast_layers: bool | None = None  # a forward's decoder layers as one C++ call, a float32 forward's small steps
    # by casspec's ops (dsia/fastloop.py; None: on a CPU, where it builds, once per machine)

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(f.name for f in fields(EngineOptions))


@dataclass
class Target:
    """The target as the options built it, with its KV cache."""
    model: Transformer  # every variant applied (graphs last)
    cache: KVCache
    graphs: Graphs | None  # CUDA graphs of small forwards (None: eager)
    kernels: str  # the dense kernels chosen, for --stats
    build: str  # what its forwards' time depends on besides machine, model and dtype: profiles and state are kept
    # per build


def build_target(loaded: Loaded, opts: EngineOptions) -> Target:
    """The loaded checkpoint's target under `opts` (one clear error for options that cannot go together)."""
    model = loaded.runtime if loaded.runtime is not None else Transformer.from_hf(loaded.model)
    if opts.max_context is not None and opts.max_context < 2:
        raise CasspecError(f"max_context must be >= 2 (got {opts.max_context})")
    model = model.with_context(opts.max_context or min(model.spec.max_context, DEFAULT_CONTEXT))
    if opts.weights not in WEIGHTS:
        raise CasspecError(f"unknown weights {opts.weights!r}: use one of {', '.join(WEIGHTS)}")
    native = opts.weights == "native"
    if native:
        if loaded.native is None:
            raise CasspecError("--weights native runs a quantized GGUF file: pass --model FILE.gguf (or the "
                               "embedded default), or use --weights float")
        model = model.with_native(loaded.native)
    cuda = model.device.type == "cuda"
    fuse = cuda if opts.fuse_projections is None else opts.fuse_projections
    if fuse:
        model = model.with_fused_projections()
    compiled = cuda if opts.compile_pointwise is None else opts.compile_pointwise
    stacked = _library_loop(not cuda if opts.fast_layers is None else opts.fast_layers, bool(opts.fast_layers))
    # a native target's forwards are batch-invariant always: its kernels take bfloat16 activations, which would
    # round a verification's last-bit differences from a one-token step (the attention's) into larger ones
    invariant = opts.batch_invariant or native
    # casspec's own products and attention give each row the same bits whatever the rows beside it (by
    # construction, on every CPU): a batch-invariant target runs them where the library is built
    own = stacked and not compiled and not cuda  # (the library's ops: its attention in LIBRARY_DTYPES)
    dense, kernels = kernels_for(model, opts.kernels, invariant=invariant and own)
    model = model.with_dense(dense)
    if invariant:
        if opts.graphs or opts.compile_pointwise:
            raise CasspecError("batch-invariant forwards run eagerly: leave CUDA graphs and compiled "
                               "elementwise steps off with them")
        model = model.with_batch_invariant(own_attention=own and model.dtype in LIBRARY_DTYPES)
        kernels += "; batch-invariant"
    if compiled:
        model = model.with_pointwise(compiled_pointwise())
    if stacked:
        model = model.with_stacks(Stacks())
        if not compiled:  # a forward's small steps by the same library's ops (where they take it), in both loops
            model = model.with_pointwise(cxx_pointwise())
    graphs = cuda if opts.graphs is None else opts.graphs
    build = "; ".join([dense.describe()] + [name for name, on in (
        ("native weights (casspec's block kernel)" if native and block_kernel() else "native weights", native),
        ("fused projections", fuse), ("compiled pointwise", compiled), ("CUDA graphs", graphs),
        ("c++ layers", stacked), ("c++ ops", stacked and not compiled), ("batch-invariant", invariant),
        (f"casspec library {source_digest()}", not cuda and build_error() is None)) if on])
    cache = model.new_cache(model.context, spare=GRAPH_TOKENS[-1] if graphs else 0)
    runner = Graphs(model, cache) if graphs else None
    return Target(model.with_graphs(runner), cache, runner, kernels, build)


def _library_loop(wanted: bool, required: bool) -> bool:
    """Whether forwards run the C++ layer loop and ops: `wanted` and the library builds (built once per machine,
    said on stderr); a CasspecError where it is `required` (--fast-layers) and does not build."""
    if not wanted:
        return False
    if not built():
        print("casspec: building the C++ layer loop (once per machine, about 15 s; --no-fast-layers runs the "
              "Python one)", file=sys.stderr)
    error = build_error()
    if error is not None and required:
        raise CasspecError(f"the C++ layer loop did not build ({error}): install a C++ compiler and ninja, "
                           "or run without fast layers")
    return error is None
