"""A checkpoint folder read straight into casspec's runtime, without transformers' model classes.

Building the HF model (`AutoModelForCausalLM.from_pretrained`) costs about 2.7 s of a one-shot `casspec generate`
for SmolLM2-135M (importing the modeling code, constructing and filling the modules), while reading the
safetensors files takes milliseconds. So where nothing needs the HF model (`casspec generate`), the runtime's
tensors come from the files directly: config.json gives the ModelSpec, the safetensors files the weights (cast to
the dtype as from_pretrained casts them), and the RoPE frequencies are computed as transformers computes its
default rotary embedding. A checkpoint this reader does not cover (another RoPE type, weights not in safetensors)
returns None and goes through transformers as before; the HF model is then loaded.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from dsia.errors import CasspecError
from dsia.model import LayerWeights, ModelSpec, Transformer

PROJECTIONS = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
               "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
LAYER = re.compile(r"model\.layers\.(\d+)\.")  # a layer's tensor names
BIASED = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj"}  # Qwen2's q/k/v bias


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


def read_runtime(path: Path, dtype: torch.dtype, device: torch.device) -> Transformer | None:
    """The runtime over the checkpoint in `path`, or None when this reader does not cover it."""
    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    theta = rope_theta(config)
    if theta is None or not files:
        return None
    spec = ModelSpec.from_hf_config(SimpleNamespace(**config))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))

    def w(name: str) -> torch.Tensor:
        return state[name].to(device=device, dtype=dtype)

    check_tensors(state, spec, config)

    layers = []
    for i in range(spec.n_layers):
        pre = f"model.layers.{i}."
        norms = {n: w(pre + f"self_attn.{n}.weight") if spec.qk_norm else None for n in ("q_norm", "k_norm")}
        layers.append(LayerWeights(
            attn_norm=w(pre + "input_layernorm.weight"), mlp_norm=w(pre + "post_attention_layernorm.weight"),
            **{field: w(pre + name + ".weight") for field, name in PROJECTIONS.items()}, **norms,
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
        eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
