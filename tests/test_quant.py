"""Weight-only quantized kernels (dsia/quant.py): each kernel computes x @ dequantized(w).T, the packing conventions
of torch's int8/int4 CPU kernels hold, a Plan of quantized linears runs the real forward, the model is untouched."""
import copy
import dataclasses
import importlib
import importlib.util

import pytest
import torch

from dsia import layer, qkernels, quant
from dsia.blockq import BlockLinear
from dsia.cxx import build_error
from dsia.errors import CasspecError
from dsia.model import Transformer
from dsia.qkernels import SHORTLIST, RescoredHead
from dsia.quant import (HEAD, HEAD_KINDS, KINDS, QuantCodec, QuantConfig, quantize_head, quantize_linears,
                        quantize_weight)
from tiny import tiny_model

BNB_KINDS = ("nf4",)


def has_bnb() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def kind_param(kind: str):
    marks = [pytest.mark.skipif(not has_bnb(), reason="needs bitsandbytes")] if kind in BNB_KINDS else []
    if kind == "w8a8":
        marks = [pytest.mark.skipif(not qkernels.w8a8_available(), reason="needs torch's fbgemm kernels")]
    return pytest.param(kind, marks=marks, id=kind)


ALL_KINDS = [kind_param(k) for k in KINDS]  # body kinds
# and int8g (int4r: test_rescored_head_...; int3 / int2, the block kernel's alone: test_blockq)
KERNEL_KINDS = [kind_param(k) for k in HEAD_KINDS if k != "int4r" and k not in quant.BLOCK_ONLY]


def config(kind: str, **kw) -> QuantConfig:
    """A QuantConfig for a kernel of this kind (int8g is a head kind only: it rides as the head of int8)."""
    return QuantConfig(kind, **kw) if kind in KINDS else QuantConfig("int8", head_kind=kind, **kw)


