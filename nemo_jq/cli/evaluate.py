"""``nemo-jq eval``: a checkpoint's p@1, p@k and m@k on a split, printed and kept beside the run."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys

from nemo_jq.cli import arguments


def add_parser(commands) -> None:
    evaluate = commands.add_parser("eval", help="evaluate a checkpoint on a split")
    evaluate.add_argument("checkpoint", type=arguments.path, help="a checkpoint directory, or a run directory (its best checkpoint)")
    evaluate.add_argument("--split", default="test", choices=("train", "validation", "test"))
    evaluate.add_argument("--step", default="best", help=arguments.STEP_HELP)
    evaluate.add_argument("overrides", nargs="*", default=[],
                          help="how it samples and where it runs, e.g. eval.num_samples=16 train.device=cpu")
    evaluate.set_defaults(run=run)


def load(args: argparse.Namespace):
    """The checkpoint ``args`` names, loaded for inference with the overrides its command takes (eval, generate,
    export)."""
    from nemo_jq.recipe.components import load_for_inference

    return load_for_inference(args.checkpoint, args.overrides, args.step, command=args.command)


def run(args: argparse.Namespace) -> int:
    from nemo_jq.recipe.evaluation import Evaluator
    from nemo_jq.runtime import distributed
    from nemo_jq.runtime.runs import EVALS_DIR, evals_folder, sampled_with, write_evaluation

    loaded = load(args)
    selected = loaded.selected
    folder = os.stat(selected.run_dir).st_ino  # the run's folder: one moved aside meanwhile holds another run there

    def not_kept(err: OSError) -> None:
        """Another user's run, a read-only mount: evaluated all the same, and said (else ``err`` is raised)."""
        if err.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise err
        if distributed.is_writer():
            print(f"nemo-jq: warning: {selected.run_dir} cannot be written ({(err.strerror or str(err)).lower()}): the "
                  f"evaluation is printed, not kept in its {EVALS_DIR}/", file=sys.stderr)

    kept = written = None
    try:
        kept = evals_folder(selected.run_dir)  # before the evaluation, not after it
    except OSError as err:
        not_kept(err)
    noise = loaded.components.config.data.label_noise
    if args.split == "train" and noise and distributed.is_writer():
        print(f"nemo-jq: warning: the train split is scored against its labels as the run trained on them: "
              f"data.label_noise={noise:g} of them made wrong", file=sys.stderr)
    config = loaded.components.config
    report = {"split": args.split, **selected.describe(), **Evaluator(loaded.components).evaluate(args.split),
              "sampled_with": sampled_with(config)}
    if distributed.is_writer():
        print(json.dumps(report, indent=2))
        moved = not selected.run_dir.is_dir() or os.stat(selected.run_dir).st_ino != folder
        if moved and kept:  # --overwrite moved it aside (a new run in its place), or it was moved: the report is its
            print(f"nemo-jq: warning: {selected.run_dir} was moved while it was evaluated (another run may be there "
                  f"now): the evaluation is printed, not kept in its {EVALS_DIR}/", file=sys.stderr)
        try:  # its evals/ may be there from before, where nothing can now be written
            written = write_evaluation(selected.run_dir, args.split, selected.step, report) if kept and not moved else None
        except OSError as err:
            not_kept(err)
        print(f"nemo-jq: evaluated step {selected.step} of {selected.run_dir} ({selected.why})"
              + (f"; wrote {written}" if written else ""), file=sys.stderr)
    return 0
