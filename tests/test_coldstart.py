"""Cold start: level weights kept in the user cache, learned state kept between processes, the profile made on
first use (on tiny random models, with tiny grids: the logic, not the timings)."""
import json
import os
import threading

import pytest
import torch
from tiny import tiny_engine, tiny_model, tiny_tokenizer

from casspec.runtime.engine import Engine
from casspec.loading.levelstore import LevelStore
from casspec.loading.checkpoints import Loaded
from casspec.runtime.request import Request
from casspec.cache.state import StateFile
from dsia.cxx import build_error
from dsia.quant import QuantCodec, QuantConfig, quantize_linears
from dytc.acceptance import AcceptanceTracker
from dytc.latency import TARGET_LEVEL
from dytc.machine import machine_info

PROMPT = [5, 17, 33, 5, 17, 40, 41, 5, 17]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _plan_logits(model, q) -> torch.Tensor:
    e = tiny_engine()
    e.extend_prefix(PROMPT[:-1])
    return model.forward(e.cache, torch.tensor(PROMPT[-1:]), torch.tensor([len(PROMPT) - 1]), len(PROMPT) - 1,
                         None, q.plan())


def test_quantized_copies_are_stored_once_and_read_back_identical(tmp_path, capsys):
    e = tiny_engine()
    codec = QuantCodec(QuantConfig("int4"), e.model.lm_head)  # (an int4r head scores again with the model's rows)
    built = []

    def build():
        built.append(1)
        return quantize_linears(e.model, codec.cfg)

    store = LevelStore(tmp_path / "levels", e.dtype, e.device)
    first = store.fetch(codec, build)
    again = LevelStore(tmp_path / "levels", e.dtype, e.device).fetch(codec, build)  # as a second process would
    assert built == [1] and again.kinds == first.kinds and again.nbytes == first.nbytes
    kernels = {type(k).__name__ for k in again.linears.values()} | {type(again.head).__name__}
    # casspec's block kernel takes the tiny vocabulary's head as an int4r copy; torch's int4 kernel does not (int8)
    assert kernels == ({"BlockLinear", "RescoredHead"} if build_error() is None else {"Int4Linear", "Int8Linear"})
    assert torch.equal(_plan_logits(e.model, first), _plan_logits(e.model, again))
    store.path(codec).write_bytes(b"not a safetensors file")  # corrupt: rebuilt, with one warning, no crash
    store.fetch(codec, build)
    assert built == [1, 1] and "unreadable level cache" in capsys.readouterr().err
    assert len(list((tmp_path / "levels").glob("*.safetensors"))) == 1


def test_an_engine_over_stored_levels_stays_exact(tmp_path):
    model, tok = tiny_model(), tiny_tokenizer()
    outs = []
    for _ in range(2):  # the first engine builds and stores the int4 copy, the second reads it back
        e = Engine(Loaded(model, tok, "tiny-llama", tmp_path), kernels="blas", autoprofile=False, keep_state=False)
        ar = e.generate_ids(PROMPT, Request(max_new_tokens=24, method="ar")).token_ids
        outs.append(e.generate_ids(PROMPT, Request(max_new_tokens=24, method="dytc")).token_ids)
        assert outs[-1] == ar
    assert outs[0] == outs[1] and list((tmp_path / "levels").glob("quant-int4-*.safetensors"))


def test_acceptance_estimates_survive_json():
    t = AcceptanceTracker()
    for step in range(30):
        t.update([("int4", 0.95, True), ("int4", 0.3, step % 3 == 0), ("maxgram", 2, step % 2 == 0)])
    back = AcceptanceTracker.from_json(json.loads(json.dumps(t.to_json())))
    for source, belief in (("int4", 0.95), ("int4", 0.3), ("maxgram", 2), ("int4+vocab", 0.5)):
        assert back.estimate(source, belief) == t.estimate(source, belief)
    back.update([("int4", 0.95, False)])
    t.update([("int4", 0.95, False)])
    assert back.estimate("int4", 0.95) == t.estimate("int4", 0.95)  # the windows came back too


