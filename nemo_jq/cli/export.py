"""``nemo-jq export``: a checkpoint as an HF folder, with a record of where it came from."""

from __future__ import annotations

import argparse
from pathlib import Path

from nemo_jq.cli import arguments
from nemo_jq.cli.evaluate import load


def add_parser(commands) -> None:
    export = commands.add_parser("export", help="export a checkpoint to an HF folder")
    export.add_argument("checkpoint", type=Path, help="a checkpoint directory, or a run directory (its best checkpoint)")
    export.add_argument("--out", type=Path, required=True)
    export.add_argument("--step", default="best", help=arguments.STEP_HELP)
    export.add_argument("overrides", nargs="*", help="where it runs, e.g. train.device=cpu (a run trained on a GPU)")
    export.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nemo_jq.models.export import record_source
    from nemo_jq.runtime import distributed
    from nemo_jq.runtime.runs import MODEL_CARD, model_card

    loaded = load(args)
    selected = loaded.selected
    loaded.components.policy.export(args.out, loaded.components.tokenizer)
    if distributed.is_writer():
        (args.out / MODEL_CARD).write_text(model_card(selected))
        record_source(args.out, selected.describe(), written=[MODEL_CARD])
        print(f"exported step {selected.step} of {selected.run_dir} ({selected.why}) to {args.out}")
    return 0
