"""The C++ layer loop (dsia/fastloop.py, csrc/layers.cpp): the plans it takes give the Python loop's logits and KV bit
for bit (the quantized levels' block products and dense targets, float32 and bfloat16, q|k|v fused or not, with or
without biases, BLAS and MKL; one token, a tree's scratch mask, a causal prefill; a GGUF target's Q4_0 / Q8_0 products
as stored), the plans it does not take run the Python loop, and a build that fails is one clear line where the loop
was asked for."""
import copy

import pytest
import torch

from dsia.blockq import FORMATS
from dsia.errors import CasspecError
from dsia.cxx import build_error
from dsia.fastloop import BLOCKS, Stacks, layer_stack
from dsia.plan import TARGET, Plan
from tiny import KERNELS, tiny_engine, tiny_gguf

pytestmark = pytest.mark.skipif(build_error() is not None, reason=f"the C++ layer loop did not build: {build_error()}")


def both(model):
    """The model with the C++ loop and without it."""
    return model.with_stacks(Stacks()), model.with_stacks(None)


def run(model, plan: Plan, cache, tokens: list[int], start: int, mask: torch.Tensor | None) -> torch.Tensor:
    T = len(tokens)
    return model.forward(cache, torch.tensor(tokens), torch.arange(start, start + T), start, mask, plan)


def forwards(model, plan: Plan) -> tuple[torch.Tensor, ...]:
    """A causal prefill, a one-token step and a tree's forward, and the KV they wrote."""
    prompt = [5, 9, 17, 23, 4, 8, 31]
    cache = model.new_cache(64)
    prefill = run(model, plan, cache, prompt, 0, None)  # causal prefill (is_causal)
    cache.commit(list(range(len(prompt))))
    one = run(model, plan, cache, [12], cache.length, None)  # one token, every slot visible
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    branch = run(model, plan, cache, [12, 40, 41, 7], cache.length, tree)  # a tree's scratch mask
    return prefill, one, branch, cache.k[:, :, :cache.length + 4].clone(), cache.v[:, :, :cache.length + 4].clone()


def assert_same(fast, slow, plan: Plan) -> None:
    for a, b in zip(forwards(fast, plan), forwards(slow, plan)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["int4", "int4+vocab", "int8"])
def test_block_levels_run_the_same_bits_in_the_cpp_loop(arch, dtype, name):
    """The quantized levels' products run casspec's block kernel (Q4_1 / Q8_0 blocks) in both loops; Qwen2's fused
    q|k|v product gets its parts' biases after the split."""
    eng = tiny_engine(arch, seed=1, dtype=dtype)
    fast, slow = both(eng.model)
    level = eng.levels.get(name)
    stack = fast.stacks.get(fast, level.plan)
    assert stack is not None and not stack.dense
    assert {slot.kind for slot in stack.slots if slot.weight.numel()} == {BLOCKS}
    assert stack.one_region == (dtype == torch.float32)  # (one region: float32 activations only)
    assert_same(fast, slow, level.plan)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kernels", ["blas", "mkl", "casspec"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_targets_equal_the_python_loop(arch, kernels, fused, dtype):
    """The target's own forward: dense products through the engine's kernel (MKL computes float32 only: bfloat16
    products go to BLAS, as in the Python loop), q|k|v and gate|up fused or not, Qwen2's q/k/v biases."""
    if kernels not in KERNELS:
        pytest.skip(f"torch here has no {kernels} kernel")
    eng = tiny_engine(arch, seed=2, dtype=dtype, kernels=kernels, fuse_projections=fused)
    fast, slow = both(eng.model)
    stack = fast.stacks.get(fast, TARGET)
    assert stack is not None and stack.dense
    assert_same(fast, slow, TARGET)


