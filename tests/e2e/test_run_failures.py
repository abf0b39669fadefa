"""What a new user met when runs went wrong (issue 34): two writers of one run directory, a diverged run, a full disk
or quota, a long prompt, a broken model folder, hints that did not work, and the smaller frictions. Each ends in one
line with exit code 2, and loses nothing."""

import errno
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import TINY_RUN, one_line_error, run_cli
from nemo_jq.config import load_config
from nemo_jq.recipe.trainer import Trainer
from nemo_jq.runtime.checkpoint import latest_checkpoint, load_checkpoint
from nemo_jq.runtime.monitor import RunLogger, read_metrics

ROOT = Path(__file__).resolve().parents[2]
QUICK = [*TINY_RUN, "train.max_steps=2", "eval.every=1000"]


def strict_json(line: str):
    """JSON as other languages read it: no bare NaN or Infinity."""
    return json.loads(line, parse_constant=lambda word: pytest.fail(f"{word} is not JSON"))


def files(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# ----------------------------------------------------------------------------- item 1: one writer per run directory
@pytest.mark.slow
def test_a_second_writer_of_a_held_run_directory_is_one_line_naming_the_holder(tmp_path, capsys):
    """A real process holds the directory; a new run there and a --resume of it are refused, naming it, and change
    nothing; once the holder dies (SIGKILL, a crash), its lock dies with it and the run resumes."""
    run_dir = tmp_path / "run"
    assert run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")[0] == 0
    script = tmp_path / "holder.py"
    script.write_text("import sys\nfrom nemo_jq.runtime.outputs import hold_run_dir\n\nhold_run_dir(sys.argv[1])\n"
                      "print('held', flush=True)\nsys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, script, run_dir], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = files(run_dir)
        for args in ([*QUICK, "objective.q=0.5", f"train.run_dir={run_dir}"], ["--resume", run_dir, "train.max_steps=3"]):
            code, _, err = run_cli(capsys, "train", *args)
            one_line_error(code, err, f"{run_dir} is in use by another run", f"pid {holder.pid} on host "
                           f"{socket.gethostname()}", f"holder.py {run_dir}", "choose another train.run_dir")
        assert files(run_dir) == before
    finally:
        holder.kill()
        holder.wait(timeout=30)
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=3")
    assert code == 0, err
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == [1, 2, 3]


def test_a_folder_whose_runs_are_in_use_is_not_moved_aside_nor_run_a_second_time(tmp_path, capsys):
    """A demo or experiment folder moved aside by --overwrite while its runs trained: the running one went on writing
    into the moved folder and its next run into the new one (a table mixing two demos). A second start of a running
    sweep (or demo) failed run by run, blaming each run, and a new one in its folder was told to continue it. All are
    refused up front, naming the holder; nothing moves."""
    from nemo_jq.runtime.outputs import claim_dir
    from nemo_jq.runtime.sweep import Sweep, run_here

    demo = tmp_path / "demo"
    sweep = Sweep.from_grid(demo, [], ["objective.name=garl,grpo", "train.max_steps=1"], None)
    sweep.write()
    script = tmp_path / "holder.py"
    script.write_text("import sys\nfrom nemo_jq.runtime.outputs import hold_run_dir\n\nhold_run_dir(sys.argv[1])\n"
                      "print('held', flush=True)\nsys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, script, demo / sweep.runs[1].name], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for overwrite in (True, False):  # a second start is not told to continue the demo, which is running
            with pytest.raises(FileExistsError, match=f"{demo / sweep.runs[1].name}.* in use by another run \\(pid "
                                                      f"{holder.pid} on host") as refused:
                claim_dir(demo, ("sweep.json",), overwrite=overwrite, what="a sweep", advice="continue it with --resume")
            assert "--resume" not in str(refused.value)
        with pytest.raises(FileExistsError, match=f"{demo / sweep.runs[1].name}.* in use by another run \\(pid "
                                                  f"{holder.pid} on host"):
            run_here(sweep)
        assert sorted(path.name for path in tmp_path.iterdir()) == ["demo", "holder.py"]
        assert not (demo / "logs").exists()  # the second start wrote nothing
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert claim_dir(demo, ("sweep.json",), overwrite=True, what="a sweep", advice="").name.startswith("demo.old-")


@pytest.mark.slow
def test_a_running_sweep_is_held_between_its_runs_and_as_one_starts(tmp_path):
    """A run holds its folder only once its start-up (imports, config, world) is done: in that while, and between two
    runs, `sweep --overwrite` moved the running sweep aside, and its runs went on into the new sweep's folder, counted
    there as its finished runs. The sweep's process holds the folder all along."""
    from nemo_jq.runtime.outputs import claim_dir
    from nemo_jq.runtime.sweep import Sweep

    demo = tmp_path / "demo"
    Sweep.from_grid(demo, [], ["objective.name=garl,grpo", "train.max_steps=1"], None).write()
    script = tmp_path / "sweeper.py"  # each run a stand-in that holds nothing (a run's start-up)
    script.write_text("import sys\nfrom nemo_jq.runtime.sweep import Sweep, run_here\n\n"
                      "run_here(Sweep.load(sys.argv[1]), threads=1, say=lambda line: print(line, flush=True), "
                      "python=(sys.executable, '-c', 'import time; time.sleep(120)'))\n")
    sweeper = subprocess.Popen([sys.executable, script, demo], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert "started" in (sweeper.stdout.readline() + sweeper.stdout.readline())  # its first run is starting
        with pytest.raises(FileExistsError, match=f"{demo}.* in use by another run \\(pid {sweeper.pid} on host"):
            claim_dir(demo, ("sweep.json",), overwrite=True, what="a sweep", advice="")
        assert sorted(path.name for path in tmp_path.iterdir()) == ["demo", "sweeper.py"]
    finally:
        sweeper.terminate()
        sweeper.wait(timeout=60)
    assert not (demo / ".nemo_jq.runs.lock").exists()  # let go when it ended


def test_the_sbatch_default_run_directories_never_collide():
    """15 of the 8B config names are also 0.6B config names: ``runs/NAME`` gave both runs one directory."""
    configs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("qwen3_*/*.yaml"))
    for script in ROOT.glob("launchers/*.sbatch"):
        (line,) = [line for line in script.read_text().splitlines() if line.startswith("RUN_DIR=")] or [None]
        if line is None:
            continue
        loop = f'for CONFIG in {" ".join(configs)}; do\n{line}\necho "$RUN_DIR"\ndone'
        dirs = subprocess.run(["bash", "-c", loop], capture_output=True, text=True, check=True).stdout.split()
        assert len(dirs) == len(configs) and len(set(dirs)) == len(dirs), (script.name, dirs)


# ----------------------------------------------------------------------------- item 3: divergence
@pytest.mark.parametrize("how", ["lr", "weights"])
def test_a_diverged_run_stops_in_one_line_and_keeps_its_last_good_checkpoint(tmp_path, capsys, monkeypatch, how):
    """optim.lr=1e30 used to exit 0 with every weight NaN in the saved checkpoint; a weight gone inf is caught too."""
    from nemo_jq.models.hf import HFPolicy

    run_dir = tmp_path / "run"
    overrides = [*QUICK, "train.max_steps=4", "train.save_every=1", f"train.run_dir={run_dir}"]
    if how == "lr":
        overrides.append("optim.lr=1e30")
    else:
        original = HFPolicy.optimizer_step

        def overflow_at_step_2(self):
            result = original(self)
            if self.weights_version == 2:
                next(self.model.parameters()).data[0, 0] = float("inf")
            return result

        monkeypatch.setattr(HFPolicy, "optimizer_step", overflow_at_step_2)
    code, _, err = run_cli(capsys, "train", *overrides)
    what = "the gradient norm is nan" if how == "lr" else "the weight tensor model.embed_tokens.weight is inf"
    one_line_error(code, err, "diverged at step 2", what, f"the last good checkpoint, {run_dir / 'checkpoints' / 'step_00000001'}, "
                   "is kept", "lower optim.lr")
    latest = latest_checkpoint(run_dir / "checkpoints")
    assert latest.name == "step_00000001" and not (run_dir / "checkpoints" / "step_00000002").exists()
    from safetensors.torch import load_file

    assert all(tensor.isfinite().all() for tensor in load_file(latest / "model.safetensors").values())
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        strict_json(line)


def test_metrics_stay_valid_json_and_read_back_as_numbers(tmp_path):
    logger = RunLogger(tmp_path, tensorboard=False)
    logger.log({"kind": "train", "step": 1, "loss": float("nan"), "log_p_hat": float("-inf"), "x": [float("inf")], "q": None})
    logger.close("finished")
    [line] = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert strict_json(line)["loss"] == "NaN"
    [record] = read_metrics(tmp_path)
    assert record["loss"] != record["loss"] and record["log_p_hat"] == float("-inf") and record["q"] is None


# ----------------------------------------------------------------------------- item 4: a full disk, a quota
@pytest.fixture
def small_disk(tmp_path):
    """A real 12 MiB tmpfs (mounting needs root); skipped, saying why, where it cannot be mounted."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip() or mounted.returncode}): the simulated "
                    "cases below still run")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_really_full_disk_is_one_line_and_the_last_good_checkpoint_stays_loadable(small_disk, capsys):
    """A checkpoint write that fills a real disk: the weights fit, the optimizer state does not, and torch says only
    ``unexpected pos``. (The old code got this one right by luck: torch's writer still held the deleted file open when
    it measured the space. The quota cases below are what it got wrong.)"""
    run_dir = small_disk / "run"
    tiny = [*QUICK, "model.tiny.hidden_size=64", "model.tiny.intermediate_size=384", f"train.run_dir={run_dir}"]
    assert run_cli(capsys, "train", *tiny)[0] == 0
    weights = (run_dir / "checkpoints" / "step_00000002" / "model.safetensors").stat().st_size
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    (small_disk / "filler").write_bytes(b"\0" * (free - weights - (600 << 10)))  # room for the weights and 600 KiB
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=4")
    one_line_error(code, err, "no space left on device", str(run_dir / "checkpoints" / "step_00000004"), "--resume")
    latest = latest_checkpoint(run_dir / "checkpoints")
    assert latest.name == "step_00000002" and not list((run_dir / "checkpoints").glob(".tmp-*"))
    (small_disk / "filler").unlink()
    state, _ = load_checkpoint(latest, Trainer.resume(run_dir).policy)
    assert state["step"] == 2


@pytest.mark.parametrize("failure", ["EDQUOT", "torch, with room on the disk"])
def test_a_quota_is_one_line_naming_it(tmp_path, capsys, monkeypatch, failure):
    """Simulated (a quota cannot be set on a tmpfs here): the second checkpoint's write fails as a quota makes it
    fail, with the OS's errno, or as torch reports it, hiding the errno while the disk itself has room (Lustre)."""
    from nemo_jq.models.hf import HFPolicy

    original, calls = HFPolicy.save, []

    def over_quota(self, path):
        calls.append(path)
        if len(calls) > 1:
            if failure == "EDQUOT":
                raise OSError(errno.EDQUOT, "Disk quota exceeded", str(Path(path) / "model.safetensors"))
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs 1002")
        original(self, path)

    monkeypatch.setattr(HFPolicy, "save", over_quota)
    monkeypatch.setattr("nemo_jq.runtime.checkpoint.shutil.disk_usage", lambda _p: SimpleNamespace(total=1 << 40, used=0, free=1 << 40))
    run_dir = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", *QUICK, "train.save_every=1", f"train.run_dir={run_dir}")
    one_line_error(code, err, "disk quota exceeded", str(run_dir / "checkpoints" / "step_00000002"), "lfs quota", "--resume")
    assert latest_checkpoint(run_dir / "checkpoints").name == "step_00000001"


# ----------------------------------------------------------------------------- item 5: long prompts, failed starts
def test_a_long_prompt_is_dropped_and_named_at_prepare_time_and_a_bom_and_repeated_ids_are_handled(tmp_path, capsys):
    rows = [{"id": "a", "question": "1+1?", "answer": "2"}, {"id": "b", "question": "x" * 100_000, "answer": "3"},
            {"id": "c", "question": "2+2?", "answer": "4", "Context": "a passage"},
            {"id": "a", "question": "3+3?", "answer": "6", "source": "book"}]
    source = tmp_path / "mine.jsonl"
    source.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())  # as Notepad saves it
    code, out, err = run_cli(capsys, "data", "prepare", "--dataset", "jsonl", "--source", source, "--sizes", "1,1,1",
                             "--out", tmp_path / "p")
    assert code == 0, err
    assert "0 bad, 1 over the 32000-character cap (row 2: id b, 100010 characters)" in out  # the BOM row is kept
    assert [line for line in err.splitlines() if "warning" in line] == [
        f"nemo-jq: warning: {source}: 1 example id(s) on more than one row: a (rows 1, 4): reports name examples by "
        "id, so make the ids unique",
        f"nemo-jq: warning: {source}: 1 row(s) hold the key 'Context' (rows 3), which is not read: did you mean "
        "'context'? (a row is read for question, answer, context, id, _id)",
        f"nemo-jq: warning: {source}: 1 row(s) hold the key 'source' (rows 4), which is not read (a row is read for "
        "question, answer, context, id, _id)"]
    # a folder of prepared data is refused before the source is read (a download, a large file), not after
    code, _, err = run_cli(capsys, "data", "prepare", "--dataset", "jsonl", "--source", tmp_path / "absent.jsonl",
                           "--sizes", "1,1,1", "--out", tmp_path / "p")
    one_line_error(code, err, f"{tmp_path / 'p'} already holds prepared data", "pass --overwrite")


def test_a_prompt_beyond_the_models_context_is_one_line_before_anything_is_written(tmp_path, capsys):
    """Training from data.source (no prepared folder, no manifest): a row over the cap is named as it is dropped; a
    prompt under it that the model's context cannot hold is an error naming it."""
    from nemo_jq.config import load_config
    from nemo_jq.data.prepare import build_task

    source = tmp_path / "mine.jsonl"
    questions = {5: "why " * 300, 8: "x" * 40_000}
    source.write_text("".join(json.dumps({"id": f"q{i}", "question": questions.get(i, f"{i}+1?"), "answer": str(i + 1)})
                              + "\n" for i in range(9)))
    data = ["data.name=jsonl", f"data.source={source}", "data.train_size=4", "data.validation_size=2", "data.test_size=2"]
    build_task(load_config(None, data).data)
    assert f"nemo-jq: warning: data.source {source} (all): 1 over the 32000-character cap (row 9: id q8, 40010 " \
           "characters) dropped" in capsys.readouterr().err
    source.write_text("".join(source.read_text().splitlines(keepends=True)[:8]))  # without q8
    run_dir = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", *QUICK, *data, "model.tiny.max_position_embeddings=128", f"train.run_dir={run_dir}")
    one_line_error(code, err, "example 'q5': its prompt is", "beyond the model's context of 128 tokens",
                   "raise model.tiny.max_position_embeddings")
    assert not run_dir.exists()
    # budgets that leave no room for any prompt are the budgets' fault: said so, not of the first example (generate's
    # question included, which the message named as a train example to drop)
    code, _, err = run_cli(capsys, "train", *QUICK, *data, "rollout.max_thinking_tokens=600", f"train.run_dir={run_dir}")
    one_line_error(code, err, "rollout.max_thinking_tokens=600, </think> and rollout.max_answer_tokens=",
                   "leave no room for a prompt in the model's context of 512 tokens", "lower rollout.max_thinking_tokens")
    assert not run_dir.exists()


def test_a_start_that_failed_before_its_first_checkpoint_never_blocks_the_retry(tmp_path, capsys, monkeypatch):
    """Killed or out of memory in its first step, a run left config.yaml, tokenizer/ and metrics.jsonl: the retry was
    refused ("holds a run: --resume") and --resume said there was no checkpoint."""
    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "train_step", lambda self, batch: (_ for _ in ()).throw(MemoryError("40 GB")))
        with pytest.raises(MemoryError):
            run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")
    assert (run_dir / "config.yaml").exists() and not (run_dir / "checkpoints").exists()
    code, _, err = run_cli(capsys, "train", "--resume", run_dir)
    one_line_error(code, err, "has no checkpoint to resume from", "start it again with its command")
    code, out, err = run_cli(capsys, "train", *QUICK, f"train.run_dir={run_dir}")
    assert code == 0, err
    assert "holds a start that never saved a checkpoint: moving it aside" in out
    (aside,) = tmp_path.glob("run.old-*")
    assert (aside / "config.yaml").exists() and not (aside / ".nemo_jq.lock").exists()


# ----------------------------------------------------------------------------- item 7: model, tokenizer, device
def test_model_tokenizer_and_device_mistakes_are_one_line_and_leave_nothing(tmp_path, capsys):
    from nemo_jq.data import SyntheticArithmetic
    from nemo_jq.data.chat import build_tokenizer
    from nemo_jq.models.hf import tiny_qwen3

    tokenizer = build_tokenizer(SyntheticArithmetic(3).corpus([]))
    good = tmp_path / "good"
    tiny_qwen3(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
               max_position_embeddings=128, seed=0).save_pretrained(good)
    tokenizer.save_pretrained(good)

    def variant(name, change):
        folder = tmp_path / name
        subprocess.run(["cp", "-r", str(good), str(folder)], check=True)
        change(folder)
        return f"model.path={folder}"

    def wider(folder):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))

    def deeper(folder):  # a layer more than the weights hold: it started random, without a word
        config = json.loads((folder / "config.json").read_text())
        config.pop("layer_types", None)
        (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))

    def no_template(folder):
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))

    def no_tokenizer(folder):
        for path in folder.iterdir():
            if path.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                path.unlink()

    cases = [
        (variant("wider", wider), ["its config.json does not match its weights", "in model.safetensors, [",
                                   "by config.json"]),
        (variant("deeper", deeper), ["its config.json builds 11 weights its weight files lack (model.layers.1.",
                                     "which would start random: use the config.json that came with these weights"]),
        (variant("no_template", no_template), ["has no chat template", "chat_template.jinja"]),
        (variant("no_tokenizer", no_tokenizer), ["has no tokenizer files", "hf download"]),
        ("train.device=gpu", ["train.device=gpu is not a device", "auto, cpu, cuda or cuda:N"]),
        ("train.device=meta", ["train.device=meta is not a device a run takes", "auto, cpu, cuda or cuda:N"]),
    ]
    for index, (override, fragments) in enumerate(cases):
        run_dir = tmp_path / f"run{index}"
        code, _, err = run_cli(capsys, "train", *QUICK, override, f"train.run_dir={run_dir}")
        one_line_error(code, err, *fragments)
        assert not run_dir.exists(), override


