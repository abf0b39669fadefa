"""Names to the things a run is built from (estimators, backends, rollout engines, datasets), filled by a decorator:
one class, so that every unknown name gets the same one-line message."""

from __future__ import annotations

import difflib
from typing import Callable, TypeVar

T = TypeVar("T")

#: The module name a plugin given as a .py file is imported under (``nemo_jq.config.import_plugins``), its file's.
PLUGIN_MODULE_PREFIX = "nemo_jq_plugin_"


class Registry(dict):
    """A name -> object mapping; ``register(name)`` decorates the object, and a second one under a name is refused, as
    is a ``reserved`` name (one the code handles itself, outside the registry). The same definition run again (a
    notebook's cell, a reloaded module: the same module and qualified name) replaces the first."""

    def __init__(self, what: str, reserved: tuple[str, ...] = ()):
        super().__init__()
        self.what, self.reserved = what, reserved

    def register(self, name: str) -> Callable[[T], T]:
        def decorate(obj: T) -> T:
            if name in self.reserved or (name in self and not _same_definition(self[name], obj)):
                first = "built in" if name in self.reserved else _defined_in(self[name])
                raise ValueError(f"{self.what} {name!r} is already registered ({first}): register it under another name")
            self[name] = obj
            return obj

        return decorate

    def lookup(self, name: str, where: str) -> T:
        """The object registered as ``name``; else a one-line ``ConfigError`` from ``where`` (a config key or option)."""
        from nemo_jq.typed import ConfigError

        if name not in self:
            raise ConfigError(f"{where}: {self.unknown(name)}")
        return self[name]

    def unknown(self, name: str) -> str:
        """The one-line message for a name nobody registered: the known ones, and the closest."""
        close = difflib.get_close_matches(str(name), list(self), n=1)
        return f"unknown {self.what} {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "") + f"; known: {', '.join(sorted(self))}"


def _defined_in(thing: object) -> str:
    """Where a registered object was defined, in words: ``built in`` (nemo_jq's own), else ``by FILE`` (a plugin's)."""
    import sys

    module = getattr(getattr(thing, "fn", thing), "__module__", None) or ""
    if module == "nemo_jq" or module.startswith("nemo_jq."):
        return "built in"
    return f"by {getattr(sys.modules.get(module), '__file__', None) or module or 'an earlier definition'}"


def _same_definition(registered: object, obj: object) -> bool:
    """Whether ``obj`` is ``registered`` defined again: the same module and qualified name (of the function a spec
    wraps, its ``fn``, where it has one)."""
    def place(thing: object) -> tuple:
        target = getattr(thing, "fn", thing)
        return getattr(target, "__module__", None), getattr(target, "__qualname__", None)

    return place(registered)[1] is not None and place(registered) == place(obj)
