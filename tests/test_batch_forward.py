"""Several sequences' forwards as one (dsia/model.py Transformer.forward_batch, csrc Stack::run_batch): every
sequence's logits and the KV it writes are those of its forward alone, bit for bit, whatever the sequences beside
it (casspec's own attention and products, in the one-region step, the ATen loop and the Python loop; a GGUF target
as stored), and a batch's bad shapes are one clear error."""
import copy
import random

import pytest
import torch

from dsia.cxx import build_error
from dsia.errors import CasspecError
from dsia.fastloop import Stacks
from dsia.model import BatchItem
from dsia.plan import TARGET
from dytc.tree import ancestor_mask, position_ids
from tiny import tiny_engine, tiny_gguf

pytestmark = pytest.mark.skipif(build_error() is not None, reason=f"the C++ layer loop did not build: {build_error()}")


def random_tree(rng: random.Random, n: int) -> list[int]:
    """Parents of an n-node tree (node 0 the root)."""
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def sequences(model, rng: random.Random, count: int) -> list[tuple]:
    """`count` caches, each with a random prompt prefilled, and a random tree (tokens, parents) to verify on it."""
    out = []
    for _ in range(count):
        cache = model.new_cache(64)
        prompt = [rng.randrange(3, 90) for _ in range(rng.randrange(1, 20))]
        model.forward(cache, torch.tensor(prompt), torch.arange(len(prompt)), 0)
        cache.commit(list(range(len(prompt))))
        n = rng.choice([1, 1, 2, 5, 9])
        parents = random_tree(rng, n)
        out.append((cache, [rng.randrange(3, 90) for _ in range(n)], parents))
    return out


def item(model, cache, tokens, parents) -> BatchItem:
    chain = all(p == i - 1 for i, p in enumerate(parents))
    return BatchItem(cache, torch.tensor(tokens), position_ids(parents, cache.length, model.device), cache.length,
                     None if chain else ancestor_mask(parents, model.device))


def alone(model, cache, tokens, parents) -> torch.Tensor:
    it = item(model, cache, tokens, parents)
    return model.forward(cache, it.tokens, it.positions, it.start, it.scratch_mask)


def assert_batch_is_alone(model, seed: int, count: int) -> None:
    rng = random.Random(seed)
    seqs = sequences(model, rng, count)
    copies = [(copy.deepcopy(c), t, p) for c, t, p in seqs]
    singles = [alone(model, c, t, p) for c, t, p in copies]
    batched = model.forward_batch([item(model, c, t, p) for c, t, p in seqs])
    for (c, t, _), (c1, _, _), a, b in zip(seqs, copies, singles, batched):
        assert torch.equal(a, b)
        end = c.length + len(t)
        assert torch.equal(c.k[:, :, :end], c1.k[:, :, :end]) and torch.equal(c.v[:, :, :end], c1.v[:, :, :end])


@pytest.mark.parametrize("loop", ["one-region", "aten", "python"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_batch_gives_each_sequence_its_bits_alone(loop, seed):
    """Dense targets on casspec's kernel (row-invariant by construction), 2 to 4 sequences of random prompts and
    trees: float32 in one parallel region; bfloat16 Qwen2 (its biases keep the ATen loop); the Python loop."""
    arch, dtype = ("qwen2", torch.bfloat16) if loop == "aten" else ("llama", torch.float32)
    eng = tiny_engine(arch, seed=seed, kernels="casspec", dtype=dtype)
    model = eng.model.with_stacks(Stacks() if loop != "python" else None)
    if model.stacks is not None:
        assert model.stacks.get(model, TARGET).one_region == (loop == "one-region")
    assert_batch_is_alone(model, seed, count=2 + seed)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_native_targets_batch_is_each_sequence_alone(tmp_path, qtype):
    """A GGUF target run as stored: batch-invariant products and attention, in one parallel region; 1 to 4 sequences
    of random prompts and trees, on one thread and on two."""
    from casspec.runtime.engine import Engine

    path = tiny_gguf(tmp_path / f"t-{qtype}.gguf", dim=64, heads=4, kv_heads=1, qtype=qtype, pad_vocab=13)
    try:
        eng = Engine.from_pretrained(str(path), weights="native", autoprofile=False, keep_state=False)
    except CasspecError as e:
        pytest.skip(f"no native target on this machine: {e}")
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for seed in range(4):
                assert_batch_is_alone(eng.model, seed, count=1 + seed)
    finally:
        torch.set_num_threads(threads)


def test_a_bfloat16_batch_is_each_sequence_alone():
    eng = tiny_engine("llama", seed=3, kernels="casspec", dtype=torch.bfloat16, batch_invariant=True)
    assert_batch_is_alone(eng.model, 5, count=3)


def test_a_batch_past_a_window_is_one_error():
    eng = tiny_engine("llama", seed=0, kernels="casspec")
    cache = eng.model.new_cache(8)
    with pytest.raises(CasspecError, match="context window full"):
        eng.model.forward_batch([BatchItem(cache, torch.arange(3, 12), torch.arange(9), 0)])


def test_the_stacks_batch_checks_its_shapes():
    eng = tiny_engine("llama", seed=0, kernels="casspec")
    model = eng.model.with_stacks(Stacks())
    stack = model.stacks.get(model, TARGET).stack
    cache = model.new_cache(16)
    cache.zero_all()
    x = torch.zeros(3, model.norm.shape[0])
    cos, sin = model.cos[:3], model.sin[:3]
    with pytest.raises(RuntimeError, match="rows"):  # rows that do not add up to x's
        stack.run_batch(x, 3, [cache.k], [cache.v], cos, sin, [2], [0], [2], [None])
    with pytest.raises(RuntimeError, match="within the cache"):  # slots past the cache
        stack.run_batch(x, 3, [cache.k], [cache.v], cos, sin, [3], [15], [18], [None])
    with pytest.raises(RuntimeError, match="mask"):
        stack.run_batch(x, 3, [cache.k], [cache.v], cos, sin, [3], [0], [3], [torch.ones(2, 3, dtype=torch.bool)])