def test_learned_state_is_kept_between_engines_and_a_bad_file_is_ignored(cache):
    first = tiny_engine(keep_state=True)
    ar = first.generate_ids(PROMPT, Request(max_new_tokens=24, method="ar")).token_ids
    assert first.generate_ids(PROMPT, Request(max_new_tokens=24, method="dytc")).token_ids == ar
    tracker = next(iter(first.drafters.trackers.values()))
    second = tiny_engine(keep_state=True)  # a later process
    assert "refined by earlier runs" in second.latency_source
    assert second.latency.predict_ms(TARGET_LEVEL, 4, 30) == first.latency.predict_ms(TARGET_LEVEL, 4, 30)
    kept = next(iter(second.drafters.trackers.values()))
    assert kept.estimate("int4", 0.9) == tracker.estimate("int4", 0.9) and kept.counts == tracker.counts
    assert second.generate_ids(PROMPT, Request(max_new_tokens=24, method="dytc")).token_ids == ar
    state = StateFile.of(machine_info("cpu"), "tiny-llama", "float32", first.build)  # (tiny engines force BLAS)
    assert state.path.is_file() and state.path.parent == cache / "state"
    assert state.load("another profile")[0] is None and state.load("another profile")[1]  # estimates still count
    state.path.write_text('{"version": 1, "key": ' + json.dumps(state.key) + ', "trackers": {"x": {"rates": 3}}}')
    assert state.load(second._state_origin) == (None, {})
    state.path.write_text("{truncated")
    third = tiny_engine(keep_state=True)
    assert "refined" not in third.latency_source and third.drafters.trackers == {}
    assert StateFile.of(machine_info("cpu"), "tiny-llama", "bfloat16", first.build).path != state.path
    assert StateFile.of(machine_info("cpu"), "tiny-llama", "float32", "mkl (T 1+)").path != state.path
    assert StateFile.of(machine_info("cpu"), "tiny-llama", "float32", "blas (T 1+)").path != state.path


def test_a_batch_writes_the_learned_state_when_its_last_generation_ends(cache, monkeypatch):
    """A generation ending beside others (a batch's) does not stall them to write the state; the last one to end
    writes it (and one beside others does, once STATE_WRITE_EVERY_S have passed)."""
    from casspec.runtime.batch import Batch

    eng = tiny_engine(keep_state=True)
    writes = []
    real = StateFile.save
    monkeypatch.setattr(StateFile, "save", lambda self, *a: writes.append(1) or real(self, *a))
    batch = Batch(eng, 2)
    for n in (4, 12):
        batch.join(PROMPT, Request(max_new_tokens=n, method="dytc"))
    ended = []
    while batch.running:
        batch.step()
        for run in [r for r in batch.running if r.done]:
            batch.leave(run)
            ended.append(len(writes))
    assert ended == [0, 1]
    eng._state_written -= 3600  # (an hour ago)
    batch.join(PROMPT, Request(max_new_tokens=4, method="dytc"))
    batch.join(PROMPT, Request(max_new_tokens=12, method="dytc"))
    while batch.running:
        batch.step()
        for run in [r for r in batch.running if r.done]:
            batch.leave(run)
    assert len(writes) == 3  # the first to end (an hour since the last write), then the last


@pytest.fixture
def tiny_auto(monkeypatch):
    """The profile made on first use over a tiny grid, counting its measurements."""
    from casspec.calibrate import latency_grid as prof_mod

    measured = []
    real = prof_mod.profile

    def counting(engine, cfg, progress=True):
        measured.append(cfg.levels)
        return real(engine, cfg, progress=False)

    monkeypatch.setattr(prof_mod, "AUTO", prof_mod.ProfileConfig(tokens=(1, 2, 3, 4, 6), contexts=(8, 24), repeats=1,
                                                                  shapes=("chain",), budget_s=1.0))
    monkeypatch.setattr(prof_mod, "profile", counting)
    return measured


