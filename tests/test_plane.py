"""The levels plane (casspec/calibrate/plane.py): the multi-level methods' default draft levels chosen from what was
measured on the machine. The choice is tested on injected measurements (the Intel Xeon numbers of issue 13 and a machine
where bfloat16 products are cheap); the measurement and its cache on a tiny model."""
import json

import pytest

from casspec.calibrate import plane as plane_mod
from casspec.runtime.methods import Drafters, make_policy
from casspec.runtime.method_table import default_levels, default_sources
from casspec.calibrate.plane import Plane, PlaneConfig, chain_speedup, from_json, rank
from casspec.runtime.request import Request
from tiny import tiny_engine

# `casspec levels` on a 2-core Intel Xeon (AMX-BF16/INT8, AVX512-FP16), 6 questions (issue 13): cost ratio, agreement
XEON = {"int4": (0.31, 0.98), "int8": (0.44, 0.96), "int4+vocab": (0.29, 0.93), "sparse0.5": (0.95, 0.93),
        "skip0.2": (0.83, 0.58)}
# a machine whose bfloat16 products are cheap and whose int4 kernel is slow (as on AMX, where bf16 over 4-16 tokens
# cost a third of fp32): the cheap accurate level must win there
CHEAP_BF16 = {"int4": (0.55, 0.97), "int4+vocab": (0.52, 0.90), "bf16": (0.22, 0.995), "int8": (0.60, 0.975)}


def plane_of(rows: dict, verify_ratio: float = 1.3, verify_tokens: int = 8) -> Plane:
    obj = {"levels": {n: {"cost_ratio": c, "agreement": a} for n, (c, a) in rows.items()},
           "verify_ratio": verify_ratio, "verify_tokens": verify_tokens, "created": "test"}
    return from_json(obj)


def test_chain_speedup_is_tokens_per_step_time_at_the_best_length():
    flat = lambda n: 1.0  # noqa: E731  (a verification costs one step whatever its size)
    assert chain_speedup(0.5, 0.0, flat, 10) == (1.0, 0)  # nothing is ever accepted: AR
    s, k = chain_speedup(0.0, 1.0, flat, 10)  # free and always right: the longest chain, k + 1 tokens per step
    assert (s, k) == (11.0, 10)
    s, k = chain_speedup(0.3, 0.9, flat, 10)
    best = max((sum(0.9 ** i for i in range(j + 1)) / (0.3 * j + 1), j) for j in range(1, 11))
    assert (s, k) == pytest.approx(best)
    # a costlier verification of more tokens shortens the chain
    assert chain_speedup(0.3, 0.9, lambda n: 1 + 0.2 * (n - 1), 10)[1] < k


def test_on_the_xeon_numbers_int4_then_int4_vocab():
    p = plane_of(XEON)
    assert [r.name for r in p.ranked][:2] == ["int4", "int4+vocab"]
    assert p.ranked[-1].name == "skip0.2"  # 0.58 agreement for 0.83 of a step: no gain
    # int4+vocab 6% cheaper than int4, 5 points less accurate: within the cost margin, so dytc routes int4 alone
    assert default_sources("dytc", "cpu", p) == [("int4", 0)]
    assert default_sources("vc", "cpu", p) == [("int4", 0)]
    assert default_sources("hc", "cpu", p) == [("int4", 4), ("int4+vocab", 3), ("pld", 3)]
    assert default_levels("cpu", p) == ("int4", "int4+vocab")


def test_where_bf16_is_cheap_it_drafts_first():
    p = plane_of(CHEAP_BF16)
    assert p.chosen == ("bf16", "int4")
    assert default_sources("dytc", "cpu", p) == [("bf16", 0)]  # int4: dearer and less accurate, so not routed
    assert default_sources("hc", "cpu", p) == [("bf16", 4), ("int4", 3), ("pld", 3)]
    assert default_sources("vc+hc", "cpu", p) == [("bf16", 4), ("int4", 3), ("pld", 3)]


# the levels plane of the AMD EPYC (family 26) at this session's bench: int8 agreed as int4 did (92 of 94 tokens
# each) for 1.3x its cost; int4+vocab cost as much as int4 and agreed less
EPYC = {"int4": (0.2778, 0.9787), "int4+vocab": (0.2797, 0.8936), "int8": (0.3603, 0.9787)}


