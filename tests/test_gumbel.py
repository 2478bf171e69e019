"""Position-owned Gumbel noise (dsia/csrc/gumbel.cpp, dytc.verify.gumbel_noise / Noise): each token's value a pure
function of (seed, position, token), the same bits alone as in its row and on every thread count; the documented
draw (SplitMix64's output function over a counter, then -log(-log u)) within float64's last bits of numpy's logs;
standard Gumbel in distribution and independent between positions; bad arguments one clear error."""
import numpy as np
import pytest
import torch

from dsia.cxx import build_error
from dytc.verify import Noise, gumbel_noise

pytestmark = pytest.mark.skipif(build_error() is not None, reason=f"the C++ ops did not build: {build_error()}")

V = 49152


def reference(seed: int, position: int, vocab: int) -> np.ndarray:
    """The draw gumbel.cpp documents, with numpy's log."""
    golden = np.uint64(0x9E3779B97F4A7C15)

    def mix(z):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    with np.errstate(over="ignore"):
        stream = mix(mix(np.array([seed], dtype=np.uint64)) + np.uint64(position) * golden)
        r = mix(stream + np.arange(1, vocab + 1, dtype=np.uint64) * golden)
    u = ((r >> np.uint64(12)).astype(np.float64) + 0.5) * 2.0 ** -52
    return -np.log(-np.log(u))


@pytest.mark.parametrize("seed, position", [(0, 0), (7, 11), (2**62 + 5, 123456)])
def test_the_draw_is_the_documented_one(seed, position):
    row = gumbel_noise(seed, position, V)
    assert row.dtype == torch.float64 and row.shape == (V,)
    assert np.allclose(row.numpy(), reference(seed, position, V), rtol=4e-15, atol=4e-15)


def test_a_token_is_the_same_bits_alone_in_a_row_and_on_one_thread():
    row = gumbel_noise(3, 99, V)
    picks = torch.tensor([V - 1, 0, 5, 5, 1234, 77, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3, 40000])
    assert torch.equal(gumbel_noise(3, 99, V, picks), row[picks])
    assert torch.equal(gumbel_noise(3, 99, V, picks[::2]), row[picks[::2]])  # (a strided view)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gumbel_noise(3, 99, V), row)
    finally:
        torch.set_num_threads(threads)
    assert gumbel_noise(3, 99, V, torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_it_is_standard_gumbel_and_positions_are_independent():
    rows = torch.stack([gumbel_noise(5, p, 8192) for p in range(8)])  # [8, 8192]
    u = np.sort(torch.exp(-torch.exp(-rows)).flatten().numpy())  # the uniforms back
    n = len(u)
    ks = max(np.abs(u - np.arange(1, n + 1) / n).max(), np.abs(u - np.arange(n) / n).max())  # Kolmogorov-Smirnov's D
    assert ks < 1.95 / np.sqrt(n)  # (its p-value above 0.001)
    corr = np.corrcoef(rows.numpy())
    assert np.abs(corr[np.triu_indices(8, 1)]).max() < 0.05  # (8192 pairs: |r| ~ 0.011 at one sigma)
    assert not torch.equal(gumbel_noise(5, 0, 64), gumbel_noise(6, 0, 64))


def test_noise_reads_a_few_tokens_alone_or_from_a_row_it_drew():
    noise = Noise(4, V)
    picks = torch.tensor([3, 30000, 17])
    few = noise(10, picks)
    assert noise._rows == {}  # (a few tokens drawn on their own)
    row = noise(10)
    assert torch.equal(noise(10, picks), few) and torch.equal(row[picks], few)
    noise.forget_before(11)
    assert noise._rows == {}


@pytest.mark.parametrize("position, tokens, vocab, message", [
    (0, None, 0, "at least one token"),
    (-1, None, 10, "a position >= 0"),
    (0, torch.tensor([0, 10]), 10, "tokens must lie in 0..9, got 10"),
    (0, torch.tensor([-1]), 10, "tokens must lie in 0..9, got -1"),
    (0, torch.tensor([[1]]), 10, "1 dims expected"),
    (0, torch.tensor([1.0]), 10, "Long expected"),
])
def test_bad_arguments_are_one_clear_error(position, tokens, vocab, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.casspec.gumbel(0, position, tokens, vocab)
