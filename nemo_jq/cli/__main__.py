"""``python -m nemo_jq.cli``: the ``nemo-jq`` command (what torchrun and SLURM's srun start)."""

from nemo_jq.cli import main

raise SystemExit(main())
