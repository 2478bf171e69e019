"""scripts/gguf_at_scale.py: its files follow llama.cpp's Q4_K_M layout (fallbacks included), casspec's native
target loads them and decodes them losslessly, and bad input is one error line with exit 2."""
import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gguf_at_scale.py"


def load():
    spec = importlib.util.spec_from_file_location("gguf_at_scale", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclass looks its module up)
    spec.loader.exec_module(mod)
    return mod


def tiny(mod, arch: str):
    """2 layers of 256 with an intermediate of 288 (not whole super-blocks: ffn_down falls back)."""
    return mod.Shape(hidden=256, intermediate=288, layers=2, heads=4, kv_heads=2, vocab=320, arch=arch,
                     rope_theta=10000.0, tied=arch == "qwen2", context=256)


def test_the_named_shapes_follow_llama_cpps_layer_rule():
    mod = load()
    assert [i for i in range(24) if mod.use_more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    q05 = mod.layout(mod.SHAPES["qwen2.5-0.5b"])  # hidden 896: every [*, 896] tensor falls back
    assert q05["token_embd.weight"][0] == "Q8_0" and "output.weight" not in q05
    assert q05["blk.0.attn_q.weight"][0] == "Q5_0" and q05["blk.0.attn_v.weight"][0] == "Q8_0"
    assert q05["blk.3.attn_v.weight"][0] == "Q5_0" and q05["blk.0.ffn_down.weight"][0] == "Q6_K"
    assert q05["blk.3.ffn_down.weight"][0] == "Q4_K" and q05["blk.0.attn_q.bias"][0] == "F32"
    untied = mod.layout(dataclasses.replace(mod.SHAPES["qwen2.5-0.5b"], tied=False))  # (Qwen's published layout)
    assert untied["token_embd.weight"][0] == "Q5_0" and untied["output.weight"][0] == "Q8_0"
    l7 = mod.layout(mod.SHAPES["llama-7b"])
    assert l7["token_embd.weight"][0] == "Q4_K" and l7["output.weight"][0] == "Q6_K"
    assert l7["blk.0.ffn_down.weight"][0] == "Q6_K" and l7["blk.5.ffn_down.weight"][0] == "Q4_K"
    assert not any(n.endswith(".bias") for n in l7)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_tiny_file_has_q4_k_m_types_and_decodes_losslessly(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    from gguf import GGUFReader

    from casspec.runtime.engine import Engine
    from casspec.runtime.request import Request

    mod = load()
    shape = tiny(mod, arch)
    path = tmp_path / f"{arch}.gguf"
    counts = mod.make(shape, path)
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    want = {  # layer 0: Q4_K (ffn_down's 288 -> Q5_0); layer 1 (>= 7n/8): more bits (ffn_down Q6_K -> Q8_0)
        "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_v.weight": "Q4_K", "blk.0.ffn_gate.weight": "Q4_K",
        "blk.0.ffn_down.weight": "Q5_0", "blk.1.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q8_0",
        "blk.1.attn_output.weight": "Q4_K", "blk.1.ffn_norm.weight": "F32", "output_norm.weight": "F32"}
    assert {n: types[n] for n in want} == want
    if arch == "qwen2":
        assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types
        assert types["blk.1.attn_k.bias"] == "F32"
    else:
        assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert sum(counts.values()) == len(types)
    engine = Engine.from_pretrained(str(path), weights="native", autoprofile=False, keep_state=False)
    ar = engine.generate_ids([5, 6, 7], Request(max_new_tokens=4, method="ar"))
    pld = engine.generate_ids([5, 6, 7], Request(max_new_tokens=4, method="pld"))
    assert len(ar.token_ids) >= 1 and ar.token_ids == pld.token_ids


def test_bad_input_is_one_error_and_exit_2(tmp_path):
    for args, says in ((["make", "--shape", "qwen2.5-0.5b", "--out", str(tmp_path / "no" / "x.gguf")], "--out"),
                       (["measure", str(tmp_path / "missing.gguf")], "measure takes"),
                       (["measure", str(SCRIPT)], "measure takes")):
        out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert says in out.stderr.splitlines()[-1]


def test_the_table_names_both_runtimes():
    mod = load()
    side = {"load_s": 1.0, "baseline_bytes": 10**6, "resident_bytes": 3 * 10**6, "weight_bytes": 2 * 10**9,
            "ms": {"1": 10.0, "4": 20.0, "8": 30.0, "16": None}}
    rec = {"file": "f.gguf", "shape_summary": "llama", "cpu": "CPU X", "file_bytes": 2 * 10**9,
           "meta": {"first_use_s": 2}, "casspec": dict(side, floor_ms=5.0, kv_bytes=2 * 10**6), "llama.cpp": side}
    text = mod.table(rec)
    assert "CPU X" in text and "| casspec | 1.00 | 2 (1) | 2000 | 2 | 2000 | 10.0 | 20.0 | 30.0 | - | 5.0 |" in text
    assert "| llama.cpp |" in text
