"""The ``Stateful`` protocol: values with ``state_dict``/``load_state_dict`` that save and load call for you."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = ["Stateful", "StatefulT"]


@runtime_checkable
class Stateful(Protocol):
    """An object that checkpoints itself: save stores ``state_dict()``; load fills it, then ``load_state_dict``."""

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ...


StatefulT = TypeVar("StatefulT", bound=Stateful)
