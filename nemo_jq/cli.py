"""The ``nemo-jq`` command: train, eval, export, theory."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nemo-jq", description="Post-train reasoning LLMs on the J_Q loss continuum.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser(
        "train",
        help="train one run; with no arguments, the embedded CPU cold-start comparison",
        description="nemo-jq train --config configs/x.yaml objective.name=paft objective.q=0.75",
    )
    train.add_argument("--config", type=Path, help="YAML config (defaults: the embedded CPU demo settings)")
    train.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    train.add_argument("--demo-dir", type=Path, default=Path("runs/cold_start"), help="output of the no-argument demo")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides")

    evaluate = commands.add_parser("eval", help="evaluate a checkpoint on a split")
    evaluate.add_argument("checkpoint", type=Path, help="a checkpoint directory, or a run directory (its best checkpoint)")
    evaluate.add_argument("--split", default="test", choices=("train", "validation", "test"))
    evaluate.add_argument("overrides", nargs="*", help="e.g. eval.num_samples=16")

    export = commands.add_parser("export", help="export a checkpoint to an HF folder")
    export.add_argument("checkpoint", type=Path, help="a checkpoint directory, or a run directory (its best checkpoint)")
    export.add_argument("--out", type=Path, required=True)

    data = commands.add_parser("data", help="dataset tools")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    prep = data_commands.add_parser(
        "prepare", help="write deterministic train/validation/test subsets as JSONL with a manifest"
    )
    prep.add_argument("--dataset", required=True, help="finqa, hotpotqa, musique or jsonl")
    prep.add_argument("--source", help="local file, folder of split files, or hub name (default: the paper's hub name)")
    prep.add_argument("--hub-config", help="hub dataset config (hotpotqa: distractor)")
    prep.add_argument("--out", type=Path, required=True)
    prep.add_argument("--sizes", help="train,validation,test sizes (default: the paper's for its datasets)")
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--on-bad-row", default="skip", choices=("skip", "fail"))
    prep.add_argument("--template", help="jsonl: user-turn template over {question} and {context}")
    prep.add_argument("--system", help="jsonl: system message for the warm format")

    theory = commands.add_parser("theory", help="print the paper's stylised results and plot escape times")
    theory.add_argument("--out", type=Path, default=Path("runs/theory"), help="directory for theory.json and escape_time.png")

    args, extra = parser.parse_known_args(argv)
    stray = [word for word in extra if word.startswith("-") or "=" not in word]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:  # key=value words after an option land here
        args.overrides = [*args.overrides, *extra]
    try:
        return _dispatch(args)
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"nemo-jq {args.command}: error: {err}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "theory":
        from nemo_jq.theory.report import run

        run(args.out)
        return 0
    if args.command == "data":
        return _prepare_data(args)

    from nemo_jq.runs import load_for_inference

    if args.command == "train":
        if args.resume is not None:
            from nemo_jq.trainer import Trainer

            result = Trainer.resume(args.resume).fit()
        elif args.config is None and not args.overrides:
            from nemo_jq.demo import run_demo

            run_demo(args.demo_dir)
            return 0
        else:
            from nemo_jq.config import load_config
            from nemo_jq.trainer import Trainer

            result = Trainer(load_config(args.config, args.overrides)).fit()
        print(json.dumps(result, indent=2))
        return 0

    trainer = load_for_inference(args.checkpoint, getattr(args, "overrides", ()))
    if args.command == "eval":
        print(json.dumps({"split": args.split, **trainer.evaluate(args.split)}, indent=2))
    else:
        trainer.policy.export(args.out, trainer.tokenizer)
        print(f"exported to {args.out}")
    return 0


def _prepare_data(args: argparse.Namespace) -> int:
    from nemo_jq.data.prepare import PAPER_SIZES, make_task, prepare, write_prepared

    if args.sizes:
        sizes = tuple(int(n) for n in args.sizes.split(","))
        if len(sizes) != 3:
            raise ValueError(f"--sizes needs three numbers (train,validation,test); got {args.sizes!r}")
    elif args.dataset in PAPER_SIZES:
        sizes = PAPER_SIZES[args.dataset]
    else:
        raise ValueError(f"--sizes is required for dataset {args.dataset!r}")
    task = make_task(args.dataset, template=args.template, system=args.system)
    splits, manifest = prepare(task, args.source, sizes, args.seed, hub_config=args.hub_config, on_bad_row=args.on_bad_row)
    write_prepared(splits, manifest, args.out)
    for name, entry in manifest["sources"].items():
        derived = {k: v for k, v in entry["reference_sources"].items() if k != "answer"}
        print(f"{name}: {entry['rows']} rows, {len(entry['bad'])} bad, {len(entry['over_cap'])} over the cap, "
              f"selected {entry['selected']}, {entry['unused']} unused"
              + "".join(f", y* from {k} in {v}" for k, v in derived.items()))
    print(f"wrote {args.out}/{{train,validation,test}}.jsonl and manifest.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
