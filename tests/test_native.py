"""`--weights native` (casspec/loading/native.py, ggufcodes.py): a quantized GGUF (Q4_0 .. Q8_0 and the K-quants)
run in its stored quantization. The blocks decode as llama.cpp's (gguf-py's) dequantization, the kernels multiply
what is stored, and every method is lossless relative to the native target: greedy tokens equal native `ar`'s."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from casspec.runtime.engine import Engine
from casspec.loading.ggufcodes import QUANT_TYPES, Codes, decode, random_blocks
from casspec.loading.native import kernel
from casspec.runtime.request import Request
from dsia import blockq
from dsia.blockq import BlockLinear
from dsia.cxx import build_error
from dsia.errors import CasspecError
from test_blockq import close as block_close
from tiny import tiny_gguf

pytestmark = pytest.mark.skipif(build_error() is not None, reason=f"native runs casspec's C++: {build_error()}")

ENGINE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K")  # (Q4_K_M files: Q4_K, Q6_K, Q5_0 / Q8_0 beside)
METHODS = ("pld", "sd", "tree", "vc", "hc", "dytc")


def codes_of(kind: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, Codes]:
    raw = random_blocks(kind, rows, cols, np.random.default_rng(seed))
    return raw, decode(kind, raw)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(QUANT_TYPES), st.integers(1, 9), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_blocks_decode_as_gguf_dequantizes_them(kind, rows, blocks, seed):
    """Every stored bit (random blocks: every code, scale and min pattern) decodes as gguf-py's dequantization,
    exactly."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    cols = blocks * (256 if kind.endswith("_K") else 32)
    raw, codes = codes_of(kind, rows, cols, seed)
    ref = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[kind]))
    assert torch.equal(codes.dequantize(), ref)
    assert codes.u.shape == (rows, cols) and int(codes.u.max()) < 1 << codes.fmt.bits


@pytest.mark.parametrize("kind", QUANT_TYPES)
def test_the_kernels_blocks_dequantize_and_give_rows_as_the_file_does(kind):
    """What a native target reads instead of float copies: the kernel's own layout back to the file's weights (a
    level built from them), and any rows of it (a token embedding's lookups)."""
    _, codes = codes_of(kind, 37, 512, 5)
    k = codes.kernel()
    assert torch.equal(k.dequantize(), codes.dequantize())
    idx = torch.tensor([5, 0, 36, 17, 5, 16])
    assert torch.equal(k.rows(idx), codes.dequantize()[idx])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(("Q4_1", "Q8_0", "Q6_K")), st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=70),
                                                          min_size=1, max_size=12))
def test_rows_read_a_few_at_a_time_are_the_dequantized_rows_whatever_was_read_before(monkeypatch, kind, calls):
    """The rows of a few at a time (an embedding's in a step) come from kept tiles: every call's rows the file's
    dequantization, across hits, misses, evictions past the bound and calls too large to keep."""
    monkeypatch.setattr(blockq, "TILES_KEPT", 3)
    _, codes = codes_of(kind, 100, 256, 7)
    k, full = codes.kernel(), codes.dequantize()
    for call in calls:
        idx = torch.tensor(call)
        assert torch.equal(k.rows(idx), full[idx])
        kept = blockq._KEPT.get(k, {})
        assert len(kept) <= 3  # (and each kept tile holds its own 16 rows' memory, no more: the bound is of bytes too)
        assert all(w.untyped_storage().nbytes() == w.numel() * w.element_size() for w in kept.values())


@pytest.mark.parametrize("kind", QUANT_TYPES)
def test_the_kernel_multiplies_the_stored_codes(kind):
    _, codes = codes_of(kind, 32, 512, 2)
    x = torch.randn(5, 512)
    k = kernel(codes)  # casspec's block product: activations quantized to 8 bits per block
    assert isinstance(k, BlockLinear)
    assert block_close(k(x), x, codes.fmt, {n: getattr(codes, n) for n in ("u", "D", "Dm", "a", "b")})


@pytest.mark.parametrize("kind", QUANT_TYPES)
def test_a_rows_result_does_not_depend_on_the_row_count(kind):
    """What makes speculation on a native target lossless: a verification's rows are what one-token steps give
    (the real model's q|k|v shape)."""
    _, codes = codes_of(kind, 960, 768, 3)
    k = kernel(codes)
    x = torch.randn(16, 768, generator=torch.Generator().manual_seed(0))
    for T in (2, 5, 16):
        assert torch.equal(k(x[:T]), torch.cat([k(x[i:i + 1]) for i in range(T)]))


