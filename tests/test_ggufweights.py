"""casspec's own GGUF weight reader (casspec/loading/ggufweights.py): a Llama GGUF's weights equal transformers' reading
of the same file bit for bit (every stored type it takes, q/k rows back in transformers' order, grouped-query heads);
what it does not take (another architecture or type) is left to transformers; the loader's cache is built from it."""
import pytest
import torch
from tiny import tiny_gguf

from casspec.loading import checkpoints as loading
from casspec.loading.ggufcheck import GGUFFile
from casspec.loading.ggufweights import hf_name, state_dict
from casspec.loading.native import unpermute


def transformers_state(path):
    from transformers import AutoModelForCausalLM

    with GGUFFile(path) as src:
        folder, file = str(src.reader_path.parent), src.reader_path.name
        config = loading._checked_config(folder, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, config=config, dtype=torch.float32)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state, config


@pytest.mark.parametrize("qtype", ["F32", "Q4_0", "Q4_1", "Q8_0"])
def test_it_reads_what_transformers_reads(tmp_path, qtype):
    path = tiny_gguf(tmp_path / f"m-{qtype}.gguf", seed=1, dim=64, layers=2, heads=4, kv_heads=2, qtype=qtype)
    ref, config = transformers_state(path)
    with GGUFFile(path) as src:
        own = state_dict(src, src.header(), config)
    assert own is not None and set(own) == set(ref)
    for name, w in ref.items():
        assert own[name].dtype == torch.float32 and torch.equal(own[name], w), name


def test_unpermute_undoes_llama_cpps_rope_reordering():
    """llama.cpp's converter: w.reshape(heads, 2, hd / 2, in).swapaxes(1, 2) -- interleaves each head's halves."""
    w = torch.arange(8 * 3 * 5, dtype=torch.float32).reshape(8 * 3, 5)  # 3 heads of 8 rows
    stored = w.reshape(3, 2, 4, 5).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute(stored, 3), w) and not torch.equal(stored, w)


def test_names_it_does_not_know_are_left_to_transformers():
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.3.attn_q.bias") is None and hf_name("blk.x.ffn_up.weight") is None
    assert hf_name("blk.0.ffn_gate_exps.weight") is None


def test_another_architecture_or_type_is_left_to_transformers(tmp_path):
    path = tiny_gguf(tmp_path / "m.gguf", seed=2)
    raw = bytearray(path.read_bytes())
    key = b"general.architecture"
    at = raw.index(key) + len(key) + 4 + 8  # the value: its type (string), its length, then "llama"
    assert raw[at:at + 5] == b"llama"
    raw[at:at + 5] = b"gpt2x"
    other = tmp_path / "other.gguf"
    other.write_bytes(bytes(raw))
    _, config = transformers_state(path)
    with GGUFFile(other) as src:
        assert state_dict(src, src.header(), config) is None
    with GGUFFile(path) as src:  # an untied model that stores no head: not taken either
        assert state_dict(src, src.header(), config) is not None
        config.tie_word_embeddings = False
        assert state_dict(src, src.header(), config) is None


def test_the_cache_is_built_by_it_and_loads_the_same_model(tmp_path, monkeypatch):
    """transformers reads the tokenizer and config; the weights come from casspec's reader, as transformers'."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    path = tiny_gguf(tmp_path / "m.gguf", seed=3, dim=64, heads=4, kv_heads=2, qtype="Q4_1")
    ref, _ = transformers_state(path)
    real, gguf_reads = AutoModelForCausalLM.from_pretrained.__func__, []

    def counting(cls, *args, **kw):
        gguf_reads.extend([kw["gguf_file"]] if kw.get("gguf_file") else [])
        return real(cls, *args, **kw)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(counting))
    state = loading.load(str(path)).model.state_dict()
    assert gguf_reads == []
    for name, w in ref.items():
        assert torch.equal(state[name], w), name


def test_the_cache_parses_the_header_once_and_its_tokenizer_loads_by_its_own_class(tmp_path, monkeypatch):
    """Building the cache, transformers' metadata parse runs once for the tokenizer and the config
    (metadata_once); a later load reads the saved tokenizer by its fast class (weights.read_tokenizer), the same
    tokenizer AutoTokenizer gives: ids, special tokens, chat template."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoTokenizer

    from casspec.loading.weights import read_tokenizer

    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    path = tiny_gguf(tmp_path / "m.gguf", seed=3, dim=64, heads=4, kv_heads=2, qtype="Q4_1")
    real, parses = gguf_utils.load_gguf_checkpoint, []

    def counting(*args, **kw):
        parses.append(args[0])
        return real(*args, **kw)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counting)
    built = loading.load(str(path))
    assert len(parses) == 1
    entry = next(p for p in (tmp_path / "cache").iterdir() if (p / "tokenizer_config.json").is_file())
    fast, auto = read_tokenizer(entry), AutoTokenizer.from_pretrained(entry)
    assert type(fast) is type(auto)
    text = "a b ab ba <s> hello"
    assert fast(text).input_ids == auto(text).input_ids == built.tokenizer(text).input_ids
    assert fast.special_tokens_map == auto.special_tokens_map and fast.chat_template == auto.chat_template
