"""The dry run's report: its table (:func:`format_report`) and its peaks held against ``nemo-jq plan``'s components
(:func:`against_plan`)."""

from __future__ import annotations

from typing import Any

from nemo_jq.config import Config
from nemo_jq.dryrun.memory import KINDS, gib

#: Where a sampling call's KV cache and prefill temporaries together (``plan.sampler_bytes``'s ``sampling``) are seen
#: in a dry run: both kinds at the phase's peak.
SAMPLING = (("rollout", "evaluate"), ("kv_cache", "temporaries"))
#: Where each of ``nemo-jq plan``'s components is seen in a dry run: the phases, and the kind at its most there (or
#: the kinds, summed: a refit's gathered weights and, in a split world, the sync's buckets beside them).
PLAN_COMPONENTS = {"weights": (("build",), "weights"), "gradients": (("optimizer_step",), "gradients"),
                   "optimizer": (("save",), "optimizer"), "activations": (("train",), "activations"),
                   "logprob_head": (("train",), "logprob_head"), "rollout_copy": (("build",), "sampler_copy"),
                   "kv_cache": (("rollout", "evaluate"), "kv_cache"), "prefill": (("rollout", "evaluate"), "temporaries"),
                   "sampling": SAMPLING, "decode_cast": (("rollout", "evaluate"), "sampler_copy"),
                   "vllm": (("rollout",), "vllm"), "refit": (("sync",), "sync_buckets")}


#: The same for a Megatron rank: the optimizer's state at rest after the step is seen in the refit (or a split
#: world's sync) that follows it, before the save gathers it, and so is what gathering the weights holds; the KV cache
#: in the rollouts; the weights and the sampler's copy after the build, which counts the copy as weights until the
#: backend has made it (its peak shows them together).
MEGATRON_PLAN_COMPONENTS = {**PLAN_COMPONENTS, "weights": (("train",), "weights"), "optimizer": (("refit", "sync"), "optimizer"),
                            "rollout_copy": (("rollout",), "sampler_copy"), "kv_cache": (("rollout",), "kv_cache"),
                            "refit": (("refit", "sync"), ("temporaries", "sync_buckets"))}


#: Where each of ``plan``'s parts of a rollout rank is seen in its dry run.
ROLLOUT_RANK_COMPONENTS = {"weights": (("build",), "weights"), "kv_cache": (("rollout", "evaluate"), "kv_cache"),
                           "prefill": (("rollout", "evaluate"), "temporaries"), "sampling": SAMPLING,
                           "vllm": (("rollout",), "vllm"), "sync_buckets": (("sync",), "sync_buckets")}


def against_plan(report: dict[str, Any], config: Config) -> dict[str, dict[str, float]]:
    """``nemo-jq plan --config``'s estimate of each component beside the dry run's (GiB), and their ratio. Megatron:
    the plan's layout is the config's over the report's world, and its figure is the layout's fullest rank's, so the
    dry run's is the most any simulated rank holds."""
    from nemo_jq.cluster import plan

    work = plan.Workload.from_config(config, report["prompt_tokens"])
    layout, simulated, where = (1, 1, 1), [report], PLAN_COMPONENTS
    if "ranks" in report:
        megatron = config.megatron
        layout = (megatron.tensor_parallel, megatron.pipeline_parallel, megatron.data_parallel(report["world_size"]))
        simulated, where = list(report["ranks"].values()), MEGATRON_PLAN_COMPONENTS
    planned_bytes = plan.component_bytes(plan.architecture(config.model.path or ""), work, *layout,
                                         report["gpu"]["memory_gib"])
    rows = {}
    for component, (phases, kinds) in where.items():
        dry = _seen(simulated, phases, kinds, at_peak=component == "sampling")
        planned = gib(planned_bytes[component])
        rows[component] = {"dry_run_gib": dry, "plan_gib": planned,
                           "plan_over_dry_run": round(planned / dry, 3) if dry else None}
    serving = report.get("rollout_rank")
    if serving:  # what plan says of a rollout rank (at the layout's DP), beside its dry run
        planned_bytes = plan.rollout_rank_bytes(plan.architecture(config.model.path or ""), work, layout[2],
                                                report["gpu"]["memory_gib"])
        for component, size in planned_bytes.items():
            dry = _seen([serving], *ROLLOUT_RANK_COMPONENTS[component], at_peak=component == "sampling")
            rows[f"rollout_rank.{component}"] = {"dry_run_gib": dry, "plan_gib": gib(size),
                                                 "plan_over_dry_run": round(gib(size) / dry, 3) if dry else None}
    return rows


