"""What a checkpoint's config says of its model (ModelSpec), checked as the untrusted input it is: every size within
what casspec runs (SPEC_LIMITS), the heads consistent, RoPE over the whole head; one CasspecError line naming the
field for a config casspec cannot run, before anything is allocated from it."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import CasspecError

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# RoPE scalings whose frequencies are fixed at load (the runtime copies the HF model's inv_freq and attention
# scaling once); "dynamic" and "longrope" change them with the sequence length, so they are refused
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
DEFAULT_CONTEXT = 32768  # positions a run takes when it names none (capped by the model's own maximum)


# What a checkpoint's config may ask for (a config is untrusted input: sizes past these are refused, one line each,
# before anything is allocated from them). Generous for the Llama family: the largest released models are well
# inside them.
MAX_HEAD_DIM = 256  # the widest attention head casspec's ops take (dsia/csrc/ops.h kMaxHeadDim)
SPEC_LIMITS: dict[str, tuple[int, int]] = {  # config field -> (least, most)
    "num_hidden_layers": (1, 1024),
    "hidden_size": (1, 1 << 16),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, MAX_HEAD_DIM),
    "intermediate_size": (1, 1 << 19),
    "vocab_size": (1, 1 << 22),
    "max_position_embeddings": (2, 1 << 24),
}


def _config_int(cfg, name: str, default: int | None = None) -> int:
    """The config's integer `name` (`default` where it has none) within SPEC_LIMITS, else a CasspecError naming it."""
    value = getattr(cfg, name, None)
    if value is None:
        value = default
    return _checked_int(name, value)


def check_config_fields(config: dict, where: str) -> None:
    """A raw config.json's architecture and the SPEC_LIMITS fields it holds, each checked (a CasspecError naming the
    first bad one) before a library builds a config of them (transformers' own checks would fail on some with a bare
    ZeroDivisionError)."""
    if config.get("model_type") not in SUPPORTED_ARCHS:
        raise CasspecError(f"unsupported architecture {repr(config.get('model_type'))[:40]} in {where}: casspec "
                           f"supports {', '.join(SUPPORTED_ARCHS)} (Llama family)")
    for name in SPEC_LIMITS:
        if config.get(name) is not None:
            _checked_int(name, config[name])


def _checked_int(name: str, value: object) -> int:
    lo, hi = SPEC_LIMITS[name]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise CasspecError(f"the model config's {name} is {repr(value)[:40]}: casspec takes an integer in [{lo}, "
                           f"{hi}]; the config.json (or GGUF header) is corrupt or of an unsupported model")
    return value


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # HF model_type
    n_layers: int
    dim: int  # hidden size D
    n_heads: int  # H
    n_kv_heads: int  # Hkv
    head_dim: int
    intermediate: int  # MLP width
    vocab_size: int
    norm_eps: float
    max_context: int  # positions the model supports (capped by a sliding window, where one is set)
    qk_norm: bool  # Qwen3

    @staticmethod
    def from_hf_config(cfg) -> "ModelSpec":
        """The spec of an HF config (or any object with its fields), every size checked against SPEC_LIMITS and
        against each other: a CasspecError naming the field for a config casspec cannot run."""
        arch = getattr(cfg, "model_type", "?")
        if arch not in SUPPORTED_ARCHS:
            raise CasspecError(f"unsupported architecture {arch!r}: casspec supports {', '.join(SUPPORTED_ARCHS)} "
                               "(Llama family); use a checkpoint of one of these")
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in STATIC_ROPE:
            raise CasspecError(f"RoPE scaling {rope_type!r} is not supported: casspec implements "
                               f"{', '.join(STATIC_ROPE)} (frequencies fixed at load); use a checkpoint without it")
        partial = getattr(cfg, "partial_rotary_factor", None)
        if partial is None and isinstance(rope, dict):
            partial = rope.get("partial_rotary_factor")
        if partial is not None and partial != 1.0:
            raise CasspecError(f"partial_rotary_factor {repr(partial)[:40]} is not supported: casspec rotates the "
                               "whole head (factor 1.0); use a checkpoint without partial rotary embeddings")
        dim = _config_int(cfg, "hidden_size")
        n_heads = _config_int(cfg, "num_attention_heads")
        n_kv_heads = _config_int(cfg, "num_key_value_heads", n_heads)
        if n_heads % n_kv_heads:
            raise CasspecError(f"the model config's num_attention_heads {n_heads} is not a multiple of its "
                               f"num_key_value_heads {n_kv_heads}: the config is corrupt or of an unsupported model")
        head_dim = _checked_int("head_dim", getattr(cfg, "head_dim", None) or dim // n_heads)  # (HF's rule)
        if head_dim % 2:
            raise CasspecError(f"the model config's head size {head_dim} is odd: RoPE rotates pairs of a head's "
                               "numbers, so it must be even; the config is corrupt or of an unsupported model")
        eps = getattr(cfg, "rms_norm_eps", None)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
            raise CasspecError(f"the model config's rms_norm_eps is {repr(eps)[:40]}: casspec takes a number in "
                               "[0, 1); the config is corrupt or of an unsupported model")
        max_ctx = _config_int(cfg, "max_position_embeddings")
        window = getattr(cfg, "sliding_window", None)
        if window and (arch == "mistral" or getattr(cfg, "use_sliding_window", False)):
            if isinstance(window, bool) or not isinstance(window, int) or window < 2:
                raise CasspecError(f"the model config's sliding_window is {repr(window)[:40]}: an integer >= 2 "
                                   "expected; the config is corrupt")
            max_ctx = min(max_ctx, window)  # within the window, sliding attention equals full attention
        return ModelSpec(
            arch=arch, n_layers=_config_int(cfg, "num_hidden_layers"), dim=dim, n_heads=n_heads,
            n_kv_heads=n_kv_heads, head_dim=head_dim, intermediate=_config_int(cfg, "intermediate_size"),
            vocab_size=_config_int(cfg, "vocab_size"), norm_eps=float(eps), max_context=max_ctx,
            qk_norm=arch == "qwen3")
