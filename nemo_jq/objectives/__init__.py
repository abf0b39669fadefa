"""The J_Q objective core: pure torch, no backend imports.

The estimators are plain functions over log-prob tensors (one file each), usable from any training
loop; each file also registers its estimator by name for the trainer (see :func:`get_objective`).
"""

from nemo_jq.objectives.garl import garl, rb_rloo
from nemo_jq.objectives.grpo import grpo
from nemo_jq.objectives.inputs import EstimatorInputs
from nemo_jq.objectives.interfaces import Need, ObjectiveOutput
from nemo_jq.objectives.paft import paft, resample_indices
from nemo_jq.objectives.qlog import jq_loss, log_q
from nemo_jq.objectives.registry import NoOptions, ObjectiveSpec, get_objective, list_objectives, register_objective
from nemo_jq.objectives.rloo import rloo
from nemo_jq.objectives.schedules import QSchedule, build_schedule
from nemo_jq.objectives.sft import sft

__all__ = [
    "EstimatorInputs",
    "Need",
    "NoOptions",
    "ObjectiveOutput",
    "ObjectiveSpec",
    "QSchedule",
    "build_schedule",
    "garl",
    "get_objective",
    "grpo",
    "jq_loss",
    "list_objectives",
    "log_q",
    "paft",
    "rb_rloo",
    "register_objective",
    "resample_indices",
    "rloo",
    "sft",
]