def test_a_profile_is_made_on_first_use_cached_and_keyed(cache, tiny_auto, capsys):
    from casspec.runtime.method_table import default_levels

    e = tiny_engine(autoprofile=True)
    routed = default_levels(e.device.type, e.plane)  # the levels the default methods route (the levels plane's
    # choice, measured on this machine: not asserted here; hc's two best and the ones dytc routes)
    assert tiny_auto == [routed] and set(routed) == set(e.plane.chosen) | set(e.plane.routed)
    assert e.latency_source.startswith("profile made on first use")
    assert {TARGET_LEVEL, *routed} <= set(e.latency.levels)
    assert "measuring one" in capsys.readouterr().err
    files = list((cache / "profiles").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["model"] == "tiny-llama"
    again = tiny_engine(autoprofile=True)  # a later process: read back, not measured
    assert len(tiny_auto) == 1 and again.latency_source == e.latency_source
    assert "measuring" not in capsys.readouterr().err
    assert tiny_engine(autoprofile=False).latency_source == e.latency_source  # made earlier: still preferred
    tiny_engine("qwen2", autoprofile=True)  # another model: its own profile
    assert len(tiny_auto) == 2 and len(list((cache / "profiles").glob("*.json"))) == 2
    files[0].write_text("{corrupt")
    tiny_engine(autoprofile=True)
    assert len(tiny_auto) == 3


def test_no_autoprofile_fits_online(cache, tiny_auto):
    e = tiny_engine(autoprofile=False)
    assert tiny_auto == [] and "fitting online" in e.latency_source and not (cache / "profiles").exists()
    small = tiny_engine(autoprofile=True, max_context=7)  # the window cannot hold the grid: nothing measured
    assert tiny_auto == [] and "fitting online" in small.latency_source


def test_two_processes_measure_the_profile_once(cache, tiny_auto):
    from casspec.calibrate.autoprofile import autoprofile
    from casspec.cache.usercache import profile_key

    from casspec.runtime.method_table import default_levels

    engines = [tiny_engine(), tiny_engine()]
    levels = default_levels(engines[0].device.type, engines[0].plane)
    key = profile_key(machine_info("cpu"), "tiny-llama", "float32", "blas (T 1+)")
    got = [None, None]
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, autoprofile(engines[i], key, levels, False)))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tiny_auto) == 1 and got[0]["created"] == got[1]["created"]


def test_profile_rounds_stop_when_the_budget_is_spent():
    from tqdm import tqdm

    from casspec.calibrate.latency_grid import ProfileConfig, _rounds

    calls = [("target", t, False, lambda: None) for t in (1, 2, 3)]
    cfg = ProfileConfig(repeats=4, warmup=1)
    bar = tqdm(total=len(calls) * cfg.repeats, disable=True)
    assert [len(t) for t in _rounds(calls, cfg, torch.device("cpu"), bar, None)] == [4, 4, 4]
    assert [len(t) for t in _rounds(calls, cfg, torch.device("cpu"), bar, 0.0)] == [1, 1, 1]


def test_stats_separate_setup_from_generation(cache):
    e = tiny_engine()
    first = e.generate_ids(PROMPT, Request(max_new_tokens=8, method="dytc")).stats
    assert set(first.setup) == {"kernels", "plane", "profile", "levels"} and first.setup["levels"] > 0
    later = e.generate_ids(PROMPT, Request(max_new_tokens=8, method="dytc")).stats
    assert set(later.setup) == {"levels"}  # the engine's set-up is reported once; the levels were built
    assert later.setup_summary().startswith("setup ") and "levels" in later.setup_summary()
    if os.path.exists("/proc/self/statm"):  # (Linux) the process's resident memory, with the weights in it
        assert later.resident_mb * 2**20 > e.model.weight_bytes() and "resident memory" in later.setup_summary()


def test_cli_one_shot_calls_measure_once_and_reuse_what_they_built(cache, tiny_auto, tmp_path, capsys):
    from casspec.cli import main

    folder = tmp_path / "tiny-hf"
    tiny_model().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    argv = ["generate", "w5 w17 w33 w5 w17", "--model", str(folder), "--no-chat", "--max-new-tokens", "12", "--stats"]
    outs = []
    for _ in range(2):  # two one-shot calls
        assert main(argv) == 0
        outs.append(capsys.readouterr())
    assert "measuring one" in outs[0].err and "measuring" not in outs[1].err and len(tiny_auto) == 1
    assert outs[0].out == outs[1].out and "refined by earlier runs" in outs[1].err
    assert outs[1].err.startswith("setup ") and "load" in outs[1].err
    assert list(cache.glob("hf-*/levels/quant-int4-*.safetensors")) and list((cache / "state").glob("*.json"))
    assert main(argv + ["--no-autoprofile", "--method", "ar"]) == 0
    assert capsys.readouterr().out == outs[0].out


