"""Fuzzed checkpoints: truncated or bit-flipped files end in a CasspecError or a correct load, never another
exception and never a model whose weights are not the file's.

- config.json of a tiny HF folder: a load that succeeds uses every tensor of the weights file, unchanged (a config
  that lost layers or changed a shape is refused), and a forward gives finite logits.
- model.safetensors: a truncated file or a flipped bit in its header is refused or loads the very same weights. A
  flipped bit in the tensor DATA of a user's own folder cannot be detected (safetensors has no checksum): it loads
  as what the file now says, so there only the absence of any other exception is asserted. (The GGUF cache's own
  entries carry checksums: tests/test_cache.py.)
- a tiny GGUF: a load that succeeds gives exactly what transformers dequantizes from the same bytes (the cache
  keeps them faithfully, and no tensor is left random or dropped).
"""
import json
import os
import shutil
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from casspec.loading.checkpoints import load
from casspec.loading.weights import HF_PROJECTIONS
from dsia.errors import CasspecError
from tiny import tiny_gguf, tiny_model, tiny_tokenizer

FUZZ = settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


@contextmanager
def fuzzed_copy(src: Path, corrupt) -> Path:
    """A copy of `src` (a folder or a file) in a fresh temporary folder, with `corrupt(path)` applied to it, and a
    user cache of its own."""
    old = os.environ.get("CASSPEC_CACHE")
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / src.name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
        os.environ["CASSPEC_CACHE"] = str(Path(tmp) / "cache")
        try:
            corrupt(dst)
            yield dst
        finally:
            os.environ["CASSPEC_CACHE"] = old if old is not None else os.environ.pop("CASSPEC_CACHE")


def truncate(n: int):
    def apply(path: Path) -> None:
        path.write_bytes(path.read_bytes()[:n])
    return apply


def flip(at: int, bit: int):
    def apply(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[at % len(data)] ^= 1 << bit
        path.write_bytes(bytes(data))
    return apply


def loaded_or_refused(path: Path, hf: bool = False):
    """The load of `path`, or None when it was refused with a one-line CasspecError; any other exception fails."""
    try:
        return load(str(path), "float32", "cpu", hf)
    except CasspecError as e:
        assert "\n" not in str(e), str(e)
        return None


def runtime_state(rt) -> dict[str, torch.Tensor]:
    """The runtime's tensors under their checkpoint names."""
    state = {"model.embed_tokens.weight": rt.embed, "model.norm.weight": rt.norm}
    if rt.lm_head is not rt.embed:
        state["lm_head.weight"] = rt.lm_head
    for i, lw in enumerate(rt.layers):
        pre = f"model.layers.{i}."
        state |= {pre + "input_layernorm.weight": lw.attn_norm, pre + "post_attention_layernorm.weight": lw.mlp_norm}
        state |= {pre + name + ".weight": getattr(lw, field) for field, name in HF_PROJECTIONS.items()}
    return state


def assert_runs(rt) -> None:
    cache = rt.new_cache(16)
    logits = rt.forward(cache, torch.tensor([3, 5, 7]), torch.arange(3), 0)
    assert logits.shape == (3, rt.spec.vocab_size) and torch.isfinite(logits).all()


def assert_is_the_file(got, weights: dict[str, torch.Tensor]) -> None:
    """The loaded model holds exactly `weights` (every tensor, none left out, none changed) and runs."""
    if got.runtime is not None:
        state = runtime_state(got.runtime)
        assert_runs(got.runtime)
    else:
        state = dict(got.model.state_dict())
        if got.model.config.tie_word_embeddings:
            state.pop("lm_head.weight")
    assert state.keys() == weights.keys()
    assert all(torch.equal(state[k], weights[k]) for k in weights)


# ------------------------------------------------------------------ (a) config.json of an HF folder
@pytest.mark.parametrize("change,hf", [({"num_hidden_layers": 2}, False), ({"num_hidden_layers": 2}, True),
                                       ({"intermediate_size": 100}, False), ({"num_attention_heads": 8}, False)])
def test_a_config_that_disagrees_with_its_weights_is_refused(hf_dir, change, hf):
    """What the fuzzing below finds rarely: a config that lost a layer (the last one was dropped silently) or gives
    another shape (the runtime failed at the first forward)."""
    def edit(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, **change}))

    with fuzzed_copy(hf_dir, edit) as d, pytest.raises(CasspecError, match="and the weights do not match"):
        load(str(d), "float32", "cpu", hf)