@pytest.mark.parametrize("kind,bad", [("Q4_0", 9000.0 * 8), ("Q4_1", float("nan")), ("Q8_0", float("inf")),
                                      ("Q4_K", float("nan"))])
def test_block_scales_that_are_no_finite_float16_are_one_clear_error(kind, bad):
    """A crafted file's scale (NaN, inf, or one float16 cannot hold) is refused, not multiplied into NaN logits."""
    _, codes = codes_of(kind, 16, 256, 4)
    codes.D[3, 0] = bad
    with pytest.raises(CasspecError, match="block scales") as e:
        kernel(codes)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module", params=ENGINE_TYPES)
def engines(request, tmp_path_factory):
    """(native, float) engines over one tiny quantized GGUF (every matrix fits the kernels)."""
    dim = 256 if request.param.endswith("_K") else 64  # (a K-quant's rows are whole super-blocks of 256)
    path = tiny_gguf(tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf", seed=3, dim=dim, layers=2,
                     heads=2, kv_heads=1, qtype=request.param, pad_vocab=13)
    kw = dict(autoprofile=False, keep_state=False, kernels="blas")
    return native_engine(str(path), **kw), Engine.from_pretrained(str(path), **kw)


def native_engine(path: str, **kw) -> Engine:
    """A native engine: casspec's products and attention give each row the same bits whatever the rows beside it
    by construction, so the engine's self-check passes on every CPU."""
    return Engine.from_pretrained(path, weights="native", **kw)


def test_native_runs_the_stored_blocks_and_reads_fewer_bytes(engines):
    native, dense = engines
    nat = native.model.native
    assert nat is not None and len(nat.fused) == 4 and nat.head is not None  # q|k|v, gate|up per layer; the head
    assert "native weights" in native.build and "batch-invariant" in native.build and dense.model.native is None
    assert native.model.batch_invariant  # its verifications' rows are its one-token steps' bit for bit
    assert native.model.weight_bytes() < dense.model.weight_bytes() / 3
    # the native target is the file's weights up to its kernel's bf16 scales and activations: close logits
    ids = [5, 6, 7, 8, 9]
    a = native.extend_prefix(ids)
    native.cache.rollback(0)
    b = dense.extend_prefix(ids)
    dense.cache.rollback(0)
    assert torch.nn.functional.cosine_similarity(a, b).item() > 0.999


def test_a_native_target_holds_no_float_copy_and_dequantizes_on_demand(engines):
    """Its quantized projections, embedding and head are held only as blocks (meta tensors in their fields); a level
    builder gets each float weight dequantized from them, equal to what the float engine loaded from the file (the
    q/k rows in the runtime's order), and the embedding's rows are the file's."""
    native, dense = engines
    m, d = native.model, dense.model
    assert all(w.is_meta for lw in m.layers for w in lw.projections().values())
    assert m.embed.is_meta and m.lm_head.is_meta and m.embed_blocks is not None
    assert m.embed_blocks is m.native.head  # (tied: the head's kernel is the embedding's own blocks, one copy)
    for i in range(len(m.layers)):
        for name, w in d.layers[i].projections().items():
            assert torch.equal(m.layers[i].dense(name), w), (i, name)
    assert torch.equal(m.dense_head(), d.lm_head)
    tokens = torch.tensor([[5, 9], [3, 5]])
    assert torch.equal(m.embed_rows(tokens), d.embed[tokens])
    assert torch.equal(m.head_rows(tokens[0]), d.lm_head[tokens[0]])  # (a vocab level's rows: from the blocks)
    h = torch.randn(3, m.spec.dim)
    top = torch.randint(0, m.spec.vocab_size, (3, 7))
    assert torch.equal(m.native.head.scores(h, top), m.native.head(h).gather(1, top))  # (the whole head's bits)
    from dsia.quant import QuantConfig, quantize_linears
    q = quantize_linears(m, QuantConfig("int4"))
    assert q.head.w is m.native.head  # an int4r level rescores with the head's blocks: no float copy of the head
    assert m.weight_bytes() == sum(k.nbytes for k in {id(k): k for k in (
        *m.native.linears.values(), *[f.kernel for f in m.native.fused.values()], m.native.head)}.values()) + sum(
        t.numel() * 4 for t in [m.norm] + [n for lw in m.layers for n in (lw.attn_norm, lw.mlp_norm)])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(3, 60), min_size=2, max_size=12), method=st.sampled_from(METHODS))