def test_a_gguf_targets_block_products_equal_the_python_loop(tmp_path):
    """A target run as stored: its block products (q|k|v, o, gate|up, down per layer), and its batch-invariant
    attention (each row over its own keys: the one-token step and the tree's rows; and by SDPA)."""
    from casspec.runtime.engine import Engine

    for qtype in ("Q4_0", "Q8_0", "Q6_K"):
        dim = 256 if qtype.endswith("_K") else 64
        path = tiny_gguf(tmp_path / f"t-{qtype}.gguf", dim=dim, heads=4, kv_heads=2, qtype=qtype, pad_vocab=13)
        try:
            eng = Engine.from_pretrained(str(path), weights="native", autoprofile=False, keep_state=False)
        except CasspecError as e:
            pytest.skip(f"no native target on this machine: {e}")
        plain = copy.copy(eng.model)
        plain.batch_invariant = False
        for target in (eng.model, plain):  # attending block by block (a native engine's own), and by SDPA
            fast, slow = both(target)
            stack = fast.stacks.get(fast, TARGET)
            blocks = [slot for slot in stack.slots if slot.kind == BLOCKS]  # its products: the blocks as stored
            assert len(blocks) == 4 * 2 and {slot.doubled for slot in blocks} == {FORMATS[qtype].code}
            assert_same(fast, slow, TARGET)


def one_region_outputs(model, plan: Plan, rows: int) -> tuple[torch.Tensor, ...]:
    """A causal prefill of `rows` tokens, a one-token step and a tree's forward, and the keys they wrote."""
    cache = model.new_cache(96)
    prompt = [(7 * i + 3) % 50 for i in range(rows)]
    prefill = run(model, plan, cache, prompt, 0, None)
    cache.commit(list(range(len(prompt))))
    one = run(model, plan, cache, [12], cache.length, None)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    branch = run(model, plan, cache, [12, 40, 41], cache.length, tree)
    return prefill, one, branch, cache.k[:, :, :cache.length + 3].clone()


def assert_one_region(fast, slow, plan: Plan, rows: int) -> None:
    """The C++ loop's stack runs in one region and gives the Python loop's bits on one thread and on two."""
    assert fast.stacks.get(fast, plan).one_region
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for a, b in zip(one_region_outputs(fast, plan, rows), one_region_outputs(slow, plan, rows)):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", ["int4", "int8", "target"])
def test_own_kernels_run_in_one_parallel_region_with_the_same_bits(arch, name):
    """A float32 plan whose every product is casspec's own (block levels; a dense target on casspec's kernel) runs
    its one-token steps and trees (up to 16 rows) in one parallel region (csrc/step.cpp; a prompt of more rows
    attends by SDPA, in the ATen loop) with the Python loop's bits, on one thread and on two (the work split
    otherwise); Qwen2's biases."""
    eng = tiny_engine(arch, seed=4, kernels="casspec")
    plan = TARGET if name == "target" else eng.levels.get(name).plan
    assert_one_region(*both(eng.model), plan, 40)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_a_bfloat16_target_on_casspecs_kernel_runs_in_one_parallel_region(invariant, fused):
    """A bfloat16 target whose products are dense on casspec's kernel runs its steps and trees (batch-invariant: every
    forward) in one region with the Python loop's bits (each op's result rounded to bfloat16 where the loop's bfloat16
    tensors round it; its KV cache bfloat16), on one thread and two. Qwen2's biases (a product rounded before its
    bias is added) keep the ATen loop, with the same bits."""
    eng = tiny_engine("llama", seed=4, kernels="casspec", dtype=torch.bfloat16, batch_invariant=invariant,
                      fuse_projections=fused)
    assert eng.model.new_cache(8).k.dtype == torch.bfloat16
    assert_one_region(*both(eng.model), TARGET, 40)
    qwen = tiny_engine("qwen2", seed=4, kernels="casspec", dtype=torch.bfloat16, batch_invariant=invariant)
    fast, slow = both(qwen.model)
    assert not fast.stacks.get(fast, TARGET).one_region
    assert_same(fast, slow, TARGET)


