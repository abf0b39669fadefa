"""A run's first step at its real size, seen on the CPU: :func:`dry_run` (``nemo-jq dryrun``).

:mod:`.world` makes every tensor fake and stands a device in for the GPU; :mod:`.memory` counts the GPU's bytes by
kind; :mod:`.run` is the entry: it drives the run's own code through :mod:`.phases` (with :mod:`.standins` for what a
dry run cannot have, and :mod:`.split_world` for rollout ranks of their own) and says whether it fits; :mod:`.bounds`
gives each phase's least time on a GPU, :mod:`.report` the table and the comparison with ``nemo-jq plan``;
:mod:`.megatron` is a Megatron rank's world.
"""

from nemo_jq.dryrun.bounds import GPUS, GpuProfile
from nemo_jq.dryrun.report import format_report
from nemo_jq.dryrun.run import DoesNotFit, check_fits, dry_run, on_gpu
from nemo_jq.dryrun.world import WrongDevice

__all__ = ["GPUS", "DoesNotFit", "GpuProfile", "WrongDevice", "check_fits", "dry_run", "format_report", "on_gpu"]
