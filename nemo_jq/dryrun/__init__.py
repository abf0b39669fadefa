"""A run's first step at its real size, seen on the CPU: :func:`dry_run` (``nemo-jq dryrun``).

:mod:`.world` makes every tensor fake and stands a device in for the GPU; :mod:`.memory` counts the GPU's bytes by
kind; :mod:`.run` drives the run's own code through its phases and reports each one's peak, FLOPs and time bound.
"""

from nemo_jq.dryrun.run import GPUS, DoesNotFit, GpuProfile, check_fits, dry_run, format_report, on_gpu
from nemo_jq.dryrun.world import WrongDevice

__all__ = ["GPUS", "DoesNotFit", "GpuProfile", "WrongDevice", "check_fits", "dry_run", "format_report", "on_gpu"]
