"""A run directory: what it holds, claiming a new one safely, and loading one's checkpoint for eval and export.

Why one file (over 700 lines): the train, resume, eval, export and report commands all read a run through the
names and checks here (its files, its checkpoints' state, its results); split by command, each part would import
the others' names back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from nemo_jq.config import PATH_KEYS, Config, ConfigError, TrackingConfig, current_key, keys_set_by, load_config, save_config
from nemo_jq.runtime import distributed
from nemo_jq.runtime.checkpoint import STATE, latest_checkpoint, read_state, saved_steps, step_dir_name
from nemo_jq.runtime.monitor import (
    METRICS_FILE,
    SAMPLES_FILE,
    nonfinite_back,
    plot_runs,
    read_json_file,
    read_metrics,
    valid_json,
)
from nemo_jq.runtime.outputs import (
    LOCK_FILE,
    claim_dir,
    folders_below,
    hold_run_dir,
    holder_of,
    let_go,
    release_run_dir,
    write_atomic,
    write_new,
)
from nemo_jq.runtime.tracking import TRACKING_FILE, first_line, is_number
from nemo_jq.strict_yaml import read_yaml_file
from nemo_jq.typed import first_few

CONFIG_FILE, TOKENIZER_DIR, CHECKPOINT_DIR, RESULTS_FILE = "config.yaml", "tokenizer", "checkpoints", "results.json"
#: Where ``nemo-jq eval`` writes its reports in a run's directory.
EVALS_DIR = "evals"
#: The Figure-3 panels of a finished run's metrics.
PLOT_FILE = "training.png"
#: Each split's digest as the run built it at its start (:func:`check_splits`).
SPLITS_FILE = "splits.json"
#: What a run writes into its directory; any of them there means the directory holds a run.
RUN_FILES = (CONFIG_FILE, TOKENIZER_DIR, CHECKPOINT_DIR, RESULTS_FILE, METRICS_FILE, SAMPLES_FILE, "tensorboard", PLOT_FILE,
             TRACKING_FILE, SPLITS_FILE)
#: All a run's start writes into its directory: its files, its lock, and the trackers' stores (W&B offline, MLflow's).
STARTED_FILES = (*RUN_FILES, LOCK_FILE, "wandb", "mlruns")
#: How the megatron backend lays the model out over the processes: its checkpoints load at any TP, PP, CP and DP size.
LAYOUT_KEYS = ("megatron.tensor_parallel", "megatron.pipeline_parallel", "megatron.context_parallel",
               "megatron.sequence_parallel")
#: The experiment trackers' keys: where a run's records are sent, not what it trains.
TRACKING_KEYS = tuple(f"tracking.{field.name}" for field in dataclasses.fields(TrackingConfig))
#: How fast a run computes and how much memory its sampling and log-probs hold, not what: the decode under CUDA graphs
#: and compiled (its tokens the eager sampler's), compiled training, the log-prob head's chunks and the sampler's
#: token budget (the settings a run out of memory, or a compile that fails mid-run, is resumed with changed).
SPEED_KEYS = ("rollout.cuda_graphs", "rollout.compile", "rollout.kv_cache_tokens", "model.compile",
              "model.logprob_chunk_size")
#: Keys that change nothing a run computes: how it is saved and shown, how much memory a step holds (row chunks and
#: recomputation give the same gradient) and how fast it runs (:data:`SPEED_KEYS`), where it runs
#: (:data:`LAYOUT_KEYS`), and where its records go.
UNSEEN_KEYS = ("train.save_every", "train.keep_checkpoints", "train.tensorboard", "train.micro_batch_rows",
               "model.activation_checkpointing", "eval.samples_shown", "eval.batch_size", *SPEED_KEYS, *LAYOUT_KEYS,
               "megatron.recompute_activations", "megatron.distributed_optimizer", "rollout.placement", "rollout.ranks",
               *TRACKING_KEYS)
#: Keys a resumed run may change: how long it goes on and how often it is evaluated, and :data:`UNSEEN_KEYS`; never what
#: it trains nor what picks its best checkpoint (``eval.num_samples``, the k of its validation m@k: m@8 beside m@4
#: compares two metrics; ``nemo-jq eval`` scores a checkpoint at any k).
RESUMABLE_KEYS = ("train.epochs", "train.max_steps", "eval.every", *UNSEEN_KEYS)
#: Where a loaded checkpoint runs: the device (a run trained on a GPU, exported on a login node) and the layout, a
#: Qwen3-MoE's experts' too (a checkpoint's weights load at any EP: docs/moe.md; its AdamW state is resumed at its own).
PLACEMENT_KEYS = ("train.device", *LAYOUT_KEYS, "megatron.expert_parallel", "megatron.expert_tensor_parallel")
#: How a loaded checkpoint samples: its budgets, sampling, engine and compute precision.
SAMPLING_KEYS = ("rollout.max_thinking_tokens", "rollout.max_answer_tokens", "rollout.temperature", "rollout.top_k",
                 "rollout.top_p", "rollout.engine", "rollout.cuda_graphs", "rollout.compile", "rollout.kv_cache_tokens",
                 "rollout.vllm_memory_utilization", "rollout.vllm_kv_cache_gb", "model.precision")
#: Keys each command that loads a checkpoint may override: how it scores and samples, and where it runs, never what
#: the checkpoint is (its model, data and prompt format: another would not load, or would score another task).
INFERENCE_KEYS = {"eval": ("eval.num_samples", "eval.batch_size", *SAMPLING_KEYS, *PLACEMENT_KEYS),
                  "generate": (*SAMPLING_KEYS, *PLACEMENT_KEYS), "export": PLACEMENT_KEYS}


def claim_run_dir(run_dir: Path, *, overwrite: bool = False) -> Path | None:
    """Hold ``run_dir`` (:func:`hold_run_dir`) and make sure a new run never writes over an earlier one
    (:func:`claim_dir` with the run's files). An earlier start that never saved a checkpoint (it failed, or was
    killed, before its first) holds nothing to resume: it is moved aside, as ``overwrite`` would. A folder with run
    files' names but no checkpoint that is not such a start (a user's own config.yaml, notes) is refused."""
    run_dir = Path(run_dir)
    if run_dir.is_dir():
        hold_run_dir(run_dir)
    try:
        unsaved = not overwrite and _run_files_without_checkpoint(run_dir)
        if unsaved:
            if foreign := not_written_by_a_run(run_dir):
                # beside a failed start's saved config, not inside it: a run's folder is its own (refuse_shared_run_dir)
                elsewhere = run_dir.parent / f"{run_dir.name}-2" if is_run_config(run_dir / CONFIG_FILE) else run_dir / "run"
                raise FileExistsError(f"{run_dir} holds no run's checkpoint, and what a run does not write "
                                      f"({'; '.join(foreign)}): write the run elsewhere (e.g. train.run_dir="
                                      f"{elsewhere}), or pass --overwrite to move {run_dir} aside first")
            print(f"nemo-jq: {run_dir} holds a start that never saved a checkpoint: moving it aside")
        aside = claim_dir(run_dir, RUN_FILES, overwrite=overwrite or unsaved, what="a run",
                          advice=f"continue it with `nemo-jq train --resume {run_dir}`, write the new run elsewhere "
                                 "(train.run_dir=...), or pass --overwrite to move the old run aside first")
    except BaseException:
        release_run_dir(run_dir)
        raise
    if aside is not None:  # the lock file went with it
        let_go(run_dir.absolute(), now_at=aside)
    hold_run_dir(run_dir)
    return aside


def failed_start(run_dir: Path) -> bool:
    """True when ``run_dir`` holds a run's start but no checkpoint: a start that failed (or was killed) before it
    saved its first, which holds nothing to resume."""
    return _run_files_without_checkpoint(run_dir) and not not_written_by_a_run(run_dir)


def _run_files_without_checkpoint(run_dir: Path) -> bool:
    """``run_dir`` holds a run's files but neither ``latest`` nor a complete checkpoint, nor the results of a run that
    finished (whose checkpoints were deleted since: no failed start, and not moved aside without --overwrite)."""
    checkpoints = run_dir / CHECKPOINT_DIR
    return (any((run_dir / name).exists() for name in RUN_FILES) and not (checkpoints / "latest").exists()
            and not saved_steps(checkpoints) and not (run_dir / RESULTS_FILE).exists())


def not_written_by_a_run(run_dir: Path) -> list[str]:
    """What in ``run_dir`` a run's start does not leave there, in words: other files, and a config.yaml that is not a
    run's saved config (or none)."""
    found = [f"{path.name}{'/' * path.is_dir()}" for path in sorted(run_dir.iterdir()) if path.name not in STARTED_FILES]
    config = run_dir / CONFIG_FILE
    if not is_run_config(config):
        found.append(f"{CONFIG_FILE}, not a run's saved config (a run saves every section)" if config.exists()
                     else f"no {CONFIG_FILE}")
    return found


