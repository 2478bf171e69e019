"""Every instruction-set path of casspec's C++ ops gives the bits of every other, end to end: whole forwards run in
child processes held to the plain path (CASSPEC_ISA=plain) and to AVX2 give this machine's widest path's logits bit
for bit (a child with the variable unset), for a float32 target, a batch-invariant bfloat16 one, and GGUF blocks as
stored. Every child runs torch's own kernels alike (its CPU dispatch is left as it is), so a difference is
casspec's. This is the plain-path run of the suite on every machine, CI's included."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsia.cxx import build_error

pytestmark = pytest.mark.skipif(build_error() is not None, reason=f"the C++ library did not build: {build_error()}")

HERE = Path(__file__).parent
PROMPT = [5, 9, 17, 23, 4, 8, 31, 12, 40, 3, 77, 6]
TREE = [-1, 0, 0, 1, 2, 2, 4]  # a verification's parents


@torch.inference_mode()
def outputs() -> dict[str, torch.Tensor]:
    """Logits of a prefill, a tree's verification and one-token steps of tiny float32 and bfloat16 targets on
    casspec's products and ops, block products of every GGUF kind and of the int3 / int2 levels' over 1-9 rows, the
    MLP's silu(gate) * up, and attention over heads of 64 and 128 floats."""
    from dsia.blockq import FORMATS, BlockLinear, q2_blocks, q3_blocks
    from test_blockq import random_blocks
    from dytc.tree import ancestor_mask, position_ids
    from tiny import tiny_engine

    out: dict[str, torch.Tensor] = {}
    for dtype in (torch.float32, torch.bfloat16):
        e = tiny_engine("llama", 2, dtype=dtype, kernels="casspec", batch_invariant=dtype == torch.bfloat16)
        m, cache, L = e.model, e.cache, len(PROMPT)
        out[f"{dtype} prefill"] = m.forward(cache, torch.tensor(PROMPT), torch.arange(L), 0)
        cache.commit(list(range(L)))
        tokens = torch.tensor([3, 14, 15, 92, 65, 35, 89])
        out[f"{dtype} tree"] = m.forward(cache, tokens, position_ids(TREE, L, m.device), L, ancestor_mask(TREE))
        steps = []
        for tok in (3, 14, 15, 92):
            steps.append(m.forward(cache, torch.tensor([tok]), torch.tensor([cache.length]), cache.length))
            cache.commit([0])
        out[f"{dtype} steps"] = torch.cat(steps)
    gen = torch.Generator().manual_seed(0)
    for kind, fmt in FORMATS.items():  # (every GGUF block format, over 1-9 rows)
        w = random_blocks(fmt, 40, 512, gen)
        k = BlockLinear(w["u"], fmt, w["D"], w["Dm"], w["a"], w["b"])
        out[f"blocks {kind}"] = torch.cat([k(torch.randn(T, 512, generator=gen)) for T in range(1, 10)])
    edge = []  # activations' blocks at the edges of their quantization (all zero, subnormal, huge, one huge value
    # among small ones) in rows of 3, 7, 19 and 32 blocks (AVX-512 quantizes up to 16 at once, a short run alone)
    for blocks in (3, 7, 19, 32):
        w = random_blocks(FORMATS["Q4_1"], 24, 32 * blocks, gen)
        k = BlockLinear(w["u"], FORMATS["Q4_1"], w["D"], w["Dm"], w["a"], w["b"])
        x = torch.randn(4, 32 * blocks, generator=gen) * 3
        x[0, :32], x[1, 32:64], x[2, 64:96] = 0.0, 1e-41, 1e33
        x[3, :32] = 1e-3
        x[3, 5] = -5e3
        edge.append(k(x))
    out["blocks edge"] = torch.cat(edge, dim=1)
    for name, make in (("int3", q3_blocks), ("int2", q2_blocks)):  # (formats of no GGUF type: read at run time)
        k = make(torch.randn(40, 576, generator=gen) * 0.05)
        out[f"blocks {name}"] = torch.cat([k(torch.randn(T, 576, generator=gen)) for T in range(1, 10)])
    for hd in (64, 128):  # (heads of 64 and 128 floats: AVX-512 scores a block of 16 keys a row sees at once; 3
        # rows x 3 heads a key at a time, 8 rows x 3 heads each block dimension-major, ops.h kByDimHeads)
        keys, values = torch.randn(2, 60, hd, generator=gen), torch.randn(2, 60, hd, generator=gen)
        runs = []
        for T in (3, 8):
            q = torch.randn(6, T, hd, generator=gen)
            mask = torch.rand(T, 50, generator=gen) < 0.7
            mask[:, :20] = True  # (a first block seen whole, then blocks seen in part)
            runs += [torch.ops.casspec.attention(q, keys, values, 50, m, hd ** -0.5) for m in (None, mask)]
        out[f"attention {hd}"] = torch.cat(runs)
    edge = torch.tensor([-100.0, -88.0, -20.0, 0.0, 1e-30, 20.0, 88.0, 100.0, -1e-3])  # e^-|g| under and at 1
    g = torch.cat((torch.randn(3, 37, generator=gen) * 4, edge.repeat(3, 1)), dim=1)  # [3, 46]: a tail past 32
    out["silu_mul"] = torch.ops.casspec.silu_mul(g, torch.randn(3, 46, generator=gen))
    x = torch.randn(3, 1000, generator=gen) * 5  # a row's top k and log-sum-exp: blocks of 64 and a tail
    values, indices, lse = torch.ops.casspec.row_top_lse(x, 9, 0.7)
    out["row_top_lse"] = torch.cat([values, indices.float(), lse[:, None]], dim=1)
    out["gumbel"] = torch.cat([torch.ops.casspec.gumbel(3, 17, None, 1001),  # a whole row (a tail past 8 lanes)
                               torch.ops.casspec.gumbel(3, 17, torch.tensor([1000, 0, 5, 77, 12]), 1001)])
    probs, tokens, inside = torch.ops.casspec.coupled_top(x, 0.7, 0, 0.9, 5, torch.tensor([4, 9, 2]), 3, 40)
    out["coupled_top"] = torch.cat([probs, tokens.float(), inside[:, None].float()], dim=1)
    return out


