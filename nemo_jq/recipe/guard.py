"""The collapse guard: notice a run falling apart, so the trainer can restore its best checkpoint and change course.

Two signals, either one enough: validation m@k below ``min_fraction_of_best`` of its best so far, and
by more than ``min_drop_se`` standard errors, for ``patience`` evaluations in a row (what a collapse onto
a wrong or constant answer looks like), or the training log P̂ (averaged over ``window`` steps)
``logp_drop`` nats below its best such average (the estimate of P falling, before validation sees it).
The guard only decides; the trainer acts.

The standard error is the binomial one of the difference of two scores at the best's rate over the
validation prompts, ``100 sqrt(2 p (1 - p) / n)``: on the demo's 64 prompts a best of 17% moves by
±6.7 points between evaluations from sampling alone, and the best of a dozen such evaluations is
itself a lucky draw, so a fraction of the best alone would fire on noise.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

#: What the trainer may do after restoring the best checkpoint: switch to ``guard.estimator`` (a registered
#: estimator, at the same q), or lower q or the learning rate by ``guard.factor``.
GUARD_ACTIONS = ("switch_estimator", "lower_q", "lower_lr")


class CollapseGuard:
    def __init__(self, *, min_fraction_of_best: float, patience: int, logp_drop: float, window: int,
                 min_drop_se: float = 0.0):
        self.min_fraction_of_best, self.patience, self.min_drop_se = min_fraction_of_best, patience, min_drop_se
        self.logp_drop, self.window = logp_drop, window
        self.best_validation: float | None = None
        self.below = 0
        self.best_logp: float | None = None
        self.recent: deque[float] = deque(maxlen=window)

    def validation(self, value: float, num_prompts: int | None = None) -> str | None:
        """Record one validation m@k (a percentage over ``num_prompts`` prompts; None: no significance test);
        the reason to act, if it is time."""
        if self.best_validation is None or value > self.best_validation:
            self.best_validation, self.below = value, 0
            return None
        best = self.best_validation
        noise = 0.0 if num_prompts is None else self.min_drop_se * 100 * math.sqrt(2 * (best / 100) * (1 - best / 100) / num_prompts)
        self.below = self.below + 1 if value < self.min_fraction_of_best * best and best - value > noise else 0
        if self.below >= self.patience:
            return (f"validation m@k {value:.3g} below {self.min_fraction_of_best:g} x its best {self.best_validation:.3g} "
                    f"for {self.below} evaluations")
        return None

    def train(self, log_p_hat: float | None) -> str | None:
        """Record one step's training log P̂ (None for estimators without it); the reason to act, if it is time."""
        if log_p_hat is None or self.logp_drop <= 0:
            return None
        self.recent.append(log_p_hat)
        if len(self.recent) < self.window:
            return None
        mean = sum(self.recent) / self.window
        if self.best_logp is None or mean > self.best_logp:
            self.best_logp = mean
        elif mean < self.best_logp - self.logp_drop:
            return f"train log P̂ (mean of {self.window} steps) {mean:.3g}, {self.best_logp - mean:.3g} below its best {self.best_logp:.3g}"
        return None

    def restart(self) -> None:
        """After the trainer restored the best checkpoint: streaks and the log P̂ window start over (bests stay)."""
        self.below = 0
        self.recent.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"best_validation": self.best_validation, "below": self.below, "best_logp": self.best_logp,
                "recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_validation, self.below, self.best_logp = state["best_validation"], state["below"], state["best_logp"]
        self.recent = deque(state["recent"], maxlen=self.window)
