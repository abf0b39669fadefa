"""Names to the things a run is built from (backends, rollout engines, datasets), filled by a decorator."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


class Registry(dict):
    """A name -> object mapping; ``register(name)`` decorates the object, and a second one under a name is refused."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def register(self, name: str) -> Callable[[T], T]:
        def decorate(obj: T) -> T:
            if name in self:
                raise ValueError(f"{self.what} {name!r} is already registered")
            self[name] = obj
            return obj

        return decorate
