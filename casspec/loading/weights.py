"""A checkpoint folder read straight into casspec's runtime, without transformers' model classes.

Building the HF model (`AutoModelForCausalLM.from_pretrained`) costs about 2.7 s of a one-shot `casspec generate`
for SmolLM2-135M (importing the modeling code, constructing and filling the modules), while reading the
safetensors files takes milliseconds. So where nothing needs the HF model (`casspec generate`), the runtime's
tensors come from the files directly: config.json gives the ModelSpec, the safetensors files the weights (cast to
the dtype as from_pretrained casts them), and the RoPE frequencies are computed as transformers computes its
default rotary embedding. A checkpoint this reader does not cover (another RoPE type, weights not in safetensors)
returns None and goes through transformers as before; the HF model is then loaded.

The files read are the ones the checkpoint lists (model.safetensors.index.json's shards, else model.safetensors; a
cache entry: its manifest's, each checked against its sha256 from the bytes read). config.json is read with the
user cache's JSON bounds, and a safetensors file is checked before use (read_safetensors): its header length within
SAFETENSORS_MAX_HEADER and the file, known dtypes, each shape's byte size equal to its offset range, the ranges
contiguous from 0 to the file's end; the tensors are views of the one buffer checked (and, for a cache file, read
and hashed): what is checked is what is loaded.
"""
from __future__ import annotations

import mmap
import os
import re
from pathlib import Path
from types import SimpleNamespace

import torch

from dsia.errors import CasspecError
from dsia.layer import LayerWeights
from dsia.model import Transformer
from dsia.spec import ModelSpec

from ..cache.usercache import ChecksumError, open_regular, parse_json, read_hashed, read_json_file

HF_PROJECTIONS = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
               "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
LAYER = re.compile(r"model\.layers\.(\d+)\.")  # a layer's tensor names
BIASED = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj"}  # Qwen2's q/k/v bias
SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors library's own cap on its JSON header
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
             "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # safetensors dtype -> torch


def rope_theta(config: dict) -> float | None:
    """The base of a default (unscaled) rotary embedding; None for any other RoPE type."""
    params = config.get("rope_parameters")
    if params is None:  # the older layout: rope_theta and rope_scaling at the top
        if config.get("rope_scaling"):
            return None
        params = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    if params.get("rope_type", "default") != "default" or "rope_theta" not in params:
        return None
    return float(params["rope_theta"])


def inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """transformers' default RoPE inverse frequencies, computed the same way (the same floats)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def read_config(path: Path) -> dict:
    """The checkpoint folder's config.json, read with the JSON bounds (CasspecError: unreadable or malformed)."""
    try:
        config = read_json_file(path / "config.json")  # (a CasspecError names the file and the fix itself)
    except OSError as e:
        raise CasspecError(f"cannot read {path / 'config.json'} ({e.strerror or e}): fix or replace the file") from None
    if not isinstance(config, dict):
        raise CasspecError(f"{path / 'config.json'} is not a JSON object: fix or replace the file")
    return config


