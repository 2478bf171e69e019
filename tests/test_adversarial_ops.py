"""Every C++ op and the C++ layer loop check what they index (dsia/csrc): wrong shapes, dtypes, devices, sizes and
strides give a RuntimeError naming the op, never a read outside a tensor or a signal; the process goes on. The
security review's reproducers are here: RoPE tables narrower than the head (a partial-rotary config), an
attention over zero KV heads (SIGFPE before its check), a norm weight shorter than the row, block scales of the
wrong first dimension."""
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsia.blockq import FORMATS
from dsia.cxx import build_error
from test_ops import sdpa_rows

pytestmark = pytest.mark.skipif(build_error() is not None, reason=f"the C++ ops did not build: {build_error()}")

ops = torch.ops.casspec
META = torch.device("meta")  # a device the ops do not run on (the CPU is the one they take)


def refused(fn, *args, match: str = "casspec") -> None:
    with pytest.raises(RuntimeError, match=match):
        fn(*args)


# ---------------------------------------------------------------------------------------------------- norms
def test_rms_norm_checks_its_weight_and_rows():
    x, w = torch.randn(3, 64), torch.randn(64)
    assert ops.rms_norm(x, w, 1e-5).shape == (3, 64)
    refused(ops.rms_norm, x, torch.randn(16), 1e-5, match="weight of 64 values")  # read past it before
    refused(ops.rms_norm, x, w.double(), 1e-5, match="Float expected")
    refused(ops.rms_norm, x, w.view(8, 8), 1e-5, match="1 dims expected")
    refused(ops.rms_norm, x[None], w, 1e-5, match="2 dims expected")
    refused(ops.rms_norm, x.bfloat16(), w, 1e-5, match="BFloat16 expected")  # (the weight in x's dtype)
    refused(ops.rms_norm, x.double(), w, 1e-5, match="float32 or bfloat16 expected")
    refused(ops.rms_norm, x.t(), torch.randn(3), 1e-5, match="unit stride")
    refused(ops.rms_norm, torch.empty(3, 64, device=META), w, 1e-5, match="CPU tensor expected")
    refused(ops.rms_norm, x, torch.empty(64, device=META), 1e-5, match="CPU tensor expected")
    refused(ops.rms_norm, x, w, float("nan"), match="eps")


def test_add_rms_norm_checks_both_inputs_and_the_weight():
    x, d, w = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    assert ops.add_rms_norm(x, d, w, 1e-5)[1].shape == (3, 64)
    refused(ops.add_rms_norm, x, torch.randn(2, 64), w, 1e-5, match="of one shape")
    refused(ops.add_rms_norm, x, d, torch.randn(63), 1e-5, match="weight of 64 values")
    refused(ops.add_rms_norm, x, d.int(), w, 1e-5, match="float32 or bfloat16 expected")
    refused(ops.add_rms_norm, x, d.bfloat16(), w, 1e-5, match="of one shape and dtype")
    refused(ops.add_rms_norm, x, torch.empty(3, 64, device=META), w, 1e-5, match="CPU tensor expected")


# ---------------------------------------------------------------------------------------------------- RoPE
def test_rope_refuses_tables_narrower_than_the_head():
    """The review's high finding: a partial-rotary config made the tables [T, hd/4] and the op read past them."""
    x = torch.randn(4, 5, 64)
    cos, sin = torch.randn(5, 64), torch.randn(5, 64)
    assert ops.rope(x, cos, sin).shape == (4, 5, 64)
    refused(ops.rope, x, cos[:, :16], sin[:, :16], match=r"cos and sin \[5, 64\] expected")
    refused(ops.rope, x, cos[:3], sin[:3], match=r"cos and sin \[5, 64\] expected")  # fewer positions than rows
    refused(ops.rope, x, cos, sin[:, :32], match="cos and sin")
    refused(ops.rope, torch.randn(4, 5, 63), torch.randn(5, 63), torch.randn(5, 63), match="even head size")
    refused(ops.rope, x, cos.double(), sin, match="Float expected")
    refused(ops.rope, x, cos[None], sin, match="2 dims expected")
    refused(ops.rope, x[0], cos, sin, match="3 dims expected")
    refused(ops.rope, x.transpose(1, 2), cos, sin, match="unit stride")
    refused(ops.rope, x, torch.empty(5, 64, device=META), sin, match="CPU tensor expected")


