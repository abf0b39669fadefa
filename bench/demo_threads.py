"""The demo's five runs, one at a time with two threads (its old way) beside the free cores with one thread each (now),
on an idle machine and with a second process keeping one core busy. ``--quick``'s workload (five runs of 96 steps).

    python bench/demo_threads.py [--busy-cap-seconds 210] [--out bench/results/demo_threads.json]

Under load the old way can take many times longer: each of its measurements stops at ``--busy-cap-seconds`` and gives
the steps its first run made by then. Times are wall seconds on this machine; docs/results/demo.md has the table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import time
from pathlib import Path

from nemo_jq.recipe.demo import QUICK, demo_sweep
from nemo_jq.runtime.monitor import read_metrics
from nemo_jq.runtime.preemption import Stopped
from nemo_jq.runtime.sweep import free_cores, run_here


def spin() -> None:
    while True:
        pass


def run_quietly(sweep, parallel: int, threads: int) -> None:
    """The sweep, its progress lines silenced; the stop at the cap ends it without a traceback."""
    try:
        run_here(sweep, parallel=parallel, threads=threads, say=lambda line: None)
    except Stopped:
        pass


def measure(parallel: int, threads: int, cap: float) -> dict:
    """The quick demo's wall time at ``parallel`` runs of ``threads`` threads, or the steps made by ``cap`` seconds."""
    with tempfile.TemporaryDirectory() as scratch:
        sweep = demo_sweep(Path(scratch) / "demo", list(QUICK))
        sweep.write()
        runner = multiprocessing.Process(target=run_quietly, args=(sweep, parallel, threads))
        started = time.monotonic()
        runner.start()
        runner.join(cap)
        seconds = time.monotonic() - started
        finished = not runner.is_alive()
        if not finished:
            runner.terminate()  # the sweep passes it to its running run, which stops
            runner.join()
        steps = {run.name: max([r["step"] for r in read_metrics(sweep.directory / run.name) if r["kind"] == "train"],
                               default=0) for run in sweep.runs}
    return {"parallel": parallel, "threads": threads, "finished": finished, "seconds": round(seconds, 1),
            "steps_made": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy-cap-seconds", type=float, default=210.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "demo_threads.json")
    args = parser.parse_args()
    results = {"free_cores_idle": free_cores()}
    results["idle"] = {"old": measure(1, 2, 3600), "new": measure(free_cores(), 1, 3600)}
    busy = multiprocessing.Process(target=spin, daemon=True)
    busy.start()
    time.sleep(3)
    results["free_cores_busy"] = free_cores()
    results["busy"] = {"old": measure(1, 2, args.busy_cap_seconds), "new": measure(results["free_cores_busy"], 1, 3600)}
    busy.terminate()
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
