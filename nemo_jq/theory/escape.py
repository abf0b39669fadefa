"""Cold-start escape times on the paper's sigmoid model (Section 3, Appendix D.1).

Under gradient flow on l_q with P = sigmoid(theta), dp/dt = p^{2-q} (1-p)^2, so the time
to go from p0 to delta is T_q(p0, delta) = ∫ du / (u^{2-q} (1-u)^2) (Eq. exact-time).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.integrate import quad, solve_ivp


def escape_time_quadrature(q: float, p0: float, delta: float = 0.5) -> float:
    """T_q(p0, delta) by adaptive quadrature, in the variable s = log u for accuracy at tiny p0."""
    _check_interval(p0, delta)
    value, _ = quad(
        lambda s: math.exp((q - 1.0) * s) / (1.0 - math.exp(s)) ** 2,
        math.log(p0),
        math.log(delta),
        epsabs=0.0,
        epsrel=1e-11,
        limit=500,
    )
    return value


def escape_time_ode(q: float, p0: float, delta: float = 0.5) -> float:
    """T_q(p0, delta) by integrating dp/dt = p^{2-q}(1-p)^2 until p reaches delta.

    Integrates y = log p (dy/dt = p^{1-q}(1-p)^2), which keeps the early, slow phase accurate.
    """
    _check_interval(p0, delta)
    _, upper = escape_time_bounds(q, p0, delta)

    def reached(_t: float, y: np.ndarray) -> float:
        return y[0] - math.log(delta)

    reached.terminal = True
    sol = solve_ivp(
        lambda _t, y: [math.exp((1.0 - q) * y[0]) * (1.0 - math.exp(y[0])) ** 2],
        (0.0, 2.0 * upper),
        [math.log(p0)],
        method="LSODA",
        events=reached,
        rtol=1e-11,
        atol=1e-12,
    )
    if not sol.t_events[0].size:
        raise RuntimeError(f"ODE did not reach delta={delta} from p0={p0} at q={q}")
    return float(sol.t_events[0][0])


def escape_time_asymptotic(q: float, p0: float) -> float:
    """Leading term as p0 -> 0 (Thm 3.2 on the sigmoid): p0^{-(1-q)}/(1-q) for q<1, log(1/p0) at q=1."""
    if q == 1.0:
        return math.log(1.0 / p0)
    return p0 ** -(1.0 - q) / (1.0 - q)


def escape_time_bounds(q: float, p0: float, delta: float = 0.5) -> tuple[float, float]:
    """Appendix D.1's two-sided bounds: dominant integral <= T <= dominant + remainder bound.

    The dominant part is ∫ u^{q-2} du; the remainder ∫ r(u) u^{q-2} du with 0 <= r(u) <= 8u
    (delta <= 1/2) is at most 8 ∫ u^{q-1} du.
    """
    _check_interval(p0, delta)
    if q == 1.0:
        dominant = math.log(delta / p0)
    else:
        dominant = (p0 ** -(1.0 - q) - delta ** -(1.0 - q)) / (1.0 - q)
    remainder = 8.0 * math.log(delta / p0) if q == 0.0 else 8.0 * (delta**q - p0**q) / q
    return dominant, dominant + remainder


def _check_interval(p0: float, delta: float) -> None:
    if not 0.0 < p0 < delta <= 0.5:
        raise ValueError(f"need 0 < p0 < delta <= 1/2; got p0={p0}, delta={delta}")
