"""The J_Q objective core: pure torch, no backend imports.

The estimators are plain functions over log-prob tensors (one file each), usable from any training
loop; each file also registers its estimator by name for the trainer (see :func:`get_objective`).
"""

from nemo_jq.objectives.garl import garl, rb_rloo
from nemo_jq.objectives.garl_ablations import garl_resampled_pathwise, garl_score_only
from nemo_jq.objectives.grpo import grpo
from nemo_jq.objectives.inputs import EstimatorInputs
from nemo_jq.objectives.interfaces import Need, ObjectiveOutput
from nemo_jq.objectives.maxrl import maxrl
from nemo_jq.objectives.paft import paft, resample_indices
from nemo_jq.objectives.qlog import jq_loss, log_q
from nemo_jq.objectives.registry import NoOptions, ObjectiveSpec, get_objective, list_objectives, register_objective
from nemo_jq.objectives.rloo import rloo
from nemo_jq.objectives.schedules import QSchedule, StepOnlyQ, build_schedule, register_q_schedule
from nemo_jq.objectives.sft import sft
from nemo_jq.objectives.verifier_free import garl_length_normalized, rlpr

__all__ = [
    "EstimatorInputs",
    "Need",
    "NoOptions",
    "ObjectiveOutput",
    "ObjectiveSpec",
    "QSchedule",
    "StepOnlyQ",
    "build_schedule",
    "garl",
    "garl_length_normalized",
    "garl_resampled_pathwise",
    "garl_score_only",
    "get_objective",
    "grpo",
    "jq_loss",
    "list_objectives",
    "log_q",
    "maxrl",
    "paft",
    "rb_rloo",
    "register_q_schedule",
    "register_objective",
    "resample_indices",
    "rloo",
    "rlpr",
    "sft",
]
