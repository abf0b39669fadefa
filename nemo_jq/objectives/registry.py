"""Estimators by name, with one fixed signature, in the style of verl's ``@register_policy_loss``.

Every registered estimator is ``fn(inputs: EstimatorInputs, options) -> ObjectiveOutput`` and declares
the inputs it needs (:class:`Need`), whether it takes ``q``, the fewest samples per prompt it accepts,
and an ``options`` dataclass: the keys a user may set under ``objective.options``, each typed and
ranged, checked when the config loads. A trainer builds only the rollouts the estimator needs and
rejects an impossible config before any rollout. The pure functions (:func:`~nemo_jq.objectives.garl`,
...) stay callable on plain tensors from any training loop.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from nemo_jq.objectives.inputs import EstimatorInputs
from nemo_jq.objectives.interfaces import Need, ObjectiveOutput
from nemo_jq.registry import Registry
from nemo_jq.typed import ConfigError, build, check_defaults


@dataclass(frozen=True)
class NoOptions:
    """For estimators without options."""


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    fn: Callable[[EstimatorInputs, Any], ObjectiveOutput]
    needs: frozenset[Need]
    uses_q: bool
    min_samples: int
    options: type = NoOptions
    #: Whether it corrects rollouts sampled by another policy (``EstimatorInputs.off_policy``): a trainer refuses
    #: an explicit ``objective.importance`` for one that does not.
    corrects_off_policy: bool = False

    def parse_options(self, raw: Mapping[str, Any] | None, where: str = "objective.options") -> Any:
        """``raw`` (a mapping from the config) as this estimator's options dataclass; a one-line
        :class:`ConfigError` names an unknown key, an input the trainer supplies, or a bad value."""
        raw = dict(raw or {})
        supplied = {f.name for f in dataclasses.fields(EstimatorInputs)} | {
            "rationale_logprob", "answer_logprob", "sequence_logprob", "logprob", "mask", "old_logprob"}
        known = [f.name for f in dataclasses.fields(self.options)]
        for key in raw:
            if key in supplied and key not in known:
                raise ConfigError(f"{where}.{key}: '{key}' is an input the trainer supplies to {self.name!r}, not an "
                                  f"option; {self.name!r} takes {', '.join(known) or 'no options'}")
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ConfigError(f"{where}.{key} is not an option of {self.name!r} (its options: "
                                  f"{', '.join(known) or 'none'}){hint}")
        return build(self.options, raw, f"{where}.")

    def __call__(self, inputs: EstimatorInputs, options: Any = None) -> ObjectiveOutput:
        return self.fn(inputs, self.options() if options is None else options)


_REGISTRY: Registry = Registry("objective")


def register_objective(name: str, *, needs: set[Need], uses_q: bool, min_samples: int = 1, options: type = NoOptions,
                       corrects_off_policy: bool = False):
    """Decorator adding ``fn(inputs, options)`` to the registry under ``name``: what a trainer needs to produce for it
    (``needs``: one :class:`Need`), and the least samples a prompt it takes, checked here, where a plugin registers
    it (a wrong one trained on inputs of another kind, or failed at its first step)."""

    def decorate(fn: Callable[[EstimatorInputs, Any], ObjectiveOutput]) -> Callable[[EstimatorInputs, Any], ObjectiveOutput]:
        if not dataclasses.is_dataclass(options):
            raise TypeError(f"objective {name!r}: options must be a dataclass; got {options!r}")
        if len(needs) != 1 or not all(isinstance(need, Need) for need in needs):
            raise TypeError(f"objective {name!r}: needs must be one of {', '.join(f'Need.{need.name}' for need in Need)} "
                            f"(what the trainer produces for it), in a set; got {needs!r}")
        if not isinstance(min_samples, int) or min_samples < 1:
            raise TypeError(f"objective {name!r}: min_samples must be a whole number >= 1; got {min_samples!r}")
        if not name.isidentifier():
            raise TypeError(f"objective {name!r}: its name is a config value (objective.name): letters, digits and _")
        try:
            check_defaults(options, "options.")
        except ConfigError as err:
            raise TypeError(f"objective {name!r}: the default of {err}") from None
        _REGISTRY.register(name)(ObjectiveSpec(name, fn, frozenset(needs), uses_q, min_samples, options, corrects_off_policy))
        return fn

    return decorate


def get_objective(name: str) -> ObjectiveSpec:
    """The registered estimator called ``name``; an unknown name lists the known ones."""
    if name not in _REGISTRY:
        raise KeyError(_REGISTRY.unknown(name))
    return _REGISTRY[name]


def list_objectives() -> list[str]:
    return sorted(_REGISTRY)