def test_a_config_that_is_not_an_object_is_refused(hf_dir):
    with fuzzed_copy(hf_dir, lambda d: (d / "config.json").write_text("[1, 2]")) as d:
        with pytest.raises(CasspecError, match="config.json is not a JSON object"):
            load(str(d))


@FUZZ
@given(cut=st.integers(0, 2000), at=st.integers(0, 10**6), bit=st.integers(0, 7), hf=st.booleans(),
       truncated=st.booleans())
def test_fuzzed_config_json(hf_dir, cut, at, bit, hf, truncated):
    weights = load_file(hf_dir / "model.safetensors")
    corrupt = truncate(cut) if truncated else flip(at, bit)
    with fuzzed_copy(hf_dir, lambda d: corrupt(d / "config.json")) as d:
        got = loaded_or_refused(d, hf)
        if got is not None:
            assert_is_the_file(got, weights)


# ------------------------------------------------------------------ (b) model.safetensors of an HF folder
def header_end(path: Path) -> int:
    """The end of the safetensors header (8-byte length, then the JSON header)."""
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


@FUZZ
@given(at=st.integers(0, 10**6), bit=st.integers(0, 7), truncated=st.booleans())
def test_fuzzed_safetensors_header(hf_dir, at, bit, truncated):
    f = hf_dir / "model.safetensors"
    weights = load_file(f)
    size, end = f.stat().st_size, header_end(f)
    corrupt = truncate(at % size) if truncated else flip(at % end, bit)
    with fuzzed_copy(hf_dir, lambda d: corrupt(d / f.name)) as d:
        got = loaded_or_refused(d)
        if got is not None:
            assert_is_the_file(got, weights)


@settings(FUZZ, max_examples=6)
@given(at=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_fuzzed_safetensors_data_never_raises_another_exception(hf_dir, at, bit):
    """Not detectable (no checksum in a user's folder): only no exception other than a CasspecError."""
    f = hf_dir / "model.safetensors"
    end, size = header_end(f), f.stat().st_size
    with fuzzed_copy(hf_dir, lambda d: flip(end + at % (size - end), bit)(d / f.name)) as d:
        loaded_or_refused(d)


# ------------------------------------------------------------------ (c) a GGUF
@pytest.mark.parametrize("block_count", [1, 3])
def test_a_gguf_whose_header_disagrees_with_its_tensors_is_refused(tmp_path, block_count):
    """A header claiming a layer more (transformers left it random) or fewer (its tensors were dropped)."""
    g = tiny_gguf(tmp_path / "tiny.gguf", block_count=block_count)
    with fuzzed_copy(g, lambda path: None) as g:
        with pytest.raises(CasspecError, match="missing weight tensors|a layer beyond its block count"):
            load(str(g))


@FUZZ
@given(at=st.integers(0, 10**6), bit=st.integers(0, 7), truncated=st.booleans())
def test_fuzzed_gguf(gguf_file, at, bit, truncated):
    from transformers import AutoModelForCausalLM

    size = gguf_file.stat().st_size
    corrupt = truncate(at % size) if truncated else flip(at, bit)
    with fuzzed_copy(gguf_file, corrupt) as g:
        got = loaded_or_refused(g)
        if got is not None:
            ref = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32)
            weights = dict(ref.state_dict())
            if ref.config.tie_word_embeddings:
                weights.pop("lm_head.weight")
            assert_is_the_file(got, weights)
