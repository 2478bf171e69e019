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
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from dsia.errors import CasspecError
from dsia.model import LayerWeights, ModelSpec, Transformer

PROJECTIONS = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
               "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
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

    missing = sorted(n for n in expected_names(spec, config) if n not in state)
    if missing:
        raise CasspecError(f"missing weight tensors {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
                           f"({len(missing)} in all)")

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


def expected_names(spec: ModelSpec, config: dict) -> list[str]:
    """The tensors a checkpoint of this spec must hold (biases are optional)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.get("tie_word_embeddings", False):
        names.append("lm_head.weight")
    for i in range(spec.n_layers):
        pre = f"model.layers.{i}."
        names += [pre + "input_layernorm.weight", pre + "post_attention_layernorm.weight"]
        names += [pre + name + ".weight" for name in PROJECTIONS.values()]
        if spec.qk_norm:
            names += [pre + "self_attn.q_norm.weight", pre + "self_attn.k_norm.weight"]
    return names


def generation_eos(path: Path) -> tuple[int, ...]:
    """The eos_token_id(s) of the folder's generation_config.json (none when it has none)."""
    try:
        eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
