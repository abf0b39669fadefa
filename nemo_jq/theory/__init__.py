"""The paper's stylised results as numpy/scipy functions (no torch needed)."""

from nemo_jq.theory.escape import (
    escape_time_asymptotic,
    escape_time_bounds,
    escape_time_ode,
    escape_time_quadrature,
)
from nemo_jq.theory.landscape import (
    categorical_jq,
    dispersion_gap,
    escort_minimizer,
    neg_log_q,
    noise_equilibrium,
    noise_equilibrium_asymptote,
    noise_fitting_rate,
)
from nemo_jq.theory.latent import LatentModel, bias_table, default_model, measured_bias

__all__ = [
    "LatentModel",
    "bias_table",
    "categorical_jq",
    "default_model",
    "dispersion_gap",
    "escape_time_asymptotic",
    "escape_time_bounds",
    "escape_time_ode",
    "escape_time_quadrature",
    "escort_minimizer",
    "measured_bias",
    "neg_log_q",
    "noise_equilibrium",
    "noise_equilibrium_asymptote",
    "noise_fitting_rate",
]