def start_child(tmp_path: Path, isa: str | None) -> tuple[subprocess.Popen, Path, Path]:
    env = {k: v for k, v in os.environ.items() if k != "CASSPEC_ISA"}
    if isa is not None:
        env["CASSPEC_ISA"] = isa
    path, err = tmp_path / f"out-{isa}.pt", tmp_path / f"err-{isa}.txt"
    code = f"import torch, test_isa; torch.save(test_isa.outputs(), {str(path)!r})"
    with open(err, "w") as sink:  # (a file, not a pipe: the children run at once, and a full pipe would stall one)
        return subprocess.Popen([sys.executable, "-c", code], cwd=HERE, env=env, stdout=subprocess.DEVNULL,
                                stderr=sink), path, err


def finish_child(child: tuple[subprocess.Popen, Path, Path]) -> dict[str, torch.Tensor]:
    proc, path, err = child
    try:
        proc.wait(timeout=300)
    finally:
        proc.kill()  # (no-op once it has exited)
    assert proc.returncode == 0, err.read_text()[-2000:]
    return torch.load(path)


def test_the_plain_and_avx2_paths_give_the_widest_paths_bits(tmp_path):
    """(On a machine without AVX-512 the avx2 child runs the widest path again; without AVX2, the plain one.) The
    three children run at once (each one's import and tiny engines cost more than its forwards)."""
    children = {isa: start_child(tmp_path, isa) for isa in (None, "avx2", "plain")}
    results = {isa: finish_child(child) for isa, child in children.items()}
    widest = results[None]
    assert len(widest) == 25
    for isa in ("avx2", "plain"):
        other = results[isa]
        assert other.keys() == widest.keys()
        for name in widest:
            assert torch.equal(widest[name], other[name]), (isa, name)


def test_a_bad_isa_name_is_one_clear_error(tmp_path):
    env = dict(os.environ, CASSPEC_ISA="sse9")
    done = subprocess.run([sys.executable, "-m", "casspec", "generate", "hi", "--max-new-tokens", "2"],
                          cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "CASSPEC_ISA=sse9" in done.stderr and "plain, avx2 or avx512" in done.stderr
