"""Run a script or module with the memory peak of each phase of a step recorded, to set beside the dry run's phases.

    python bench/phase_peaks.py OUT.json -m nemo_jq.cli train ...        # or: OUT.json tests/megatron_cpu.py train ...

A step's ``gpu_peak_gib`` is one figure over its rollouts, training and optimizer step; where a real peak differs from
``nemo-jq dryrun``'s, this says in which phase. Each call of a policy's ``token_logprobs``, ``forward_backward`` and
``optimizer_step``, an HF sampler's ``sample`` and a refit is recorded to OUT.json as the memory allocated on entry,
the call's own peak and the memory allocated on exit (GiB, ``torch.cuda``; a call inside another counts in both).
On a CPU there is no allocator to read: the calls are recorded with their seconds only (a smoke run of this script).
"""

from __future__ import annotations

import functools
import importlib
import json
import runpy
import sys
import time
from pathlib import Path

import torch

#: The phases recorded: (module, class, method).
PHASES = [("nemo_jq.rollouts.hf", "HFSampler", "sample"), ("nemo_jq.rollouts.refit", "RefittedRolloutEngine", "_refit"),
          *((module, policy, method) for module, policy in (("nemo_jq.models.hf", "HFPolicy"),
                                                              ("nemo_jq.models.megatron.policy", "MegatronPolicy"))
            for method in ("token_logprobs", "forward_backward", "optimizer_step"))]
GIB = 2**30


def main(out: Path, command: list[str]) -> None:
    calls: list[dict] = []
    running: list[int] = []  # the enclosing calls' peaks so far, innermost last
    cuda = torch.cuda.is_available()

    def recorded(name: str, method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            if cuda:
                torch.cuda.synchronize()
                if running:  # the enclosing call's peak so far, before this call resets the counter
                    running[-1] = max(running[-1], torch.cuda.max_memory_allocated())
                entry = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            running.append(0)
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                peak = running.pop()
                record = {"phase": name, "seconds": round(time.perf_counter() - started, 3)}
                if cuda:
                    torch.cuda.synchronize()
                    peak = max(peak, torch.cuda.max_memory_allocated())
                    if running:
                        running[-1] = max(running[-1], peak)
                    record.update(entry_gib=round(entry / GIB, 3), peak_gib=round(peak / GIB, 3),
                                  exit_gib=round(torch.cuda.memory_allocated() / GIB, 3))
                calls.append(record)
                out.write_text(json.dumps(calls, indent=1) + "\n")
        return call

    for module, owner, method in PHASES:
        cls = getattr(importlib.import_module(module), owner)
        setattr(cls, method, recorded(f"{owner}.{method}", getattr(cls, method)))
    sys.argv = command[1:] if command[0] == "-m" else command
    if command[0] == "-m":
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, str(Path(command[0]).resolve().parent))
        runpy.run_path(command[0], run_name="__main__")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
