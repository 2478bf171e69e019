"""Latency predictor: JSON round trip, online refinement, profile selection, held-out MAPE, the profiler."""
import json

import numpy as np
import pytest
import torch

from dsia.errors import CasspecError
from dytc.latency import (TARGET_LEVEL, FeatureSpec, LatencyModel, Point, heldout_mape, select_profile,
                          split_heldout)

SPEC = FeatureSpec()


def synthetic(level: str = TARGET_LEVEL, scale: float = 1.0) -> list[Point]:
    """A roofline-like grid with a bump at 2-4 tokens (non-monotone, as on a float32 CPU)."""
    pts = []
    for C in (128, 256, 512, 1024):
        for T in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64):
            for tree in (False, True):
                ms = scale * (10 + 0.4 * T + 0.004 * C + 0.0001 * T * C + (6 if 2 <= T <= 4 else 0) + 0.1 * tree * T)
                pts.append(Point(level, T, C, tree, ms))
    return pts


def test_fit_and_json_round_trip_predict_the_same():
    pts = synthetic() + synthetic("int4", 0.5)
    model = LatencyModel.fit(SPEC, pts)
    back = LatencyModel.from_json(json.loads(json.dumps(model.to_json())))
    for level in (TARGET_LEVEL, "int4"):
        for T, C in ((1, 128), (3, 700), (64, 1024), (10, 300)):
            assert back.predict_ms(level, T, C) == model.predict_ms(level, T, C)
    assert back.cost_ratio("int4", 1, 512) == model.cost_ratio("int4", 1, 512)
    # the fit captures the non-monotone bump, and the ratio of int4 to the target step is about 0.5
    assert model.predict_ms(TARGET_LEVEL, 3, 512)[0] > model.predict_ms(TARGET_LEVEL, 8, 512)[0]
    ratio, std = model.cost_ratio("int4", 1, 512)
    assert ratio == pytest.approx(0.5, abs=0.03) and std > 0


def test_online_observations_move_predictions_toward_injected_timings():
    model = LatencyModel.fit(SPEC, synthetic())
    before, _ = model.predict_ms(TARGET_LEVEL, 8, 512)
    for _ in range(150):
        for T in (4, 8, 16):
            model.observe(TARGET_LEVEL, T, 512, 50.0)
    after, _ = model.predict_ms(TARGET_LEVEL, 8, 512)
    assert abs(after - 50.0) < 0.2 * abs(before - 50.0)


def test_a_level_without_a_profile_is_learned_online():
    model = LatencyModel(SPEC)
    with pytest.raises(KeyError):
        model.predict_ms("int8", 1, 128)
    for p in synthetic("int8"):
        model.observe(p.level, p.tokens, p.context, p.ms, p.tree)
    mean, std = model.predict_ms("int8", 6, 512)
    assert mean == pytest.approx(10 + 2.4 + 2.048 + 0.3072, rel=0.05) and std > 0


def test_heldout_mape_is_the_mean_relative_error_on_the_held_out_points():
    pts = synthetic()
    train, held = split_heldout(pts, 0.25, seed=1)
    assert len(held) == 20 and not set(train) & set(held) and len(train) + len(held) == len(pts)
    model = LatencyModel.fit(SPEC, train)
    assert heldout_mape(model, held)[TARGET_LEVEL] < 0.02  # the synthetic grid is in the model's span
    doubled = [Point(p.level, p.tokens, p.context, p.tree, 2 * model.predict_ms(p.level, p.tokens, p.context,
                                                                                p.tree)[0]) for p in held]
    assert heldout_mape(model, doubled)[TARGET_LEVEL] == pytest.approx(0.5)


def _write(folder, name, machine, model="m", dtype="float32", version=1, **extra):
    prof = {"version": version, "created": "2026-01-01T00:00:00", "machine": machine, "model": model,
            "dtype": dtype, "predictor": LatencyModel.fit(SPEC, synthetic()).to_json(), **extra}
    (folder / name).write_text(json.dumps(prof))


def test_only_a_profile_of_this_machine_model_and_dtype_is_used(tmp_path):
    here = {"cpu": "Test CPU 9000", "gpu": None}
    _write(tmp_path, "other_cpu.json", {"cpu": "Other CPU", "gpu": None})
    _write(tmp_path, "other_gpu.json", {"cpu": "Test CPU 9000", "gpu": "H100"})
    _write(tmp_path, "other_model.json", here, model="other")
    _write(tmp_path, "other_dtype.json", here, dtype="bfloat16")
    _write(tmp_path, "other_kernels.json", here, created="2027-01-01", kernels="mkl (T 1+)")
    (tmp_path / "broken.json").write_text("{not json")
    assert select_profile(here, "m", "float32", "blas (T 1+)", tmp_path) is None
    _write(tmp_path, "stale.json", here, created="2027-02-01")  # (records no kernels: made before casspec's own)
    assert select_profile(here, "m", "float32", "blas (T 1+)", tmp_path) is None  # (it matches no kernels)
    _write(tmp_path, "mine.json", here, kernels="blas (T 1+)")
    assert select_profile(here, "m", "float32", "blas (T 1+)", tmp_path).name == "mine.json"
    assert select_profile(here, "m", "float32", "mkl (T 1+)", tmp_path).name == "other_kernels.json"
    assert LatencyModel.from_json(json.loads((tmp_path / "mine.json").read_text())["predictor"]).known(TARGET_LEVEL)
    assert select_profile(here, "m", "float32", None, tmp_path / "missing") is None


