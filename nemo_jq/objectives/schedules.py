"""Schedules for the commitment q over training steps.

A schedule is called with the step to get q, and may be told the running success
estimate log P̂ after each step (only the adaptive schedule listens). All carry a
``state_dict`` so a resumed run continues with the same q.

SFT-then-RLVR is ``StepQ(q_before=1, q_after=0, switch_step=N)``. A schedule of one's own is a dataclass registered
with :func:`register_q_schedule` (its fields the config's keys; :class:`StepOnlyQ` gives it nothing to observe and no
state); the trainer checks each q it returns.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Protocol

from nemo_jq.objectives.checks import check_q
from nemo_jq.registry import Registry, blamed_on_plugin
from nemo_jq.typed import as_float

SCHEDULES: Registry = Registry("q schedule")


def register_q_schedule(name: str):
    """Decorator adding a schedule class to :data:`SCHEDULES` under ``name`` (``objective.q_schedule: {name: ...}``):
    a dataclass whose fields are its keys (annotated ``float``, ``int`` or ``bool`` to have their values checked),
    called with the step (from 0) for q, with ``observe``, ``state_dict`` and ``load_state_dict`` (:class:`StepOnlyQ`
    for a schedule of the step alone)."""

    def decorate(cls: type) -> type:
        if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
            raise TypeError(f"q schedule {name!r}: register a dataclass (its fields are the schedule's keys); got {cls!r}")
        defined = {name for klass in cls.__mro__[:-1] for name in vars(klass)}  # object's own __call__ aside
        lacking = [method for method in ("__call__", "observe", "state_dict", "load_state_dict") if method not in defined]
        if lacking:
            raise TypeError(f"q schedule {name!r}: {cls.__name__} lacks {', '.join(lacking)} (subclass StepOnlyQ for a "
                            "schedule of the step alone)")
        return SCHEDULES.register(name)(cls)

    return decorate


class QSchedule(Protocol):
    def __call__(self, step: int) -> float: ...

    def observe(self, log_p_hat: float) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StepOnlyQ:
    """Schedules that depend on the step alone: nothing to observe, no state."""

    def observe(self, log_p_hat: float) -> None:
        del log_p_hat

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


@register_q_schedule("constant")
@dataclass
class ConstantQ(StepOnlyQ):
    q: float

    def __post_init__(self) -> None:
        self.q = check_q(self.q)

    def __call__(self, step: int) -> float:
        return self.q


@register_q_schedule("step")
@dataclass
class StepQ(StepOnlyQ):
    """``q_before`` until ``switch_step`` (exclusive), then ``q_after``."""

    switch_step: int
    q_before: float = 1.0
    q_after: float = 0.0

    def __post_init__(self) -> None:
        self.q_before, self.q_after = check_q(self.q_before, "q_before"), check_q(self.q_after, "q_after")
        if self.switch_step < 0:
            raise ValueError(f"switch_step must be >= 0 (the first step is 0); got switch_step={self.switch_step!r}")

    def __call__(self, step: int) -> float:
        return self.q_before if step < self.switch_step else self.q_after


@dataclass
class _Anneal(StepOnlyQ):
    """From ``q_start`` at the first step (0) to ``q_end`` at the last of ``num_steps`` (``num_steps - 1``; the only
    one, when ``num_steps`` is 1), then flat; subclasses shape the path."""

    num_steps: int
    q_start: float = 1.0
    q_end: float = 0.0

    def __post_init__(self) -> None:
        self.q_start, self.q_end = check_q(self.q_start, "q_start"), check_q(self.q_end, "q_end")
        if int(self.num_steps) < 1:
            raise ValueError(f"num_steps must be >= 1; got num_steps={self.num_steps!r}")

    def progress(self, step: int) -> float:
        """0 at the first step, 1 at the last scheduled one and after."""
        last = int(self.num_steps) - 1
        return 1.0 if last == 0 else min(max(step / last, 0.0), 1.0)


@register_q_schedule("linear")
@dataclass
class LinearQ(_Anneal):
    """Straight line from ``q_start`` to ``q_end``."""

    def __call__(self, step: int) -> float:
        return self.q_start + (self.q_end - self.q_start) * self.progress(step)


@register_q_schedule("cosine")
@dataclass
class CosineQ(_Anneal):
    """Half-cosine from ``q_start`` to ``q_end``: stays near ``q_start`` longer than linear."""

    def __call__(self, step: int) -> float:
        return self.q_end + (self.q_start - self.q_end) * 0.5 * (1.0 + math.cos(math.pi * self.progress(step)))


@register_q_schedule("adaptive")
@dataclass
class AdaptiveQ:
    """q driven by a running estimate of P̂ (the paper leaves the rule open; this is ours).

    Rule: ``q = q_min + (q_max - q_min) * clip(log P̂ / log cold_p, 0, 1)``, where log P̂ is an
    exponential moving average of the batch mean of ``log w̄``.

    Why this shape: below ``cold_p`` (default 1/32, i.e. 1/M for the paper's M=32) a group
    of M rollouts expects fewer than one success, so RLVR's signal vanishes and the
    amplification P̂^{-q} is what escapes (Thm 3.2): q stays at ``q_max``. Above it, the
    ratio-estimator bias O(q / (M P̂^q)) and noise memorisation (Prop. D.2) argue for less
    commitment, and q falls linearly in log P̂ to ``q_min`` at P̂ = 1, where the q=0
    estimator is unbiased. The mean of log w̄ (a geometric mean over prompts) is used
    because it stays low while many prompts are still cold. With ``monotone=True``
    q never rises again, the SFT-then-RLVR order: re-committing after the model has left
    cold start would re-amplify label noise.
    """

    q_max: float = 1.0
    q_min: float = 0.0
    cold_p: float = 1.0 / 32
    ema_decay: float = 0.9
    monotone: bool = True
    _log_p_hat: float | None = field(default=None, repr=False)
    _q: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.q_max, self.q_min = check_q(self.q_max, "q_max"), check_q(self.q_min, "q_min")
        if self.q_min > self.q_max:
            raise ValueError(f"q_min={self.q_min} must not exceed q_max={self.q_max}")
        if not 0.0 < self.cold_p < 1.0:
            raise ValueError(f"cold_p must lie in (0, 1); got cold_p={self.cold_p!r}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must lie in [0, 1); got ema_decay={self.ema_decay!r}")

    def __call__(self, step: int) -> float:
        return self.q_max if self._q is None else self._q

    def observe(self, log_p_hat: float) -> None:
        log_p_hat = min(float(log_p_hat), 0.0)
        if self._log_p_hat is None:
            self._log_p_hat = log_p_hat
        else:
            self._log_p_hat = self.ema_decay * self._log_p_hat + (1.0 - self.ema_decay) * log_p_hat
        coldness = min(max(self._log_p_hat / math.log(self.cold_p), 0.0), 1.0)
        target = self.q_min + (self.q_max - self.q_min) * coldness
        self._q = min(target, self(0)) if self.monotone else target

    def state_dict(self) -> dict[str, Any]:
        return {"log_p_hat": self._log_p_hat, "q": self._q}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._log_p_hat, self._q = state["log_p_hat"], state["q"]


def build_schedule(spec: dict[str, Any] | float) -> QSchedule:
    """A schedule from a config mapping ``{"name": ..., **params}``, or a bare q for a constant."""
    if isinstance(spec, (int, float)):
        return ConstantQ(float(spec))
    params = dict(spec)
    name = params.pop("name", None)
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(f"q schedule name must be one of {sorted(SCHEDULES)}; got name={name!r}")
    cls = SCHEDULES[name]
    allowed = {f.name for f in fields(cls) if not f.name.startswith("_")}
    unknown = sorted(map(str, set(params) - allowed))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} for q schedule {name!r}; allowed: {sorted(allowed)}")
    required = [f.name for f in fields(cls) if f.init and f.default is MISSING and f.default_factory is MISSING]
    missing = [key for key in required if key not in params]
    if missing:
        keys = ", ".join(f.name if f.name in required else f"{f.name}={f.default}" for f in fields(cls)
                         if not f.name.startswith("_"))
        raise ValueError(f"q schedule {name!r} needs {', '.join(missing)} (its keys: {keys})")
    for f in fields(cls):
        kind = _kind(f.type)
        if kind == "float" and isinstance(params.get(f.name), str) and as_float(params[f.name]) is not None:
            params[f.name] = as_float(params[f.name])  # YAML 1.1 reads 1e-1, with no dot, as text
        if f.name in params and kind in _KINDS and not _KINDS[kind][0](params[f.name]):
            raise ValueError(f"q schedule {name!r}: {f.name} must be {_KINDS[kind][1]}; got {params[f.name]!r}")
    with blamed_on_plugin(cls, f"q schedule {name!r}"):  # a plugin's own check (an assert) was a traceback
        return cls(**params)


#: A schedule field's annotation -> (accepts the value, what it must be), so a wrong value is named, not a TypeError.
_KINDS = {"float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), "a finite number"),
          "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "a whole number"),
          "bool": (lambda v: isinstance(v, bool), "true or false")}


def _kind(annotation: Any) -> str | None:
    """A field's annotation by name: a string where its module postpones annotations (ours), else the type itself (a
    plugin's schedule without ``from __future__ import annotations``, whose values went unchecked)."""
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", None)


def describe(schedule: QSchedule) -> dict[str, Any]:
    """The public parameters of a schedule, for logging."""
    return {k: v for k, v in asdict(schedule).items() if not k.startswith("_")}