def checkpoint_files(path: Path) -> list[str]:
    """The safetensors files of a checkpoint folder as transformers picks them: the shards its
    model.safetensors.index.json names, else model.safetensors (none: this reader does not cover it)."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return ["model.safetensors"] if (path / "model.safetensors").is_file() else []
    shards = read_json_file(index).get("weight_map", {}).values()
    bad = [s for s in shards if not isinstance(s, str) or Path(s).name != s or not s.endswith(".safetensors")]
    if bad:
        raise CasspecError(f"{index} names the shard {str(bad[0])[:60]!r}, not a .safetensors file of the folder: "
                           "fix or replace it")
    return sorted(set(shards))


def read_runtime(path: Path, dtype: torch.dtype, device: torch.device,
                 checksums: dict[str, str] | None = None) -> Transformer | None:
    """The runtime over the checkpoint in `path`, or None when this reader does not cover it. checksums (a cache
    entry): its safetensors files and their sha256, checked from the bytes read (ChecksumError)."""
    config = read_config(path)
    files = sorted(checksums) if checksums is not None else checkpoint_files(path)
    theta = rope_theta(config)
    if theta is None or not files:
        return None
    spec = ModelSpec.from_hf_config(SimpleNamespace(**config))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(read_safetensors(path / f, checksums[f] if checksums is not None else None)[0])

    def w(name: str) -> torch.Tensor:
        return state[name].to(device=device, dtype=dtype)

    check_tensors(state, spec, config)

    layers = []
    for i in range(spec.n_layers):
        pre = f"model.layers.{i}."
        norms = {n: w(pre + f"self_attn.{n}.weight") if spec.qk_norm else None for n in ("q_norm", "k_norm")}
        layers.append(LayerWeights(
            attn_norm=w(pre + "input_layernorm.weight"), mlp_norm=w(pre + "post_attention_layernorm.weight"),
            **{field: w(pre + name + ".weight") for field, name in HF_PROJECTIONS.items()}, **norms,
            bias={n: w(pre + name + ".bias") for n, name in BIASED.items() if pre + name + ".bias" in state}))
    embed = w("model.embed_tokens.weight")
    head = embed if config.get("tie_word_embeddings", False) else w("lm_head.weight")  # (HF's default: untied)
    return Transformer(spec, embed, layers, w("model.norm.weight"), head, inv_freq(theta, spec.head_dim).to(device),
                       1.0)


def expected_shapes(spec: ModelSpec, config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint of this spec must hold, with their shapes (biases are optional, see BIASED)."""
    d, q, kv, ffn, hd = (spec.dim, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim, spec.intermediate,
                         spec.head_dim)
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, d), "model.norm.weight": (d,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (spec.vocab_size, d)
    per_layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
                 "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
                 "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
                 "mlp.gate_proj.weight": (ffn, d), "mlp.up_proj.weight": (ffn, d), "mlp.down_proj.weight": (d, ffn)}
    if spec.qk_norm:
        per_layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    for i in range(spec.n_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in per_layer.items()}
    return shapes


def missing_tensors(names: list[str]) -> CasspecError:
    """The error of a checkpoint that lacks these weight tensors (sorted)."""
    return CasspecError(f"missing weight tensors {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} "
                        f"({len(names)} in all)")


def check_tensors(state: dict[str, torch.Tensor], spec: ModelSpec, config: dict) -> None:
    """A CasspecError unless the weights are the ones config.json describes: none missing, each of its shape (with
    the optional q/k/v biases), and no layer beyond num_hidden_layers (a config that lost layers)."""
    shapes = expected_shapes(spec, config)
    missing = sorted(n for n in shapes if n not in state)
    if missing:
        raise missing_tensors(missing)
    q, kv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    for i in range(spec.n_layers):
        shapes |= {f"model.layers.{i}.{name}.bias": (q if n == "q" else kv,) for n, name in BIASED.items()}
    wrong = [n for n, shape in shapes.items() if n in state and tuple(state[n].shape) != shape]
    if wrong:
        n = wrong[0]
        raise CasspecError(f"weight tensor {n} has shape {list(state[n].shape)} where config.json gives "
                           f"{list(shapes[n])}: config.json and the weights do not match; re-download the checkpoint")
    extra = sorted(n for n in state if (m := LAYER.match(n)) and int(m.group(1)) >= spec.n_layers)
    if extra:
        raise CasspecError(f"the weights hold {extra[0]} but config.json gives num_hidden_layers "
                           f"{spec.n_layers}: config.json and the weights do not match; re-download the checkpoint")


def generation_eos(path: Path) -> tuple[int, ...]:
    """The eos_token_id(s) of the folder's generation_config.json (none when it has none)."""
    try:
        eos = read_json_file(path / "generation_config.json").get("eos_token_id")
        return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
    except (OSError, CasspecError, AttributeError, TypeError, ValueError):
        return ()


FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")  # tokenizer_class values of a tokenizer.json


