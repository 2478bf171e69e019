"""Dense kernels chosen by measurement: the selection logic on injected timings (the AMD and the Intel machines
this project has seen), every candidate computing the product, and the cached choice."""
import json

import pytest
import torch
import torch.nn.functional as F

from casspec.calibrate.tune import STEP_TOKENS, format_steps, format_tuning, step_times, tuned_kernels, tuning_key
from dsia.errors import CasspecError
from dsia.kernels import TOKEN_BUCKETS, DenseKernels, bucket_of, candidates, choose
from dsia.model import Transformer
from tiny import tiny_engine, tiny_model

# ms of one layer's linears plus the LM head of SmolLM2-135M at 1, 4, 8, 16 tokens (issue 13), spread over TOKEN_BUCKETS
INTEL = {"blas": [3.58, 5.0, 6.71, 13.24, 14.26, 20.0, 30.0, 90.0],
         "onednn": [3.79, 6.0, 9.36, 11.11, 13.48, 21.0, 33.0, 99.0]}
AMD = {"blas": [6.0, 8.0, 10.0, 16.0, 22.0, 30.0, 50.0, 150.0], "onednn": [3.2, 4.5, 5.5, 9.0, 14.0, 24.0, 45.0, 135.0]}
# ms of a whole SmolLM2-135M target forward on a 300-token prefix, on a 2-core Xeon (family 6 model 207, AVX512,
# no AMX) at 1, 2, 4, 8, 16, 24, 64 and 300 tokens: MKL's packed sgemm loses at 1-2 tokens and on prompts, wins
# by 1.3-1.6x in between
XEON = {"blas": [28.2, 30.3, 60.6, 57.8, 83.2, 86.1, 105.0, 531.0],
        "mkl": [39.9, 35.0, 42.2, 46.6, 50.9, 65.5, 110.0, 637.0]}


def test_choice_follows_the_measurement():
    assert choose(AMD).names == ("onednn",) * len(TOKEN_BUCKETS)  # oneDNN 1.5-2x faster there
    intel = choose(INTEL)  # BLAS wins but where oneDNN is faster by more than the margin (8 and 16 tokens)
    assert intel.names == ("blas", "blas", "blas", "onednn", "onednn", "blas", "blas", "blas")
    assert choose(XEON).names == ("blas", "blas", "mkl", "mkl", "mkl", "mkl", "blas", "blas")
    near = {"blas": [10.0] * len(TOKEN_BUCKETS), "onednn": [9.8] * len(TOKEN_BUCKETS)}  # 2% faster: within the margin
    assert choose(near).names == ("blas",) * len(TOKEN_BUCKETS)
    assert choose({"blas": INTEL["blas"]}).names == ("blas",) * len(TOKEN_BUCKETS)  # the only candidate (e.g. a GPU)


def test_buckets_and_description():
    assert [bucket_of(t) for t in (1, 2, 3, 4, 5, 64, 65, 256, 1000)] == [0, 1, 2, 2, 3, 6, 7, 7, 7]
    k = DenseKernels(("onednn", "onednn", "blas", "blas", "onednn", "mkl", "mkl", "blas"))
    assert k.describe() == "onednn (T 1-2), blas (T 3-8), onednn (T 9-16), mkl (T 17-64), blas (T 65+)"
    assert DenseKernels.forced("blas").describe() == "blas (T 1+)"
    with pytest.raises(CasspecError, match="unknown kernel"):
        DenseKernels.forced("fast")