def test_dytc_leaves_out_a_level_dominated_beyond_the_measurements_noise():
    p = plane_of(EPYC)
    assert p.chosen == ("int4", "int8") and p.scored == 94
    assert default_sources("dytc", "cpu", p) == [("int4", 0)]
    assert default_sources("vc+hc", "cpu", p) == [("int4", 4), ("int8", 3), ("pld", 3)]  # (hc keeps its ranking)
    # more accurate beyond two standard errors (about 0.03 at 0.98 over 94 tokens): routed despite its cost
    assert plane_of(dict(EPYC, int8=(0.3603, 0.9990))).routed == ("int4",)  # (within the noise: still left out)
    assert plane_of({"int4": (0.28, 0.90), "int8": (0.36, 0.99)}).routed == ("int8", "int4")  # (int4: cheaper)
    assert plane_of({"int4": (0.28, 0.93), "int8": (0.36, 0.99), "x": (0.40, 0.90)}).routed == ("int8", "int4")
    # cheaper, less accurate: a different trade-off, routed, where the saving passes the cost ratio's noise
    assert plane_of({"int4": (0.28, 0.98), "int4+vocab": (0.21, 0.89)}).routed == ("int4", "int4+vocab")
    assert plane_of({"int4": (0.2515, 0.9787), "int4+vocab": (0.2506, 0.8936)}).routed == ("int4",)
    assert Plane(p.ranked, p.verify_ratio, p.verify_tokens).routed == p.chosen  # agreement noise unknown
    # the second best dominated, the third a different trade-off: dytc routes the first and third, hc takes the
    # first two, and the levels measured and kept on first use are all three
    p = plane_of({"int4": (0.28, 0.98), "int8": (0.33, 0.985), "int4+vocab": (0.20, 0.85)})
    assert (p.chosen, p.routed) == (("int4", "int8"), ("int4", "int4+vocab"))
    assert default_levels("cpu", p) == ("int4", "int8", "int4+vocab")


def test_one_candidate_fills_what_it_can():
    p = plane_of({"int8": (0.4, 0.95)})
    assert default_sources("dytc", "cpu", p) == [("int8", 0)]
    assert default_sources("hc", "cpu", p) == [("int8", 4), ("pld", 3)]  # no second level: its segment is left out


def test_without_a_plane_the_fixed_defaults():
    assert default_sources("dytc", "cpu", None) == default_sources("dytc", "cpu")
    assert default_sources("dytc", "cpu", plane_of({})) == default_sources("dytc", "cpu")  # nothing measured
    assert default_sources("dytc", "cuda") == [("skip0.4", 0)]


def test_rank_reads_the_verification_line():
    rows = {"a": {"cost_ratio": 0.3, "agreement": 0.9}}
    cheap, dear = rank(rows, 1.0, 8, 10)[0], rank(rows, 3.0, 8, 10)[0]
    assert cheap.speedup > dear.speedup and cheap.k > dear.k


# ---------------------------------------------------------------------- measured on an engine
@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def small_plane(monkeypatch):
    """A quick plane (three candidates, short answers), counting its measurements."""
    cfg = PlaneConfig(candidates=("int8", "int4+vocab", "bf16"), max_new_tokens=12, repeats=2)
    monkeypatch.setattr(plane_mod, "PlaneConfig", lambda **kw: cfg)
    from casspec.calibrate import first_use
    monkeypatch.setattr(first_use, "PlaneConfig", lambda **kw: cfg)  # (whatever candidates this CPU would measure)
    measured = []
    real = plane_mod.measure

    def counting(engine, cfg, progress=True):
        measured.append(cfg.candidates)
        return real(engine, cfg, False)

    monkeypatch.setattr(plane_mod, "measure", counting)
    return measured


