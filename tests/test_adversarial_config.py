"""A model config is untrusted input (dsia/spec.py ModelSpec.from_hf_config): zero, odd or huge sizes, heads that do
not divide, partial rotary embeddings, a claimed context of 10^8 positions, non-integers: each is one clear
CasspecError line naming the field, before anything is allocated from it. RoPE tables and the KV cache are sized
by the context a run uses, not by the file's claim; token ids are checked against the vocabulary."""
import time
import tracemalloc
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsia.errors import CasspecError
from dsia.model import Transformer
from dsia.spec import DEFAULT_CONTEXT, SPEC_LIMITS, ModelSpec
from tiny import tiny_config, tiny_engine, tiny_model

GOOD = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=97, rms_norm_eps=1e-5, max_position_embeddings=256)


def spec(**changes) -> ModelSpec:
    return ModelSpec.from_hf_config(SimpleNamespace(**(GOOD | changes)))


def test_a_good_config_gives_its_spec():
    s = spec()
    assert (s.n_heads, s.n_kv_heads, s.head_dim, s.max_context) == (4, 2, 16, 256)
    assert spec(num_key_value_heads=None).n_kv_heads == 4  # (HF's default: as many KV heads as heads)


@pytest.mark.parametrize("changes, field", [
    (dict(num_attention_heads=0), "num_attention_heads"),  # SIGFPE in the C++ attention before
    (dict(num_attention_heads=-4), "num_attention_heads"),
    (dict(num_key_value_heads=0), "num_key_value_heads"),
    (dict(num_key_value_heads=3), "not a multiple"),
    (dict(num_attention_heads=4.0), "num_attention_heads"),
    (dict(num_attention_heads="4"), "num_attention_heads"),
    (dict(num_attention_heads=True), "num_attention_heads"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(hidden_size=10**12), "hidden_size"),
    (dict(head_dim=512), "head_dim"),  # wider than the ops take
    (dict(hidden_size=36, num_attention_heads=4, num_key_value_heads=4), "odd"),  # head of 9
    (dict(hidden_size=4, num_attention_heads=4, num_key_value_heads=4), "head_dim"),  # head of 1
    (dict(num_hidden_layers=0), "num_hidden_layers"),
    (dict(num_hidden_layers=10**6), "num_hidden_layers"),
    (dict(intermediate_size=0), "intermediate_size"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(vocab_size=2**40), "vocab_size"),
    (dict(max_position_embeddings=10**8), "max_position_embeddings"),  # ~25 GB of RoPE tables before
    (dict(max_position_embeddings=1), "max_position_embeddings"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
    (dict(rms_norm_eps="1e-5"), "rms_norm_eps"),
    (dict(partial_rotary_factor=0.25), "partial_rotary_factor"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 1.0, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
    (dict(model_type="gpt2"), "unsupported architecture"),
    (dict(model_type="mistral", sliding_window=-3), "sliding_window"),
])
def test_a_bad_config_is_one_line_naming_the_field(changes, field):
    with pytest.raises(CasspecError, match=field) as e:
        spec(**changes)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(SPEC_LIMITS) + ["rms_norm_eps", "partial_rotary_factor"]),
                       st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=5),
                                 st.none(), st.booleans()), max_size=4))
def test_any_config_values_give_a_sane_spec_or_one_error(changes):
    try:
        s = spec(**changes)
    except CasspecError as e:
        assert "\n" not in str(e)
        return
    assert 1 <= s.n_kv_heads <= s.n_heads and s.n_heads % s.n_kv_heads == 0
    assert 2 <= s.head_dim <= 256 and s.head_dim % 2 == 0 and 2 <= s.max_context <= 1 << 24
    for name, value in (("num_hidden_layers", s.n_layers), ("hidden_size", s.dim), ("vocab_size", s.vocab_size),
                        ("intermediate_size", s.intermediate)):
        assert SPEC_LIMITS[name][0] <= value <= SPEC_LIMITS[name][1]


