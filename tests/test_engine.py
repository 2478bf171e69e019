"""The engine's AR decoding equals HF generate; sampling, stops, EOS, streaming and limits behave."""
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from casspec.runtime.engine import Request
from dsia.errors import CasspecError
from dytc.router import RouterConfig
from dytc.sampling import SamplingParams
from tiny import ARCHS, KERNELS, tiny_engine


@functools.lru_cache(maxsize=None)
def engine(arch: str = "llama", seed: int = 0, max_context: int | None = None, kernels: str = "blas",
           fused: bool = False):
    return tiny_engine(arch, seed, max_context=max_context, kernels=kernels, fuse_projections=fused)


def hf_greedy(e, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = e.hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                              eos_token_id=sorted(e.eos_ids), pad_token_id=0)
    return out[0, len(ids):].tolist()


@settings(max_examples=20, deadline=None)
@given(arch=st.sampled_from(ARCHS), seed=st.integers(0, 3), prompt=st.lists(st.integers(3, 96), min_size=1,
                                                                             max_size=30),
       kernels=st.sampled_from(KERNELS), fused=st.booleans())
def test_ar_greedy_equals_hf_generate(arch, seed, prompt, kernels, fused):
    e = engine(arch, seed, kernels=kernels, fused=fused)
    res = e.generate_ids(prompt, Request(method="ar", max_new_tokens=24))
    assert res.token_ids == hf_greedy(e, prompt, 24)
    assert res.stats.mean_accepted_tokens == 1.0
    assert res.stats.new_tokens == len(res.token_ids) <= 24


def test_sampling_reproducible_with_seed():
    e = engine()
    kw = dict(max_new_tokens=30, temperature=0.9, top_p=0.9, top_k=40)
    a = e.generate("w5 w6 w7", seed=123, **kw)
    b = e.generate("w5 w6 w7", seed=123, **kw)
    c = e.generate("w5 w6 w7", seed=124, **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_max_new_tokens_is_never_exceeded():
    e = engine()
    for n in (1, 2, 7):
        res = e.generate("w5 w6 w7", max_new_tokens=n)
        assert len(res.token_ids) <= n


def test_eos_ends_generation_and_is_not_in_text():
    e = engine()
    greedy = e.generate("w9 w10", max_new_tokens=40).token_ids
    # make the 5th generated token an EOS: the run must stop right there
    eos_e = tiny_engine("llama", 0)
    eos_e.eos_ids = frozenset({greedy[4]})
    res = eos_e.generate("w9 w10", max_new_tokens=40)
    assert res.token_ids == greedy[:5]
    assert res.stats.finish_reason == "eos"


def test_stop_string_ends_generation_where_ar_would():
    e = engine()
    full = e.generate("w9 w10", max_new_tokens=30)
    words = full.text.split()
    stop = " ".join(words[5:7])  # a stop string spanning two tokens in the middle of the output
    res = e.generate("w9 w10", max_new_tokens=30, stop=[stop])
    assert res.stats.finish_reason == "stop"
    assert stop not in res.text
    assert full.text.startswith(res.text)
    first = full.text.find(stop)
    assert res.text == full.text[:first]
    assert res.token_ids == full.token_ids[:len(res.token_ids)]
    assert stop in e.decode(res.token_ids)  # the token that completed the stop string was the last one


def test_streaming_emits_exactly_the_committed_text():
    e = engine()
    ref = e.generate("w11 w12 w13", max_new_tokens=25)
    pieces = list(e.generate("w11 w12 w13", max_new_tokens=25, stream=True))
    assert len(pieces) > 1
    assert "".join(pieces) == ref.text
    assert e.last_result.token_ids == ref.token_ids
    words = ref.text.split()
    stop = words[10]
    pieces = list(e.generate("w11 w12 w13", max_new_tokens=25, stop=[stop], stream=True))
    assert "".join(pieces) == e.last_result.text
    assert stop not in "".join(pieces)


def test_context_window_full_ends_cleanly():
    e = engine("llama", 0, max_context=16)
    res = e.generate("w5 w6 w7 w8 w9 w10", max_new_tokens=100)
    assert res.stats.finish_reason == "context"
    assert res.stats.prompt_tokens + len(res.token_ids) == 16  # the whole window, not one token more


def test_sampling_params_validate():
    from dsia.errors import CasspecError

    for kw in (dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)):
        with pytest.raises(CasspecError):
            SamplingParams(**kw)


