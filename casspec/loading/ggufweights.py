"""casspec's own reader of a GGUF's weights: a Llama-architecture file's tensors (F32, F16, BF16 as stored; quantized
blocks, Q4_0 .. Q8_0 and the K-quants, decoded as llama.cpp decodes them, ggufcodes.py) under transformers'
parameter names, with the q/k rows llama.cpp's converter reorders for its RoPE put back, read from the bytes
casspec's bounded reader checked (ggufcheck.py: every offset and size lies inside the file).

transformers reads a GGUF three times (tokenizer, config, weights: gguf's reader parses the whole header each time,
then maps the names module by module): 15.7 s of SmolLM2's 35.6 s first use on the AMD EPYC. The weights are the
part casspec reads itself; a file of another architecture, or with a tensor of another type or name, is left to
transformers (`state_dict` returns None), which reads every architecture it knows. The tokenizer's and the config's
two parses of the same header are one (`metadata_once`: 2.5 s each for SmolLM2's 49,152-token vocabulary).
"""
from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from dsia.errors import CasspecError
from dsia.spec import ModelSpec

from .ggufcheck import GGUFFile, GGUFHeader, GGUFTensor
from .ggufcodes import decode
from .native import DENSE_TYPES, NATIVE_TYPES, unpermute
from .weights import check_tensors

ARCHS = ("llama",)  # general.architecture values read here (SmolLM2, Llama, Mistral as converted by llama.cpp)
FLOATS = {"F32": np.float32, "F16": np.float16}  # dense types numpy reads as they are (BF16: widened by hand)
NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"}  # whole-model tensors
LAYER_PARTS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")
GGUF_LAYER = re.compile(r"blk\.(\d+)\.")  # a layer's tensor names in a GGUF
SKIPPED = ("rope_freqs.weight",)  # tensors transformers computes from the config instead


def float32_bytes(header: GGUFHeader, gguf: Path) -> int:
    """Bytes of the GGUF's tensors in float32 (what a cache entry holds), after checking that no layer lies beyond
    its block count (transformers would drop it without a word)."""
    arch = header.fields.get("general.architecture")
    blocks = header.fields.get(f"{arch.decode('utf-8', 'replace')}.block_count") if isinstance(arch, bytes) else None
    if isinstance(blocks, int) and not isinstance(blocks, bool):
        extra = sorted(t.name for t in header.tensors if (m := GGUF_LAYER.match(t.name)) and int(m.group(1)) >= blocks)
        if extra:
            raise CasspecError(f"GGUF file {gguf} holds {extra[0]}, a layer beyond its block count {blocks}: it may be "
                               "corrupt; re-download it")
    return 4 * sum(t.n_elements for t in header.tensors)


def hf_name(name: str) -> str | None:
    """transformers' name of a GGUF tensor, or None where this reader does not know it."""
    if name in NAMES:
        return NAMES[name]
    m = LAYER_TENSOR.fullmatch(name)
    if m is None or m.group(2) not in LAYER_PARTS:
        return None
    return f"model.layers.{m.group(1)}.{LAYER_PARTS[m.group(2)]}.weight"


def _float32(raw: np.ndarray, t: GGUFTensor) -> Tensor:
    """A tensor's stored bytes [rows, row bytes] -> float32 [rows, dims[0]] (a vector: [dims[0]])."""
    if t.kind in NATIVE_TYPES:
        w = decode(t.kind, raw).dequantize()
    elif t.kind == "BF16":
        bits = raw.view(np.uint16).astype(np.uint32) << 16
        w = torch.from_numpy(bits.view(np.float32))
    else:
        w = torch.from_numpy(raw.view(FLOATS[t.kind]).astype(np.float32))
    return w.reshape(t.dims[0]) if len(t.dims) == 1 else w


def state_dict(src: GGUFFile, header: GGUFHeader, config) -> dict[str, Tensor] | None:
    """The file's weights in float32 under transformers' names, checked against transformers' config of the file
    (tied: no lm_head, the embedding is the head; a mismatch is one CasspecError line), or None where this reader
    does not take the file (another architecture, a tensor of another type, name or rank)."""
    spec, tied = ModelSpec.from_hf_config(config), bool(getattr(config, "tie_word_embeddings", False))
    arch = header.fields.get("general.architecture")
    if arch not in (a.encode() for a in ARCHS):
        return None
    names = {t.name: hf_name(t.name) for t in header.tensors if t.name not in SKIPPED}
    if None in names.values() or any(t.kind not in DENSE_TYPES + NATIVE_TYPES or len(t.dims) > 2
                                     for t in header.tensors if t.name in names):
        return None
    if ("output.weight" in names) == tied:  # a tied model stores no head; an untied one must
        return None
    state = {}
    raw = src.tensor_bytes(header, names)
    for t in header.tensors:
        if t.name not in names:
            continue
        w = _float32(raw.pop(t.name), t)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            w = unpermute(w, spec.n_heads if ".attn_q." in t.name else spec.n_kv_heads)
        state[names[t.name]] = w.contiguous()
    try:
        check_tensors(state, spec, config.to_dict())
    except CasspecError as e:
        raise CasspecError(f"cannot read GGUF file {src.path}: {e}") from None
    return state


def hf_model(state: dict[str, Tensor], config) -> torch.nn.Module:
    """transformers' model of these weights (transformers' names, checked; a tied head is the embedding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


@contextlib.contextmanager
def metadata_once() -> Iterator[None]:
    """Within the block, transformers' metadata parse of a GGUF (`load_gguf_checkpoint` without tensors, which
    AutoTokenizer and AutoConfig each call for the same file) runs once per file; later calls get a copy of its
    result. (A process-wide patch of transformers' function for the block: the GGUF cache's build, under its lock.)"""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    parse = gguf_utils.load_gguf_checkpoint
    parsed: dict[str, dict] = {}

    def once(path, return_tensors=False, **kw):
        if return_tensors or kw:
            return parse(path, return_tensors, **kw)
        if str(path) not in parsed:
            parsed[str(path)] = parse(path, return_tensors=False)
        return copy.deepcopy(parsed[str(path)])

    gguf_utils.load_gguf_checkpoint = once
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = parse
