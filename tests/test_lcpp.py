"""bench's llama.cpp baselines (casspec/tools/lcpp.py) against a stand-in `llama_cpp` module: llama-cpp-python is an
optional extra and never a test dependency. What is tested is casspec's side: the prompt ids, decoding settings,
threads, stops, conversation reuse, the F32 file made once, and the errors."""
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from casspec.tools import lcpp
from casspec.tools.bench import parse_methods, run_bench
from dsia.errors import CasspecError
from dytc.sampling import SamplingParams
from tiny import tiny_engine

EOS = 2


class FakeLlama:
    """Records what casspec asks of llama.cpp; generates (last + 1) % 90 + 3 after each last token, EOS at `eos_at`."""
    made: list["FakeLlama"] = []
    eos_at: int | None = None

    def __init__(self, **kw):
        self.kw, self.resets, self.calls, self.seeds = kw, 0, [], []
        FakeLlama.made.append(self)

    def reset(self):
        self.resets += 1

    def set_seed(self, seed):
        self.seeds.append(seed)

    def generate(self, tokens, **kw):
        self.calls.append((list(tokens), kw))
        last, i = tokens[-1], 0
        while True:
            i += 1
            last = EOS if i == self.eos_at else (last + 1) % 90 + 3
            yield last


@pytest.fixture
def fake(monkeypatch, tmp_path):
    quantized = []

    def quantize(src, dst, params):
        quantized.append((src, dst, params.ftype, params.allow_requantize))
        open(dst, "wb").write(b"F32" + open(src, "rb").read())
        return 0

    mod = types.ModuleType("llama_cpp")
    mod.Llama = FakeLlama
    mod.llama_model_quantize_default_params = lambda: SimpleNamespace(ftype=7, allow_requantize=False)
    mod.llama_model_quantize = quantize
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    FakeLlama.made, FakeLlama.eos_at = [], None
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    return SimpleNamespace(gguf=gguf, quantized=quantized)


def test_missing_llama_cpp_python_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    with pytest.raises(CasspecError, match=r"need llama-cpp-python, which is not installed: pip install "):
        lcpp.llama_cpp()


def test_a_turn_is_greedy_with_torchs_threads_and_stops_like_casspec(fake):
    run = lcpp.lcpp_runner(fake.gguf, False, 256, frozenset({EOS}), SamplingParams(), seed=0)
    (llm,) = FakeLlama.made
    assert llm.kw["model_path"] == str(fake.gguf) and llm.kw["n_ctx"] == 256
    assert llm.kw["n_threads"] == llm.kw["n_threads_batch"] == torch.get_num_threads()
    out, forwards, stats = run([5, 6, 7], 4)
    assert out == [11, 15, 19, 23] and forwards == 4 and stats == {}  # max_new_tokens
    tokens, kw = llm.calls[-1]
    assert tokens == [5, 6, 7] and kw["temp"] == 0.0 and kw["top_k"] == 1 and kw["repeat_penalty"] == 1.0
    FakeLlama.eos_at = 2
    assert run([5, 6, 7, 9], 10)[0] == [13, EOS]  # EOS ends the turn and is part of it, as in casspec's answers


def test_a_conversation_reuses_and_a_new_question_resets(fake):
    run = lcpp.lcpp_runner(fake.gguf, False, 256, frozenset({EOS}), SamplingParams(), seed=0)
    (llm,) = FakeLlama.made
    run([5, 6], 3)
    assert llm.resets == 1  # the first turn starts empty
    run([5, 6, 9, 10, 11], 3)  # the same conversation, one turn on: llama.cpp keeps its prefix
    assert llm.resets == 1
    run([7, 8], 3)  # another question
    assert llm.resets == 2


def test_sampling_passes_the_warp_and_seeds_each_turn(fake):
    run = lcpp.lcpp_runner(fake.gguf, False, 256, frozenset({EOS}), SamplingParams(0.7, 20, 0.9), seed=5)
    (llm,) = FakeLlama.made
    run([5], 2)
    _, kw = llm.calls[-1]
    assert (kw["temp"], kw["top_k"], kw["top_p"], kw["min_p"]) == (0.7, 20, 0.9, 0.0) and llm.seeds == [5]


def test_f32_file_is_made_once_by_llama_cpps_quantizer(fake):
    lcpp.lcpp_runner(fake.gguf, True, 256, frozenset({EOS}), SamplingParams(), seed=0)
    lcpp.lcpp_runner(fake.gguf, True, 256, frozenset({EOS}), SamplingParams(), seed=0)
    assert len(fake.quantized) == 1
    src, dst, ftype, requant = fake.quantized[0]
    assert ftype == lcpp.LLAMA_FTYPE_ALL_F32 and requant and src == str(fake.gguf).encode()
    assert FakeLlama.made[0].kw["model_path"] == FakeLlama.made[1].kw["model_path"]
    assert FakeLlama.made[0].kw["model_path"].endswith("-f32.gguf")
    assert open(FakeLlama.made[0].kw["model_path"], "rb").read() == b"F32GGUF stand-in"


def test_a_failed_dequantization_is_one_clear_error(fake, monkeypatch):
    monkeypatch.setattr(sys.modules["llama_cpp"], "llama_model_quantize", lambda *a: 1)
    with pytest.raises(CasspecError, match="could not dequantize"):
        lcpp.lcpp_runner(fake.gguf, True, 256, frozenset({EOS}), SamplingParams(), seed=0)


def test_a_checkpoint_that_is_not_a_gguf_file_is_refused(fake, tmp_path):
    with pytest.raises(CasspecError, match="run a GGUF file"):
        lcpp.lcpp_runner(tmp_path, False, 256, frozenset({EOS}), SamplingParams(), seed=0)
    with pytest.raises(CasspecError, match="run a GGUF file"):
        lcpp.lcpp_runner(None, False, 256, frozenset({EOS}), SamplingParams(), seed=0)


def test_bench_runs_lcpp_beside_the_other_methods(fake, tmp_path):
    assert parse_methods("lcpp-ar,ar,lcpp-ar-f32") == ["hf-ar", "lcpp-ar", "ar", "lcpp-ar-f32"]
    with pytest.raises(CasspecError, match="unknown method"):
        parse_methods("lcpp-ar:int4")
    from casspec.calibrate.questions import Question

    e = tiny_engine()
    e.source = fake.gguf
    qs = [Question(1, "writing", ["w5 w6 w7", "w8 w9"]), Question(2, "coding", ["w10 w11"])]
    summary = run_bench(e, qs, ["hf-ar", "lcpp-ar", "ar"], 6, tmp_path / "out", "float32", progress=False)
    row = summary["methods"]["lcpp-ar"]
    assert row["questions"] == 2 and row["new_tokens"] == 18 and row["target_forwards"] == 18
    assert row["identical_to_baseline"] is False  # another engine's tokens, reported, not required
    assert "identical_to_ar" not in row  # the ar-divergence report is for casspec's own methods
    (llm,) = FakeLlama.made
    assert llm.resets == 3  # the warm-up, then each question's first turn
