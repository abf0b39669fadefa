"""Names to the things a run is built from (backends, rollout engines, datasets), filled by a decorator."""

from __future__ import annotations

import difflib
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

    def unknown(self, name: str) -> str:
        """The one-line message for a name nobody registered: the known ones, and the closest."""
        close = difflib.get_close_matches(str(name), list(self), n=1)
        return f"unknown {self.what} {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "") + f"; known: {', '.join(sorted(self))}"
