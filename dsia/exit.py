"""Early exit: `exitL` runs only the first L layers, then the final norm and the target's own head.

The layers after L write no KV, so another level cannot read the scratch KV an exit level wrote.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import ClassVar

from .errors import CasspecError
from .model import Transformer
from .plan import Plan
from .strategy import Resources, Strategy, Switch

_FORM = re.compile(r"^exit(\d+)$")


@dataclass(frozen=True)
class Exit(Strategy):
    after: int  # layers run before the head (1 <= after < the model's layers)

    FORMS: ClassVar[tuple[str, ...]] = ("exitL (1 <= L < layers)",)
    KEY: ClassVar[str] = "exit_after"

    def __post_init__(self) -> None:
        if self.after < 1:
            raise CasspecError("exit after at least one layer")

    @classmethod
    def parse(cls, part: str) -> Exit | None:
        m = _FORM.match(part)
        return cls(int(m.group(1))) if m else None

    @property
    def name(self) -> str:
        return f"exit{self.after}"

    def check(self, model: Transformer) -> None:
        if not self.after < model.spec.n_layers:
            raise CasspecError(f"exit layer must be in [1, {model.spec.n_layers - 1}] for this model")

    def bind(self, resources: Resources) -> Switch:
        return ExitSwitch(self.after)


class ExitSwitch(Switch):
    def __init__(self, after: int) -> None:
        self.after = after

    def extend(self, plan: Plan) -> Plan:
        return dataclasses.replace(plan, exit_after=self.after)

    @property
    def writes_all_layers(self) -> bool:
        return False