# ---------------------------------------------------------------------- independent reference dequantizers
def ref_dequant(w: torch.Tensor, kind: str, cfg: QuantConfig) -> torch.Tensor:
    """The weight [out, in] each kernel should multiply by, from the documented formulas (not the packed data)."""
    w = w.float()
    out, n_in = w.shape
    if quant.blocks_for(w, kind, cfg):  # casspec's block kernel: GGUF Q4_1 / Q8_0 blocks of 32, float16 scales
        g = w.reshape(out, n_in // 32, 32)
        half = lambda t: t.half().float()  # noqa: E731
        if kind == "int4":
            lo = half(g.amin(2, keepdim=True))
            d = half(((g.amax(2, keepdim=True) - lo) / 15).clamp(min=2 ** -24))
            return (((g - lo) / d).round().clamp(0, 15) * d + lo).reshape(out, n_in)
        d = half((g.abs().amax(2, keepdim=True) / 127).clamp(min=2 ** -24))
        return ((g / d).round().clamp(-127, 127) * d).reshape(out, n_in)
    rnd = lambda t: t.to(cfg.act_dtype).float()  # scales are stored in the activation dtype  # noqa: E731
    if kind == "int8":
        s = rnd((w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12))
        return (w / s).round().clamp(-127, 127) * s
    if kind == "bf16":
        return w.bfloat16().float()
    if kind == "w8a8":  # the scales stay in float64
        s = (w.double().abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
        return ((w.double() / s).round().clamp(-127, 127) * s).float()
    G = cfg.group_size
    g = w.reshape(out, n_in // G, G)
    if kind == "int8g":
        d = rnd((g.abs().amax(2, keepdim=True) / 127).clamp(min=1e-12))
        return ((g / d).round().clamp(-127, 127) * d).reshape(out, n_in)
    if kind == "int4":
        lo, hi = g.amin(2, keepdim=True), g.amax(2, keepdim=True)
        scale = rnd(((hi - lo) / 15).clamp(min=1e-6))
        zero = rnd(lo + 8 * scale)
        q = ((g - zero) / scale + 8).round().clamp(0, 15)
        return ((q - 8) * scale + zero).reshape(out, n_in)
    import bitsandbytes.functional as bnbF
    assert kind == "nf4", kind
    packed, state = bnbF.quantize_4bit(w.contiguous(), blocksize=G, quant_type="nf4")
    state.absmax = state.absmax.bfloat16().float()  # the fused CPU kernel keeps absmax in bf16
    return bnbF.dequantize_4bit(packed, state).float()


def act_of(kind: str, cfg: QuantConfig, blocks: bool = False) -> torch.dtype:
    if blocks:
        return torch.float32
    return torch.bfloat16 if kind in ("nf4", "bf16") else torch.float32 if kind == "w8a8" else cfg.act_dtype


def ref_act(x: torch.Tensor, kind: str, cfg: QuantConfig, blocks: bool = False) -> torch.Tensor:
    """The activations each kernel multiplies: w8a8 quantizes them per call to uint8 over [min(x, 0), max(x, 0)];
    the block kernel per row and block of 32 to int8, d = max |x| / 127 (times 1 / d, rounded half to even)."""
    if blocks:
        g = x.float().reshape(x.shape[0], -1, 32)
        d = g.abs().amax(2, keepdim=True) / 127
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        return ((g * inv).round() * d).reshape(x.shape)
    if kind != "w8a8":
        return x.to(act_of(kind, cfg)).float()
    lo, hi = x.min().clamp(max=0), x.max().clamp(min=0)
    scale = (hi - lo) / 255
    zero = (-lo / scale).round()
    return ((x / scale).round() + zero).clamp(0, 255).sub(zero) * scale


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def model() -> Transformer:
    # dim 64 (in % 32), vocab 112 (out % 16): every matrix, the head included, fits every kernel
    return Transformer.from_hf(tiny_model("llama", seed=3, vocab=112, dim=64, layers=2))


# ---------------------------------------------------------------------- kernels
@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "torch"])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", KERNEL_KINDS)
def test_kernel_equals_dense_matmul_with_dequantized_weight(kind, act_dtype, blocks):
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.1  # [out, in]
    x = torch.randn(5, 128)  # [T, in]
    cfg = config(kind, act_dtype=act_dtype, blocks=blocks)
    k = quantize_weight(w, kind, cfg)
    own = quant.blocks_for(w, kind, cfg)
    assert k.kind == kind and isinstance(k, BlockLinear) == own
    assert own == (blocks and kind in quant.BLOCK_KINDS and build_error() is None)
    y = k(x)  # [T, out]
    assert y.shape == (5, 96) and y.dtype == x.dtype
    deq = ref_dequant(w, kind, cfg)
    act = act_of(kind, cfg, own)
    ref = ref_act(x, kind, cfg, own) @ deq.T  # what the kernel multiplies, in float32
    # bf16 activations give a bf16 output; w8a8's rounding of x to its grid may differ by one step at a tie
    tol = 2 ** -8 if act == torch.bfloat16 else 2 ** -7 if kind == "w8a8" else 1e-5
    torch.testing.assert_close(y, ref, rtol=0, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("kind,bound", [("int8", 0.02), ("int8g", 0.02), ("int4", 0.15), ("w8a8", 0.03), ("bf16", 0.01),
                                        pytest.param("nf4", 0.15, marks=kind_param("nf4").marks)])
def test_kernel_close_to_original_weight(kind, bound):
    torch.manual_seed(1)
    w, x = torch.randn(64, 256) * 0.05, torch.randn(3, 256)
    y = quantize_weight(w, kind, config(kind))(x)
    assert rel(y, x @ w.T) < bound


def on_grid_activations(blocks: bool) -> torch.Tensor:
    """x [4, 64]; for the block kernel integers with 127 in every block of 32, which its 8-bit rows keep exactly."""
    if not blocks:
        return torch.randn(4, 64)
    x = torch.randint(-127, 128, (4, 64)).float()
    x[:, ::32] = 127
    return x


@pytest.mark.parametrize("kind,blocks", [("int8g", True), ("int8g", False), ("int8", True)],
                         ids=["int8g-blocks", "int8g-torch", "int8-blocks"])
def test_int8g_is_exact_on_a_q8_0_grid(kind, blocks):
    """Blocks of 32 int8 values times a per-block scale (GGUF Q8_0) come back exactly, up to the bf16 scale (the
    block kernel's int8 is Q8_0 too; torch's per-channel int8 is not)."""
    torch.manual_seed(2)
    q = torch.randint(-127, 128, (32, 64)).float()
    q[:, ::32] = 127  # every block reaches its absmax
    d = torch.rand(32, 2).repeat_interleave(32, dim=1).bfloat16().float()  # [out, in], one scale per block
    w = q * d
    x = on_grid_activations(blocks)
    k = quantize_weight(w, kind, config(kind, act_dtype=torch.float32, blocks=blocks))
    torch.testing.assert_close(k(x), x @ w.T, rtol=1e-5, atol=1e-4 * x.abs().max().item())


@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "torch"])
def test_int4_is_exact_on_a_q4_1_grid(blocks):
    """Blocks of 32 4-bit codes with a per-block scale and min (GGUF Q4_1) come back exactly with group 32."""
    torch.manual_seed(3)
    q = torch.randint(0, 16, (32, 64)).float()
    q[:, ::32], q[:, 1::32] = 0, 15  # every block uses its full range
    d = torch.rand(32, 2).repeat_interleave(32, dim=1).bfloat16().float()
    m = -8 * d  # with min = -8d, the zero point (min + 8d = 0) is exact in any dtype
    w = q * d + m
    x = on_grid_activations(blocks)
    k = quantize_weight(w, "int4", QuantConfig("int4", act_dtype=torch.float32, blocks=blocks))
    torch.testing.assert_close(k(x), x @ w.T, rtol=1e-5, atol=1e-4 * x.abs().max().item())


