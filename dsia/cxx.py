"""casspec's C++ library (csrc/): the layer loop, the ops of a float32 forward's small steps, the attention and the
dense product (float32 and bfloat16: LIBRARY_DTYPES), the GGUF block product, a row's top k and log-sum-exp (drafts'
next tokens) and position-owned Gumbel noise (sampling), built once per machine with the system's C++ compiler and
cached by torch.utils.cpp_extension (torch's extension cache rebuilds it when a source changes). Where it does not
build (no compiler, no ninja), `build_error` says why, once, and every caller runs torch's own kernels instead."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sysconfig
from pathlib import Path
from typing import Iterator

import torch

from .errors import CasspecError

LIBRARY_DTYPES = (torch.float32, torch.bfloat16)  # what the library's dense product and attention take (on a CPU)
ISAS = ("plain", "avx2", "avx512")  # what the environment's CASSPEC_ISA may name: the widest path the ops run (ops.h)
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("layers.cpp", "step.cpp", "ops.cpp", "blockq.cpp", "dense.cpp", "rowtop.cpp", "gumbel.cpp",
                        "coupled.cpp")]
EXTENSION = "casspec_layers"  # the built library's name


@functools.cache
def source_digest() -> str:
    """A short digest of the library's sources (headers included): what was measured of its kernels on a machine
    (latency profiles, levels planes) is measured again when they change."""
    h = hashlib.sha256()
    for path in sorted((Path(__file__).parent / "csrc").iterdir()):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def check_isa_env() -> None:
    """A CasspecError (one line) where CASSPEC_ISA names no path the library has."""
    name = os.environ.get("CASSPEC_ISA", "")
    if name and name not in ISAS:
        raise CasspecError(f"CASSPEC_ISA={name} is not an instruction set casspec has paths for: use "
                           f"{', '.join(ISAS[:-1])} or {ISAS[-1]}, or unset it")


@contextlib.contextmanager
def own_ninja_first() -> Iterator[None]:
    """PATH with this interpreter's scripts folder first while the library builds, where the ninja casspec depends on
    was installed there: torch runs `ninja` from PATH, and two ninjas of other versions (a venv's, run activated; the
    system's, run through the venv's python alone) each took the other's build log for a stale one and rebuilt the
    whole library (20 s on a 2-core AMD EPYC) at every switch."""
    scripts, before = sysconfig.get_path("scripts"), os.environ.get("PATH")
    if not scripts or shutil.which("ninja", path=scripts) is None:
        yield
        return
    os.environ["PATH"] = os.pathsep.join([scripts, before]) if before else scripts
    try:
        yield
    finally:
        if before is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = before


@functools.cache
def build_error() -> str | None:
    """Build (or load the cached build of) the library once per process: None when torch.ops.casspec and
    torch.classes.casspec hold it, else why not. A bad CASSPEC_ISA is a CasspecError."""
    check_isa_env()
    try:
        from torch.utils.cpp_extension import load
        # -ffp-contract=off: no multiply-add is fused where the source has a product and a sum, so ops.cpp's RoPE
        # is ATen's bits and every sum the same on every machine (the dense product's fused multiply-adds are
        # written out: std::fma in its plain path); -fopenmp: at::parallel_for runs on torch's threads (its OpenMP
        # runtime, loaded first, serves the library; without the flag the loops run on one thread)
        with own_ninja_first():
            load(name=EXTENSION, sources=[str(s) for s in SOURCES],
                 extra_cflags=["-O2", "-ffp-contract=off", "-Wno-psabi", "-fopenmp"], extra_ldflags=["-fopenmp"],
                 is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja, a header mismatch: torch's kernels are the same computation
        first = str(e).strip().splitlines()
        return f"{type(e).__name__}: {first[0] if first else ''}"
    return None


def built() -> bool:
    """Whether a build of the library lies in torch's extension cache (False: the first use builds it)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
        return (Path(_get_build_directory(EXTENSION, False)) / f"{EXTENSION}.so").is_file()
    except Exception:  # (a private helper of torch's: where it is gone, nothing is said before a build)
        return True
