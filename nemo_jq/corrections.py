"""The names of the off-policy corrections (``objective.importance``; their maths: ``nemo_jq.objectives.importance``).

Apart from the estimators, which import torch: the config, and with it every command's ``--help``, names them
without loading torch.
"""

#: The corrections that work from the per-token ratios (the estimators then need the sampled tokens' log-probs).
PER_TOKEN_CORRECTIONS = ("token_truncate", "geometric")
CORRECTIONS = ("plain", "truncate", "mask", *PER_TOKEN_CORRECTIONS)
