"""Quantized and packed level weights kept in the user cache, beside the cached copy of the weights they come from.

A level's shared copies (e.g. the int4 weights every `int4*` level runs) take about a second to build for
SmolLM2-135M on a 2-core CPU and are the same in every process, so the first process writes them to
`<weights entry>/levels/<codec name>-<key>.safetensors` (tensors plus the codec's JSON layout in the metadata)
and later ones read them back. The weights entry is the folder keyed by the checkpoint's content (a GGUF's
hash: `gguf-...`, whose rebuild removes the levels with it) or, for an HF folder, by its path, file sizes and
modification times (`hf-...`); the key adds the torch version (packed layouts are torch's), device and dtype.
Each file is written with its checksum (`<file>.sha256`, usercache.write_verified) and read back only if the bytes
read match it, then checked as safetensors (weights.parse_safetensors) before a tensor is made of them: a file that
cannot be read, or is not what was written, is built again (one line); the build holds a lock, so two processes
build it once.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, TypeVar

import torch
from safetensors.torch import save

from dsia.strategy import Codec

from ..cache.usercache import SUM_SUFFIX, digest, locked, parse_json, read_verified, remove, write_verified
from .weights import parse_safetensors

T = TypeVar("T")


class LevelStore:
    """A dsia Store over one folder of the user cache (see dsia/strategy.py)."""

    def __init__(self, folder: Path, model_dtype: torch.dtype, device: torch.device) -> None:
        self.folder = folder
        self.key = digest({"torch": torch.__version__, "dtype": str(model_dtype), "device": device.type})

    def path(self, codec: Codec) -> Path:
        return self.folder / f"{codec.name}-{self.key}.safetensors"

    def fetch(self, codec: Codec[T], build: Callable[[], T]) -> T:
        path = self.path(codec)
        obj = _read(path, codec)
        if obj is not None:
            return obj
        with locked(path):
            obj = _read(path, codec)  # another process may have built it while this one waited
            if obj is None:
                obj = build()
                tensors, layout = codec.encode(obj)
                write_verified(path, save(tensors, metadata={"layout": json.dumps(layout)}))
        return obj


    def discard(self, codec: Codec) -> None:
        """Remove the stored copy of `codec` and its checksum (no chosen level uses it)."""
        path = self.path(codec)
        with locked(path):
            for p in (path, path.with_name(path.name + SUM_SUFFIX)):
                remove(p)


def _read(path: Path, codec: Codec[T]) -> T | None:
    """The stored object; None when there is none or it cannot be read (it is then built again)."""
    try:
        data = read_verified(path)
        tensors, meta = parse_safetensors(torch.frombuffer(data, dtype=torch.uint8), str(path))
        # copies in torch's own (64-byte aligned) memory: the packed kernels' vector loads fault on a tensor at an
        # arbitrary offset of a buffer
        return codec.decode({k: v.clone() for k, v in tensors.items()}, parse_json(meta["layout"], str(path)))
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a cache file is only a shortcut: any failure means building it again
        print(f"casspec: ignoring the unreadable level cache {path} ({type(e).__name__}); rebuilding it",
              file=sys.stderr)
        return None