def test_every_method_gives_native_ars_tokens(engines, prompt, method):
    native, _ = engines
    prompt = prompt + prompt[:4]  # a repeat, so that the lookups find something
    ref = native.generate_ids(prompt, Request(max_new_tokens=20, method="ar")).token_ids
    got = native.generate_ids(prompt, Request(max_new_tokens=20, method=method))
    assert got.token_ids == ref
    if method not in ("pld", "dytc") and len(ref) > 1:  # (a lookup may find nothing; dytc may verify the root
        # alone, its levels costing about what this target does; the first token may end the answer)
        assert got.stats.tree_nodes > 0  # the levels' drafts were verified


def test_native_needs_a_gguf_file(tmp_path):
    from tiny import tiny_model, tiny_tokenizer

    folder = tmp_path / "hf"
    tiny_model().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    with pytest.raises(CasspecError, match="--weights native runs a quantized GGUF file"):
        Engine.from_pretrained(str(folder), weights="native", autoprofile=False, keep_state=False)
    with pytest.raises(CasspecError, match="unknown weights 'q4'"):
        Engine.from_pretrained(str(folder), weights="q4", autoprofile=False, keep_state=False)


def test_an_unsupported_block_type_is_one_clear_line(tmp_path):
    path = tiny_gguf(tmp_path / "k.gguf", dim=64, layers=1, heads=2, kv_heads=1, qtype="IQ4_NL", pad_vocab=13)
    with pytest.raises(CasspecError, match=r"--weights native runs Q4_0, .*, Q6_K tensors, and blk\.0\.\w+\.weight "
                                           r"is IQ4_NL: use --weights float"):
        Engine.from_pretrained(str(path), weights="native", autoprofile=False, keep_state=False)


def test_cli_generate_native(tmp_path, capsys):
    from casspec.cli import main

    path = tiny_gguf(tmp_path / "q.gguf", dim=64, layers=2, heads=2, kv_heads=1, qtype="Q4_1", pad_vocab=13)
    native_engine(str(path), autoprofile=False, keep_state=False)  # (skips where the machine's kernels refuse)
    argv = ["generate", "ab ab", "--model", str(path), "--no-chat", "--max-new-tokens", "6", "--no-autoprofile"]
    assert main(argv + ["--weights", "native", "--method", "ar"]) == 0
    ar = capsys.readouterr().out
    assert main(argv + ["--weights", "native", "--method", "dytc"]) == 0
    assert capsys.readouterr().out == ar


def test_tune_native_measures_the_native_forwards_and_caches_no_float_copy(tmp_path, capsys, monkeypatch):
    from casspec.cli import main

    monkeypatch.setenv("CASSPEC_CACHE", str(tmp_path / "cache"))
    path = tiny_gguf(tmp_path / "t.gguf", dim=64, layers=2, heads=2, kv_heads=1, qtype="Q8_0", pad_vocab=13,
                     context=256)  # (tune's forwards run on 64 committed tokens)
    assert main(["tune", "--model", str(path), "--weights", "native"]) == 0
    out = capsys.readouterr().out
    assert "no dense kernel choice to measure" in out and "| 1 token |" in out and "floor" in out
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # (the float32 cache entry was never built)


@pytest.mark.skipif(build_error() is not None, reason="casspec's panels are the C++ library's")
def test_only_the_weights_a_forward_multiplies_densely_keep_panels(tmp_path):
    from dsia.kernels import _PANELS
    path = tiny_gguf(tmp_path / "tiny.gguf", seed=3, dim=64, layers=2, heads=2, kv_heads=1, qtype="Q8_0",
                     pad_vocab=13)
    kw = dict(autoprofile=False, keep_state=False, kernels="casspec")
    dense = Engine.from_pretrained(str(path), **kw)
    native = Engine.from_pretrained(str(path), weights="native", **kw)
    packed = lambda m: [id(w) in _PANELS._packed for w in m.dense_weights()]  # noqa: E731
    assert all(packed(dense.model))  # (a float target's products run on the panels, packed at set-up)
    nat = native.model
    assert nat.native is not None and nat.native.head is not None and not any(packed(nat))  # (the native kernels
    # run its layers and head: their dense copies, kept to build levels from, are not packed twice over)
    assert native.generate_ids([5, 6, 7], Request(method="ar", max_new_tokens=4)).token_ids  # (and it still generates)
