"""Estimators by name, in the style of verl's ``@register_adv_est``.

Each entry declares the inputs it needs (:class:`Need`), whether it takes ``q``,
and the fewest samples per prompt it accepts, so a trainer builds only what the
chosen estimator consumes and rejects an impossible config before any rollout.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable

from nemo_jq.objectives.interfaces import Need, ObjectiveOutput


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    fn: Callable[..., ObjectiveOutput]
    needs: frozenset[Need]
    uses_q: bool
    min_samples: int


_REGISTRY: dict[str, ObjectiveSpec] = {}


def register_objective(name: str, *, needs: set[Need], uses_q: bool, min_samples: int = 1):
    """Decorator adding ``fn`` to the registry under ``name``."""

    def decorate(fn: Callable[..., ObjectiveOutput]) -> Callable[..., ObjectiveOutput]:
        if name in _REGISTRY:
            raise ValueError(f"objective {name!r} is already registered")
        _REGISTRY[name] = ObjectiveSpec(name, fn, frozenset(needs), uses_q, min_samples)
        return fn

    return decorate


def get_objective(name: str) -> ObjectiveSpec:
    """The registered estimator called ``name``; an unknown name lists the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown objective {name!r}; known: {sorted(_REGISTRY)}.{hint}") from None


def list_objectives() -> list[str]:
    return sorted(_REGISTRY)