def is_run_config(path: Path) -> bool:
    """Whether ``path`` is a config a run saved (:func:`write_run_files`): every section of the config, where one
    written by hand sets a few."""
    try:
        saved = read_yaml_file(path)
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and set(saved) == {field.name for field in dataclasses.fields(Config)}


def refuse_shared_run_dir(run_dir: Path, config: Config) -> None:
    """Before a new run writes anything: its directory is its own. Inside another run's (or a held folder), that run
    prunes its checkpoints/, rebuilds its tensorboard/ and moves all it holds on ``--overwrite``; holding a run, this
    one does so to it; and a run's directory is never its data's (prepared, or a local source), which ``--overwrite``
    would move away."""
    folder = Path(run_dir).resolve()
    owns = "it rebuilds its tensorboard/, prunes its checkpoints/, and --overwrite moves all of it"
    if (above := run_above(folder)) is not None:
        outer, why = above
        raise ConfigError(f"train.run_dir={run_dir} is inside the run {outer} ({why}), whose folder is its own "
                          f"({owns}): choose a train.run_dir outside it (e.g. {outer.parent / folder.name})")
    for inner, why in runs_below(folder):
        raise ConfigError(f"train.run_dir={run_dir} holds the run {inner} ({why}), which this run's folder would "
                          f"share ({owns}): choose a train.run_dir that holds no run (a new folder, beside {inner})")
    local_source = config.data.source if config.data.source and Path(config.data.source).exists() else None
    for key, given in (("data.prepared_dir", config.data.prepared_dir), ("data.source", local_source)):
        if given is None:
            continue
        data = Path(given).resolve()
        where = ("is" if folder == data else "is inside" if data in folder.parents else
                 "holds" if folder in data.parents else None)
        if where is not None:
            raise ConfigError(f"train.run_dir={run_dir} {where} {key}={given}: a run writes (and --overwrite moves) "
                              "its folder, the data with it: choose a train.run_dir outside the data's folder")