@pytest.mark.parametrize("dim,heads,kv_heads", [(40, 5, 1), (72, 3, 3), (48, 2, 1)])
def test_odd_widths_run_in_one_parallel_region_with_the_same_bits(dim, heads, kv_heads):
    """Widths that fill no 16-float chunk or 32-input block (heads of 8, 24 and 24 floats, an MLP of 2 x dim) in the
    one-region step of a dense target on casspec's kernel: the Python loop's one-token steps, on one and two threads."""
    eng = tiny_engine("llama", seed=5, kernels="casspec", dim=dim, heads=heads, kv_heads=kv_heads)
    fast, slow = both(eng.model)
    assert fast.stacks.get(fast, TARGET).one_region
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs = []
            for model in (fast, slow):
                cache = model.new_cache(32)
                run(model, TARGET, cache, [3, 9, 27, 81 % 97], 0, None)
                cache.commit(list(range(4)))
                steps = []
                for tok in (5, 6, 7):
                    steps.append(run(model, TARGET, cache, [tok], cache.length, None))
                    cache.commit([0])
                outs.append((torch.cat(steps), cache.k[:, :, :cache.length].clone()))
            assert all(torch.equal(a, b) for a, b in zip(*outs))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_native_target_runs_in_one_parallel_region(tmp_path, qtype):
    """A GGUF target run as stored (batch-invariant: every forward attends with casspec's attention) runs each
    forward in one region: a prefill of 21 rows (past one block of 16 query rows), a step, a tree; heads of 16 and
    of 32 (each head's outputs half a block of o's input, or one: quantized after the attention or with it)."""
    from casspec.runtime.engine import Engine

    for dim, heads in ((64, 4), (64, 2)):
        path = tiny_gguf(tmp_path / f"t-{qtype}-{heads}.gguf", dim=dim, heads=heads, kv_heads=1, qtype=qtype,
                         pad_vocab=13)
        try:
            eng = Engine.from_pretrained(str(path), weights="native", autoprofile=False, keep_state=False)
        except CasspecError as e:
            pytest.skip(f"no native target on this machine: {e}")
        assert_one_region(*both(eng.model), TARGET, 21)


@pytest.mark.parametrize("arch,name", [("qwen3", "int4"), ("llama", "int4+skip0.3"), ("llama", "int4+exit2"),
                                       ("llama", "w8a8")])
def test_plans_it_does_not_take_run_the_python_loop(arch, name):
    """q/k norms (Qwen3), skipped sublayers, an early exit, other kernels: no stack."""
    eng = tiny_engine(arch, seed=0)
    level = eng.levels.get(name)
    assert layer_stack(eng.model, level.plan) is None
    assert (layer_stack(eng.model, TARGET) is None) == (arch == "qwen3")


def test_onednn_steps_and_batch_invariant_targets_run_the_python_loop():
    """A token count the engine multiplies with oneDNN (a kernel the C++ loop does not run) runs the Python loop,
    with the same result; a batch-invariant target with dense products has no stack."""
    if "onednn" not in KERNELS:
        pytest.skip("torch here has no oneDNN inner product")
    eng = tiny_engine("llama", seed=3, kernels="onednn")
    fast, slow = both(eng.model)
    stack = fast.stacks.get(fast, TARGET)
    assert stack is not None and stack.run(fast, torch.zeros(1, 64), None, None, None, None) is None
    assert_same(fast, slow, TARGET)
    bf = tiny_engine("llama", seed=3, dtype=torch.bfloat16, batch_invariant=True)
    assert layer_stack(bf.model, TARGET) is None  # (its dense products run over padded rows)


def test_engine_builds_it_by_default_and_says_so(monkeypatch, capsys):
    assert "c++ layers" in tiny_engine("llama").build
    assert "building" not in capsys.readouterr().err  # (built already: nothing said)
    monkeypatch.setattr("casspec.runtime.target.built", lambda: False)
    assert "c++ layers" in tiny_engine("llama").build
    assert "casspec: building the C++ layer loop (once per machine" in capsys.readouterr().err
    monkeypatch.setattr("casspec.runtime.target.build_error", lambda: "CalledProcessError: c++ not found")
    assert "c++ layers" not in tiny_engine("llama").build  # the default falls back to the Python loop quietly
    with pytest.raises(CasspecError, match="did not build .*install a C\\+\\+ compiler"):
        tiny_engine("llama", fast_layers=True)
