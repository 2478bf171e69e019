"""What measuring a machine reads of a running engine (the latency profile, the levels plane, a level's agreement and
cost): a protocol `casspec.runtime.engine.Engine` satisfies, so that the modules that measure (autoprofile.py,
profile.py, plane.py, levels_report.py) import no engine, and the engine can call them on itself."""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from dsia.kvcache import KVCache
from dsia.levels import LevelRegistry
from dsia.model import Transformer


def dtype_name(engine: EngineView) -> str:
    """The engine's dtype as keys and reports name it: "float32", "bfloat16"."""
    return str(engine.dtype).removeprefix("torch.")


class EngineView(Protocol):
    name: str  # the checkpoint's name
    build: str  # what its forwards' time depends on besides machine, model and dtype (kernels, loops)
    model: Transformer  # the target
    cache: KVCache  # its KV cache (the committed prefix, then scratch)
    levels: LevelRegistry  # its draft levels, built on first use
    eos_ids: frozenset[int]  # tokens that end a generation
    tokenizer: object | None  # its tokenizer (None: token ids only)

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def encode(self, prompt: str, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt (through the chat template where the tokenizer has one)."""
        ...

    def extend_prefix(self, ids: Sequence[int]) -> torch.Tensor:
        """Commit the target's KV for ids[cache.length:] in one forward; the last token's logits [1, V]."""
        ...

    def forget_prefix(self) -> None:
        """The next generation prefills its whole prompt."""
        ...