def test_a_qwen3_moe_folder_whose_config_does_not_fit_its_weights_is_one_line(tmp_path, capsys):
    """A Qwen3-MoE's config that puts a dense MLP where the weights hold experts (``mlp_only_layers``) trained with
    that MLP random; one routing to more experts than it has failed at the first forward; experts of another width
    failed inside transformers (its fused experts' names are not the file's, so the check before loading missed them)."""
    from helpers import moe_run_folder

    good = moe_run_folder(tmp_path)

    def variant(name, **changes):
        folder = tmp_path / name
        subprocess.run(["cp", "-r", str(good), str(folder)], check=True)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        return folder

    for folder, fragments in ((variant("dense_layer", mlp_only_layers=[0]), ["builds 3 weights its weight files lack "
                                                                            "(model.layers.0.mlp.down_proj.weight"]),
                              (variant("top_k", num_experts_per_tok=8), ["num_experts_per_tok=8 of num_experts=4"]),
                              (variant("narrow", moe_intermediate_size=8), ["its config.json does not match its weights"])):
        code, _, err = run_cli(capsys, "train", *QUICK, f"model.path={folder}", f"train.run_dir={tmp_path / 'run'}")
        one_line_error(code, err, f"model folder {folder}", *fragments)
        assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- item 10: hints that work
