"""`--weights native` read straight from the GGUF, in the memory the file takes: no float copy of any quantized
tensor is made or cached. Each layer's tensors are read in turn (casspec's bounded reader, ggufcheck.py), its
quantized projections decoded (ggufcodes.py) into casspec's block kernel (native.py: the Plan the target runs) and let
go; the model's projection fields are meta tensors (shapes without values) whose float weight a level builder gets
dequantized on demand (`LayerWeights.dense`, `Transformer.dense_head`); a quantized token embedding is kept as its
blocks, its rows dequantized per lookup (`Transformer.embed_rows`), and where the head is tied the head's kernel is
that same copy. Norms and biases (F32) are read as they are. The tokenizer, config and generation config are
transformers' parse of the file's header, cached once in a user-cache entry that holds nothing else (its `levels/`
keeps the draft levels built for it).

llama.cpp's converter stores a Llama file's q/k rows reordered for its RoPE (`unpermute` puts them back); Qwen2 /
Qwen3 files keep transformers' order.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor

from dsia.errors import CasspecError
from dsia.layer import FUSED_GROUPS, LayerWeights
from dsia.model import Transformer
from dsia.plan import Plan
from dsia.qkernels import FusedLinear
from dsia.spec import ModelSpec
from dytc.machine import release_free_memory

from ..cache.usercache import (cache_root, entry_problem, file_record, locked, new_build_folder, read_manifest,
                               remove, remove_stale_builds, swap_in)
from .ggufcheck import GGUFFile, GGUFHeader
from .ggufcodes import Codes, decode
from .ggufweights import _float32, metadata_once
from .native import DENSE_TYPES, GGUF_PROJECTIONS, NATIVE_TYPES, block_kernel, kernel, native_plan, unpermute
from .weights import generation_eos, inv_freq, read_config, read_tokenizer, rope_theta

PERMUTED = {"llama": True, "qwen2": False, "qwen3": False}  # architectures read here -> q/k rows reordered for RoPE
FIELDS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}
NORMS = {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}
BIASES = {"attn_q": "q", "attn_k": "k", "attn_v": "v"}  # Qwen2's q/k/v biases
META_VERSION = 1  # of the metadata entry (config, generation config, tokenizer): in its folder's name
MANIFEST = "casspec-cache.json"


def meta_entry(src: GGUFFile, sha: str) -> Path:
    """The user-cache entry of the file's tokenizer, config and generation config (transformers' parse of its
    header, made once under the entry's lock; a corrupt entry is made again)."""
    entry = cache_root() / f"gguf-{sha[:24]}-meta{META_VERSION}"
    with locked(entry):
        remove_stale_builds(entry)
        manifest = read_manifest(entry / MANIFEST, {"version": META_VERSION, "gguf_sha256": sha})
        if manifest is not None and entry_problem(entry, manifest["files"], frozenset(), (MANIFEST, "levels")) is None:
            return entry
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        print(f"casspec: reading {src.path.name}'s tokenizer and config (once; cached in {entry})", file=sys.stderr)
        tmp = new_build_folder(entry)
        folder, file = str(src.reader_path.parent), src.reader_path.name  # this open file, whatever the path names
        try:
            with metadata_once():
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
                config = AutoConfig.from_pretrained(folder, gguf_file=file)
            src.check_unchanged(sha)
            cfg = config.to_dict()
            cfg.pop("quantization_config", None)
            (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            files = {p.name: file_record(p) for p in sorted(tmp.iterdir())}
            (tmp / MANIFEST).write_text(json.dumps({"version": META_VERSION, "gguf": str(src.path),
                                                     "gguf_sha256": sha, "files": files}, indent=1))
            swap_in(tmp, entry)
        except CasspecError:
            remove(tmp)
            raise
        except Exception as e:  # noqa: BLE001 - transformers' GGUF parse raises many kinds of errors on bad files
            remove(tmp)
            raise CasspecError(f"cannot read GGUF file {src.path}'s tokenizer and config ({str(e).splitlines()[0]}): "
                               "re-download it, or use --weights float") from None
    return entry


def _meta(shape: tuple[int, ...]) -> Tensor:
    return torch.empty(shape, dtype=torch.float32, device="meta")


def _tensors(src: GGUFFile, header: GGUFHeader, names: list[str]) -> dict[str, object]:
    """name -> Codes (a quantized tensor) or a float32 tensor (F32 / F16 / BF16), for the names the file holds."""
    by_name = {t.name: t for t in header.tensors}
    out: dict[str, object] = {}
    for name, raw in src.tensor_bytes(header, [n for n in names if n in by_name]).items():
        t = by_name[name]
        if t.kind in NATIVE_TYPES and (len(t.dims) != 2 or t.dims[0] % (256 if t.kind.endswith("_K") else 32)):
            raise CasspecError(f"the GGUF tensor {name} ({t.kind}, dims {t.dims}) is no matrix of whole blocks: the "
                               "file is corrupt; re-download it")
        if t.kind in NATIVE_TYPES:
            out[name] = decode(t.kind, raw)
        elif t.kind in DENSE_TYPES:
            out[name] = _float32(raw, t)
        else:
            raise CasspecError(f"--weights native runs {', '.join(NATIVE_TYPES)} tensors, and {name} is {t.kind}: "
                               "use --weights float (dequantized)")
    return out


def _shape(w: object) -> tuple[int, ...]:
    return tuple(w.u.shape) if isinstance(w, Codes) else tuple(w.shape)


def _expected(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """A layer's tensors' shapes (GGUF name part -> [out, in], or [n]) under the model's config."""
    d, q, kv, ffn, hd = (spec.dim, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim, spec.intermediate,
                         spec.head_dim)
    return {"attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q), "ffn_gate": (ffn, d),
            "ffn_up": (ffn, d), "ffn_down": (d, ffn), "attn_norm": (d,), "ffn_norm": (d,), "attn_q_norm": (hd,),
            "attn_k_norm": (hd,), "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
            "token_embd": (spec.vocab_size, d), "output": (spec.vocab_size, d), "output_norm": (d,)}


def _check_shapes(got: dict[str, object], spec: ModelSpec, gguf: Path) -> None:
    """One clear line where a tensor's shape is not the one the model's config gives."""
    want = _expected(spec)
    for name, w in got.items():
        part = name.split(".", 2)[-1].removesuffix(".weight") if name.startswith("blk.") else name.removesuffix(
            ".weight")
        if want.get(part) is not None and _shape(w) != want[part]:
            raise CasspecError(f"{gguf.name}'s tensor {name} has shape {_shape(w)} where the model's config gives "
                               f"{want[part]}: the file is corrupt or mislabelled; re-download it")


def read_native(src: GGUFFile, header: GGUFHeader, spec: ModelSpec, theta: float) -> tuple[Transformer, Plan]:
    """The runtime of the open file's weights (module docstring; `header` its checked header) and its native
    Plan."""
    gguf = src.path
    arch = header.fields.get("general.architecture")
    arch = arch.decode("utf-8", "replace") if isinstance(arch, bytes) else str(arch)
    if arch not in PERMUTED:
        raise CasspecError(f"--weights native reads {', '.join(PERMUTED)} GGUF files, and {gguf.name} is {arch}: "
                           "use --weights float")
    linears, fused, layers = {}, {}, []
    for i in range(spec.n_layers):
        names = [f"blk.{i}.{g}.weight" for g in (*GGUF_PROJECTIONS, *NORMS)] + [
            f"blk.{i}.{g}.bias" for g in BIASES]
        got = _tensors(src, header, names)
        _check_shapes(got, spec, gguf)
        proj: dict[str, Tensor] = {}
        stored: dict[tuple[int, str], Codes] = {}
        for g, p in GGUF_PROJECTIONS.items():
            w = got.get(f"blk.{i}.{g}.weight")
            if w is None:
                raise CasspecError(f"{gguf} has no tensor blk.{i}.{g}.weight: it is not a complete model; "
                                   "re-download it")
            heads = spec.n_heads if p == "q" else spec.n_kv_heads if p == "k" else 0
            if heads and PERMUTED[arch]:
                w = w.rows(unpermute(torch.arange(_shape(w)[0])[:, None], heads)[:, 0]) if isinstance(
                    w, Codes) else unpermute(w, heads)
            if isinstance(w, Codes):
                stored[(i, p)] = w
            proj[FIELDS[p]] = _meta(_shape(w)) if isinstance(w, Codes) else w
        norms = {f: got.get(f"blk.{i}.{g}.weight") for g, f in NORMS.items()}
        for g, f in NORMS.items():
            if norms[f] is None and (spec.qk_norm or f not in ("q_norm", "k_norm")):
                raise CasspecError(f"{gguf} has no tensor blk.{i}.{g}.weight: it is not a complete model; "
                                   "re-download it")
        layers.append(LayerWeights(**norms, **proj, bias={p: got[f"blk.{i}.{g}.bias"] for g, p in BIASES.items()
                                                         if f"blk.{i}.{g}.bias" in got}))
        part = native_plan(stored, [i])  # (this layer's kernels now: its decoded codes go before the next's)
        linears.update(part.linears)
        fused.update(part.fused)
    top = _tensors(src, header, ["token_embd.weight", "output_norm.weight", "output.weight"])
    _check_shapes(top, spec, gguf)
    embed, head = top.get("token_embd.weight"), top.get("output.weight", top.get("token_embd.weight"))
    if embed is None or "output_norm.weight" not in top:
        raise CasspecError(f"{gguf} has no token_embd or output_norm tensor: re-download it")
    embed_kernel = kernel(embed) if isinstance(embed, Codes) else None
    head_kernel = embed_kernel if head is embed else kernel(head) if isinstance(head, Codes) else None
    plan = Plan(linears=linears, fused=fused, head=head_kernel)
    layers = [dataclasses.replace(lw, stored=_dequantizer(plan, i)) for i, lw in enumerate(layers)]
    model = Transformer(spec, _meta(_shape(embed)) if embed_kernel else embed, layers, top["output_norm.weight"],
                        _meta(_shape(head)) if isinstance(head, Codes) else head, inv_freq(theta, spec.head_dim), 1.0)
    model.embed_blocks = embed_kernel
    return model, plan


def _dequantizer(plan: Plan, i: int):
    """Layer i's float weight of a projection, from the native kernels' blocks."""
    def weight(name: str) -> Tensor:
        if (i, name) in plan.linears:
            return plan.linears[(i, name)].dequantize()
        for (j, group), k in plan.fused.items():
            if j == i and isinstance(k, FusedLinear) and name in FUSED_GROUPS[group]:
                return k.kernel.dequantize().split(k.sizes)[FUSED_GROUPS[group].index(name)]
        raise CasspecError(f"layer {i}'s {name} projection is held neither densely nor as blocks")
    return weight


def load_native(gguf: Path, dtype: torch.dtype, device: torch.device) -> dict:
    """Loaded's fields (checkpoints.py) of the GGUF run natively: runtime, native Plan, tokenizer, store_dir (the
    metadata entry), generation EOS ids, source."""
    if gguf.suffix.lower() != ".gguf" or not gguf.is_file():
        raise CasspecError("--weights native runs a quantized GGUF file: pass --model FILE.gguf (or the embedded "
                           "default), or use --weights float")
    if device.type != "cpu" or dtype != torch.float32:
        raise CasspecError("--weights native runs casspec's CPU block kernel in float32: use --device cpu --dtype "
                           "float32 (or --weights float)")
    if not block_kernel():
        raise CasspecError("--weights native runs casspec's C++ block kernel, which did not build here: install a C++ "
                           "compiler and ninja, or use --weights float")
    with GGUFFile(gguf) as src:
        header = src.header()  # (casspec's bounded check, before transformers' reader parses the header)
        entry = meta_entry(src, src.sha256())
        config = read_config(entry)
        spec = ModelSpec.from_hf_config(SimpleNamespace(**config))
        theta = rope_theta(config)
        if theta is None:
            raise CasspecError(f"{gguf}'s config has no RoPE base: use --weights float")
        model, plan = read_native(src, header, spec, theta)
    release_free_memory()  # (the decoded codes' transient buffers: 0.2 GB of Qwen2.5-0.5B's load)
    return dict(runtime=model, native=plan, tokenizer=read_tokenizer(entry), store_dir=entry,
                generation_eos=generation_eos(entry), source=gguf)
