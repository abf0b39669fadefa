"""The import paths of 0.2's flat modules, kept working until 0.3 as old config keys are: ``nemo_jq.trainer`` is
``nemo_jq.recipe.trainer``, the same module object (so a patch through either name patches both), with a
``DeprecationWarning`` naming the new path. Nothing is imported until an old name is."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module (under nemo_jq) -> its home now.
MOVED = {**{name: f"recipe.{name}" for name in
            ("trainer", "components", "experience", "evaluation", "guard", "sequences", "learn", "demo")},
         "train_state": "recipe.state",
         **{name: f"runtime.{name}" for name in
            ("checkpoint", "runs", "distributed", "preemption", "monitor", "tracking", "outputs")},
         **{name: f"cluster.{name}" for name in ("plan", "launch", "doctor")},
         "chat": "data.chat", "models.backends": "backends"}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``nemo_jq.<old>`` and loads it as its new module (the loader puts that one in ``sys.modules``)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("nemo_jq.") and fullname.removeprefix("nemo_jq.") in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None  # a placeholder module: exec_module swaps the real one in

    def exec_module(self, module):
        new = "nemo_jq." + MOVED[module.__name__.removeprefix("nemo_jq.")]
        warnings.warn(f"{module.__name__} moved to {new} (the old path is read until 0.3)", DeprecationWarning,
                      stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