def test_first_use_measures_caches_and_chooses(cache, small_plane, monkeypatch):
    from casspec.calibrate import autoprofile as ap
    monkeypatch.setattr(ap, "autoprofile", lambda engine, key, levels, progress=True: None)  # the plane alone here
    from casspec.calibrate import first_use
    monkeypatch.setattr(first_use, "autoprofile", lambda engine, key, levels: None)
    e = tiny_engine(autoprofile=True)
    assert small_plane == [("int8", "int4+vocab", "bf16")]
    assert e.plane is not None and {r.name for r in e.plane.ranked} == {"int8", "int4+vocab", "bf16"}
    # the candidate not chosen is dropped with the copy only it held
    assert set(e.levels.levels) == set(e.plane.chosen) | set(e.plane.routed) and len(e.plane.chosen) == 2
    held = {id(o) for lv in e.levels.levels.values() for o in lv.holds}
    assert {id(o) for o in e.levels.resources.built.values()} <= held  # (a level may hold more of its own)
    for r in e.plane.ranked:
        assert r.cost_ratio > 0 and 0.0 <= r.agreement <= 1.0 and r.speedup >= 1.0
    assert e.plane.verify_ratio > 0
    files = list((cache / "planes").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["model"] == "tiny-llama"
    assert e.cache.length == 0  # measured on the engine's cache, left empty
    # the defaults follow it: dytc routes the plane's levels, and --stats says so
    req = Request(method="dytc", max_new_tokens=8)
    policy = make_policy(req, e.drafters)
    assert tuple(policy.levels) == e.plane.routed and e.plane.routed[0] == e.plane.chosen[0]
    r = e.generate("w5 w6 w7 w8", max_new_tokens=8, method="dytc")
    assert "chosen by the levels measured on this machine" in r.stats.summary()
    assert r.token_ids == e.generate("w5 w6 w7 w8", max_new_tokens=8, method="ar").token_ids
    # a later process reads it back; one without autoprofile too
    again = tiny_engine(autoprofile=True)
    off = tiny_engine(autoprofile=False)
    assert len(small_plane) == 1 and again.plane.ranked == e.plane.ranked == off.plane.ranked
    # another model: its own plane
    tiny_engine("qwen2", autoprofile=True)
    assert len(small_plane) == 2


def test_no_autoprofile_and_nothing_cached_keeps_the_fixed_defaults(cache, small_plane):
    e = tiny_engine(autoprofile=False)
    assert e.plane is None and small_plane == []
    assert e.drafters.sources(Request(method="dytc")) == default_sources("dytc", "cpu")
    assert "fixed defaults" in e.drafters.describe(Request(method="dytc"))
    assert "the request's" in e.drafters.describe(Request(method="dytc", levels=("int8",)))


def test_an_unreadable_plane_is_measured_again(cache, small_plane, monkeypatch):
    from casspec.calibrate import first_use
    monkeypatch.setattr(first_use, "autoprofile", lambda engine, key, levels: None)
    e = tiny_engine(autoprofile=True)
    (path,) = (cache / "planes").glob("*.json")
    path.write_text("{not json")
    assert tiny_engine(autoprofile=False).plane is None  # not used, not measured
    assert tiny_engine(autoprofile=True).plane is not None  # measured again, and written whole
    assert len(small_plane) == 2 and set(json.loads(path.read_text())["levels"]) == {r.name for r in e.plane.ranked}


def test_a_small_window_measures_nothing(cache, small_plane):
    e = tiny_engine(autoprofile=True, max_context=64)
    assert e.plane is None and small_plane == []


def test_the_request_levels_override_the_plane():
    p = plane_of(CHEAP_BF16)
    d = Drafters(levels=None, trackers={}, device_type="cpu", plane=p)
    assert d.sources(Request(method="dytc", levels=("int4",))) == [("int4", 0)]
    assert d.sources(Request(method="dytc")) == [("bf16", 0)]
    assert d.describe(Request(method="sd", level="int8")) == "int8"
    assert d.describe(Request(method="ar")) == ""


def test_a_cpu_with_casspecs_library_measures_the_block_kinds_only(monkeypatch):
    """int4 / int8 on the block kernel read fewer bytes a weight than bf16 or w8a8 on any CPU; without the library
    torch's kinds are candidates too."""
    from dsia import cxx

    assert plane_mod.cpu_candidates() == (plane_mod.LIBRARY_CANDIDATES if cxx.build_error() is None
                                          else plane_mod.CPU_CANDIDATES)
    monkeypatch.setattr(cxx, "build_error", lambda: "no compiler")
    assert plane_mod.cpu_candidates() == plane_mod.CPU_CANDIDATES
    assert set(plane_mod.LIBRARY_CANDIDATES) < set(plane_mod.CPU_CANDIDATES)


def test_a_calibration_handed_in_is_used_and_nothing_is_measured(monkeypatch):
    """Engine(calibration=...) takes the plane and latency model it is handed (from_pretrained or a caller that
    calibrated already) and measures nothing itself."""
    from casspec.calibrate.first_use import Calibration
    from casspec.loading.checkpoints import Loaded
    from casspec.runtime import engine as engine_mod

    first = tiny_engine()
    monkeypatch.setattr(engine_mod, "calibrate", lambda *a, **k: pytest.fail("calibrated though one was handed in"))
    cal = Calibration(None, first.latency, "handed in")
    e = engine_mod.Engine(Loaded(first.hf_model, first.tokenizer, "tiny"), calibration=cal, kernels="blas",
                          keep_state=False)
    assert e.plane is None and e.latency is first.latency and e.latency_source == "handed in"
    assert e.generate_ids([5, 17, 9], Request(method="dytc", max_new_tokens=6)).token_ids == \
        e.generate_ids([5, 17, 9], Request(method="ar", max_new_tokens=6)).token_ids