def test_profiler_quick_path_end_to_end(tiny_engine_factory, tmp_path):
    from casspec.calibrate.latency_grid import ProfileConfig, profile
    from casspec.tools.profile_report import write_profile

    engine = tiny_engine_factory(max_context=96)
    cfg = ProfileConfig(tokens=(1, 2, 4, 8), contexts=(16, 64), levels=("int8", "exit1"), repeats=1, warmup=1)
    prof = profile(engine, cfg, progress=False)
    paths = write_profile(prof, tmp_path / "tiny.json", plot=True)
    assert [p.name for p in paths] == ["tiny.json", "tiny.png"] and paths[1].stat().st_size > 1000
    back = json.loads(paths[0].read_text())
    assert back["model"] == "tiny-llama" and back["dtype"] == "float32" and back["machine"]["cpu"]
    assert set(back["heldout_mape"]) == {TARGET_LEVEL, "int8", "exit1"}
    assert len(back["grid"]) == 2 * 3 * 2 * 4 and any(p["heldout"] for p in back["grid"])
    model = LatencyModel.from_json(back["predictor"])
    assert model.predict_ms("int8", 3, 40)[0] > 0
    assert select_profile(back["machine"], "tiny-llama", "float32", back["kernels"], tmp_path) == paths[0]


def test_profile_command_rejects_a_bad_out_before_loading(tmp_path, capsys):
    from casspec.cli import main

    assert main(["profile", "--out", str(tmp_path / "p.txt")]) == 2
    assert main(["profile", "--levels", "int5", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert ".json" in err and "unknown level" in err


def test_random_weight_shapes_for_profiling():
    from casspec.runtime.engine import Engine
    from casspec.loading.checkpoints import EMBEDDED_NAME, load

    e = Engine(load("random:smollm2-135m"), max_context=64, autoprofile=False, keep_state=False)
    assert e.name == EMBEDDED_NAME  # a profile of the shape is picked up by the real model's engine
    assert e.model.spec.n_layers == 30 and e.model.spec.vocab_size == 49152
    logits = e.extend_prefix([1, 2, 3])
    assert logits.shape == (1, 49152) and torch.isfinite(logits).all()
    with pytest.raises(CasspecError, match="no tokenizer"):
        e.encode("hello")
    with pytest.raises(CasspecError, match="unknown random-weight shape"):
        load("random:gpt-9")


def test_observations_absorbed_in_one_batch_equal_one_by_one():
    rng = np.random.default_rng(0)
    obs = [(int(T), int(C), bool(tree), float(ms)) for T, C, tree, ms in
           zip(rng.integers(1, 33, 40), rng.integers(64, 2048, 40), rng.integers(0, 2, 40), rng.uniform(8, 80, 40))]
    batched, single = LatencyModel.fit(SPEC, synthetic()), LatencyModel.fit(SPEC, synthetic())
    for T, C, tree, ms in obs:
        batched.observe(TARGET_LEVEL, T, C, ms, tree)
        single.observe(TARGET_LEVEL, T, C, ms, tree)
        single.predict_ms(TARGET_LEVEL, 1, 128)  # absorbs each observation on its own
    for T, C in ((1, 128), (8, 700), (32, 1500)):
        assert batched.predict_ms(TARGET_LEVEL, T, C)[0] == pytest.approx(single.predict_ms(TARGET_LEVEL, T, C)[0],
                                                                          rel=1e-9)
    assert batched.levels[TARGET_LEVEL].n == single.levels[TARGET_LEVEL].n == len(synthetic()) + len(obs)


def test_forgetting_keeps_the_profiles_shape_where_decoding_never_looks():
    """A level the router runs over one token only, thousands of times (a long-lived engine, or the state kept
    between calls), used to forget its profile entirely, leaving its cost over more tokens to whatever the
    one-token timings implied (once predicted below zero). Forgetting now decays to the profile's anchor: the
    one-token timings move the level, the profile's slope in T stays."""
    model = LatencyModel.fit(SPEC, synthetic("int4+vocab", 0.5))
    assert model.online.anchor > 0
    rng = np.random.default_rng(1)
    one, sixteen = (model.predict_ms("int4+vocab", T, 300, True)[0] for T in (1, 16))
    for _ in range(2000):  # 10% slower than profiled, with noise
        model.observe("int4+vocab", 1, int(rng.integers(100, 500)), 1.1 * one * float(rng.uniform(0.9, 1.1)), True)
    after_one, after_sixteen = (model.predict_ms("int4+vocab", T, 300, True)[0] for T in (1, 16))
    assert after_one == pytest.approx(1.1 * one, rel=0.03)  # the timings seen are learned
    assert after_sixteen - after_one == pytest.approx(sixteen - one, rel=0.15)  # the slope in T is kept
    back = LatencyModel.from_json(json.loads(json.dumps(model.to_json())))  # the anchor travels with the state
    assert np.array_equal(back.levels["int4+vocab"].anchor_P, model.levels["int4+vocab"].anchor_P)


def test_an_exact_fit_stays_solvable_after_online_updates():
    """Points fitted exactly (synthetic) once gave an unbounded noise precision, and a few online timings far from
    them then made the posterior precision numerically singular (a LinAlgError in the router); the noise floor
    keeps it well conditioned."""
    pts = [Point("int4", t, c, tree, 80.0 + 20.0 * (t - 1)) for t in (1, 2, 4, 8, 16, 32, 64) for c in (64, 128)
           for tree in (False, True)]
    model = LatencyModel.fit(SPEC, pts)
    for ms in (0.5, 0.3, 2.0, 0.2, 0.1):
        for T in (1, 2, 1, 3):
            model.observe("int4", T, 70, ms, True)
        assert 0.05 < model.predict_ms("int4", 1, 70, True)[0] < 2.5  # (from 80 ms: toward what it sees)
        assert np.linalg.cond(model.levels["int4"].P) < 1e14
