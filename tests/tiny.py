"""Tiny random Llama-family checkpoints built in-process (no files, no network) for unit tests."""
from __future__ import annotations

import torch
from scipy.stats import chisquare

from dsia.kernels import candidates
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def tiny_config(arch: str = "llama", vocab: int = 97, layers: int = 3, dim: int = 64, heads: int = 4,
                kv_heads: int = 2, tie: bool = False, max_pos: int = 256):
    common = dict(vocab_size=vocab, hidden_size=dim, intermediate_size=dim * 2, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=dim // heads)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **kw):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **kw), dtype=dtype, attn_implementation="sdpa")
    # random init is tiny; spread the weights so logits are not all near-ties
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.uniform_(0.7, 1.3)
            else:
                p.normal_(0, 0.1)
    return model.eval()


def tiny_tokenizer(vocab: int = 97):
    """A word-level tokenizer over the words w0 .. w{vocab-1} (w1 = BOS, w2 = EOS, w0 = pad/unk)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0", bos_token="w1",
                                   eos_token="w2")
    # a minimal chat template: the turns' words, space-joined
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return fast


KERNELS = tuple(candidates(torch.float32, "cpu"))  # forced in the
# exactness tests: each must give the target's tokens


def tiny_engine(arch: str = "llama", seed: int = 0, max_context: int | None = None, kernels: str = "blas",
                graphs: bool | None = None, autoprofile: bool = False, keep_state: bool = False,
                fuse_projections: bool | None = None, reuse_prefix: bool = True, batch_invariant: bool = False,
                fast_layers: bool | None = None, **kw):
    """An Engine over a tiny random model (no files). Prompts are strings of words 'w5 w17 ...'. graphs=True on the
    CPU runs the CUDA graphs' static-shape forwards eagerly. No profile is measured and no state is kept unless asked
    (tests that ask point CASSPEC_CACHE at a temporary folder)."""
    from casspec.runtime.engine import Engine
    from casspec.loading.checkpoints import Loaded

    model = tiny_model(arch, seed, **kw)
    engine = Engine(Loaded(model, tiny_tokenizer(model.config.vocab_size), f"tiny-{arch}"), max_context=max_context,
                    kernels=kernels, graphs=graphs, autoprofile=autoprofile, keep_state=keep_state,
                    fuse_projections=fuse_projections, reuse_prefix=reuse_prefix,
                    batch_invariant=batch_invariant, fast_layers=fast_layers)
    if autoprofile:  # (as Engine.from_pretrained does)
        engine.measure_first_use()
    return engine


def complete_at_once(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt's greedy /v1/completions text, the calls made at once (one client thread each)."""
    import threading

    import httpx

    got: dict[int, str] = {}

    def call(i: int) -> None:
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0})
        got[i] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return [got[i] for i in range(len(prompts))]


def chi2_p(observed: list[float], expected: list[float]) -> float:
    """Chi-square p-value; expected counts rescaled (in float64) to the observed total."""
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def joint_chi2_p(obs, joint) -> float:
    """Chi-square p-value of observed counts [K] against a distribution [K]: cells expecting >= 5 draws stand
    alone, the rare ones are pooled into one cell (left out when it expects nothing)."""
    n = float(obs.sum())
    big = joint * n >= 5
    o, x = obs[big].tolist(), (joint[big] * n).tolist()
    if joint[~big].sum() > 0:
        o, x = o + [float(obs[~big].sum())], x + [float(joint[~big].sum() * n)]
    return chi2_p(o, x)


# a K-quant's float16 scales in tiny_gguf: weights of about the float ones' size (0.2) from random codes
K_SCALES = {"Q2_K": 0.02, "Q3_K": 0.006, "Q4_K": 0.001, "Q5_K": 0.0005, "Q6_K": 0.0002}


def tiny_gguf(path, seed: int = 0, dim: int = 16, layers: int = 2, heads: int = 2, kv_heads: int = 1,
              block_count: int | None = None, qtype: str = "F32", pad_vocab: int = 0, context: int = 64,
              chat_template: str | None = None):
    """A tiny float32 Llama GGUF (tied head) with a byte-level BPE vocabulary (the 256 byte symbols, one merge
    'a b', then <s> and </s>), written with gguf's GGUFWriter: a few tens of KB that dequantize in well under a
    second. block_count: the layer count its header claims (default: `layers`, the layers it holds). Returns
    `path`. qtype: the GGML type its matrices are stored in (F32, a type gguf quantizes: Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0; or a K-quant, random blocks of about the float weights' size, dim a multiple of 256; the token embedding,
    tied head, in Q8_0 when quantized); pad_vocab: unused tokens appended to the vocabulary (so that it fits a packed
    kernel); context: the context length its header gives; chat_template: the tokenizer's (None: none)."""
    import numpy as np
    from gguf import GGUFWriter, TokenType
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from casspec.loading.ggufcodes import random_blocks

    tokens = list(bytes_to_unicode().values()) + ["ab"] + [f"<pad{i}>" for i in range(pad_vocab)] + ["<s>", "</s>"]
    vocab, ffn, kv_dim = len(tokens), 2 * dim, kv_heads * (dim // heads)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(layers if block_count is None else block_count)
    w.add_context_length(context)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(dim // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.NORMAL] * (vocab - 2) + [TokenType.CONTROL] * 2)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (dim,), f"blk.{i}.ffn_norm.weight": (dim,),
                   f"blk.{i}.attn_q.weight": (dim, dim), f"blk.{i}.attn_k.weight": (kv_dim, dim),
                   f"blk.{i}.attn_v.weight": (kv_dim, dim), f"blk.{i}.attn_output.weight": (dim, dim),
                   f"blk.{i}.ffn_gate.weight": (ffn, dim), f"blk.{i}.ffn_up.weight": (ffn, dim),
                   f"blk.{i}.ffn_down.weight": (dim, ffn)}
    for name, shape in shapes.items():
        norm = len(shape) == 1
        data = (rng.uniform(0.7, 1.3, shape) if norm else rng.normal(0, 0.2, shape)).astype(np.float32)
        kind = "F32" if norm else "Q8_0" if name == "token_embd.weight" and qtype != "F32" else qtype
        if kind == "F32":
            w.add_tensor(name, data)
        elif kind in K_SCALES:
            w.add_tensor(name, random_blocks(kind, *shape, rng, K_SCALES[kind]), raw_dtype=GGMLQuantizationType[kind])
        elif kind == "IQ4_NL":  # (a type casspec does not multiply: blocks of 32, a float16 d, 16 bytes of indices)
            raw = rng.integers(0, 256, (shape[0], shape[1] // 32, 18), dtype=np.uint8)
            raw[..., 0:2] = np.full((shape[0], shape[1] // 32, 1), 0.002, np.float16).view(np.uint8)
            w.add_tensor(name, raw.reshape(shape[0], -1), raw_dtype=GGMLQuantizationType[kind])
        else:
            t = GGMLQuantizationType[kind]
            w.add_tensor(name, quantize(data, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
