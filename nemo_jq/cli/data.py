"""``nemo-jq data prepare``: deterministic train/validation/test subsets of a dataset as JSONL, with a manifest."""

from __future__ import annotations

import argparse
from pathlib import Path

from nemo_jq.cli import arguments


def add_parser(commands) -> None:
    from nemo_jq.data.qa import describe_datasets

    data = commands.add_parser("data", help="dataset tools")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    prep = data_commands.add_parser(
        "prepare", help="write deterministic train/validation/test subsets as JSONL with a manifest",
        description="nemo-jq data prepare --dataset jsonl --source mine.jsonl --sizes 800,100,100 --out data/mine",
        epilog="datasets (a --source file gives every split; a folder, one file per split):\n" + describe_datasets(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prep.add_argument("--dataset", required=True, help="finqa, hotpotqa, musique or jsonl")
    prep.add_argument("--source", type=arguments.given,
                      help="local file, folder of split files, or hub name (default: the paper's hub name)")
    prep.add_argument("--hub-config", help="hub dataset config (hotpotqa: distractor)")
    prep.add_argument("--out", type=arguments.path, required=True, help="a new folder (one that holds prepared data is refused)")
    prep.add_argument("--overwrite", action="store_true", help="if --out holds prepared data, move it aside to NAME.old-<time> first")
    prep.add_argument("--sizes", help="train,validation,test sizes (default: the paper's for its datasets)")
    prep.add_argument("--seed", type=arguments.seed, default=0)
    prep.add_argument("--on-bad-row", default="skip", choices=("skip", "fail"))
    prep.add_argument("--template", type=arguments.with_escapes,
                      help="jsonl: user-turn template over {question} and {context}; \\n is a new line")
    prep.add_argument("--system", type=arguments.with_escapes, help="jsonl: system message for the warm format; \\n is a new line")
    prep.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                      help="a module or .py file that registers a dataset (docs/extending.md); repeatable")
    prep.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from nemo_jq.config import import_plugins
    from nemo_jq.data.prepare import PAPER_SIZES, PREPARE_FLAGS, PREPARED_FILES, describe_rejects, make_task, prepare, write_prepared
    from nemo_jq.runtime.outputs import claim_dir, refuse_foreign_files
    from nemo_jq.runtime.runs import RUN_FILES, run_above

    import_plugins(args.plugin)
    task = make_task(args.dataset, template=args.template, system=args.system, options=PREPARE_FLAGS)
    if args.sizes:
        parts = args.sizes.split(",")
        if len(parts) != 3 or not all(p.strip().isascii() and p.strip().isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(f"--sizes needs three whole numbers >= 1 (train,validation,test), e.g. 800,100,100; got {args.sizes!r}")
        sizes = tuple(int(p) for p in parts)
    elif args.dataset in PAPER_SIZES:
        sizes = PAPER_SIZES[args.dataset]
    else:
        raise ValueError(f"--sizes is required for dataset {args.dataset!r} (train,validation,test, e.g. 800,100,100)")
    if args.source and Path(args.source).exists() and Path(args.out).resolve() in (Path(args.source).resolve(),
                                                                                 *Path(args.source).resolve().parents):
        raise ValueError(f"--out {args.out} holds --source {args.source}: write the prepared data to a folder of its own "
                         "(moved aside with --overwrite, the source would go with it)")
    claim_dir(args.out, RUN_FILES, overwrite=False, what="a run", advice="prepared data goes in a folder of its own: "
              "choose another --out")
    if (above := run_above(Path(args.out))) is not None:  # the run's --overwrite would move the data with it
        raise ValueError(f"--out {args.out} is inside the run {above[0]} ({above[1]}): prepared data goes in a folder "
                         f"of its own (e.g. {above[0].parent / Path(args.out).name})")
    if not any((Path(args.out) / name).exists() for name in PREPARED_FILES):  # a folder of the user's own files
        refuse_foreign_files(args.out, "prepared data")
    claimed = {"what": "prepared data", "advice": "choose another --out, or pass --overwrite to move it aside first"}
    if not args.overwrite:  # said before the source is read (a download, a large file), not after
        claim_dir(args.out, PREPARED_FILES, overwrite=False, **claimed)
    splits, manifest = prepare(task, args.source, sizes, args.seed, hub_config=args.hub_config, on_bad_row=args.on_bad_row,
                               options=PREPARE_FLAGS)
    claim_dir(args.out, PREPARED_FILES, overwrite=args.overwrite, **claimed)  # moved aside only once the data is ready
    write_prepared(splits, manifest, args.out)
    for name, entry in manifest["sources"].items():
        derived = {k: v for k, v in entry["reference_sources"].items() if k != "answer"}
        print(f"{name}: {entry['rows']} rows, {describe_rejects(task, entry)}, selected {entry['selected']}, "
              f"{entry['unused']} unused" + "".join(f", y* from {k} in {v}" for k, v in derived.items()))
    print(f"wrote {args.out}/{{train,validation,test}}.jsonl and manifest.json")
    return 0