def test_the_hub_hint_names_todays_command(monkeypatch):
    import huggingface_hub

    from nemo_jq.models.common import resolve_pretrained

    def offline(*_args, **_kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError) as raised:
        resolve_pretrained("Qwen/Qwen3-0.6B")
    message = str(raised.value)  # today's command first; the one huggingface-hub before 0.34 had, after it
    assert "(`hf download Qwen/Qwen3-0.6B`;" in message and message.index("hf download") < message.index("huggingface-cli")


def test_the_readme_commands_name_a_kept_step_and_a_ui_that_the_install_has():
    import doc_pages

    from nemo_jq.config import load_config

    block = (ROOT / "docs" / "training.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    [train] = [line.split("#")[0].split() for line in block.splitlines() if line.startswith("nemo-jq train --config")]
    [longer] = [line.split("#")[0].split() for line in block.splitlines() if "--resume" in line and "=" in line]
    [step] = [line.split("--step")[1].split()[0] for line in block.splitlines() if "eval" in line and "--step" in line]
    config = load_config(ROOT / train[3], [*train[4:], *longer[4:]])
    first = load_config(ROOT / train[3], train[4:])
    saves, done = set(), 0
    for run in (first, config):  # every save_every steps, and at each end; the newest keep_checkpoints are kept
        end = run.train.epochs * -(-run.data.train_size // run.train.batch_size)
        saves |= {s for s in range(done + 1, end + 1) if s % run.train.save_every == 0} | {end}
        done = end
    assert int(step) in sorted(saves)[-config.train.keep_checkpoints:], (step, sorted(saves))
    [ui] = [line for line in doc_pages.text().splitlines() if "mlflow ui --backend-store-uri" in line]
    assert "pip install mlflow " in ui or "pip install mlflow&" in ui  # the tracking extra's mlflow-skinny has no server


# ----------------------------------------------------------------------------- item 11: smaller frictions
def test_a_q_that_nothing_reads_is_a_one_line_warning(capsys):
    from nemo_jq.config import ConfigError, load_config

    load_config(None, ["objective.name=grpo", "objective.q=0.5"])
    load_config(None, ["objective.name=garl", "objective.q=0.25", "objective.q_schedule={name: step, switch_step: 5}"])
    load_config(None, ["objective.name=garl", "objective.q=0.25"])
    assert capsys.readouterr().err.splitlines() == [
        "nemo-jq: warning: objective.q=0.5 is ignored: objective.name=grpo takes no q",
        "nemo-jq: warning: objective.q=0.25 is ignored: objective.q_schedule sets q at every step"]
    # so is every other key a run does not read: a schedule without a q, a guard switched off, another engine's,
    # placement's, optimizer's, model source's or dataset's key
    load_config(None, ["objective.name=grpo", "objective.q_schedule={name: linear, num_steps: 10}", "guard.patience=5",
                       "rollout.vllm_kv_cache_gb=4", "rollout.sync_bucket_mb=1", "optim.momentum=0.9",
                       "train.device=cpu", "model.compile=true", "data.on_bad_row=fail"])
    assert capsys.readouterr().err.splitlines() == [
        "nemo-jq: warning: objective.q_schedule={'name': 'linear', 'num_steps': 10} is ignored: objective.name=grpo "
        "takes no q",
        "nemo-jq: warning: guard.patience=5 is ignored: guard.enabled=false",
        "nemo-jq: warning: rollout.vllm_kv_cache_gb=4.0 is ignored: rollout.engine=native",
        "nemo-jq: warning: rollout.sync_bucket_mb=1.0 is ignored: rollout.placement=colocated",
        "nemo-jq: warning: optim.momentum=0.9 is ignored: optim.name=adamw (SGD's)",
        "nemo-jq: warning: model.compile=True is ignored: train.device=cpu (it compiles on a GPU)",
        "nemo-jq: warning: data.on_bad_row=fail is ignored: the synthetic task reads no source"]
    load_config(None, ["model.backend=megatron", "train.device=cuda", "model.compile=true"])
    assert capsys.readouterr().err.splitlines() == [
        "nemo-jq: warning: model.compile=True is ignored: model.backend=megatron (the hf backend's)"]
    # the native sampler's GPU decode under another engine, or off; the KV budget under vLLM, which sizes its own cache
    load_config(None, ["rollout.engine=vllm", "rollout.cuda_graphs=false", "rollout.kv_cache_tokens=4096"])
    load_config(None, ["train.device=cuda", "rollout.cuda_graphs=false", "rollout.compile=false"])
    load_config(None, ["train.device=cpu", "rollout.cuda_graphs=false"])
    assert capsys.readouterr().err.splitlines() == [
        "nemo-jq: warning: rollout.cuda_graphs=False is ignored: rollout.engine=vllm (the native sampler's)",
        "nemo-jq: warning: rollout.kv_cache_tokens=4096 is ignored: rollout.engine=vllm (vLLM sizes its own cache: "
        "rollout.vllm_kv_cache_gb, rollout.vllm_memory_utilization)",
        "nemo-jq: warning: rollout.compile=False is ignored: rollout.cuda_graphs=false (it compiles the graph path's "
        "steps)",
        "nemo-jq: warning: rollout.cuda_graphs=False is ignored: train.device=cpu (the GPU's decode)"]
    # another guard action's, correction's or tracker's key (a misspelt estimator was read by nothing, unsaid)
    load_config(None, ["guard.enabled=true", "guard.action=lower_lr", "guard.estimator=grpoo", "objective.importance=none",
                       "objective.importance_cap=5", "tracking.wandb_project=mine", "tracking.mlflow_experiment=mine"])
    load_config(None, ["guard.enabled=true", "guard.factor=0.25", "objective.importance=mask", "objective.importance_cap=5",
                       "objective.importance_bounds=[0.5, 2]", "objective.importance=auto"])
    assert capsys.readouterr().err.splitlines() == [
        "nemo-jq: warning: guard.estimator=grpoo is ignored: guard.action=lower_lr (switch_estimator's)",
        "nemo-jq: warning: objective.importance_cap=5.0 is ignored: objective.importance=none",
        "nemo-jq: warning: tracking.wandb_project=mine is ignored: tracking.wandb=false",
        "nemo-jq: warning: tracking.mlflow_experiment=mine is ignored: tracking.mlflow=false",
        "nemo-jq: warning: guard.factor=0.25 is ignored: guard.action=switch_estimator (lower_q's and lower_lr's)"]
    with pytest.raises(ConfigError, match=r"data.template is for a dataset whose prompts it shapes \(jsonl\): the synthetic task builds"):
        load_config(None, ['data.template="Q: {question}"'])


def test_checkpoints_follow_the_umask_and_the_progress_line_shows_its_own_step(tmp_path, capsys):
    run_dir = tmp_path / "run"
    previous = os.umask(0o002)
    try:
        code, _, err = run_cli(capsys, "train", *QUICK, "data.train_size=40", "train.max_steps=10",
                               "train.save_every=10", f"train.run_dir={run_dir}")
    finally:
        os.umask(previous)
    assert code == 0, err
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o664}, modes
    losses = {r["step"]: f"{r['loss']:.4g}" for r in read_metrics(run_dir) if r["kind"] == "train"}
    lines = [line for line in err.splitlines() if line.startswith(f"train {run_dir.name}: ")]
    assert len(lines) == 10
    for line in lines:  # "train run: 3/10 (1.2 steps/s, 6 s left), loss=...": step 3's figures
        step = int(line.split(": ")[1].split("/")[0])
        assert f"loss={losses[step]}," in line, (line, losses)


# ----------------------------------------------------------------------------- what a resume may change
def test_a_requeued_command_applies_its_changed_limits_however_it_spells_the_run_directory(tmp_path, capsys, monkeypatch):
    """The job's command run again with a higher train.max_steps (or the run directory spelled absolute, where it was
    relative) resumed with the old limits (or was refused as "another run")."""
    monkeypatch.chdir(tmp_path)
    assert run_cli(capsys, "train", "--requeue", *QUICK, "train.run_dir=run")[0] == 0
    run_dir = tmp_path / "run"
    code, _, err = run_cli(capsys, "train", "--requeue", *QUICK, "train.max_steps=3", "eval.every=3",
                           f"train.run_dir={run_dir}")
    assert code == 0, err
    config = load_config(run_dir / "config.yaml")
    assert (config.train.max_steps, config.eval.every) == (3, 3)
    records = read_metrics(run_dir)
    assert {"kind": "resume", "step": 2, "overrides": ["eval.every=3", "train.max_steps=3"]} in records
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    # the job launched again once the run has finished: its results, after a line saying so (only the JSON was shown)
    code, out, err = run_cli(capsys, "train", "--requeue", *QUICK, "train.max_steps=3", "eval.every=3", "train.run_dir=run")
    assert code == 0 and out.startswith("nemo-jq train: run: the run finished its train.max_steps=3 steps and has "
                                        "nothing left to train"), out
    code, _, err = run_cli(capsys, "train", "--requeue", *QUICK, "train.max_steps=3", "optim.lr=0.1", "train.run_dir=run")
    one_line_error(code, err, "run holds another run (its config.yaml differs in optim.lr, which a resumed run keeps)")


def test_a_resume_never_ends_a_run_below_its_step_nor_trains_another_objective_than_its_checkpoint(tmp_path, capsys):
    """A run at step 2 resumed with train.max_steps=1 wrote its final results at step 2 under a config saying 1; one
    whose config.yaml was edited to another objective trained the checkpoint's and recorded the edited one."""
    run_dir = tmp_path / "run"
    Trainer(load_config(None, [*QUICK, "train.max_steps=4", f"train.run_dir={run_dir}"])).fit(max_steps=2)
    code, _, err = run_cli(capsys, "train", "--resume", run_dir, "train.max_steps=1")
    one_line_error(code, err, "the run is at step 2, at or past its train.max_steps=1 steps: raise train.max_steps to go "
                   f"past step 2 (e.g. --resume {run_dir} train.max_steps=4)")
    config = run_dir / "config.yaml"
    saved = config.read_text()
    config.write_text(saved.replace("name: garl", "name: paft"))
    code, _, err = run_cli(capsys, "train", "--resume", run_dir)
    one_line_error(code, err, f"{config} says objective.name=paft, but its checkpoint step_00000002 was trained with "
                              "objective.name=garl: a run's config.yaml holds what it trained with; put it back")
    state = run_dir / "checkpoints" / "step_00000002" / "state.json"  # a checkpoint from before they recorded their config
    state.write_text(json.dumps({key: value for key, value in json.loads(state.read_text()).items() if key != "config"}))
    code, _, err = run_cli(capsys, "train", "--resume", run_dir)
    one_line_error(code, err, f"{config} says objective.name=paft, but its checkpoint", "trains garl",
                   "put objective.name=garl back")
    assert not (run_dir / "results.json").exists() and config.read_text() != saved


@pytest.mark.slow  # a run, with its imports
def test_a_compile_asked_for_where_auto_finds_no_gpu_is_said_once_as_the_run_starts(tmp_path, capsys):
    """``model.compile=true`` with ``train.device=auto`` on a machine without a GPU: the run trains uncompiled, and
    says so (a config read on a login node for a GPU job says nothing: only where the run is decides)."""
    load_config(None, ["model.compile=true"])
    assert capsys.readouterr().err == ""
    code, _, err = run_cli(capsys, "train", *TINY_RUN, "train.max_steps=1", "model.compile=true",
                           f"train.run_dir={tmp_path / 'run'}")
    assert code == 0 and err.count("nemo-jq: warning: model.compile=true is ignored: this run is on cpu (it compiles "
                                   "on a GPU)") == 1, err