def run_above(folder: Path) -> tuple[Path, str] | None:
    """The nearest run whose folder holds ``folder``, and what shows it (:func:`_run_there`); None if none does."""
    return next(((outer, why) for outer in Path(folder).resolve().parents if (why := _run_there(outer)) is not None), None)


def holds_a_run(folder: Path) -> bool:
    """Whether ``folder`` is a run's, or holds one below it (:func:`_run_there`, :func:`runs_below`)."""
    return _run_there(folder) is not None or next(runs_below(folder), None) is not None


def runs_below(folder: Path) -> Iterator[tuple[Path, str]]:
    """The runs in the folders below ``folder`` (:func:`~.outputs.folders_below`), each with what shows it."""
    return ((inner, why) for inner in folders_below(folder) if (why := _run_there(inner)) is not None)


def _run_there(folder: Path) -> str | None:
    """What shows a run in ``folder``, in words (None: nothing does): its saved config, its checkpoints, or a holder."""
    if is_run_config(folder / CONFIG_FILE):
        return f"its {CONFIG_FILE}"
    if (folder / CHECKPOINT_DIR / "latest").exists():
        return f"its {CHECKPOINT_DIR}/latest"
    holder = holder_of(folder)
    return None if holder is None else f"held by {holder}"


class Diverged(ValueError):
    """The loss, the gradient norm or the weights went NaN or infinite: the run stops before anything saves them."""


def diverged(run_dir: Path, step: int, what: str, value: float, lr: float, estimator: str | None = None) -> Diverged:
    """The one line that stops a diverged run: the step, what went non-finite, and the last good checkpoint, kept.
    ``estimator``: the objective whose loss it was, where no update has yet been made (no learning rate is to blame)."""
    try:
        last = latest_checkpoint(Path(run_dir) / CHECKPOINT_DIR)
    except FileNotFoundError:
        last = None
    kept = (f"the last good checkpoint, {last}, is kept (nothing after it was saved)" if last is not None else
            "no checkpoint was saved before it")
    if estimator is not None:
        return Diverged(f"the run's first step gave a loss of {value}, before any update: objective {estimator!r} "
                        "computed it from the initial weights, so no learning rate is to blame; look at the estimator "
                        "(a plugin's: its loss) and its options; nothing was saved")
    return Diverged(f"the run diverged at step {step}: {what} is {value} (not finite); it stopped there and {kept}: "
                    f"start it again with a lower optim.lr (now {lr:g}); --overwrite moves this run aside first")


def nonfinite_weights(policy: Any) -> tuple[str, float | None]:
    """``("the weights ...", value)`` naming the policy's first weight tensor that holds a NaN or inf, with its largest
    magnitude; ``value`` None when every one is finite (or the policy shows no ``model`` module to look into)."""
    import torch

    model = getattr(policy, "model", None)
    params = list(model.named_parameters()) if isinstance(model, torch.nn.Module) else []
    if not params:
        return "the weights", None
    peaks = torch.stack([torch.linalg.vector_norm(p.detach(), float("inf")).float() for _, p in params]).cpu()
    bad = [(name, float(peak)) for (name, _), peak in zip(params, peaks) if not torch.isfinite(peak)]
    if not bad:
        return "the weights", None
    more = f" (and {len(bad) - 1} more of the {len(params)} tensors)" if len(bad) > 1 else ""
    return f"the weight tensor {bad[0][0]}{more}", bad[0][1]


def write_run_files(run_dir: Path, config: Config, tokenizer: Any, splits: Any) -> None:
    """What a run writes before its first step (holding its directory, if it does not yet): its resolved config, and
    (once) its tokenizer and its splits' digests (:meth:`~nemo_jq.data.base.Splits.digests`)."""
    hold_run_dir(run_dir)
    save_config(config, run_dir / CONFIG_FILE)
    if not (run_dir / TOKENIZER_DIR).exists():
        tokenizer.save_pretrained(run_dir / TOKENIZER_DIR)
    if not (run_dir / SPLITS_FILE).exists():
        (run_dir / SPLITS_FILE).write_text(json.dumps(splits.digests(), indent=1) + "\n")


def check_splits(run_dir: Path, splits: Any, data: Any) -> None:
    """The splits a reopened run (a resume, an evaluation) built from its config's ``data`` are the ones it recorded
    at its start: a source edited since (or a prepared folder rewritten) would train on other data, or score a test
    split that holds training examples. Refused in one line naming the splits; a run that recorded none is not
    checked; one whose record is not its digests (an edit, a cut write) is refused, naming the file."""
    path = Path(run_dir) / SPLITS_FILE
    if not path.exists():
        return
    try:
        recorded = json.loads(path.read_text())
        fault = (f"it holds a JSON {type(recorded).__name__}, not split: digest" if not isinstance(recorded, dict) else
                 next((f"its {name} is {json.dumps(digest)[:30]}, not a digest" for name, digest in recorded.items()
                       if not (isinstance(digest, str) and len(digest) == 64)), None))
    except (OSError, ValueError) as err:
        fault = f"not JSON: {err}" if isinstance(err, ValueError) else first_line(err)
    if fault:
        raise ConfigError(f"{path} is not the splits' digests the run wrote at its start ({fault}): restore it from a "
                          f"copy of the run, or delete it to reopen the run without checking its data")
    changed = [name for name, digest in splits.digests().items() if recorded.get(name) != digest]
    if changed:
        where = data.prepared_dir or data.source or f"the {data.name} task"
        raise ConfigError(f"{run_dir}: its {' and '.join(changed)} split{'s' * (len(changed) > 1)} as built now from {where} "
                          f"differ from those it recorded at its start ({SPLITS_FILE}): its data has changed since; "
                          "restore it as it was, or start a new run on the data as it is")


