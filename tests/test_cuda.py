"""CUDA paths (skipped without a GPU): runtime parity in float32 / bfloat16 / float16, and greedy lossless
decoding of every method on the GPU."""
import pytest
import torch

from casspec.runtime.engine import Engine, Request
from casspec.loading.checkpoints import Loaded
from dsia.model import Transformer
from tiny import ARCHS, tiny_model, tiny_tokenizer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
@torch.no_grad()
def test_logits_parity_on_cuda(arch, dtype, tol):
    hf = tiny_model(arch, seed=1, dtype=dtype).cuda()
    rt = Transformer.from_hf(hf)
    ids = torch.randint(0, 97, (20,), device="cuda")
    ref = hf(ids[None]).logits[0].float()
    out = rt.forward(rt.new_cache(64), ids, torch.arange(20, device="cuda"), 0)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= tol


@pytest.mark.parametrize("method,level", [("ar", "int4"), ("pld", "int4"), ("sd", "skip0.3"), ("tree", "exit2"),
                                          ("sd", "sparse0.5"), ("tree", "vocab"), ("sd", "int8"), ("dytc", "-"),
                                          ("vc", "-"), ("hc", "-"), ("sd", "nf4")])
def test_greedy_methods_equal_ar_on_cuda(method, level):
    if level == "nf4":
        pytest.importorskip("bitsandbytes", reason="the nf4 level needs bitsandbytes")
    hf = tiny_model("llama", seed=0).cuda()
    e = Engine(Loaded(hf, tiny_tokenizer(), "tiny-cuda"), autoprofile=False, keep_state=False)
    prompt = [5, 6, 7, 8, 5, 6, 7]
    ar = e.generate_ids(prompt, Request(method="ar", max_new_tokens=30))
    x = torch.tensor([prompt], device="cuda")
    ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=30, do_sample=False,
                      eos_token_id=sorted(e.eos_ids), pad_token_id=0)[0, len(prompt):].tolist()
    assert ar.token_ids == ref
    req = Request(max_new_tokens=30, method=method, level=level) if level != "-" else \
        Request(max_new_tokens=30, method=method)  # multi-level methods: their GPU default levels
    spec = e.generate_ids(prompt, req)
    assert spec.token_ids == ar.token_ids


def test_cuda_graphs_replay_the_eager_tokens():
    """Small forwards replayed from CUDA graphs with compiled elementwise steps (the default on a GPU) give eager
    decoding's tokens (float32)."""
    hf = tiny_model("qwen3", seed=2).cuda()
    eager = Engine(Loaded(hf, tiny_tokenizer(), "tiny-cuda"), graphs=False, compile_pointwise=False)
    graphed = Engine(Loaded(hf, tiny_tokenizer(), "tiny-cuda"))
    assert graphed.graphs is not None and eager.graphs is None
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6, 7]
    ar = eager.generate_ids(prompt, Request(method="ar", max_new_tokens=40))
    for req in (Request(max_new_tokens=40), Request(max_new_tokens=40, method="sd", level="skip0.3"),
                Request(max_new_tokens=40, method="tree", level="exit2"), Request(max_new_tokens=40, method="dytc"),
                Request(max_new_tokens=40, method="vc")):
        assert graphed.generate_ids(prompt, req).token_ids == ar.token_ids, req.method
    st = graphed.graphs.stats
    assert st.captures > 0 and st.replays > st.captures and st.failed == 0, str(st)