def test_a_partial_rotary_model_is_refused_before_any_step():
    """The review's high finding: such a model's tables were [T, hd/4] and the C++ RoPE read past them."""
    cfg = tiny_config("llama")
    cfg.rope_parameters = {"rope_type": "linear", "factor": 1.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(CasspecError, match="partial_rotary_factor"):
        Transformer.from_hf(model)
    # and a runtime whose frequencies do not cover the head (whatever the config said)
    good = Transformer.from_hf(tiny_model("llama"))
    with pytest.raises(CasspecError, match="frequencies for a head of 16"):
        Transformer(good.spec, good.embed, good.layers, good.norm, good.lm_head, good.inv_freq[:2], 1.0)


def test_rope_tables_are_sized_by_the_context_used_not_the_files_claim(monkeypatch):
    """A header claiming 2^24 positions costs nothing until a run asks for them: the runtime's tables cover
    DEFAULT_CONTEXT positions at most, an engine's its --max-context."""
    model = tiny_model("llama", max_pos=1 << 24)
    tracemalloc.start()
    t0 = time.perf_counter()
    runtime = Transformer.from_hf(model)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert runtime.context == DEFAULT_CONTEXT and runtime.cos.shape == (DEFAULT_CONTEXT, 16)
    assert time.perf_counter() - t0 < 5 and peak < 64 << 20
    assert runtime.with_context(100).cos.shape == (100, 16)
    assert torch.equal(runtime.with_context(100).sin, runtime.sin[:100])  # the same bits as the longer tables
    with pytest.raises(CasspecError, match="lower --max-context"):
        runtime.with_context((1 << 24) + 1)
    monkeypatch.setattr("dsia.variants._device_memory", lambda device: 1 << 30)  # a machine of 1 GiB
    with pytest.raises(CasspecError, match="more than the 1.1 GB"):  # 3.3 GB of KV cache, refused before allocating
        runtime.with_context(1 << 23)
    monkeypatch.undo()
    engine = tiny_engine("llama", max_context=64)
    assert engine.model.context == engine.cache.capacity == 64
    with pytest.raises(CasspecError, match="lower --max-context"):
        tiny_engine("llama", max_context=257)  # past the model's 256 positions


def test_token_ids_outside_the_vocabulary_are_one_error_and_the_engine_goes_on():
    from casspec.runtime.request import Request

    engine = tiny_engine("llama")
    for ids in ([5, 97], [-1, 3], [5, 2**70], [5, 3.0], [True, 4]):
        with pytest.raises(CasspecError, match=r"token id .*\[0, 97\)"):
            engine.generate_ids(ids, Request(method="ar", max_new_tokens=2))
    assert len(engine.generate_ids([5, 17, 9], Request(method="ar", max_new_tokens=3)).token_ids) == 3


@pytest.mark.parametrize("hf", [False, True], ids=["runtime-reader", "transformers"])
@pytest.mark.parametrize("changes, needle", [
    ({"num_attention_heads": 0}, "num_attention_heads is 0"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"partial_rotary_factor": 0.25}, "partial_rotary_factor 0.25"),
    ({"max_position_embeddings": 10**8}, "max_position_embeddings is 100000000"),
    ({"vocab_size": 2**40}, "vocab_size is 1099511627776"),
    ({"head_dim": 1024}, "head_dim is 1024"),
])
def test_a_crafted_config_json_is_refused_before_any_weight_is_read(tmp_path, hf_dir, hf, changes, needle):
    """Both readers (casspec's runtime reader and transformers, behind `hf`) refuse before building anything."""
    import json
    import shutil

    from casspec.loading.checkpoints import load

    d = tmp_path / "m"
    shutil.copytree(hf_dir, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | changes))
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(CasspecError, match=needle) as e:
        load(str(d), "float32", "cpu", hf=hf)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert "\n" not in str(e.value) and time.perf_counter() - t0 < 10 and peak < 64 << 20