# ---------------------------------------------------------------------------------------------------- attention
def attention_args(H=4, Hkv=2, T=3, S=10, hd=16, end=None):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(H, T, hd, generator=g), torch.randn(Hkv, S, hd, generator=g),
            torch.randn(Hkv, S, hd, generator=g), S if end is None else end, None, hd ** -0.5)


def with_arg(args, i, value):
    return args[:i] + (value,) + args[i + 1:]


def test_attention_over_zero_kv_heads_is_an_error_not_a_signal():
    """The review's finding: H / Hkv ran before the check, and a config with zero heads killed the process with
    SIGFPE. Run in a child process, so a signal would show as its exit status instead of ending this one."""
    code = textwrap.dedent("""
        import torch
        from dsia.cxx import build_error
        assert build_error() is None
        for H, Hkv in ((4, 0), (0, 0), (0, 2)):
            try:
                torch.ops.casspec.attention(torch.randn(H, 2, 16), torch.randn(Hkv, 4, 16), torch.randn(Hkv, 4, 16),
                                            4, None, 0.25)
            except RuntimeError as e:
                assert "query heads over" in str(e), e
            else:
                raise SystemExit("no error")
        print("alive")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "alive"


def test_attention_checks_every_tensor_and_size():
    args = attention_args()
    assert ops.attention(*args).shape == (3, 4 * 16)
    q, k, v = args[:3]
    refused(ops.attention, *with_arg(args, 0, torch.randn(3, 3, 16)), match="multiple of the KV heads")
    refused(ops.attention, *with_arg(args, 2, v[:, :5]), match="keys and values")  # values shorter than keys
    refused(ops.attention, *with_arg(args, 2, v[:1]), match="keys and values")
    refused(ops.attention, *with_arg(args, 1, torch.randn(2, 10, 8)), match="keys and values")  # other head size
    refused(ops.attention, *with_arg(args, 3, 11), match="within the 10 slots")
    refused(ops.attention, *with_arg(args, 3, 2), match="cover the 3 query rows")
    refused(ops.attention, *with_arg(args, 3, -1), match="cover")
    refused(ops.attention, *attention_args(H=2, Hkv=1, hd=272), match="head size 1..256")
    refused(ops.attention, *with_arg(args, 0, q.double()), match="float32 or bfloat16 q expected")
    refused(ops.attention, *with_arg(args, 1, k.bfloat16()), match="Float expected")  # (q's dtype: float32 here)
    refused(ops.attention, *with_arg(with_arg(args, 0, q.bfloat16()), 2, v.half()), match="BFloat16 expected")
    refused(ops.attention, *with_arg(args, 2, v[None]), match="3 dims expected")
    refused(ops.attention, *with_arg(args, 1, k.transpose(1, 2).contiguous().transpose(1, 2)), match="unit stride")
    refused(ops.attention, *with_arg(args, 0, torch.empty(4, 3, 16, device=META)), match="CPU tensor expected")
    refused(ops.attention, *with_arg(args, 5, float("inf")), match="finite scale")


def test_attention_checks_its_mask():
    args = attention_args()
    ok = torch.ones(3, 10, dtype=torch.bool)
    assert ops.attention(*with_arg(args, 4, ok)).shape == (3, 64)
    refused(ops.attention, *with_arg(args, 4, ok[:, :9]), match=r"mask \[3, 10\]")
    refused(ops.attention, *with_arg(args, 4, ok[:2]), match=r"mask \[3, 10\]")
    refused(ops.attention, *with_arg(args, 4, ok[None]), match=r"mask \[3, 10\]")
    refused(ops.attention, *with_arg(args, 4, torch.empty(3, 10, dtype=torch.bool, device=META)), match="mask")
    blind = ok.clone()
    blind[1] = False  # a row that sees no key: its softmax would read past its scores
    refused(ops.attention, *with_arg(args, 4, blind), match="row 1 of the mask sees no key")


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 5), st.integers(0, 3), st.integers(0, 6), st.integers(0, 12), st.sampled_from([1, 2, 7, 16, 33]),
       st.integers(-2, 14), st.sampled_from([None, "full", "short", "long"]), st.integers(0, 6), st.integers(-2, 2))
def test_attention_any_shapes_give_sdpa_or_an_error(H, Hkv, T, S, hd, end, mask, kv_extra, hd_shift):
    """Arbitrary head counts, row counts, slot counts, head sizes and ends: the op either refuses with a
    RuntimeError or returns what SDPA computes over the keys it was given."""
    g = torch.Generator().manual_seed(H * 1000 + T * 10 + S)
    q = torch.randn(H, T, hd, generator=g)
    keys = torch.randn(Hkv, S, max(1, hd + hd_shift), generator=g)
    values = torch.randn(Hkv, S + kv_extra % 2, max(1, hd + hd_shift), generator=g)
    m = None
    if mask is not None:
        cols = max(end, 0) + {"full": 0, "short": -1, "long": 1}[mask]
        m = torch.ones(T, max(cols, 0), dtype=torch.bool)
    try:
        out = ops.attention(q, keys, values, end, m, hd ** -0.5)
    except RuntimeError as e:
        assert "casspec attention" in str(e)
        return
    assert out.shape == (T, H * hd)
    if T:
        torch.testing.assert_close(out, sdpa_rows(q, keys, values, end, m), rtol=1e-5, atol=2e-6)


# ---------------------------------------------------------------------------------------------------- blocks
Q4_1 = FORMATS["Q4_1"].code  # 4-bit codes, offsets (two scale planes)
Q6_K = FORMATS["Q6_K"].code  # nibbles, two bit planes, multipliers per half block, super-blocks of 8


def block_args(T=2, tiles=2, blocks=3, fmt=FORMATS["Q4_1"], n=None):
    record = fmt.record
    codes = torch.randint(0, 256, (tiles, blocks, record), dtype=torch.uint8)
    scales = torch.rand(2 if fmt.mins else 1, tiles, blocks // fmt.super, 16).half()
    return torch.randn(T, 32 * blocks), codes, scales, 16 * tiles if n is None else n


def test_block_linear_checks_codes_scales_format_and_outputs():
    x, codes, scales, n = block_args()
    assert ops.block_linear(x, codes, scales, n, Q4_1).shape == (2, 32)
    refused(ops.block_linear, x, codes, torch.rand(3, 2, 3, 16).half(), n, Q4_1, match=r"scales \[2")  # dim 0
    refused(ops.block_linear, x, codes, torch.rand(0, 2, 3, 16).half(), n, Q4_1, match=r"scales \[2")
    refused(ops.block_linear, x, codes, scales[:1], n, Q4_1, match=r"scales \[2")  # (Q4_1 has offsets: D and Dm)
    refused(ops.block_linear, x, codes, scales.float(), n, Q4_1, match="Half expected")  # (float16, as GGUF's)
    refused(ops.block_linear, x, codes, scales[:, :1], n, Q4_1, match=r"scales \[2, 2, 3, 16\]")
    refused(ops.block_linear, x, codes, scales[:, :, :2], n, Q4_1, match="scales")
    refused(ops.block_linear, x, codes, scales.transpose(1, 2), n, Q4_1, match="scales")
    refused(ops.block_linear, x, codes[:, :, :3], scales, n, Q4_1, match="codes")
    refused(ops.block_linear, x, codes.transpose(0, 1), scales, n, Q4_1, match="codes")  # (not contiguous)
    refused(ops.block_linear, x, codes.to(torch.int8), scales, n, Q4_1, match="Byte expected")
    refused(ops.block_linear, x, codes[0], scales, n, Q4_1, match="3 dims expected")
    refused(ops.block_linear, x[:, :64], codes, scales, n, Q4_1, match="x has 64 inputs")
    refused(ops.block_linear, x, codes, scales, 33, Q4_1, match="outputs")
    refused(ops.block_linear, x, codes, scales, 16, Q4_1, match="outputs")  # leaves the second tile empty
    refused(ops.block_linear, x, codes, scales, 0, Q4_1, match="outputs")
    refused(ops.block_linear, x, codes, scales, -5, Q4_1, match="outputs")
    refused(ops.block_linear, x, codes, scales, n, Q4_1, 7, match="isa 7")
    refused(ops.block_linear, x, codes, scales, n, Q4_1, -2, match="isa -2")
    refused(ops.block_linear, x.double(), codes, scales, n, Q4_1, match="Float expected")
    for bad in (-1, 3, 0x33, 1 << 30, Q4_1 | 1 << 12, FORMATS["Q8_0"].code | 1 << 4, 129 << 16):
        refused(ops.block_linear, x, codes, scales, n, bad, match="is no block format")  # (a crafted format code)
    refused(ops.block_linear, x, codes, scales, n, Q6_K, match="codes")  # (the record of another format)
    x6, codes6, scales6, n6 = block_args(blocks=8, fmt=FORMATS["Q6_K"])
    assert ops.block_linear(x6, codes6, scales6, n6, Q6_K).shape == (2, 32)
    refused(ops.block_linear, x6[:, :32 * 4], codes6[:, :4].contiguous(), scales6, n6, Q6_K, match="super-blocks")
    refused(ops.block_linear, x, torch.empty(codes.shape, dtype=torch.uint8, device=META), scales, n, Q4_1,
            match="CPU tensor expected")
    refused(ops.block_linear, x, codes, torch.empty(scales.shape, dtype=torch.half, device=META), n, Q4_1,
            match="CPU tensor expected")
    empty = block_args(tiles=0)
    refused(ops.block_linear, empty[0], empty[1], empty[2], 0, Q4_1, match="outputs")


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 3), st.integers(0, 3), st.integers(0, 17), st.sampled_from(sorted(FORMATS)),
       st.sampled_from([1, 2, 3]), st.integers(-20, 70), st.integers(-1, 1), st.integers(-1, 1))
def test_block_linear_any_shapes_give_the_product_or_an_error(T, tiles, blocks, kind, planes, n, k_shift, r_shift):
    fmt = FORMATS[kind]
    codes = torch.randint(0, 256, (tiles, blocks, max(0, fmt.record + r_shift)), dtype=torch.uint8)
    scales = torch.rand(planes, tiles, max(1, blocks // fmt.super), 16).half()
    x = torch.randn(T, max(0, 32 * blocks + 32 * k_shift))
    try:
        out = ops.block_linear(x, codes, scales, n, fmt.code)
    except RuntimeError as e:
        assert "casspec block_linear" in str(e)
        return
    assert out.shape == (T, n) and torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------------- the layer loop
D, H, HKV, HD, FFN = 32, 4, 2, 8, 48


def stack_args(layers=1, heads=H, kv_heads=HKV, block=64, kinds=None, n_norms=None):
    """A Stack of dense float32 layers (slots q, k, v, o, gate, up, down, separate), as torch.classes takes it."""
    g = torch.Generator().manual_seed(1)
    shapes = [(heads * HD, D), (kv_heads * HD, D), (kv_heads * HD, D), (D, heads * HD), (FFN, D), (FFN, D), (D, FFN)]
    weights = [torch.randn(*s, generator=g) * 0.2 for _ in range(layers) for s in shapes]
    empty = torch.empty(0)
    n_slots = 7 * layers
    return ([torch.ones(D)] * (2 * layers if n_norms is None else n_norms), kinds or [1] * n_slots, weights,
            [empty] * n_slots, [empty] * n_slots, [empty] * n_slots, [0] * n_slots, [0] * n_slots, 6, heads,
            kv_heads, 1e-5,
            [block, 5, 1 << 20])


def run_args(T=2, S=16, start=0, end=None, layers=1, cos=None, mask=None, kv_heads=HKV):
    x = torch.randn(T, D)
    k, v = torch.zeros(layers, kv_heads, S, HD), torch.zeros(layers, kv_heads, S, HD)
    c = torch.randn(T, HD) if cos is None else cos
    return (x, 1, k, v, c, c.clone(), start, start + T if end is None else end, mask, False, None, None, 0, 0,
            True, True)


def test_the_layer_loop_checks_its_construction():
    Stack = torch.classes.casspec.Stack
    Stack(*stack_args())  # a valid one
    with pytest.raises(RuntimeError, match="query heads over"):
        Stack(*stack_args(heads=0))
    with pytest.raises(RuntimeError, match="query heads over"):
        Stack(*stack_args(kv_heads=0))
    with pytest.raises(RuntimeError, match="query heads over"):
        Stack(*stack_args(heads=3, kv_heads=2))
    with pytest.raises(RuntimeError, match="attention block"):
        Stack(*stack_args(block=0))  # (the block attention divides by it)
    with pytest.raises(RuntimeError, match="2 norms per layer"):
        Stack(*stack_args(n_norms=3))
    with pytest.raises(RuntimeError, match="7 product slots"):
        Stack(*stack_args(n_norms=4))
    with pytest.raises(RuntimeError, match="unknown product kind"):
        Stack(*stack_args(kinds=[1, 1, 1, 9, 1, 1, 1]))
    with pytest.raises(RuntimeError, match="do not form its products"):
        Stack(*stack_args(kinds=[-1, 1, 1, 1, 1, 1, 1]))  # no q product
    with pytest.raises(RuntimeError, match="do not form its products"):
        Stack(*stack_args(kinds=[1, -1, 1, 1, 1, 1, 1]))  # k fused into q, v not
    args = list(stack_args())
    args[4] = [torch.ops.casspec.dense_pack(w) for w in args[2]]  # (each weight's panels: one region)
    assert Stack(*args).one_region()
    args[4] = [torch.ops.casspec.dense_pack(w[:, :-1]) for w in args[2]]  # (panels of fewer inputs than read)
    with pytest.raises(RuntimeError, match=r"panels \[\d+, \d+, 64\] contiguous expected"):
        Stack(*args)


def test_the_layer_loop_checks_each_call():
    stack = torch.classes.casspec.Stack(*stack_args())
    x, out = stack.run(*run_args())
    assert x.shape == out.shape == (2, D)
    with pytest.raises(RuntimeError, match=r"cos and sin \[2, 8\]"):
        stack.run(*run_args(cos=torch.randn(2, 2)))  # partial-rotary tables
    with pytest.raises(RuntimeError, match="within the cache"):
        stack.run(*run_args(start=15))  # writes past the cache
    with pytest.raises(RuntimeError, match="within the cache"):
        stack.run(*run_args(end=17))
    with pytest.raises(RuntimeError, match="within the cache"):
        stack.run(*run_args(start=-1))
    with pytest.raises(RuntimeError, match="K and V caches"):
        stack.run(*run_args(kv_heads=1))
    with pytest.raises(RuntimeError, match="K and V caches"):
        stack.run(*with_arg(run_args(), 2, torch.zeros(0, HKV, 16, HD)))  # fewer layers than the stack
    with pytest.raises(RuntimeError, match=r"mask \[2, 2\]"):
        stack.run(*run_args(mask=torch.ones(3, 2, dtype=torch.bool)))
    with pytest.raises(RuntimeError, match="dense kernel"):
        stack.run(*with_arg(run_args(), 1, 7))
    with pytest.raises(RuntimeError, match="x"):
        stack.run(*with_arg(run_args(), 0, torch.randn(2, D, 1)))
    x, out = stack.run(*run_args())  # and it still runs
    assert torch.isfinite(out).all()
