"""The J_Q objective core: pure torch, no backend imports.

Estimators (one file each) register themselves by name; see :func:`get_objective`.
"""

from nemo_jq.objectives.garl import garl, rb_rloo
from nemo_jq.objectives.grpo import grpo
from nemo_jq.objectives.interfaces import Need, Objective, ObjectiveOutput
from nemo_jq.objectives.paft import paft, resample_indices
from nemo_jq.objectives.qlog import jq_loss, log_q
from nemo_jq.objectives.registry import ObjectiveSpec, get_objective, list_objectives, register_objective
from nemo_jq.objectives.rloo import rloo
from nemo_jq.objectives.schedules import QSchedule, build_schedule
from nemo_jq.objectives.sft import sft

__all__ = [
    "Need",
    "Objective",
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