def _seen(ranks: list[dict[str, Any]], phases: tuple[str, ...], kinds: str | tuple[str, ...], *, at_peak: bool) -> float:
    """The most of ``kinds`` (summed) any of ``ranks`` held in ``phases`` (GiB): each kind at its own most, or
    ``at_peak``, as the phase's peak held them together."""
    kinds = (kinds,) if isinstance(kinds, str) else kinds
    held = "by_kind_gib" if at_peak else "most_by_kind_gib"
    return max((sum(rank["phases"][phase][held].get(kind, 0.0) for kind in kinds)
                for rank in ranks for phase in phases if phase in rank["phases"]), default=0.0)


def decode_work(report: dict[str, Any]) -> dict[str, Any] | None:
    """How each replica's rollouts were decoded: its prompts a step, its engines (``plan.decode_engines``), an engine's
    share, and the most any simulated rank's engine decoded (counted: ``DryRun._counted``); ``duplicated`` where that
    is more than its share, as when every engine of a replica decoded all of its prompts. None with rollout ranks of
    their own (each serves whole replicas)."""
    shape = report["shape"]
    if not shape["decode_engines"]:
        return None
    simulated = list(report["ranks"].values()) if "ranks" in report else [report]
    prompts, engines = shape["replica_prompts"], shape["decode_engines"]
    share = -(-prompts // engines)
    most = max(rank["shape"]["decoded_prompts"].get("rollout", 0) for rank in simulated)
    return {"replica_prompts": prompts, "engines": engines, "share": share, "most_decoded": most,
            "duplicated": most > share}


def format_decode(decode: dict[str, Any]) -> str:
    if decode["duplicated"]:
        return (f"decode: DUPLICATED: a rank's engine decoded {decode['most_decoded']} of its replica's "
                f"{decode['replica_prompts']} prompts, where its share over the replica's {decode['engines']} engines "
                f"is {decode['share']}: the replica decodes each prompt up to "
                f"{decode['engines'] * decode['most_decoded'] / decode['replica_prompts']:.1f} times")
    return (f"decode: each replica's {decode['replica_prompts']} prompts a step over its {decode['engines']} "
            f"engine{'s' * (decode['engines'] > 1)}, {decode['share']} at most each (counted: "
            f"{decode['most_decoded']}); none decoded twice")


def format_run_time(timed: dict[str, Any], gpu: str) -> str:
    """The whole run's time in one line: at least, and expected at the measured fractions (or what is not measured)."""
    line = (f"the run: {timed['steps']} steps, {timed['validations']} validations and the test split "
            f"({timed['evaluations']:g} validations' worth of evaluating) take at least {timed['hours_at_least']:.1f} h on "
            f"{timed['gpus']} {gpu} "
            f"({timed['gpu_hours_at_least']:.1f} GPU-hours)")
    if timed["not_measured"]:
        return line + (f"; expected: not measured ({', '.join(timed['not_measured'])}: no lent GPU has measured this "
                       "setting's fraction of its bound)")
    by_entry: dict[tuple, list[str]] = {}
    for phase, entry in timed["fractions"].items():
        if entry:
            by_entry.setdefault(tuple(entry), []).append(phase)
    used = "; ".join(f"{' and '.join(phases)} at {fraction:.2f} of the bound ({what})"
                     for (fraction, what), phases in by_entry.items())
    return line + (f"; expected {timed['hours_expected']:.1f} h ({timed['gpu_hours_expected']:.1f} GPU-hours) at the "
                   f"fractions measured on an H200 (bench/results/real_gpu.json, run 9): {used}")


def format_report(report: dict[str, Any]) -> str:
    simulated = list(report["ranks"].values()) if "ranks" in report else [report]
    world = f"rank(s) of {report['world_size']} GPUs, each simulated apart" if "ranks" in report else report["rank"]
    lines = [f"{report['shape']['parameters'] / 1e9:.3f}B parameters on {report['gpu']['name']} "
             f"({report['usable_gib']:.4g} GiB usable); {world}; prompts of {report['prompt_tokens']} tokens"
             + (f"; train.micro_batch_rows=auto: {report['micro_batch_rows'] or 'whole groups'}"
                if "micro_batch_rows" in report else "")]
    serving = report.get("rollout_rank")
    for rank in [*simulated, *([serving] if serving else [])]:
        if "ranks" in report or serving:
            lines.append(f"{rank['rank']} (peak {rank['peak_gib']:.2f} GiB in phase {rank['peak_phase']})")
        lines += phase_table(rank["phases"])
    verdict = "fits" if report["fits"] else "does NOT fit"
    lines.append(f"peak: {report['peak_gib']:.2f} GiB in phase {report['peak_phase']}"
                 + (f" of {report['rank'].split(':')[0]}" if "ranks" in report else "")
                 + (f"; a rollout rank's {serving['peak_gib']:.2f} GiB in phase {serving['peak_phase']}" if serving else "")
                 + f": {verdict}. TFLOP run: what "
                 f"the dry run executed ({report['decode_steps']} decode steps a sampling call, one micro-batch"
                 f"{' (PP of them under pipeline parallelism)' if 'ranks' in report else ''}); s at least: the whole "
                 "step's bound (docs/dryrun.md)")
    if report.get("decode"):
        lines.append(format_decode(report["decode"]))
    if report.get("run_time"):
        lines.append(format_run_time(report["run_time"], report["gpu"]["name"]))
    host = report.get("host")
    if host:
        limit = f" of the {host['memory_gib']:g} GiB given: {'fits' if host['fits'] else 'does NOT fit'}" \
            if host["memory_gib"] is not None else ""
        lines.append(f"host: {host['gib']:.2f} GiB a node{limit} ({host_sum(host)}); what this project's code puts on "
                     "the host, not vLLM's own process memory, Python or the libraries")
    return "\n".join(lines)

def host_sum(host: dict[str, Any], digits: int = 2) -> str:
    """How a node's host memory (``run.host_per_node``) adds up, in words: its processes at the fullest's peak, or
    where that peak is the save's, the saving replica's processes at it and the other replicas' at theirs outside it."""
    writing, processes, per = host["writing_replica_processes"], host["processes"], host["per_process_gib"]
    if writing == processes or host["phase"] != "save":
        return f"{processes} process{'es' * (processes != 1)} x {per:.{digits}f} GiB, the fullest's peak, in phase {host['phase']}"
    others = processes - writing
    return (f"{writing} process{'es' * (writing != 1)} of the saving replica x {per:.{digits}f} GiB, the fullest's peak, in "
            f"phase save, + {others} of other replicas x {host['outside_save_gib']:.{digits}f} GiB, its peak outside it")


def phase_table(phases: dict[str, Any]) -> list[str]:
    kinds = [kind for kind in KINDS if any(kind in phase["by_kind_gib"] for phase in phases.values())]
    lines = [f"{'phase':<14}{'peak GiB':>10}" + "".join(f"{k.replace('_', ' '):>14}" for k in kinds)
             + f"{'host GiB':>10}{'TFLOP run':>10}{'s at least':>12}"]
    for name, phase in phases.items():
        lines.append(f"{name:<14}{phase['peak_gib']:>10.2f}" + "".join(f"{phase['by_kind_gib'].get(k, 0.0):>14.2f}" for k in kinds)
                     + f"{phase.get('host_peak_gib', 0.0):>10.2f}{phase['flops'] / 1e12:>10.1f}{phase['seconds_at_least']:>12.2f}")
    return lines
