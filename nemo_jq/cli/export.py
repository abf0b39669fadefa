"""``nemo-jq export``: a checkpoint as an HF folder, with a record of where it came from."""

from __future__ import annotations

import argparse
from pathlib import Path

from nemo_jq.cli import arguments
from nemo_jq.cli.evaluate import load


def add_parser(commands) -> None:
    export = commands.add_parser("export", help="export a checkpoint to an HF folder")
    export.add_argument("checkpoint", type=arguments.path, help="a checkpoint directory, or a run directory (its best checkpoint)")
    export.add_argument("--out", type=arguments.path, required=True)
    export.add_argument("--step", default="best", help=arguments.STEP_HELP)
    export.add_argument("overrides", nargs="*", default=[], help="where it runs, e.g. train.device=cpu (a run trained on a GPU)")
    export.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nemo_jq.models.export import EXPORT_MARKER, files_of_earlier_export, make_readable, record_source, sample_as
    from nemo_jq.recipe.components import picked
    from nemo_jq.runtime import distributed
    from nemo_jq.runtime.checkpoint import out_of_space
    from nemo_jq.runtime.outputs import staged
    from nemo_jq.runtime.runs import MODEL_CARD, model_card

    chosen = picked(args.checkpoint, args.step).describe()  # --out checked before minutes of loading
    earlier = earlier_source(args.out)
    if earlier and not same_run(earlier, chosen):  # a run may start from it (model.path)
        raise FileExistsError(f"--out {args.out} holds the export of another run ({earlier.get('run_dir')}, step "
                              f"{earlier.get('step')}): choose another --out, or move that export away first")
    replaces = files_of_earlier_export(args.out)
    made = not Path(args.out).exists()
    writes = distributed.will_write()
    try:  # staged before minutes of loading: an --out it cannot write is told at once
        with staged(args.out, last=EXPORT_MARKER, replaces=replaces, writes=writes) as staging:
            loaded = load(args)
            selected = loaded.selected
            loaded.components.policy.export(staging, loaded.components.tokenizer)
            if writes:
                sample_as(staging, loaded.components.config.rollout)
                (staging / MODEL_CARD).write_text(model_card(selected))
                record_source(staging, selected.describe(), written=[MODEL_CARD])
    except Exception as err:  # safetensors' own error hides the disk's (a traceback): said as the disk's, with --out
        space = out_of_space(err, Path(args.out).absolute().parent)
        if space is None or (isinstance(err, OSError) and err.filename is not None):
            raise
        raise OSError(space[0], space[1], str(args.out)) from err
    if writes:
        make_readable(args.out, folder_too=made)  # a folder of the user's keeps its mode
        print(f"exported step {selected.step} of {selected.run_dir} ({selected.why}) to {args.out}"
              + (f", replacing its export of step {earlier.get('step')}" if earlier else ""))
    return 0


def same_run(earlier: dict, chosen: dict) -> bool:
    """Whether an export's source and a chosen checkpoint are one run's: the folder and, where both checkpoints name
    one, the run's id (another run started in the folder, ``--overwrite``, is another); a run moved since is the same
    (its old folder gone), a copy beside it another (it may train on apart)."""
    from nemo_jq.runtime.runs import last_checkpoint_state

    folder = Path(earlier.get("run_dir", "")) == Path(chosen["run_dir"])
    if not (earlier.get("run_id") and chosen.get("run_id")):
        return folder
    if earlier["run_id"] != chosen["run_id"]:
        return False
    if folder:
        return True
    try:  # the run still in its old folder: this is a copy of it
        there = (last_checkpoint_state(Path(earlier["run_dir"])) or {}).get("run_id")
    except (OSError, ValueError):
        there = None
    return there != earlier["run_id"]


def earlier_source(out: Path) -> dict | None:
    """Where the export already in ``out`` came from (its marker's ``source``); None where there is none."""
    import json

    from nemo_jq.models.export import EXPORT_MARKER

    try:
        source = json.loads((Path(out) / EXPORT_MARKER).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return source if isinstance(source, dict) else None