def _named(t) -> dict[str, torch.Tensor]:
    """Every tensor of a runtime by name (RoPE tables included)."""
    out = {"embed": t.embed, "lm_head": t.lm_head, "norm": t.norm, "cos": t.cos, "sin": t.sin}
    for i, lw in enumerate(t.layers):
        out.update({f"{i}.{f}": v for f, v in vars(lw).items() if isinstance(v, torch.Tensor)})
        out.update({f"{i}.bias.{n}": v for n, v in lw.bias.items()})
    return out


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False),
                                      ("mistral", False)])
def test_the_runtime_read_from_files_is_the_wrapped_hf_model(tmp_path, arch, tie):
    from casspec.loading.weights import read_runtime
    from dsia.model import Transformer

    from transformers import AutoModelForCausalLM

    tiny_model(arch, tie=tie).save_pretrained(tmp_path)
    for dtype in (torch.float32, torch.bfloat16):  # against what loading builds through transformers
        hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, attn_implementation="sdpa")
        wrapped = _named(Transformer.from_hf(hf))
        runtime = read_runtime(tmp_path, dtype, torch.device("cpu"))
        direct = _named(runtime)
        assert direct.keys() == wrapped.keys() and runtime.spec == Transformer.from_hf(hf).spec
        assert [k for k in direct if not (torch.equal(direct[k], wrapped[k]) and direct[k].dtype == dtype)] == []
        assert (runtime.lm_head is runtime.embed) == tie


def test_generate_without_the_hf_model_is_exact(tmp_path):
    from casspec.loading.checkpoints import load

    tiny_model().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with_hf = Engine(load(str(tmp_path)), kernels="blas", autoprofile=False, keep_state=False)
    without = Engine(load(str(tmp_path), hf=False), kernels="blas", autoprofile=False, keep_state=False)
    assert without.hf_model is None and without.eos_ids == with_hf.eos_ids
    for method in ("ar", "dytc"):
        req = Request(max_new_tokens=20, method=method)
        assert without.generate_ids(PROMPT, req).token_ids == with_hf.generate_ids(PROMPT, req).token_ids


def test_the_library_builds_with_the_ninja_installed_beside_this_python(tmp_path, monkeypatch):
    import shutil
    import sysconfig

    from dsia.cxx import own_ninja_first
    scripts = tmp_path / "bin"
    scripts.mkdir()
    ninja = scripts / "ninja"
    ninja.write_text("#!/bin/sh\n")
    ninja.chmod(0o755)
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(scripts))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with own_ninja_first():  # (torch runs `ninja` from PATH: the one pip installed with casspec, whatever PATH says)
        assert shutil.which("ninja") == str(ninja)
    assert os.environ["PATH"] == "/usr/bin:/bin"
    monkeypatch.delenv("PATH")
    with own_ninja_first():
        assert os.environ["PATH"] == str(scripts)
    assert "PATH" not in os.environ
    ninja.unlink()  # none there: PATH as it was
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with own_ninja_first():
        assert os.environ["PATH"] == "/usr/bin:/bin"


def test_dropped_levels_leave_no_stored_copy_behind(tmp_path):
    """A level dropped (the levels plane drops the candidates no method drafts with) takes its stored copy with it
    where no remaining level shares it: int8's file goes, int4's stays (int4+vocab still runs it)."""
    model, tok = tiny_model(), tiny_tokenizer()
    e = Engine(Loaded(model, tok, "tiny-llama", tmp_path), kernels="blas", autoprofile=False, keep_state=False)
    for name in ("int4", "int4+vocab", "int8"):
        e.generate_ids(PROMPT, Request(max_new_tokens=6, method="sd", level=name))
    files = lambda: sorted(p.name.split("-")[1] for p in (tmp_path / "levels").glob("*.safetensors"))  # noqa: E731
    assert files() == ["int4", "int8"]
    e.levels.drop(["int8", "int4"])  # int4+vocab still holds the int4 copy
    left = [p.name for p in (tmp_path / "levels").glob("quant-int8-*") if not p.name.endswith(".lock")]
    assert files() == ["int4"] and left == []  # (its checksum too; an empty lock file may stay)
    assert e.generate_ids(PROMPT, Request(max_new_tokens=6, method="sd", level="int8")).token_ids == \
        e.generate_ids(PROMPT, Request(max_new_tokens=6, method="ar")).token_ids  # (built again where asked)
