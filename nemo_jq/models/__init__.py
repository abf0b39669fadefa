"""Backends: policies that train, rollout engines that sample, and the helpers they share.

Importing this package imports no torch, so a config names its choices without loading a backend.
"""

#: Compute precisions of the policy and rollouts: auto = bf16 autocast on GPU, fp32 on CPU.
PRECISIONS = ("auto", "fp32", "bf16")
#: Optimizers a policy builds (:func:`nemo_jq.models.common.build_optimizer`).
OPTIMIZERS = ("adamw", "sgd")