@pytest.mark.parametrize("name", sorted(candidates(torch.float32, "cpu")))
@pytest.mark.parametrize("T", [1, 3, 16, 70])
def test_every_candidate_computes_the_product(name, T):
    g = torch.Generator().manual_seed(T)
    x, w, b = torch.randn(T, 48, generator=g), torch.randn(80, 48, generator=g), torch.randn(80, generator=g)
    torch.testing.assert_close(DenseKernels.forced(name)(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()  # another dtype always goes to BLAS, whatever was measured for float32
    assert torch.equal(DenseKernels.forced(name)(xb, wb), F.linear(xb, wb))


def test_the_choice_is_measured_once_and_cached(tmp_path):
    model = Transformer.from_hf(tiny_model("llama", seed=1))
    path = tmp_path / "kernels.json"
    first, rec = tuned_kernels(model, path)
    assert rec["source"] == "measured" and set(rec["timings_ms"]) == set(candidates(torch.float32, "cpu"))
    assert first == choose(rec["timings_ms"])
    again, rec2 = tuned_kernels(model, path)
    assert again == first and rec2["source"] == "cached"
    assert tuned_kernels(model, path, refresh=True)[1]["source"] == "measured"
    other = Transformer.from_hf(tiny_model("llama", seed=1, dim=96))  # another model shape: another key
    assert tuning_key(other) != tuning_key(model)
    assert tuned_kernels(other, path)[1]["source"] == "measured"
    assert len(json.loads(path.read_text())) == 2
    path.write_text("{not json")  # a corrupt cache is measured again, not trusted
    assert tuned_kernels(model, path)[1]["source"] == "measured"
    assert "| 1 |" in format_tuning(rec)


def test_a_choice_measured_against_another_library_is_measured_again(tmp_path, monkeypatch):
    """Where casspec's own kernel is a candidate, the key holds the library's sources' digest: a choice measured
    against an older library (its kernel slower then) is not taken for this one's."""
    import casspec.calibrate.tune as tune

    model = Transformer.from_hf(tiny_model("llama", seed=1))
    path = tmp_path / "kernels.json"
    assert tuned_kernels(model, path)[1]["source"] == "measured"
    assert tuned_kernels(model, path)[1]["source"] == "cached"
    if "casspec" not in candidates(torch.float32, "cpu"):
        pytest.skip("casspec's kernel is no candidate here (the library did not build)")
    assert json.loads(tuning_key(model))["library"] == tune.source_digest()
    monkeypatch.setattr(tune, "source_digest", lambda: "another-one")
    assert tuned_kernels(model, path)[1]["source"] == "measured"


def test_engine_reports_its_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path))
    e = tiny_engine("llama", 5, kernels="auto")
    assert e.kernels.endswith("(measured)") and (tmp_path / "kernels.json").is_file()
    assert tiny_engine("llama", 5, kernels="auto").kernels.endswith("(cached)")
    r = e.generate("w5 w6 w7", max_new_tokens=4)
    assert f"kernels: {e.kernels}" in r.stats.summary()
    assert tiny_engine("llama", 5).kernels == "blas (T 1+) (forced)"


def test_the_step_report_times_each_forward_against_the_floor():
    e = tiny_engine("llama", 5, max_context=96)
    before = e.cache.length
    times = step_times(e.model, e.cache, repeats=3)
    assert set(times) == {"floor"} | {str(T) for T in STEP_TOKENS} and all(ms > 0 for ms in times.values())
    assert e.cache.length == before == 0  # (scratch forwards only: nothing committed)
    table = format_steps(times, e.model.weight_bytes())
    assert "| 1 token |" in table and "| 16 tokens |" in table and "streamed at" in table
    assert f"| {times['1'] / times['floor']:.2f} | 1.00 |" in table
    assert len(e.generate("w5 w6 w7", max_new_tokens=4).token_ids) == 4  # the engine decodes after the report


def test_a_kernel_far_slower_in_a_bucket_is_not_timed_in_larger_ones(monkeypatch):
    """measure(): a kernel SLOWER_GONE times a bucket's fastest is not timed again (inf: first use is shorter), is
    never chosen there, and the tuning table says "-" where it was not timed."""
    import time

    import dsia.kernels as kernels

    calls = []

    def slow(x, w, b=None):
        calls.append(x.shape[0])
        time.sleep(0.002)
        return F.linear(x, w, b)

    monkeypatch.setattr(kernels, "candidates", lambda dtype, device: {"blas": F.linear, "slow": slow})
    m = tiny_model("llama", 0)
    *layers, head = [w for lw in Transformer.from_hf(m).layers for w in lw.projections().values()] + [
        Transformer.from_hf(m).lm_head]
    timings = kernels.measure(layers, head, repeats=3)
    assert all(t < float("inf") for t in timings["blas"])
    assert timings["slow"][0] > kernels.SLOWER_GONE * timings["blas"][0]
    assert timings["slow"][1:] == [float("inf")] * (len(TOKEN_BUCKETS) - 1) and set(calls) == {TOKEN_BUCKETS[0]}
    rec = {"names": list(choose(timings).names), "timings_ms": timings}
    assert rec["names"] == ["blas"] * len(TOKEN_BUCKETS) and "| - |" in format_tuning(rec)