# ---------------------------------------------------------------------- whole model
def dequantized_model(m: Transformer, cfg: QuantConfig) -> Transformer:
    """A shallow copy of m whose projections and head are the reference dequantized weights (dense)."""
    d = copy.copy(m)
    deq = lambda w, kind: ref_dequant(w, kind, cfg) if kind is not None else w  # noqa: E731
    d.layers = [dataclasses.replace(lw, **{a: deq(getattr(lw, a), cfg.kind) for a in
                                          ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")})
                for lw in m.layers]
    d.lm_head = deq(m.lm_head, cfg.head_kind or cfg.kind)
    return d


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("kind,head_kind", [("int8", None), ("int4", None), ("int4", "int8g")],
                         ids=["int8", "int4", "int4-int8g-head"])  # int4 + int8g head: the int4 level
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases added after the kernel
def test_plan_forward_equals_dense_forward_with_dequantized_weights(arch, kind, head_kind, fuse):
    m = Transformer.from_hf(tiny_model(arch, seed=4, vocab=112, dim=64, layers=2))
    # torch's kernels multiply the activations as they are (the block kernel's 8-bit rows: test_blockq, and
    # test_block_levels_run_the_same_bits_in_the_cpp_loop)
    cfg = QuantConfig(kind, act_dtype=torch.float32, head_kind=head_kind, fuse=fuse, blocks=False)
    q = quantize_linears(m, cfg)
    assert set(q.kinds.values()) == {kind, head_kind or kind}
    toks = torch.randint(0, 112, (9,), generator=torch.Generator().manual_seed(0))
    out = m.forward(m.new_cache(32), toks, torch.arange(9), 0, plan=q.plan())
    ref = dequantized_model(m, cfg).forward(m.new_cache(32), toks, torch.arange(9), 0)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_plan_forward_close_to_target(model, kind):
    q = quantize_linears(model, QuantConfig(kind, head_kind=None))
    plan = q.plan()
    covered = set(q.linears) | {(i, n) for (i, g) in q.fused for n in layer.FUSED_GROUPS[g]}
    assert not plan.is_target and len(covered) == 7 * model.spec.n_layers and q.head is not None
    toks = torch.randint(0, 112, (12,), generator=torch.Generator().manual_seed(1))
    ref = model.forward(model.new_cache(32), toks, torch.arange(12), 0)
    cache = model.new_cache(32)
    out = model.forward(cache, toks[:8], torch.arange(8), 0, plan=plan)  # prefill, then a tree-masked step
    cache.commit(list(range(8)))
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    out = torch.cat([out, model.forward(cache, toks[8:], torch.arange(8, 12), 8, mask, plan=plan)])
    assert out.shape == ref.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert rel(out, ref) < {"int8": 0.1, "int3": 0.9, "int2": 1.3}.get(kind, 0.6)  # random weights: 2-4 bits is coarse


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_model_weights_untouched(kind):
    hf = tiny_model("qwen3", seed=5, vocab=112, tie=True)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in hf.state_dict(keep_vars=True).items()}
    m = Transformer.from_hf(hf)
    q = quantize_linears(m, QuantConfig(kind))
    toks = torch.arange(6)
    m.forward(m.new_cache(16), toks, torch.arange(6), 0, plan=q.plan())
    for n, p in hf.state_dict(keep_vars=True).items():
        ptr, value = before[n]
        assert p.data_ptr() == ptr and torch.equal(p.detach(), value), n
    assert m.lm_head.data_ptr() == m.embed.data_ptr()  # tied: the head copy is quantized, the embedding stays as it was


def test_nbytes_counts_packed_weights_and_scales(model):
    s = model.spec
    mats = [(s.n_heads * s.head_dim + 2 * s.n_kv_heads * s.head_dim, s.dim), (s.dim, s.n_heads * s.head_dim),
            (2 * s.intermediate, s.dim), (s.dim, s.intermediate)]  # fused q|k|v, o, fused gate|up, down
    fp32 = 4 * (sum(o * i for o, i in mats) * s.n_layers + s.vocab_size * s.dim)
    q8 = quantize_linears(model, QuantConfig("int8", head_kind=None, blocks=False))
    assert q8.nbytes == sum(o * i + 2 * o for o, i in mats) * s.n_layers + s.vocab_size * s.dim + 2 * s.vocab_size
    q4 = quantize_linears(model, QuantConfig("int4", head_kind=None, blocks=False))
    int4 = lambda o, i: o * i // 2 + (i // 32) * o * 2 * 2  # noqa: E731  packed nibbles + bf16 (scale, zero)
    assert q4.nbytes == sum(int4(o, i) for o, i in mats) * s.n_layers + int4(s.vocab_size, s.dim)
    assert 0 < q4.nbytes < q8.nbytes < fp32 / 3
    qg = quantize_linears(model, QuantConfig("int4", head_kind="int8g", blocks=False))  # int8g: twice int4's planes
    assert qg.nbytes == q4.nbytes + 2 * int4(s.vocab_size, s.dim) - int4(s.vocab_size, s.dim)
    qr = quantize_linears(model, QuantConfig("int4", blocks=False))  # int4r: a 4-bit copy (the rows are the target's)
    assert qr.nbytes == q4.nbytes
    if build_error() is None:  # the block kernel: codes per 16 outputs (padded), float32 d (and m) per block of 32
        tiles = lambda o: -(-o // 16) * 16  # noqa: E731
        blocks = lambda o, i, bits: tiles(o) * i * bits // 8 + tiles(o) * (i // 32) * 2 * (2 if bits == 4 else 1)  # noqa: E731
        for kind, bits in (("int4", 4), ("int8", 8)):
            qb = quantize_linears(model, QuantConfig(kind, head_kind=None))
            body = sum(blocks(o, i, bits) for o, i in mats) * s.n_layers
            assert qb.nbytes == body + blocks(s.vocab_size, s.dim, bits)
    if has_bnb():
        for kind in BNB_KINDS:
            assert 0 < quantize_linears(model, QuantConfig(kind, head_kind=None)).nbytes < fp32 / 3


def test_odd_dims_fall_back_to_int8():
    """dim 48 (not a multiple of 32), vocab 97 (not of 16): those matrices become int8, the rest stays int4."""
    m = Transformer.from_hf(tiny_model("llama", seed=6, dim=48, heads=4, kv_heads=2, layers=2))
    q = quantize_linears(m, QuantConfig("int4", blocks=False))
    for i in range(2):
        assert q.kinds[(i, "down")] == "int4"  # [48, 96]
        assert all(q.kinds[(i, n)] == "int8" for n in ("q", "k", "v", "o", "gate", "up"))  # in = 48
    assert q.kinds[HEAD] == "int8"  # [97, 48]
    toks = torch.arange(10)
    ref = m.forward(m.new_cache(16), toks, torch.arange(10), 0)
    out = m.forward(m.new_cache(16), toks, torch.arange(10), 0, plan=q.plan())
    assert rel(out, ref) < 0.6
    torch_kernels = QuantConfig("int4", blocks=False)
    assert isinstance(quantize_weight(torch.randn(97, 64), "int4", torch_kernels), qkernels.Int8Linear)
    if build_error() is None:  # the block kernel takes any out (padded to 16) where in % 32 == 0
        assert isinstance(quantize_weight(torch.randn(97, 64), "int4", QuantConfig("int4")), BlockLinear)
        assert isinstance(quantize_weight(torch.randn(97, 48), "int4", QuantConfig("int4")), qkernels.Int8Linear)
    assert isinstance(quantize_weight(torch.randn(64, 96), "int4", QuantConfig("int4", 64)), qkernels.Int8Linear)
    if has_bnb():
        q = quantize_linears(m, QuantConfig("nf4", head_kind=None))
        assert q.kinds[(0, "down")] == "int8" and q.kinds[(0, "q")] == "int8"  # out 48 % 32, in 48 % 32
        assert torch.isfinite(m.forward(m.new_cache(16), toks, torch.arange(10), 0, plan=q.plan())).all()


def test_fused_kernels_equal_the_unfused_projections(model):
    q = quantize_linears(model, QuantConfig("int4"))
    assert (1, "q") not in q.linears and (1, "o") in q.linears  # q|k|v and gate|up run through Plan.fused
    fused = q.fused[(1, "qkv")]
    x = torch.randn(3, 64)
    y = fused(x)
    assert y.shape == (3, sum(fused.sizes))
    unfused = quantize_linears(model, QuantConfig("int4", fuse=False), layers=[1])
    parts = y.split(fused.sizes, dim=-1)
    for part, n in zip(parts, ("q", "k", "v")):
        torch.testing.assert_close(part, unfused.linears[(1, n)](x), rtol=0, atol=1e-2)
    toks = torch.arange(6)
    a = model.forward(model.new_cache(16), toks, torch.arange(6), 0, plan=q.plan())
    b = model.forward(model.new_cache(16), toks, torch.arange(6), 0,
                      plan=quantize_linears(model, QuantConfig("int4", fuse=False)).plan())
    torch.testing.assert_close(a, b, rtol=0, atol=5e-2)


def test_layer_subset_and_no_head(model):
    q = quantize_linears(model, QuantConfig("int8"), layers=[1], include_head=False)
    assert set(q.linears) | {(1, n) for n in ("q", "k", "v", "gate", "up")} == {
        (1, n) for n in ("q", "k", "v", "o", "gate", "up", "down")}
    assert q.head is None and HEAD not in q.kinds and not q.fused.keys() - {(1, "qkv"), (1, "gate_up")}
    toks = torch.arange(5)
    out = model.forward(model.new_cache(8), toks, torch.arange(5), 0, plan=q.plan(skip_mlp=frozenset({0})))
    assert torch.isfinite(out).all()


def test_bf16_model_keeps_its_dtype():
    m = Transformer.from_hf(tiny_model("llama", seed=7, vocab=112, dtype=torch.bfloat16, layers=1))
    q = quantize_linears(m, QuantConfig("int4"))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert q.linears[(0, "down")](torch.randn(2, 128, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert q.head(x).dtype == torch.bfloat16
    out = m.forward(m.new_cache(8), torch.arange(4), torch.arange(4), 0, plan=q.plan())
    assert torch.isfinite(out).all()


def test_bad_configs_are_one_line_errors():
    for kw in (dict(kind="int5"), dict(kind="int8g"), dict(kind="int8-bnb"), dict(kind="int8", head_kind="fp8"),
               dict(kind="int4", group_size=48), dict(kind="int8", head_kind="int8g", group_size=48),
               dict(kind="nf4", group_size=48, head_kind=None),
               dict(kind="int8", act_dtype=torch.float16)):
        with pytest.raises(CasspecError) as e:
            QuantConfig(**kw)
        assert "\n" not in str(e.value)


def test_missing_bitsandbytes_says_how_to_install(model, monkeypatch):
    real = importlib.import_module

    def fake(name, *a, **k):
        if name.startswith("bitsandbytes"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(qkernels.importlib, "import_module", fake)
    for kind in BNB_KINDS:
        with pytest.raises(CasspecError, match="pip install bitsandbytes") as e:
            quantize_linears(model, QuantConfig(kind))
        assert "\n" not in str(e.value)
    assert quantize_linears(model, QuantConfig("int8")).nbytes > 0  # the torch kinds do not need it


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rescored_head_scores_its_shortlist_with_the_targets_rows(act_dtype):
    """int4r: the 4-bit copy's logits, except each row's SHORTLIST best, which are the exact h @ w.T; the exact
    argmax is among them (so the head ranks as the target's); stored without the rows, read back with them."""
    torch.manual_seed(0)
    V, D = 160 if SHORTLIST < 160 else 16 * SHORTLIST, 64
    w = torch.randn(V, D) * 0.1  # [V, D] the target's head
    h = torch.randn(6, D)  # [N, D]
    cfg = QuantConfig("int4", act_dtype=act_dtype)
    head = quantize_head(w, "int4r", cfg)
    assert isinstance(head, RescoredHead) and head.kind == "int4r" and head.w is w and head.nbytes < w.numel()
    out = head(h)  # [N, V]
    own = quant.blocks_for(w, "int4", cfg)
    coarse = ref_act(h, "int4", cfg, own) @ ref_dequant(w, "int4", cfg).T  # [N, V]
    exact = h @ w.T
    top = coarse.topk(SHORTLIST, dim=-1).indices  # [N, k]
    listed = torch.zeros(6, V, dtype=torch.bool).scatter_(1, top, True)
    torch.testing.assert_close(out[listed], exact[listed], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[~listed], coarse[~listed], rtol=1e-2, atol=1e-3)
    assert torch.equal(out.argmax(-1), exact.argmax(-1))
    # a level store keeps the 4-bit copy and the shortlist length; the rows come from the model again
    m = Transformer.from_hf(tiny_model("llama", seed=3, vocab=112, dim=64, layers=1))
    q = quantize_linears(m, QuantConfig("int4"))
    assert isinstance(q.head, RescoredHead) and q.kinds[HEAD] == "int4r"
    tensors, layout = QuantCodec(QuantConfig("int4")).encode(q)
    assert not any(t.data_ptr() == m.lm_head.data_ptr() for t in tensors.values())
    back = QuantCodec(QuantConfig("int4"), m.lm_head).decode(tensors, layout)
    x = torch.randn(3, 64)
    assert back.head.w is m.lm_head and torch.equal(back.head(x), q.head(x))
    with pytest.raises(ValueError):
        QuantCodec(QuantConfig("int4")).decode(tensors, layout)
    # where the 4-bit kernel cannot take the head (out % 16), it falls back to int8g's choice
    torch_cfg = dataclasses.replace(cfg, blocks=False)
    assert quantize_head(torch.randn(97, 64), "int4r", torch_cfg).kind == "int8"
    if build_error() is None:  # (the block kernel pads the outputs to its tiles of 16)
        assert quantize_head(torch.randn(97, 64), "int4r", cfg).kind == "int4r"