def beats_best(value: float, best: float | None) -> bool:
    """The one rule for a run's best checkpoint (training keeps it; the guard restores it; the test split, ``eval`` and
    ``export`` take it): the validation that beats zero and every earlier one (ties keep the earliest). When no
    validation beat zero there is no best, and the latest checkpoint stands in: the earliest of equal zeros is the
    least trained, whose answers say nothing."""
    return value > max(best or 0.0, 0.0)


def best_step_of(state: dict[str, Any]) -> int | None:
    """A checkpoint's ``state.json``'s best step by :func:`beats_best` (a run saved before the rule kept a best
    validation of 0)."""
    return state.get("best_step") if (state.get("best_metric") or 0.0) > 0.0 else None


def run_results(objective: Any, uses_q: bool, final_q: float | None, best_step: int | None,
                best_validation: float | None, test: dict[str, Any], memorisation: dict | None, *, step: int,
                key: str) -> dict[str, Any]:
    """What ``results.json`` holds: the method (q, or its schedule and the last q trained with), the step it ended at
    (results of an earlier end are evaluated again), the best validation checkpoint's step and m@k, which checkpoint
    the test split scored (``tested``, in words), its test scores and, for a noisy run, its memorisation."""
    scheduled = uses_q and objective.q_schedule is not None
    tested = (f"the best validation {key} (step {best_step})" if best_step is not None else
              f"the latest (step {step}): no validation {key} rose above 0")
    return {"objective": objective.name, "q": objective.q if uses_q and not scheduled else None,
            **({"q_schedule": objective.q_schedule, "final_q": final_q} if scheduled else {}), "step": step,
            "best_step": best_step, "best_validation": best_validation, "tested": tested, "test": test,
            **({"memorisation": memorisation} if memorisation else {})}


def results_current(run_dir: Path, step: int | None) -> bool:
    """Whether the run's ``results.json`` holds its end's evaluation at ``step`` (its last checkpoint's): it names
    that step, or it is readable and names none (results written before they named their step). A missing or
    unreadable one is not: a resume evaluates again."""
    try:
        results = json.loads((Path(run_dir) / RESULTS_FILE).read_text())
    except (OSError, ValueError):
        return False
    return results_at(results, step)


def results_at(results: Any, step: int | None) -> bool:
    """Whether ``results`` (a run's ``results.json``, read) are its end's evaluation at ``step`` (see
    :func:`results_current`)."""
    return isinstance(results, dict) and results.get("step") in (None, step)


def has_finished(run_dir: Path, results: Any = None) -> bool:
    """Whether the run has finished: its ``results.json`` (``results``, where the caller has read it) is its last
    checkpoint's (:func:`results_current`). One resumed since its results were written (to train on) has not,
    whatever they say: the sweep continues it, and the report leaves it out."""
    step = last_checkpoint_step(run_dir)
    if step is None and (Path(run_dir) / RESULTS_FILE).exists():  # its checkpoints deleted since (for the disk's
        step = last_trained_step(run_dir)  # sake): its results are its last step's (report left it out, sweep retrained it)
    return results_current(run_dir, step) if results is None else results_at(results, step)


def last_trained_step(run_dir: Path) -> int | None:
    """The last step ``metrics.jsonl`` records a training record of (None: none)."""
    return max((record["step"] for record in read_metrics(run_dir) if record["kind"] == "train"), default=None)


def last_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's latest checkpoint (None: it has none, or its ``latest`` was lost beside complete ones)."""
    state = last_checkpoint_state(run_dir)
    return state["step"] if state is not None else None


def last_checkpoint_state(run_dir: Path) -> dict[str, Any] | None:
    """The ``state.json`` of the run's latest checkpoint (None: as :func:`last_checkpoint_step`)."""
    try:
        latest = latest_checkpoint(Path(run_dir) / CHECKPOINT_DIR)
    except FileNotFoundError:
        return None
    return read_state(latest) if latest is not None else None


def write_results(run_dir: Path, results: dict[str, Any]) -> None:
    """What a finished run writes: its test results and the Figure-3 panels of its metrics; then it lets go of its
    directory (a process that goes on to other runs holds only the one it writes)."""
    write_atomic(run_dir / RESULTS_FILE, valid_json(results, indent=2))
    plot_runs({run_dir.name: read_metrics(run_dir)}, run_dir / PLOT_FILE)
    release_run_dir(run_dir)


def nearest_run(folder: Path) -> str:
    """Where a folder that is no run's is (``--resume``'s advice): missing, inside a run (its checkpoints), or above
    runs (a sweep's or an experiment's), with the run to give instead."""
    if not folder.exists():
        return ": the folder does not exist; give the run's folder (its train.run_dir)"
    if (above := run_above(folder)) is not None:
        return f"; it is inside the run {above[0]}: give that"
    inner = [str(path) for path, _ in runs_below(folder)]
    return f"; it holds runs ({first_few(inner)}): give one of them" if inner else ""