def read_tokenizer(path: Path):
    """The folder's tokenizer, by transformers: where tokenizer_config.json names the fast tokenizer class (what
    casspec's GGUF cache saves) that class reads tokenizer.json directly, else AutoTokenizer. (AutoTokenizer first
    loads the model's config class, whose imports took 0.7 s of a 2.3 s later start; the tokenizer is the same.)"""
    try:
        named = read_json_file(path / "tokenizer_config.json").get("tokenizer_class")
    except (OSError, CasspecError, AttributeError):
        named = None
    if named in FAST_TOKENIZERS and (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


# ------------------------------------------------------------------------------------------------ safetensors
def read_safetensors(path: Path, sha256: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, checked before a tensor is made. With sha256 (a file of the user
    cache; a link is refused) it is read once into memory and those bytes are checked against it: what was hashed is
    what is loaded. Without (a checkpoint folder) it is mapped, copy-on-write, as safetensors' own loader maps it."""
    with open_regular(path, nofollow=sha256 is not None) as f:
        size = os.fstat(f.fileno()).st_size
        if sha256 is None and size > 0:
            return parse_safetensors(torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY),
                                                      dtype=torch.uint8), str(path))
        buf = torch.empty(size, dtype=torch.uint8)
        digest = read_hashed(f, memoryview(buf.numpy()), path)
    if sha256 is not None and digest != sha256:
        raise ChecksumError(f"{path.name} does not match its checksum")
    return parse_safetensors(buf, str(path))


def parse_safetensors(buf: torch.Tensor, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors as views of `buf`, metadata) of the safetensors bytes in `buf` (uint8), checked (module docstring)."""
    def bad(why: str) -> CasspecError:
        why = why if len(why) <= 300 else why[:300] + "..."  # (a crafted name or shape may be megabytes long)
        return CasspecError(f"{what} is not a valid safetensors file ({why}): it may be truncated or corrupt; "
                            "re-download or rebuild it")

    size = buf.numel()
    n = int.from_bytes(buf[:8].numpy().tobytes(), "little") if size >= 8 else -1
    if not 0 <= n <= min(size - 8, SAFETENSORS_MAX_HEADER):
        raise bad(f"its header length {n} does not fit its {size} bytes (at most {SAFETENSORS_MAX_HEADER})")
    header = parse_json(buf[8:8 + n].numpy().tobytes(), f"{what}'s header", SAFETENSORS_MAX_HEADER)
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("its __metadata__ is not an object of strings")
    data = buf[8 + n:]
    entries = sorted((_tensor_entry(name, info, bad) for name, info in header.items()), key=lambda e: e[3])
    tensors, end = {}, 0
    for name, dtype, shape, begin, stop in entries:
        if begin != end:
            raise bad(f"tensor {name} starts at byte {begin} of the data where the one before ends at {end} "
                      "(shared or skipped bytes)")
        if stop > data.numel():
            raise bad(f"tensor {name} ends at byte {stop} of the data and the file holds {data.numel()}")
        tensors[name], end = _view(data, begin, stop, dtype, shape), stop
    if end != data.numel():
        raise bad(f"its tensors end at byte {end} of the data and the file holds {data.numel()}")
    return tensors, meta


def _tensor_entry(name: str, info: object, bad) -> tuple[str, torch.dtype, list[int], int, int]:
    """(name, dtype, shape, begin, end) of one header entry, its byte range the size its shape and dtype give."""
    if not isinstance(info, dict):
        raise bad(f"tensor {name}'s entry is not an object")
    kind, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    dtype = ST_DTYPES.get(kind) if isinstance(kind, str) else None
    if dtype is None:
        raise bad(f"tensor {name} has the dtype {str(kind)[:20]!r}; casspec reads {', '.join(ST_DTYPES)}")
    ints = lambda v: isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)  # noqa: E731
    if not ints(shape) or not ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise bad(f"tensor {name}'s shape {str(shape)[:40]} or data_offsets {str(offsets)[:40]} are not valid")
    nbytes = 0 if 0 in shape else dtype.itemsize
    for d in shape if nbytes else ():  # (stops past the offsets' range: a long shape of huge dims costs nothing)
        nbytes *= d
        if nbytes > offsets[1] - offsets[0]:
            break
    if nbytes != offsets[1] - offsets[0]:
        raise bad(f"tensor {name} of shape {str(shape)[:60]} and dtype {kind} holds {nbytes} bytes, and its "
                  f"offsets give {offsets[1] - offsets[0]}")
    return name, dtype, shape, offsets[0], offsets[1]


def _view(data: torch.Tensor, begin: int, end: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The tensor in bytes [begin, end) of `data`: a view where its address suits the dtype, else a copy."""
    raw = data[begin:end]
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).reshape(shape)
