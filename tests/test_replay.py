"""The oracle replay: offline policies and the per-step oracle on hand-made and random recordings (dytc/replay.py),
the recording of live steps and teacher-forced ranks on a tiny engine (casspec/tools/replay.py), the script's bad
input."""
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dytc.replay import Recording, chain, lookup, oracle, replay, replay_live, static_policies

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "oracle_replay.py"


def recording(ranks: dict, match: dict, proposed: dict | None = None, verify_step: float = 1.0,
              level_ms: float = 2.0) -> Recording:
    T = len(next(iter(ranks.values())) if ranks else next(iter(match.values())))
    verify = [[0.0] + [10.0 + verify_step * (n - 1) for n in range(1, 40)]] * 2
    level = {name: [[0.0] + [level_ms * (1 + 0.1 * (n - 1)) for n in range(1, 40)]] * 2 for name in ranks}
    return Recording("q", "c", 5, list(range(T)), ranks, proposed or {k: [len(v) and 3] * T for k, v in match.items()},
                     match, verify, level)


def test_a_chain_emits_its_agreeing_run_plus_the_bonus():
    r = recording({"a": [-1, 0, 0, 1, 0, 0, 0, 0]}, {})
    # j=1: run 2 -> emits 3; j=4: run 4, capped at k=2 -> 3; j=7: run 1 -> 2; done at 9 >= T=8
    ms, steps = replay(r, chain("a", 2))
    assert steps == 3
    assert ms == 3 * (2 * 2.0 + 12.0)


def test_a_lookup_verifies_its_proposal_and_falls_back_to_ar():
    r = recording({}, {"pld": [0, 2, 0, 0, 0, 0]}, proposed={"pld": [0, 3, 0, 0, 0, 0]})
    ms, steps = replay(r, lookup("pld"))
    # j=1: 3 proposed, 2 match -> emits 3 at V(4)=13; j=4: nothing proposed -> AR 10; j=5: AR 10
    assert (ms, steps) == (13.0 + 10.0 + 10.0, 3)


def brute_force(r: Recording, j: int = 1) -> float:
    """The oracle's optimum by enumeration: every step length d, every source assignment of its d tokens."""
    T = len(r.target)
    if j >= T:
        return 0.0
    best = r.verify_ms(1, False) + brute_force(r, j + 1)
    sources = list(r.ranks) + list(r.match) + [lk + "|new" for lk in r.match]  # a lookup token continues its
    # segment, or starts a new one (the lookup asked again after the path so far)
    for d in range(1, T - j + 1):
        for assign in itertools.product(sources, repeat=d):
            cost, ok = 0.0, True
            for i, s in enumerate(assign):
                p = j + i
                if s in r.ranks:
                    ok &= r.ranks[s][p] == 0
                    cost += r.level_ms(s, 1)
                    continue
                lk, start = s.split("|")[0], p
                while not assign[start - j].endswith("|new") and start > j and assign[start - j - 1].startswith(lk):
                    start -= 1
                ok &= r.match[lk][start] >= p - start + 1
            if ok:
                best = min(best, cost + r.verify_ms(d + 1, False) + brute_force(r, j + d + 1))
    return best


@settings(max_examples=40, deadline=None)
@given(st.integers(3, 6).flatmap(lambda T: st.tuples(
    st.lists(st.sampled_from([0, 0, 1, 3]), min_size=T, max_size=T),
    st.lists(st.integers(0, 3), min_size=T, max_size=T),
    st.floats(0.2, 3.0), st.floats(0.5, 8.0))))
def test_the_oracle_is_the_optimum_and_beats_every_static_policy(case):
    ranks, match, verify_step, level_ms = case
    r = recording({"a": [-1] + ranks[1:]}, {"pld": [0] + match[1:]}, verify_step=verify_step, level_ms=level_ms)
    ms, steps, used = oracle(r)
    assert abs(ms - brute_force(r)) < 1e-9
    assert sum(used.values()) + steps == r.steps_needed or sum(used.values()) + steps > r.steps_needed
    for name, pol in static_policies(r, ks=(1, 2, 4)).items():
        assert ms <= replay(r, pol)[0] + 1e-9, name


def test_recording_a_tiny_engine_gives_consistent_live_steps_and_ranks():
    import torch

    from casspec.calibrate.questions import Question
    from casspec.tools.replay import LIVE_METHODS, evaluate, levels_of, record_question
    from tests.tiny import tiny_engine

    engine = tiny_engine()
    q = Question(7, "demo", ["w5 w17 w33 w5 w17 w33 w5 w17 w40 w41", "w9 w17 w33"])
    levels = levels_of(engine)
    with torch.inference_mode():
        first, second = record_question(engine, q, levels, max_new_tokens=24)
    assert (first.turn, second.turn) == (0, 1)
    assert second.context > first.context + len(first.target) - 1  # the second turn's prompt holds the first answer
    r = first
    T = len(r.target)
    assert set(r.live) == set(LIVE_METHODS) and set(r.ranks) == set(levels)
    for m, steps in r.live.items():
        pos = 1
        for s in steps:  # the steps tile the output: each starts where the last one's emitted tokens end
            assert s.pos == pos and 0 <= s.accepted < s.nodes
            pos += s.accepted + 1
        assert pos >= T, m
    assert all(len(v) == T for v in r.ranks.values()) and all(len(v) == T for v in r.match.values())
    assert all(s.forwards == [] and s.nodes == 1 for s in r.live["ar"])
    assert replay_live(r, "ar")[0] == pytest.approx(len(r.live["ar"]) * r.verify_ms(1, False))
    assert any(s.forwards for s in r.live["sd"])
    # a step's first draft is the teacher-forced one (the same 1-token forward over the target's KV): sd's first
    # token was accepted exactly where the recorded rank is 0
    for s in r.live["sd"]:
        if s.nodes > 1:
            assert (s.accepted > 0) == (r.ranks[levels[0]][s.pos] == 0), s
    row = evaluate(r)
    assert row["oracle_ms"] <= row["best_offline_static_ms"] + 1e-9


def test_bad_input_is_one_error_and_exit_2(tmp_path):
    cases = ((["--replay", str(tmp_path / "missing.jsonl")], "is not a file"),
             ([], "pass --questions"),
             (["--questions", str(tmp_path / "missing.jsonl")], "does not exist"))
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for args, _ in cases]  # (all at once: each is mostly its imports)
    for proc, (args, says) in zip(procs, cases):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and "Traceback" not in err, (args, err)
        assert says in err.splitlines()[-1], (args, err)
