"""The C++ layer loop (dsia/fastloop.py, csrc/layers.cpp): the plans it takes give the Python loop's logits bit for
bit (int4 levels in float32 and bfloat16, one token, a tree's scratch mask, a causal prefill; a GGUF target's Q4_0 /
Q8_0 products as stored), the plans it does not take run the Python loop, and a build that fails is one clear line
where the loop was asked for."""
import copy

import pytest
import torch

from dsia.errors import CasspecError
from dsia.fastloop import Stacks, build_error, int4_stack
from dsia.levels import Level
from dsia.plan import TARGET
from tiny import tiny_engine, tiny_gguf

pytestmark = pytest.mark.skipif(build_error() is not None, reason=f"the C++ layer loop did not build: {build_error()}")


def both(model):
    """The model with the C++ loop and without it."""
    return model.with_stacks(Stacks()), model.with_stacks(None)


def run(model, level: Level, cache, tokens: list[int], start: int, mask: torch.Tensor | None) -> torch.Tensor:
    T = len(tokens)
    positions = torch.arange(start, start + T)
    return level.forward(model, cache, torch.tensor(tokens), positions, start, mask)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["int4", "int4+vocab"])
def test_int4_levels_equal_the_python_loop(arch, dtype, name):
    eng = tiny_engine(arch, seed=1, dtype=dtype)
    fast, slow = both(eng.model)
    level = eng.levels.get(name)
    assert fast.stacks.get(fast, level.plan) is not None
    prompt = [5, 9, 17, 23, 4, 8, 31]
    outs = []
    for model in (fast, slow):
        cache = model.new_cache(64)
        prefill = run(model, level, cache, prompt, 0, None)  # causal prefill (is_causal)
        cache.commit(list(range(len(prompt))))
        one = run(model, level, cache, [12], cache.length, None)  # one token, every slot visible
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        branch = run(model, level, cache, [12, 40, 41, 7], cache.length, tree)  # a tree's scratch mask
        outs.append((prefill, one, branch, cache.k[:, :, :cache.length + 4].clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_a_gguf_targets_q4_and_q8_products_equal_the_python_loop(tmp_path):
    from casspec.engine import Engine

    for qtype in ("Q4_0", "Q8_0"):
        path = tiny_gguf(tmp_path / f"t-{qtype}.gguf", dim=64, heads=4, kv_heads=2, qtype=qtype, pad_vocab=13)
        try:
            eng = Engine.from_pretrained(str(path), weights="native", autoprofile=False, keep_state=False)
        except CasspecError as e:
            pytest.skip(f"no native target on this machine: {e}")
        target = copy.copy(eng.model)
        target.batch_invariant = False  # (a native engine's target attends block by block: the Python loop's)
        fast, slow = both(target)
        stack = fast.stacks.get(fast, TARGET)
        assert stack is not None and any(stack.doubled) == (qtype == "Q8_0")
        outs = []
        for model in (fast, slow):
            cache = model.new_cache(32)
            prefill = model.forward(cache, torch.tensor([5, 6, 7, 8]), torch.arange(4), 0)
            cache.commit([0, 1, 2, 3])
            step = model.forward(cache, torch.tensor([9, 10]), torch.arange(4, 6), 4)
            outs.append((prefill, step))
        for a, b in zip(*outs):
            assert torch.equal(a, b)


@pytest.mark.parametrize("arch,name", [("qwen2", "int4"), ("qwen3", "int4"), ("llama", "int4+skip0.3"),
                                       ("llama", "int4+exit2"), ("llama", "int8"), ("llama", "w8a8")])
def test_plans_it_does_not_take_run_the_python_loop(arch, name):
    """Biases (Qwen2), q/k norms (Qwen3), skipped sublayers, an early exit, other kernels: no stack,
    and the target's own dense forward has none either."""
    eng = tiny_engine(arch, seed=0)
    level = eng.levels.get(name)
    assert int4_stack(eng.model, level.plan) is None
    assert int4_stack(eng.model, TARGET) is None


def test_engine_builds_it_by_default_and_says_so(monkeypatch):
    assert "c++ layers" in tiny_engine("llama").build
    monkeypatch.setattr("casspec.engine.build_error", lambda: "CalledProcessError: c++ not found")
    assert "c++ layers" not in tiny_engine("llama").build  # the default falls back to the Python loop quietly
    with pytest.raises(CasspecError, match="did not build .*install a C\\+\\+ compiler"):
        tiny_engine("llama", fast_layers=True)
