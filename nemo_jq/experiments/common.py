"""What the experiments share: their run folders' names, and the checks of their options and overrides that must pass
before anything is written or trained (a run that fails halfway leaves a half-built experiment)."""

from __future__ import annotations

from typing import Any, Sequence

from nemo_jq.config import ConfigError, current_key
from nemo_jq.runtime.sweep import refuse_repeats
from nemo_jq.strict_yaml import parse_yaml

#: The keys every experiment sets for each run itself, after the user's overrides: key -> (what sets it, the option to
#: use instead, None where there is none). An override of one would be ignored, yet recorded among the settings.
PER_RUN = {"objective.name": ("per method", "--methods"), "objective.q": ("per method", "--methods"),
           "objective.q_schedule": ("per method", "--methods"), "train.seed": ("per seed", "--seeds"),
           "train.run_dir": ("per run, in a folder under --out", "--out")}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in ".=" else "_" for c in name).strip("_")


def chosen_methods(plan: dict[str, list[str]], only: Sequence[str]) -> dict[str, list[str]]:
    """The methods of ``plan`` that ``only`` (``--methods``) names, in the plan's order; all of them if it names none."""
    refuse_repeats("--methods", only)
    unknown = sorted(set(only) - set(plan))
    if unknown:
        raise ConfigError(f"--methods: unknown method(s) {', '.join(map(repr, unknown))}; choose from {', '.join(map(repr, plan))}")
    return {name: overrides for name, overrides in plan.items() if not only or name in only}


def refuse_per_run_keys(experiment: str, overrides: Sequence[str], per_run: dict[str, tuple[str, str | None]],
                        given_as: str = "override") -> None:
    """An override that sets a key of ``per_run`` (:data:`PER_RUN` and the experiment's own), itself or inside a
    section's mapping (``train={seed: 3}``), is refused: each run would set that key over it."""
    for item in overrides:
        key, _, value = item.partition("=")
        try:
            parsed = parse_yaml(value, f"override {item!r}")
        except ConfigError:  # load_config refuses it, with its own advice
            parsed = None
        for given in keys_set(current_key(key), parsed):
            for controlled, (source, option) in per_run.items():
                if given == controlled or given.startswith(f"{controlled}."):
                    raise ConfigError(f"{given_as} {item}: experiment {experiment} sets {controlled} {source}: "
                                      + (f"use {option} instead" if option else "drop it"))


def keys_set(key: str, value: Any) -> list[str]:
    """The dotted keys an override of ``key`` with ``value`` sets: a section's mapping sets each key in it."""
    if isinstance(value, dict):
        return [leaf for name, inner in value.items() for leaf in keys_set(f"{key}.{name}", inner)]
    return [key]