def test_warp_topk_topp_and_greedy():
    from dytc.sampling import warp

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    greedy = warp(logits, SamplingParams())
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    p = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)[0]
    p = warp(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-3))  # needs the top two
    assert (p[0, :2] > 0).all() and (p[0, 2:] == 0).all()
    p = warp(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) - 1e-3))  # the top one suffices
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    hot = warp(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(hot[0], torch.softmax(logits[0] / 0.5, -1))


def test_engine_without_profile_fits_latency_online():
    e = tiny_engine("llama", 0)
    assert "fitting online" in e.latency_source
    res = e.generate("w5 w6 w7", max_new_tokens=12)
    assert "fitting online" in res.stats.summary()
    assert e.latency.known("target")  # learned from its own verification timings
    mean, std = e.latency.predict_ms("target", 1, 10)
    assert mean > 0 and std >= 0


def test_stats_split_draft_time_into_level_forwards_and_policy_overhead():
    e = tiny_engine("llama", 0)
    constant = RouterConfig(constant_cost=0.3)  # drafts whatever the timings
    r = e.generate_ids([5, 6, 7, 8, 5, 6, 7], Request(max_new_tokens=24, method="dytc", levels=("int8",),
                                                      router=constant))
    st = r.stats
    assert st.draft_forwards > 0 and 0 < st.draft_forward_seconds <= st.draft_seconds
    assert st.policy_ms_per_step == pytest.approx(
        (st.draft_seconds - st.draft_forward_seconds) * 1e3 / (st.target_forwards - 1))
    assert "ms/step" in st.summary() and st.as_dict()["policy_ms_per_step"] == st.policy_ms_per_step
    ar = e.generate_ids([5, 6, 7], Request(method="ar", max_new_tokens=5))
    assert ar.stats.draft_forward_seconds == 0.0 and ar.stats.draft_forwards == 0


def test_threads_share_one_engine_one_generation_at_a_time():
    """Generations from several threads wait for each other and give what each gives alone; last_result is per
    thread; a thread whose own stream is unfinished gets a clear error instead of a deadlock."""
    import threading

    e = tiny_engine()
    jobs = [(f"w{5 + i} w{20 + i} w{40 + i}",
             dict(method="dytc" if i % 2 else "ar", seed=i, temperature=0.8 * (i % 3 == 0))) for i in range(6)]
    alone = [e.generate(p, max_new_tokens=12, **kw).token_ids for p, kw in jobs]
    got: dict[int, tuple[list[int], list[int], bool]] = {}

    def run(i: int) -> None:
        p, kw = jobs[i]
        pieces = list(e.generate(p, max_new_tokens=12, stream=True, **kw))  # holds the engine while it streams
        res = e.last_result
        got[i] = (res.token_ids, e.generate(p, max_new_tokens=12, **kw).token_ids, "".join(pieces) == res.text)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got[i][:2] for i in range(len(jobs))] == [(a, a) for a in alone] and all(g[2] for g in got.values())
    stream = e.generate("w5 w6 w7", max_new_tokens=12, stream=True)
    next(stream)
    with pytest.raises(CasspecError, match="unfinished generation"):
        e.generate("w5 w6 w7", max_new_tokens=4)
    stream.close()  # releases the engine
    assert e.generate("w5 w6 w7", max_new_tokens=4).stats.new_tokens == 4


def test_cancel_stops_a_stream_after_the_running_step():
    import threading

    e = tiny_engine()
    ids = e.encode("w10 w20 w30 w40")
    cancel = threading.Event()
    pieces = []
    for piece in e.stream_ids(ids, Request(max_new_tokens=200, method="ar"), cancel):
        pieces.append(piece)
        cancel.set()  # after the prefill's token: no verification step starts
    res = e.last_result
    assert res.stats.finish_reason == "cancelled" and len(res.token_ids) == 1 and res.stats.target_forwards == 1
    assert "".join(pieces) == res.text == e.decode(res.token_ids)


@pytest.mark.parametrize("method", ["ar", "dytc"])
def test_a_chat_turn_prefills_only_what_the_cache_does_not_hold(method):
    """A second turn (the first turn's prompt, its answer, a new message) reuses the KV the first left in the
    cache and gives the tokens a fresh engine gives; anything else touching the cache in between, or a prompt
    sharing nothing, prefills from scratch."""
    req = Request(max_new_tokens=12, method=method, router=RouterConfig(constant_cost=0.3))
    e, fresh = tiny_engine("llama", 1), tiny_engine("llama", 1, reuse_prefix=False)
    first = [5, 9, 14, 5, 9, 30, 41]
    out = e.generate_ids(first, req).token_ids
    second = first + out + [7, 8, 9]
    r = e.generate_ids(second, req)
    assert r.stats.reused_tokens >= len(first) + len(out) - 1 and "reused" in r.stats.summary()
    assert r.token_ids == fresh.generate_ids(second, req).token_ids
    assert fresh.last_result.stats.reused_tokens == 0
    e.cache.rollback(0)  # a tool drove the cache: nothing is reused
    e.extend_prefix([11, 12, 13])
    assert e.generate_ids(second, req).stats.reused_tokens == 0
    assert e.generate_ids([60, 61], req).stats.reused_tokens == 0  # nothing in common
    again = e.generate_ids([60, 61], req)  # the same prompt again: all but its last token
    assert again.stats.reused_tokens == 1 and again.token_ids == fresh.generate_ids([60, 61], req).token_ids


def test_the_collector_is_paused_while_a_generation_runs_and_as_it_was_after():
    import gc

    e = engine()
    seen = []
    for piece in e.generate("w11 w12 w13", max_new_tokens=12, stream=True):
        seen.append(gc.isenabled())
    assert seen and not any(seen)
    assert gc.isenabled()
    gc.disable()  # a program that turned it off keeps it off
    try:
        e.generate("w11 w12 w13", max_new_tokens=4)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_pauses_on_threads_resume_the_collector_when_the_last_ends():
    import gc
    import threading

    from dsia.gcpause import paused_gc

    inside, release = threading.Event(), threading.Event()

    def hold():
        with paused_gc():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert inside.wait(10)
    with paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's pause is still open
    release.set()
    t.join(10)
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with paused_gc():
            raise RuntimeError("x")
    assert gc.isenabled()


def test_every_timed_call_runs_with_the_collector_paused():
    """time_ms, the one timer of every measurement (tune, the profile, the levels plane, kernel choice), pauses the
    collector as a generation does, and leaves it as it was."""
    import gc

    from dsia.kernels import time_ms

    seen = []
    assert time_ms(lambda: seen.append(gc.isenabled()), "cpu") >= 0.0
    assert seen == [False] and gc.isenabled()
