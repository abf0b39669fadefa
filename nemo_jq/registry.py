"""Names to the things a run is built from (estimators, backends, rollout engines, datasets), filled by a decorator:
one class, so that every unknown name gets the same one-line message."""

from __future__ import annotations

import contextlib
import difflib
import sys
import traceback
from pathlib import Path
from typing import Callable, Iterator, TypeVar

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


def _module_of(thing: object) -> str:
    """The module that defined ``thing`` (an instance: its class's; a spec: the function it wraps)."""
    target = getattr(thing, "fn", thing)
    return getattr(target, "__module__", None) or getattr(type(target), "__module__", None) or ""


def _built_in(thing: object) -> bool:
    module = _module_of(thing)
    return module == "nemo_jq" or module.startswith("nemo_jq.")


def _file_of(thing: object) -> str | None:
    """The file of the module that defined ``thing`` (None where it has none)."""
    return getattr(sys.modules.get(_module_of(thing)), "__file__", None)


def _defined_in(thing: object) -> str:
    """Where a registered object was defined, in words: ``built in`` (nemo_jq's own), else ``by FILE`` (a plugin's)."""
    return "built in" if _built_in(thing) else f"by {_file_of(thing) or _module_of(thing) or 'an earlier definition'}"


def plugin_of(thing: object) -> str | None:
    """The plugin that defined ``thing`` as ``--plugin`` / ``plugins=`` take it (a .py file by its absolute path, else
    its module), None for nemo_jq's own."""
    if _built_in(thing):
        return None
    module, file = _module_of(thing), _file_of(thing)
    return str(Path(file).absolute()) if module.startswith(PLUGIN_MODULE_PREFIX) and file else module


def out_of_memory(err: BaseException) -> bool:
    """A GPU's (``torch.OutOfMemoryError``) or the host's (the CPU allocator's ``RuntimeError``) memory ran out."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(err)


class PluginFailed(ValueError):
    """A plugin's own code failed as it ran: one line naming what failed and its line (``--debug``: the traceback)."""


class NotImplementing(PluginFailed, TypeError):
    """A plugin's object lacks a member of the protocol it is registered for: a ``TypeError`` naming it, said in one
    line as a plugin's failure is."""


@contextlib.contextmanager
def blamed_on_plugin(thing: object, what: str, passes: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """An error a plugin's ``thing`` raises here (not one of ``passes``, its own way of saying a row is bad) is a
    :class:`PluginFailed` naming ``what`` and the plugin's line it came from: it was a traceback, or a line naming
    neither. nemo_jq's own objects' errors, and running out of memory (its advice is the run's), are left as they are."""
    try:
        yield
    except Exception as err:
        if isinstance(err, (PluginFailed, MemoryError, *passes)) or _built_in(thing) or out_of_memory(err):
            raise
        file = _file_of(thing)
        frames = traceback.extract_tb(err.__traceback__)
        frame = next((f for f in reversed(frames) if f.filename == file), frames[-1] if frames else None)
        where = f" ({frame.filename}:{frame.lineno})" if frame else ""
        raise PluginFailed(f"{what}{where} raised {type(err).__name__}: {err}; fix it there (--debug shows the "
                           "traceback)") from err


def _same_definition(registered: object, obj: object) -> bool:
    """Whether ``obj`` is ``registered`` defined again: the same module and qualified name (of the function a spec
    wraps, its ``fn``, where it has one)."""
    def place(thing: object) -> tuple:
        target = getattr(thing, "fn", thing)
        return getattr(target, "__module__", None), getattr(target, "__qualname__", None)

    return place(registered)[1] is not None and place(registered) == place(obj)