def open_for_resume(run_dir: Path, overrides: list[str] | tuple[str, ...]) -> tuple[Config, Path]:
    """A run's saved config (with ``overrides`` of :data:`RESUMABLE_KEYS` only) and its latest checkpoint."""
    if not (run_dir / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{run_dir} is not a run directory: no {CONFIG_FILE}{nearest_run(Path(run_dir))}")
    if distributed.will_write():
        hold_run_dir(run_dir)
    keys = {current_key(item.partition("=")[0]) for item in overrides}
    refuse_overrides(overrides, RESUMABLE_KEYS, "--resume", "a resumed run keeps what it trains" + (
        " and the k of the validation m@k that picks its best checkpoint (`nemo-jq eval RUN eval.num_samples=K` scores "
        "it at another k)" if "eval.num_samples" in keys else "") + (
        " and the expert layout its AdamW state was saved at (`nemo-jq eval` and `export` load its weights at any)"
        if keys & {"megatron.expert_parallel", "megatron.expert_tensor_parallel"} else ""))
    checkpoint = latest_checkpoint(run_dir / CHECKPOINT_DIR)
    if checkpoint is None and (run_dir / RESULTS_FILE).exists():
        raise FileNotFoundError(f"{run_dir} finished (its {RESULTS_FILE}) and its checkpoints are gone: nothing is left to "
                                "resume from (`nemo-jq report` still reads its results); train it again in another "
                                "train.run_dir")
    if checkpoint is None and not failed_start(run_dir):
        raise FileNotFoundError(f"{run_dir} has no checkpoint to resume from, and holds what a run does not write "
                                f"({'; '.join(not_written_by_a_run(run_dir))}): give the run's own directory")
    if checkpoint is None:
        raise FileNotFoundError(f"{run_dir} has no checkpoint to resume from (its start failed before the first): "
                                f"start it again with its command (train.run_dir={run_dir}, no --resume), which moves "
                                "this start aside")
    state = read_state(checkpoint)
    if (best := best_step_of(state)) is not None:  # the run's end tests it: gone, the whole resume trains in vain
        require_best(run_dir / CHECKPOINT_DIR, best, f"validation {state['best_metric']:g}, which the run's end tests",
                     f"evaluate the checkpoints still there (`nemo-jq eval {run_dir} --step N`)")
    config = at_home(load_config(run_dir / CONFIG_FILE, list(overrides), saved=True), run_dir)
    check_trained_with(config, checkpoint, ())
    if config.data.prepared_dir and not Path(config.data.prepared_dir).exists():  # --resume cannot name another
        raise FileNotFoundError(f"{run_dir} trains on data.prepared_dir={config.data.prepared_dir}, which is gone: move "
                                f"the prepared folder back there, or set data.prepared_dir in {run_dir / CONFIG_FILE} to "
                                "where it is now (the run checks that it holds the data it trained on)")
    return config, checkpoint


#: Keys whose value may differ from the one a checkpoint recorded without the run being another: where it and what it
#: reads are (a run or its data moved; the splits' digests, ``splits.json``, hold the data to what it trained on).
MOVABLE_KEYS = ("train.run_dir", *(f"{section}.{key}" for section, key in PATH_KEYS), "plugins")


def config_record(config: Config) -> dict[str, Any]:
    """What a checkpoint records of the config it was trained with (:func:`check_trained_with`): all of it, as JSON."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def check_trained_with(config: Config, checkpoint: Path, allowed: tuple[str, ...]) -> None:
    """``config`` (the run's ``config.yaml``, with a command's overrides) holds what the checkpoint's run trained with,
    but for the ``allowed`` keys, :data:`MOVABLE_KEYS` and :data:`RESUMABLE_KEYS` (a resume since rewrote them); else
    one line naming the first key that differs (an edited config.yaml resumed another q without a word, and another
    model's shape failed in a traceback). A checkpoint saved before checkpoints recorded it is not checked."""
    recorded = read_state(checkpoint).get("config")
    if not isinstance(recorded, dict):
        return
    now = config_record(config)
    differing = [key for key in _differences(recorded, now) if key not in {*allowed, *RESUMABLE_KEYS, *MOVABLE_KEYS}]
    if differing:
        key, more = differing[0], len(differing) - 1
        run_dir = Path(config.train.run_dir)
        raise ConfigError(f"{run_dir / CONFIG_FILE} says {key}={_shown(_value_at(now, key))}, but its checkpoint "
                          f"{checkpoint.name} was trained with {key}={_shown(_value_at(recorded, key))}"
                          f"{f' (and {more} more key' + 's' * (more > 1) + ')' if more else ''}: a run's config.yaml "
                          "holds what it trained with; put it back (a run of other settings is a new run)")


def refuse_overrides(overrides: list[str] | tuple[str, ...], allowed: tuple[str, ...], command: str, why: str) -> None:
    """One line refusing an override of a key outside ``allowed``, naming it and the keys ``command`` takes."""
    refused = [item for item in overrides if any(key not in allowed for key in keys_set_by(item))]
    for item in refused:  # a key no config has is a typo, which did-you-mean serves better than "cannot change"
        try:
            load_config(None, [item])
        except ConfigError as err:
            if "unknown config key" in str(err):
                raise ConfigError(f"{err} (with {command}: {', '.join(allowed)})") from None
    if refused:
        raise ValueError(f"{why}; {', '.join(refused)} cannot change with {command}. "
                         f"Overrides allowed with {command}: {', '.join(allowed)}")


def at_home(config: Config, run_dir: Path) -> Config:
    """A saved config with ``train.run_dir`` where the run is now (it may have moved since it was written), and its
    ``model.path`` where it moved with it: a model folder that shared a folder with the run (a warm-start experiment's
    warm policy, ``OUT/warm/SETTING/policy`` beside ``OUT/SETTING/METHOD/seedS``) is read from that folder's new place
    where the run's own moved there (``mv OUT OUT2``, or ``--overwrite``'s ``OUT.old-...``: the path written then may
    hold another experiment's policy now)."""
    saved, now = Path(config.train.run_dir), Path(run_dir).absolute()
    config.train.run_dir = str(run_dir)
    if config.model.path and Path(config.model.path).is_absolute() == saved.is_absolute():
        moved = moved_with(Path(config.model.path), saved, now)
        if moved is not None and moved.exists():
            config.model.path = str(moved)
    return config


def moved_with(path: Path, saved: Path, now: Path) -> Path | None:
    """Where ``path`` is now if the folder it shares with a run once at ``saved`` (not the root alone) moved with the
    run, now at ``now``; None where it did not move, or nothing but the root is shared."""
    common = Path(os.path.commonpath([path, saved]))
    inner = saved.relative_to(common).parts
    if common in (Path(common.anchor), Path(".")) or not inner or now.parts[-len(inner):] != inner:
        return None
    base = Path(*now.parts[:-len(inner)])
    return None if base == common.absolute() else base / path.relative_to(common)


def _shown(value: Any) -> str:
    """A config value as a ``key=value`` word spells it."""
    return value if isinstance(value, str) else json.dumps(value)


def holds_this_run(config: Config) -> tuple[str, list[str]]:
    """For a job that may run again with the same command: ``("resume", overrides)`` when ``train.run_dir`` holds this
    run with a checkpoint (``overrides``: the :data:`RESUMABLE_KEYS` the command changes, which the resume applies as
    ``--resume`` does), ``("restart", [])`` when it holds this run's start but no checkpoint yet (moved aside, nothing
    lost), ``("new", [])`` when it holds no run. A different run there (another config) is refused, as a new run's
    directory would be; so is a change to a key a resumed run keeps."""
    run_dir = Path(config.train.run_dir)
    if not (run_dir / CONFIG_FILE).exists():
        return "new", []
    saved = load_config(run_dir / CONFIG_FILE, saved=True)
    new = dataclasses.asdict(config)
    # train.run_dir: the run was found there, however the command spells it (relative, absolute) or it since moved
    differing = [key for key in _differences(dataclasses.asdict(saved), new) if key != "train.run_dir"]
    kept = [key for key in differing if key not in RESUMABLE_KEYS]
    if kept:
        raise FileExistsError(f"{run_dir} holds another run (its config.yaml differs in {first_few(kept)}, which a "
                              "resumed run keeps): choose another train.run_dir, or give the run's own values")
    if latest_checkpoint(run_dir / CHECKPOINT_DIR) is None:
        return "restart", []
    return "resume", [f"{key}={json.dumps(_value_at(new, key))}" for key in differing]


def _value_at(tree: dict[str, Any], key: str) -> Any:
    """The value of the dotted ``key`` (``train.max_steps``) in a config's nested dict."""
    for part in key.split("."):
        tree = tree[part]
    return tree


def _differences(saved: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ; a key only one side has is none (one added since the checkpoint was
    saved, whose default the run trained as, or one since removed: every run of an earlier version failed on it)."""
    keys = []
    for key in sorted(set(saved) & set(new)):
        a, b = saved[key], new[key]
        if isinstance(a, dict) and isinstance(b, dict) and not key.endswith(("options", "q_schedule")):
            keys += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            keys.append(f"{prefix}{key}")
    return keys


@dataclass(frozen=True)
class Selected:
    """A checkpoint of a run, and why it is the one used (eval and export say so, and record it)."""

    run_dir: Path
    checkpoint: Path
    step: int
    why: str

    def describe(self) -> dict[str, Any]:
        """The run (its folder, and its id where its checkpoint names one), the checkpoint and why it was chosen."""
        run_id = read_state(self.checkpoint).get("run_id")
        return {"run_dir": str(self.run_dir), **({"run_id": run_id} if run_id else {}), "checkpoint": str(self.checkpoint),
                "step": self.step, "selected": self.why}


#: What eval, generate and export take, said where the path given is neither.
NOT_A_RUN_ADVICE = f": give the run's directory (its train.run_dir) or a checkpoint in it (RUN/{CHECKPOINT_DIR}/step_N)"


def select_checkpoint(path: Path, which: str = "best") -> Selected:
    """The checkpoint at ``path`` (a checkpoint directory), or, for a run directory, its ``which``: ``best`` (by
    :func:`beats_best`, as training keeps it; the reason names a tie, and says when the latest stands in), ``latest``,
    or a step. Paths come back absolute, as reports carry them."""
    path = Path(path).resolve()
    if (path / STATE).exists():
        if which != "best":
            raise ValueError(f"--step {which} picks among a run's checkpoints: give the run directory, not {path}")
        run_dir = path.parent.parent
        if path.parent.name != CHECKPOINT_DIR or not (run_dir / CONFIG_FILE).exists():
            raise FileNotFoundError(f"checkpoint {path} is not inside a run directory (RUN/{CHECKPOINT_DIR}/step_N, "
                                    f"beside the RUN/{CONFIG_FILE} and RUN/{TOKENIZER_DIR}/ it is loaded with): give the "
                                    f"run directory it came from, with --step N, or copy it back into that run's "
                                    f"{CHECKPOINT_DIR}/")
        return Selected(run_dir, path, read_state(path)["step"], "the one given")
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (neither a checkpoint nor a run directory is there){NOT_A_RUN_ADVICE}")
    if not (path / CONFIG_FILE).exists():
        what = "a file" if path.is_file() else f"neither a checkpoint (no {STATE}) nor a run directory (no {CONFIG_FILE})"
        raise FileNotFoundError(f"{path} is {what}{nearest_run(path) or NOT_A_RUN_ADVICE}")
    root = path / CHECKPOINT_DIR
    saved = saved_steps(root)
    if which not in ("best", "latest") and saved:  # a step asked for: whatever ``latest`` says
        step = int(which) if which.isdigit() else None
        if step not in saved:
            raise ValueError(f"--step {which}: {path} has checkpoints at steps {', '.join(map(str, saved))} (or use best, "
                             "latest)")
        return Selected(path, root / step_dir_name(step), step, f"step {step}, as asked")
    latest = latest_checkpoint(root)
    if latest is None:
        raise FileNotFoundError(f"run {path} has no checkpoint yet (a run saves one every train.save_every steps, and "
                                "when it stops): let it train until it saves one, or, if its start failed, start it "
                                f"again with its command (train.run_dir={path}; the failed start is moved aside)")
    state = read_state(latest)
    if which == "latest":
        return Selected(path, latest, state["step"], "the latest")
    best = best_step_of(state)
    key = f"m@{load_config(path / CONFIG_FILE, saved=True).eval.num_samples}"
    if best is None:
        validated = any(record["kind"] == "validation" for record in read_metrics(path))
        unknown = not (path / METRICS_FILE).exists()  # deleted: its validations are not known, not absent
        return Selected(path, latest, state["step"], f"the latest (no validation {key} rose above 0)" if validated
                        else f"the latest (no {METRICS_FILE} says how its validations went)" if unknown
                        else "the latest (the run has no validation yet)")
    require_best(root, best, f"validation {key} {state['best_metric']:g}", "give --step latest or --step N")
    tied = [r["step"] for r in read_metrics(path) if r["kind"] == "validation" and r["step"] != best
            and r.get(key) == state["best_metric"] and r["step"] in saved]
    why = f"the best validation {key} ({state['best_metric']:g})"
    if tied:
        why += (f", tied with step{'s' if len(tied) > 1 else ''} {', '.join(map(str, tied))}: the earliest is kept, as "
                "training keeps it (--step latest or --step N for another)")
    return Selected(path, root / step_dir_name(best), best, why)


def require_best(root: Path, best: int, metric: str, fix: str) -> None:
    """The best checkpoint (step ``best``, its ``metric`` in words) is complete under ``root``; else one line with
    ``fix`` and the run's other checkpoints."""
    folder = root / step_dir_name(best)
    steps = saved_steps(root)
    others = f" (its checkpoints: steps {', '.join(map(str, steps))})" if steps else ""
    if not (folder / STATE).exists():
        raise FileNotFoundError(f"the run's best checkpoint, step {best} ({metric}), is {'incomplete' if folder.exists() else 'gone'}"
                                f" ({folder}): restore it from a copy of the run, or {fix}{others}")
    weights = folder / "model.safetensors"
    if weights.is_file() and (problem := weights_problem(weights)):  # found only when the end loads it: every step trained in vain
        raise ValueError(f"the run's best checkpoint, step {best} ({metric}), is damaged ({weights}: {problem}): restore it "
                         f"from a copy of the run, or {fix}{others}")


def weights_problem(path: Path) -> str | None:
    """What safetensors finds wrong with a weights file's header and extent (None: it is whole), the data not read."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):
            return None
    except Exception as err:  # noqa: BLE001 - safetensors' own error type, whatever the file's fault
        return f"truncated or corrupt: {err}"


def sampled_with(config: Config) -> dict[str, Any]:
    """How an evaluation sampled (``eval.num_samples``, ``eval.batch_size``, whose rows at once take their random
    draws together, and :data:`SAMPLING_KEYS`, overrides included): two reports of one checkpoint at other settings
    are told apart."""
    tree = dataclasses.asdict(config)
    return {key: _value_at(tree, key) for key in ("eval.num_samples", "eval.batch_size", *SAMPLING_KEYS)}


def evals_folder(run_dir: Path) -> Path:
    """``RUN_DIR/evals``, made if missing; a file in its place is one line."""
    folder = Path(run_dir) / EVALS_DIR
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} is a file: `nemo-jq eval` writes its reports into that folder; move the file "
                              "away")
    folder.mkdir(exist_ok=True)
    return folder


def write_evaluation(run_dir: Path, split: str, step: int, report: dict[str, Any]) -> Path:
    """``RUN_DIR/evals/<split>-step_N.json`` (``-2``, ``-3``, ... beside an earlier one, which is kept: one another
    eval writes at the same time too)."""
    folder, name, index = evals_folder(run_dir), f"{split}-{step_dir_name(step)}", 1
    text = json.dumps(report, indent=2) + "\n"
    while not write_new(path := folder / (f"{name}.json" if index == 1 else f"{name}-{index}.json"), text):
        index += 1
    return path


#: The model card an export carries (the Hugging Face Hub shows a folder's README.md).
MODEL_CARD = "README.md"


def metric_keys(scores: dict[str, Any]) -> list[str]:
    """The metric keys (``p@k``, ``m@k``) of a run's test scores or a row (not a row's ``p@k ±`` or ``p@k n``), in
    their order."""
    return [key for key in scores if key.startswith(("p@", "m@")) and " " not in key]


def results_problem(results: dict[str, Any]) -> str | None:
    """What keeps ``results`` from being what a finished run writes, as far as the report reads it (None: nothing)."""
    if not isinstance(results.get("objective"), str):
        return "no objective"
    if not isinstance(results.get("test"), dict):
        return "no test scores"
    if results.get("q_schedule") is not None and not isinstance(results["q_schedule"], dict):
        return "its q_schedule is not an object"
    test, keys = results["test"], metric_keys(results["test"])
    named = {"q": results.get("q"), **{f"test {key}": test[key] for key in keys}}
    wrong = [f"{name} is {value!r}" for name, value in named.items()
             if value is not None and not (is_number(value) and math.isfinite(value))]
    if wrong:  # a run writes no NaN score (a diverged one stops before its test), and the report's statistics fail on it
        return f"{wrong[0]}, not a number"
    if not keys:
        return "no test scores"
    unpaired = [key for key in keys if key.startswith("m@") and f"p@{key[2:]}" not in test]  # as a run writes them
    if unpaired:  # a score lost made the run a row of its own
        return f"test {unpaired[0]} without p@{unpaired[0][2:]}"
    return None if "p@1" in test else "no test p@1"


def card_results(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``results.json`` for its model card; None where it has none, or (said in a line: the card leaves the
    test scores out, the export goes on) one that is damaged."""
    path = run_dir / RESULTS_FILE
    if not path.exists():
        return None
    try:
        return read_json_file(path, "a finished run's results", results_problem, "the model card leaves the run's test "
                              f"scores out (`nemo-jq train --resume {run_dir}` writes it again, once it is moved aside)",
                              decode=nonfinite_back)
    except ValueError as err:
        print(f"nemo-jq: warning: {err}", file=sys.stderr)
        return None


def model_card(selected: Selected) -> str:
    """The export's model card: what trained it (estimator and q, or its schedule; the data and prompt format), the
    checkpoint it came from and why, its validation metrics (and the run's test scores, where it finished and this is
    the checkpoint it tested), the chat format and budgets to sample it as training did, and the run's whole config."""
    config_text = (selected.run_dir / CONFIG_FILE).read_text()
    config = load_config(selected.run_dir / CONFIG_FILE, saved=True)
    objective, rollout = config.objective, config.rollout
    q = f"q schedule {objective.q_schedule}" if objective.q_schedule else f"q = {objective.q:g}"
    records = read_metrics(selected.run_dir)
    validation = [record for record in records if record["kind"] == "validation" and record["step"] == selected.step]
    results = card_results(selected.run_dir)
    test = [record for record in records if record["kind"] == "test"]  # the best step, or the last where none was
    tested = results is not None and bool(test) and (test[-1].get("best_step") or test[-1]["step"]) == selected.step
    lines = ["---", "library_name: transformers", f"base_model: {config.model.path or 'none (a tiny Qwen3 from scratch)'}",
             "tags: [nemo-jq, reasoning, " + objective.name + "]", "---", "",
             f"# {selected.run_dir.name}, step {selected.step}", "",
             f"Trained by nemo-jq with **{objective.name}** ({q}) on {config.data.name} ({config.data.format} start), "
             f"M = {rollout.num_samples} rollouts a prompt.", "",
             f"- checkpoint: {selected.checkpoint} ({selected.why})"]
    if validation:
        lines.append("- validation at this step: " + ", ".join(f"{key} {value:.1f}" for key, value in validation[-1].items()
                                                               if key.startswith(("p@", "m@"))))
    if results is not None and tested:
        lines.append("- test (the run's own evaluation of this checkpoint): "
                     + ", ".join(f"{key} {value:.1f}" for key, value in results["test"].items()))
    lines += ["", "## Sampling it as training did", "",
              "The chat template (`chat_template.jinja`) is Qwen3's, with the generation prompt ending in "
              "`<think>\\n`: the model thinks, then answers after `</think>`. Training sampled at temperature "
              f"{rollout.temperature:g}, top-k {rollout.top_k}, top-p {rollout.top_p:g} "
              f"(`generation_config.json`), a thinking budget of {rollout.max_thinking_tokens} tokens (at the budget "
              f"`</think>` was forced) and {rollout.max_answer_tokens} answer tokens, ending at `<|im_end|>`. "
              "`nemo-jq generate` samples a run's checkpoint so.", "", "## The run's config", "", "```yaml",
              config_text.rstrip(), "```", ""]
    return "\n".join(lines)
