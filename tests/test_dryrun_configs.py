"""Every shipped config at its real size, in CI (issue 28): ``nemo-jq dryrun`` on each distinct workload under
configs/ (grouped as bench/dryrun_configs.py groups them: configs that differ only in what the dry run cannot see
share one run), a megatron config at its documented world, against an 80 GB GPU on the A100 and the H100 profile.
A tensor left on the host fails it (``WrongDevice``, naming the module), so does a phase over 90% of the GPU
(``DoesNotFit``, naming the phase, the kind and the knob). Each workload is simulated once and given on the other
profile by ``on_gpu`` (tests/test_dryrun.py holds that equal to simulating it there), so the profiles can differ in
their time bounds alone. The GPU is the dry run's stand-in (nemo_jq/dryrun/world.py): these tests need none.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from nemo_jq.dryrun import check_fits

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("dryrun_configs", ROOT / "bench" / "dryrun_configs.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
WORKLOADS = bench.workloads()


@pytest.mark.slow
@pytest.mark.parametrize("paths", WORKLOADS, ids=[paths[0].removeprefix("configs/") for paths in WORKLOADS])
def test_every_shipped_config_fits_an_80gb_gpu_with_every_tensor_on_it(paths):
    reports = bench.dry_run_workload(paths[0], prompt_tokens=1024)
    assert set(reports) == {"a100-80gb", "h100-80gb"}
    for report in reports.values():
        check_fits(report)
    a100, h100 = reports["a100-80gb"], reports["h100-80gb"]
    assert {key: value for key, value in a100.items() if key not in ("gpu", "phases", "ranks")} == \
        {key: value for key, value in h100.items() if key not in ("gpu", "phases", "ranks")}
    for a100_rank, h100_rank in zip([a100, *a100.get("ranks", {}).values()], [h100, *h100.get("ranks", {}).values()]):
        for name, phase in a100_rank["phases"].items():
            other = h100_rank["phases"][name]
            assert {k: v for k, v in phase.items() if k != "seconds_at_least"} == \
                {k: v for k, v in other.items() if k != "seconds_at_least"}
            assert phase["seconds_at_least"] >= other["seconds_at_least"]  # the A100 is the slower in both peaks
