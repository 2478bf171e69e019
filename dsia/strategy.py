"""The interface of a draft strategy, and the resources levels share.

A strategy is one acceleration a level name can switch on (`int4`, `skip0.4`, `exit24`, ...). It comes in two
halves: a `Strategy`, a frozen dataclass of its parameters that parses and names its part of a level name, and
a `Switch`, the strategy bound to a model (its kernels and whatever it learns per prompt), which adds its
switches to the level's Plan. Strategies are registered in one tuple in dsia/levels.py; nothing else needs
editing to add one.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import ClassVar, Protocol, TypeVar

from torch import Tensor

from .kvcache import KVCache
from .model import Transformer
from .plan import Plan

T = TypeVar("T")


class HasBytes(Protocol):
    @property
    def nbytes(self) -> int: ...


class Codec(Protocol[T]):
    """How a shared resource is kept on disk: its tensors plus a JSON-able layout (e.g. quant.QuantCodec)."""

    @property
    def name(self) -> str:
        """What the resource depends on besides the model's weights, as a file-name-safe string."""
        ...

    def encode(self, obj: T) -> tuple[dict[str, Tensor], dict]: ...

    def decode(self, tensors: dict[str, Tensor], layout: dict) -> T: ...


class Store(Protocol):
    """Where built resources outlive the process (casspec keeps them in its user cache, beside the weights)."""

    def fetch(self, codec: Codec[T], build: Callable[[], T]) -> T:
        """The stored resource of `codec.name`, or `build()`'s result, stored for the next process."""
        ...

    def discard(self, codec: Codec) -> None:
        """Remove the stored resource of `codec.name` (no level uses it: its bytes are not kept)."""
        ...


class Resources:
    """What levels share, built once per model (e.g. one quantized copy per kind serves every level mixing it)."""

    def __init__(self, model: Transformer, store: Store | None = None) -> None:
        self.model = model
        self.store = store  # None: everything is built in memory, every process
        self.built: dict[Hashable, object] = {}  # key -> the object its builder returned
        self.codecs: dict[Hashable, Codec] = {}  # key -> the codec it was stored with (stored resources only)

    def get(self, key: Hashable, build: Callable[[Transformer], T], codec: Codec[T] | None = None) -> T:
        """The object under `key`, built by `build(model)` on first use; with a codec and a store, built once
        per machine and read back by later processes."""
        if key not in self.built:
            if codec is not None and self.store is not None:
                self.built[key] = self.store.fetch(codec, lambda: build(self.model))
                self.codecs[key] = codec
            else:
                self.built[key] = build(self.model)
        return self.built[key]  # type: ignore[return-value]

    def keep_only(self, objects: set[int]) -> None:
        """Forget every built object whose id is not in `objects`, and remove its stored copy."""
        for key in [k for k, o in self.built.items() if id(o) not in objects]:
            del self.built[key]
            codec = self.codecs.pop(key, None)
            if codec is not None and self.store is not None:
                self.store.discard(codec)


class Switch:
    """A strategy bound to a model. The defaults switch nothing, learn nothing and hold nothing."""

    def extend(self, plan: Plan) -> Plan:
        """`plan` with this strategy's switches added (a new Plan; the given one is not modified)."""
        return plan

    def begin(self, model: Transformer, cache: KVCache, history: list[int]) -> None:
        """A new prompt: history[:cache.length] is committed (its KV in the cache), history[-1] the root."""

    def observe(self, model: Transformer, cache: KVCache, history: list[int], emitted: list[int]) -> None:
        """After a step: `emitted` are the newly committed tokens."""

    @property
    def searching(self) -> bool:
        """Whether `step` still has evaluations to run (an on-the-fly search of this strategy's switches)."""
        return False

    def step(self, model: Transformer, cache: KVCache, history: list[int], others: Plan) -> None:
        """One search evaluation, scored with `others`: the plan of the level's other switches."""

    @property
    def holds(self) -> tuple[HasBytes, ...]:
        """The memory this switch holds beyond the target's weights (shared objects are the same object)."""
        return ()

    @property
    def writes_all_layers(self) -> bool:
        """Whether a forward under its switches still writes the KV of every layer."""
        return True


class Strategy:
    """A strategy's parameters; subclasses are frozen dataclasses (validated in __post_init__, CasspecError)."""

    FORMS: ClassVar[tuple[str, ...]] = ()  # its name forms as the unknown-level error lists them, e.g. "exitL (...)"
    KEY: ClassVar[str] = ""  # what its part sets, for "<KEY> is given twice"

    @classmethod
    def parse(cls, part: str) -> Strategy | None:
        """The strategy one name part spells; None when the part is not of its form (CasspecError saying why when
        it is, but a value is out of range)."""
        raise NotImplementedError

    @property
    def name(self) -> str:
        """Its canonical name part (parse(name) gives it back)."""
        raise NotImplementedError

    def check(self, model: Transformer) -> None:
        """Raise CasspecError (saying why) if it cannot run on this model."""

    def bind(self, resources: Resources) -> Switch:
        """Its runtime part for resources.model, built from (and sharing) `resources`."""
        raise NotImplementedError
