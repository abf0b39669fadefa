"""Deterministic train/validation/test subsets with a manifest that accounts for every input row.

Rows are parsed in their native schema; malformed ones are counted with their ids and reasons
(``on_bad_row="fail"`` stops at the first instead); rows whose linearised input reaches the
dataset's character cap are dropped and listed; the rest are shuffled with the seed and the
requested sizes taken in order, so validation and test drawn from one source split are disjoint.
For every source split the manifest satisfies ``rows = bad + over_cap + selected + unused``, and
``reference_sources`` counts where each valid row's y* came from (FinQA: ``answer`` or ``exe_ans``).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import random
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_jq.data.base import Example, Splits, Task, check_scoring
from nemo_jq.data.noise import corrupt_labels
from nemo_jq.data.qa import DATASETS, HUB_SOURCES, BadRow, QATask, record_id, required_answer, required_text
from nemo_jq.data.sources import SUFFIXES, UnreadableRow, find_split_file, folder_split_names, read_hub, read_rows, sha256
from nemo_jq.data.synthetic import SyntheticArithmetic
from nemo_jq.registry import blamed_on_plugin, plugin_of
from nemo_jq.typed import ConfigError, first_few

SPLITS = ("train", "validation", "test")
#: The paper's subset sizes (Appendix F): train / validation / test.
PAPER_SIZES = {"finqa": (6145, 872, 1132), "hotpotqa": (9067, 342, 343), "musique": (9985, 579, 445)}
BAD_ROW_POLICIES = ("skip", "fail")
#: What ``write_prepared`` writes into a prepared folder.
PREPARED_FILES = ("manifest.json", *(f"{split}.jsonl" for split in SPLITS))
#: The type of each key of a prepared row (``Example``'s fields as JSON), checked at load: the folder may be edited.
PREPARED_ROW_TYPES = {"id": str, "question": str, "answer": str, "context": str, "rationale": (str, type(None)),
                      "aliases": list, "meta": dict}


@dataclass(frozen=True)
class OptionNames:
    """How the command that prepares data spells the options its error messages tell a person to change."""

    source: str
    #: Over ``{split}``, the size option of that split.
    sizes: str
    skip_bad_rows: str
    template: str
    system: str
    hub_config: str


#: A run's config keys: ``nemo-jq train`` prepares a ``data.source`` in memory (the default of :func:`prepare`).
CONFIG_KEYS = OptionNames(source="data.source", sizes="data.{split}_size", skip_bad_rows="data.on_bad_row=skip",
                          template="data.template", system="data.system_prompt", hub_config="data.hub_config")
#: ``nemo-jq data prepare``'s flags.
PREPARE_FLAGS = OptionNames(source="--source", sizes="--sizes", skip_bad_rows="--on-bad-row skip",
                            template="--template", system="--system", hub_config="--hub-config")
#: A prepared folder's manifest.json keys, as its checks name them.
MANIFEST_KEYS = OptionNames(source="its 'source'", sizes="its 'sizes'", skip_bad_rows="its 'on_bad_row'",
                            template="its 'template'", system="its 'system'", hub_config="its 'hub_config'")


def make_task(name: str, *, template: str | None = None, system: str | None = None,
              options: OptionNames = CONFIG_KEYS) -> QATask:
    """The dataset's task; ``template`` and ``system`` shape the prompts of a dataset that takes them (``jsonl``, or a
    plugin's task with those fields), and are an error elsewhere (it builds its own prompts: they would be dropped
    unsaid)."""
    if name not in DATASETS:
        raise ValueError(DATASETS.unknown(name) + " (and 'synthetic', which needs no preparing)")
    given = {key: value for key, value in {"template": template, "system": system}.items() if value is not None}
    if not set(given) <= {field.name for field in dataclasses.fields(DATASETS[name])}:
        refuse_prompt_options(name, [getattr(options, key) for key in given])
    return DATASETS[name](**given)


def refuse_prompt_options(name: str, spelled: list[str]) -> None:
    """The prompt template or system prompt (``spelled`` as the command names them) given for dataset ``name``, which
    builds its own prompts: they would be dropped unsaid."""
    are, they, shape, them = ("are", "they", "shape", "them") if len(spelled) > 1 else ("is", "it", "shapes", "it")
    raise ConfigError(f"{' and '.join(spelled)} {are} for a dataset whose prompts {they} {shape} (jsonl): {name} builds "
                      f"its own (docs/datasets.md); drop {them}")


def _read_source_split(task: QATask, source: str, hub_config: str | None, names: tuple[str, ...], options: OptionNames):
    path = Path(source)
    if path.is_file():
        return read_rows(path), {"file": str(path), "sha256": sha256(path)}
    if path.is_dir():
        found = find_split_file(path, names)
        return read_rows(found), {"file": str(found), "sha256": sha256(found)}
    if path.exists():  # a device, a pipe
        raise ValueError(f"{options.source} {source} is neither a file nor a folder: give a .jsonl, .json or .parquet "
                         "file, or a folder of split files")
    if not task.from_hub:
        raise FileNotFoundError(f"{options.source} {source} does not exist: {task.name} reads a local file or a folder "
                                "of split files, and has no hub source")
    if source.startswith((".", "/")) or path.suffix in SUFFIXES:
        raise FileNotFoundError(f"{options.source} {source} does not exist")
    records, fingerprint = read_hub(source, hub_config, names[0])
    return list(enumerate(records, 1)), {"hub": source, "config": hub_config, "split": names[0], "fingerprint": fingerprint}


def source_names(source: str, target: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """The names split ``target`` is read by, the first naming it in the manifest: ``("all",)`` for a single file; in
    a folder, the file it resolves to (:func:`~nemo_jq.data.sources.folder_split_names`): the split's own file by its
    name, else the task's names up to the one found, so that splits of one file share one pool of its rows (drawn
    apart, not twice); the task's ``names`` for the hub."""
    path = Path(source)
    if path.is_file():
        return ("all",)
    if not path.is_dir():
        return names
    found = find_split_file(path, folder_split_names(target, names)).stem
    return names[:names.index(found) + 1] if found in names else (found,)


def prepare(
    task: QATask,
    source: str | None,
    sizes: tuple[int, int, int],
    seed: int,
    *,
    hub_config: str | None = None,
    on_bad_row: str = "skip",
    options: OptionNames = CONFIG_KEYS,
) -> tuple[Splits, dict[str, Any]]:
    """Build the splits of ``task`` from ``source`` (a file, a folder of split files, or a hub name); a fix an error
    or warning gives names the option as ``options`` spells it."""
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ValueError(f"on_bad_row must be one of {BAD_ROW_POLICIES}; got {on_bad_row!r}")
    if len(sizes) != 3 or any(not isinstance(n, int) or n < 0 for n in sizes):
        raise ValueError(f"sizes must be three whole numbers >= 0 (train, validation, test); got {tuple(sizes)}")
    if source is None:
        if task.name not in HUB_SOURCES:
            raise ValueError(f"dataset {task.name!r} needs a source: a local file or folder of split files")
        source, paper_config = HUB_SOURCES[task.name]
        hub_config = hub_config or paper_config
    elif hub_config is not None and (not task.from_hub or Path(source).exists()):  # it would be dropped unsaid
        raise ConfigError(f"{options.hub_config} {hub_config} names a configuration of a hub dataset, but "
                          f"{options.source} {source} is {'a local path' if Path(source).exists() else 'read from local files'}"
                          f" ({task.name}): drop {options.hub_config}")
    plan = dict(zip(SPLITS, sizes))
    source_of = {target: source_names(source, target, names) for target, names in task.source_splits}

    pools: dict[tuple[str, ...], list[Example]] = {}
    manifest: dict[str, Any] = {
        # a local source by its absolute path: the manifest's "prepare it again" command runs from anywhere
        "dataset": task.name, **({"plugin": plugin} if (plugin := plugin_of(task)) else {}), **prompt_options(task),
        "source": str(Path(source).absolute()) if Path(source).exists() else source, "seed": seed,
        "max_input_chars": task.max_input_chars, "on_bad_row": on_bad_row, "sizes": plan, "sources": {},
    }
    ids_of: dict[str, dict[str, list[int]]] = {}
    asked_in: dict[str, dict[tuple[str, str | None], list[tuple[int, str]]]] = {}
    for names in dict.fromkeys(source_of.values()):
        rows, origin = _read_source_split(task, source, hub_config, names, options)
        entry = {**origin, "rows": len(rows), "bad": [], "over_cap": []}
        where = source_label(source, names[0], entry)
        pool, sources, rows_of, empty, unread = [], Counter(), defaultdict(list), defaultdict(list), defaultdict(list)
        rows_asking: dict[tuple[str, str | None], list[tuple[int, str]]] = defaultdict(list)
        read_keys = task.read_keys
        for number, record in rows:
            row_id = record_id(record, f"{names[0]}:{number}")
            rows_of[row_id].append(number)
            if read_keys is not None and isinstance(record, dict):
                for key in record.keys() - set(read_keys):
                    unread[key].append(number)
            try:
                if isinstance(record, UnreadableRow):
                    raise BadRow(record.reason)
                with blamed_on_plugin(task, f"{where}: row {number} (id {row_id}): the build of dataset {task.name!r}",
                                      passes=(BadRow,)):
                    example = dataclasses.replace(task.parse(record), id=row_id)
            except BadRow as err:
                if on_bad_row == "fail":
                    raise ValueError(
                        f"{where}: row {number} (id {row_id}): {err}; "
                        f"fix the row, or pass {options.skip_bad_rows} to count it in the manifest and go on"
                    ) from None
                entry["bad"].append({"id": row_id, "row": number, "reason": str(err)})
                continue
            sources[reference_source(example)] += 1
            rows_asking[(example.question, example.context)].append((number, row_id))
            for name in task.empty_fields(example):
                empty[name].append(number)
            length = len(task.linearize(example))
            if task.max_input_chars is not None and length >= task.max_input_chars:
                entry["over_cap"].append({"id": row_id, "row": number, "chars": length})
                continue
            pool.append(example)
        warn_duplicate_ids(where, rows_of)
        warn_repeated_questions(where, rows_asking)
        warn_empty_fields(where, task, empty, options)
        warn_unread_keys(where, read_keys, unread)
        ids_of[where], asked_in[where] = rows_of, rows_asking
        random.Random(f"{seed}:{names[0]}").shuffle(pool)
        pools[names] = pool
        entry.update(eligible=len(pool), selected={}, unused=len(pool), reference_sources=dict(sources))
        manifest["sources"][names[0]] = entry
    warn_shared_ids(ids_of)
    warn_shared_questions(asked_in)

    chosen: dict[str, list[Example]] = {}
    for target in SPLITS:
        names = source_of[target]
        entry = manifest["sources"][names[0]]
        taken = sum(entry["selected"].values())
        if taken + plan[target] > len(pools[names]):
            raise ValueError(too_few_rows(task, source, names[0], entry, target, plan[target],
                                          len(pools[names]) - taken, options))
        chosen[target] = pools[names][taken : taken + plan[target]]
        entry["selected"][target] = plan[target]
        entry["unused"] -= plan[target]
    manifest["splits"] = {
        t: {"source": source_of[t][0], "count": len(chosen[t]),
            "reference_sources": dict(Counter(reference_source(e) for e in chosen[t]))}
        for t in SPLITS
    }
    return Splits(**chosen), manifest


def build_task(data: Any) -> tuple[Task, Splits]:
    """The task of a config's ``data`` section and its splits (the synthetic sums, a prepared folder, or a dataset
    prepared in memory), with ``data.label_noise`` of the training labels corrupted."""
    task, splits = _clean_task(data)
    check_scoring(task, splits.train or splits.validation)
    if data.label_noise:
        splits = dataclasses.replace(splits, train=corrupt_labels(splits.train, data.label_noise, data.seed, task))
    return task, splits


def task_of(data: Any) -> Task:
    """The task of a config's ``data`` section, without its splits (what generating from or exporting a run needs:
    its prompts' format and answers, none of its data, which may be gone from where it trained)."""
    if data.name == "synthetic":
        return SyntheticArithmetic(num_operands=data.num_operands, answer_width=data.answer_width,
                                   rationale_dependence=data.rationale_dependence)
    return make_task(data.name, template=data.template, system=data.system_prompt)


def _clean_task(data: Any) -> tuple[Task, Splits]:
    sizes = (data.train_size, data.validation_size, data.test_size)
    task = task_of(data)
    if isinstance(task, SyntheticArithmetic):
        return task, task.splits(*sizes, data.seed)
    if data.prepared_dir:
        return task, load_prepared(Path(data.prepared_dir))
    splits, manifest = prepare(task, data.source, sizes, data.seed, hub_config=data.hub_config, on_bad_row=data.on_bad_row)
    for name, entry in manifest["sources"].items():  # no manifest is written here: say which rows were dropped
        where = f"data.source {entry.get('file', data.source)} ({name})"
        if entry["bad"]:
            rows = first_few(entry["bad"], lambda row: f"row {row['row']}: {row['reason']}")
            print(f"nemo-jq: warning: {where}: {len(entry['bad'])} bad row{'s' * (len(entry['bad']) > 1)} dropped ({rows}; "
                  "data.on_bad_row=fail stops at the first, `nemo-jq data prepare` lists them all)", file=sys.stderr)
        if entry["over_cap"]:
            print(f"nemo-jq: warning: {where}: {describe_over_cap(task, entry)} dropped", file=sys.stderr)
    return task, splits


def source_label(source: str, split: str, entry: dict[str, Any]) -> str:
    """How messages name a source split: its file, or the hub name and split."""
    return entry.get("file", f"{source} (split {split})")


def too_few_rows(task: QATask, source: str, split: str, entry: dict[str, Any], target: str, needed: int,
                 remaining: int, options: OptionNames) -> str:
    """Why ``target`` cannot have ``needed`` rows from source split ``split``, and the fix."""
    where = source_label(source, split, entry)
    if not entry["rows"]:
        return f"{where} is empty: {target} needs {needed} rows from it; add rows, or pass another {options.source}"
    text = (f"{where}: {target} needs {needed} rows from source split {split!r}, but only {remaining} eligible rows "
            f"remain (of {entry['rows']}: {describe_rejects(task, entry)})")
    if len(entry["bad"]) == entry["rows"]:
        if (Path(source) / "manifest.json").is_file():  # a folder `nemo-jq data prepare` wrote, given as a raw source
            return (f"{text}; {source} is a prepared folder (nemo-jq data prepare wrote its manifest.json), not "
                    f"{task.name}'s own files: give it as data.prepared_dir={source}, or put the raw files elsewhere")
        return (f"{text}; every row is bad: is {task.name!r} the source's schema? (nemo-jq data prepare --help lists "
                "each dataset's fields)")
    return f"{text}; lower {options.sizes.format(split=target)}, or give the source more rows"


def describe_rejects(task: QATask, entry: dict[str, Any]) -> str:
    """How many rows of a source split were bad, and why (the commonest reasons), and how many over the cap."""
    bad = entry["bad"]
    text = f"{len(bad)} bad"
    if bad:
        reasons = Counter(row["reason"] for row in bad).most_common(2)
        others = len({row["reason"] for row in bad}) > len(reasons)
        text += " (" + "; ".join(f"{n}: {reason}" for reason, n in reasons) + ("; ..." if others else "") + ")"
    if task.max_input_chars is not None:
        text += ", " + describe_over_cap(task, entry)
    return text


def describe_over_cap(task: QATask, entry: dict[str, Any]) -> str:
    """How many rows of a source split reach the character cap, naming the first few: a prompt that long is dropped,
    not cut (a cut question or context is another question)."""
    over = entry["over_cap"]
    text = f"{len(over)} over the {task.max_input_chars}-character cap"
    if over:
        text += " (" + first_few(over, lambda row: f"row {row.get('row', '?')}: id {row['id']}, {row['chars']} characters") + ")"
    return text


def warn_duplicate_ids(source: str, rows_of: dict[str, list[int]]) -> None:
    """Say which example ids more than one row of ``source`` carries (and on which rows)."""
    repeated = {row_id: rows for row_id, rows in rows_of.items() if len(rows) > 1}
    if repeated:
        named = "; ".join(f"{row_id} (rows {', '.join(map(str, rows))})" for row_id, rows in list(repeated.items())[:5])
        print(f"nemo-jq: warning: {source}: {len(repeated)} example id(s) on more than one row: {named}"
              f"{'; ...' if len(repeated) > 5 else ''}: reports name examples by id, so make the ids unique",
              file=sys.stderr)


def warn_repeated_questions(source: str, rows_asking: dict[Any, list[tuple[int, str]]]) -> None:
    """Say which rows of ``source`` ask what another row asks (the same question and context) under another id: the
    copies can be drawn into train and test (leakage) where no id says they are one example."""
    repeated = [rows for rows in rows_asking.values() if len({row_id for _, row_id in rows}) > 1]
    if repeated:
        named = "; ".join(f"rows {', '.join(str(number) for number, _ in rows)}" for rows in repeated[:5])
        print(f"nemo-jq: warning: {source}: {len(repeated)} question(s) on more than one row: {named}"
              f"{'; ...' if len(repeated) > 5 else ''}: copies can be drawn into train and test (leakage); remove them",
              file=sys.stderr)


def warn_shared_ids(ids_of: dict[str, dict[str, list[int]]]) -> None:
    """Say which example ids two source split files both carry: such a row can be drawn into train and into test."""
    for (first, first_ids), (second, second_ids) in itertools.combinations(ids_of.items(), 2):
        shared = [row_id for row_id in first_ids if row_id in second_ids]
        if shared:
            print(f"nemo-jq: warning: {first} and {second}: {len(shared)} example id(s) in both: {', '.join(shared[:5])}"
                  f"{'; ...' if len(shared) > 5 else ''}: a row in both can be drawn into two prepared splits "
                  "(leakage); remove them from one of the files", file=sys.stderr)


def warn_shared_questions(asked_in: dict[str, dict[Any, list[tuple[int, str]]]]) -> None:
    """Say which rows of two source split files ask the same question (and context) under other ids (a row copied
    from one file into the other, without ids: each took its file's own): drawn into train and test, a leak no id
    shows (:func:`warn_shared_ids` names those with one id)."""
    for (first, first_asks), (second, second_asks) in itertools.combinations(asked_in.items(), 2):
        shared = [rows[0][0] for asked, rows in first_asks.items() if asked in second_asks
                  and not {row_id for _, row_id in rows} & {row_id for _, row_id in second_asks[asked]}]
        if shared:
            print(f"nemo-jq: warning: {first} and {second}: {len(shared)} question(s) in both, under other ids (rows "
                  f"{', '.join(map(str, shared[:5]))}{', ...' if len(shared) > 5 else ''} of the first): a row in both "
                  "can be drawn into two prepared splits (leakage); remove them from one of the files", file=sys.stderr)


def warn_empty_fields(source: str, task: QATask, empty: dict[str, list[int]], options: OptionNames) -> None:
    """Say which rows leave a field of the prompt template empty (their prompts hold it blank)."""
    for name, rows in empty.items():
        shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
        print(f"nemo-jq: warning: {source}: {len(rows)} row(s) have no {name!r} (rows {shown}), which the prompt "
              f"template {getattr(task, 'template', '')!r} uses: their prompts hold it blank; fill the field, or "
              f"pass a {options.template} without {{{name}}}", file=sys.stderr)


def warn_unread_keys(source: str, read_keys: tuple[str, ...] | None, unread: dict[str, list[int]]) -> None:
    """Say which keys of ``source``'s rows the dataset does not read (and the one each may have meant)."""
    for key, rows in sorted(unread.items()):
        shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
        meant = difflib.get_close_matches(key.lower(), read_keys, n=1, cutoff=0.6)
        print(f"nemo-jq: warning: {source}: {len(rows)} row(s) hold the key {key!r} (rows {shown}), which is not read"
              f"{f': did you mean {meant[0]!r}?' if meant else ''} (a row is read for {', '.join(read_keys)})",
              file=sys.stderr)


def reference_source(example: Example) -> str:
    """Which field y* came from: ``answer`` unless the task says otherwise (FinQA's ``exe_ans``)."""
    return example.meta.get("reference_source", "answer")


def prompt_options(task: QATask) -> dict[str, str | None]:
    """The prompt options a prepared folder was built with (custom ``jsonl`` only), for training to reuse."""
    return {"template": getattr(task, "template", None), "system": getattr(task, "system", None)}


def write_prepared(splits: Splits, manifest: dict[str, Any], out_dir: Path) -> None:
    """The splits and their manifest in ``out_dir``, put there once all are written (``outputs.staged``: a stop
    part-way left a train.jsonl without a manifest, which blocked the command run again)."""
    from nemo_jq.runtime.outputs import staged

    with staged(Path(out_dir), last="manifest.json") as staging:
        for name in SPLITS:
            lines = [json.dumps(dataclasses.asdict(e)) for e in splits.get(name)]
            (staging / f"{name}.jsonl").write_text("".join(line + "\n" for line in lines))
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))


def prepare_again(folder: Path, manifest: dict[str, Any] | None = None) -> str:
    """The fix for a prepared folder that is broken or incomplete: write it afresh from its source; the command in
    full where its manifest says how it was made (placeholders where it cannot: no manifest, or prompt options of
    the person's own, which a shell line would have to quote whole)."""
    import shlex

    made = manifest or {}
    sizes = made.get("sizes") if isinstance(made.get("sizes"), dict) else {}
    dataset = made.get("dataset") if made.get("dataset") in DATASETS else "NAME"
    own_prompts = dataset == "NAME" or [made.get("template"), made.get("system")] != list(
        prompt_options(DATASETS[dataset]()).values())
    known = (isinstance(made.get("source"), str) and all(isinstance(sizes.get(split), int) for split in SPLITS)
             and isinstance(made.get("seed"), int) and not own_prompts)
    source, sizes_text, seed = ((shlex.quote(made["source"]), ",".join(str(sizes[split]) for split in SPLITS),
                                 f" --seed {made['seed']}") if known else ("SOURCE", "N,N,N", ""))
    plugin = f" --plugin {shlex.quote(made['plugin'])}" if isinstance(made.get("plugin"), str) else ""
    entries = made.get("sources") if isinstance(made.get("sources"), dict) else {}
    hub = next((entry.get("config") for entry in entries.values() if isinstance(entry, dict) and entry.get("hub")), None)
    options = (f" --hub-config {shlex.quote(hub)}" if isinstance(hub, str) and known else "") + (
        " --on-bad-row fail" if made.get("on_bad_row") == "fail" else "")  # what it was made with, not the defaults
    return (f"prepare the data again (nemo-jq data prepare --dataset {dataset}{plugin} --source {source}{options} "
            f"--sizes {sizes_text}{seed} --out {shlex.quote(str(folder))} --overwrite)")


def read_manifest(folder: Path) -> dict[str, Any]:
    """A prepared folder's manifest; says which dataset it holds and with which prompt options."""
    path = Path(folder) / "manifest.json"
    if Path(folder).is_file():
        raise ValueError(f"{folder} is a file, not a prepared folder: train on it as it is with data.name=jsonl "
                         f"data.source={folder}, or prepare it (`nemo-jq data prepare --dataset jsonl --source {folder} "
                         "--out DIR`) and give DIR")
    if not Path(folder).is_dir():
        raise FileNotFoundError(f"{folder} does not exist: give the folder `nemo-jq data prepare --out` wrote")
    if (Path(folder) / "config.yaml").exists() and not path.exists():
        raise FileNotFoundError(f"{folder} is a run's folder, not prepared data: give the folder `nemo-jq data prepare "
                                "--out` wrote")
    if not path.exists():
        raise FileNotFoundError(f"{folder} is not a prepared dataset: no manifest.json; {prepare_again(folder)}")
    try:
        manifest = json.loads(path.read_bytes())
    except ValueError as err:  # bad bytes or bad syntax
        raise ValueError(f"{path}: not valid JSON ({err}); {prepare_again(folder)}") from None
    if not isinstance(manifest, dict) or "dataset" not in manifest:
        raise ValueError(f"{path} does not say which dataset it holds (no 'dataset' key): {prepare_again(folder)}")
    if not isinstance(manifest["dataset"], str) or manifest["dataset"] == "synthetic":  # prepare writes neither
        raise ValueError(f"{path}: 'dataset' {manifest['dataset']!r} is not a prepared dataset's name (the synthetic "
                         f"task is generated, not prepared): {prepare_again(folder)}")
    prompts = {"template": manifest.get("template"), "system": manifest.get("system")}
    if manifest["dataset"] in DATASETS:  # the prompt options it records, checked here where the file can be named
        try:
            if any(value is not None and not isinstance(value, str) for value in prompts.values()):
                raise ValueError(f"'template' and 'system' are text or null, not {prompts!r}")
            make_task(manifest["dataset"], **prompts, options=MANIFEST_KEYS)
        except ValueError as err:
            raise ValueError(f"{path}: {err}; {prepare_again(folder, manifest)}") from None
    return manifest


def load_prepared(folder: Path) -> Splits:
    """Splits written by ``nemo-jq data prepare``; every split must hold at least one example."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    again = prepare_again(folder, manifest)
    sizes = manifest.get("sizes") if isinstance(manifest.get("sizes"), dict) else {}
    loaded = {}
    for name in SPLITS:
        path = folder / f"{name}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} is not a complete prepared dataset: it has no {name}.jsonl; {again}")
        rows = read_rows(path)
        if not rows:
            raise ValueError(f"{path} is empty: prepare the data again with a {name} size of at least 1")
        if isinstance(sizes.get(name), int) and len(rows) != sizes[name]:  # the run's split sizes and steps are these
            raise ValueError(f"{path} holds {len(rows)} rows where manifest.json says {sizes[name]} (edited since it "
                             f"was prepared?): {again}, or set manifest.json's sizes.{name} to {len(rows)} to keep the edit")
        loaded[name] = [prepared_example(path, number, row, again) for number, row in rows]
    return Splits(**loaded)


def prepared_example(path: Path, number: int, row: Any, again: str) -> Example:
    """Row ``number`` of a prepared split as an :class:`Example`; a row edited into another shape is an error naming it
    (here, not deep in a training run) and ``again``, how to prepare the folder afresh."""
    problem = prepared_row_problem(row)
    if problem:
        raise ValueError(f"{path}:{number}: {problem}; fix the row, or {again}")
    return Example(**{**row, "aliases": tuple(row["aliases"])})


def prepared_row_problem(row: Any) -> str | None:
    """What keeps a prepared row from being an :class:`Example` (None: nothing)."""
    if isinstance(row, UnreadableRow):
        return row.reason
    if not isinstance(row, dict):
        return f"a row must be a JSON object, got {type(row).__name__}"
    for key in row:
        if key not in PREPARED_ROW_TYPES:
            return f"unknown key {key!r} (a prepared row holds {', '.join(PREPARED_ROW_TYPES)})"
    for key, kind in PREPARED_ROW_TYPES.items():
        if key not in row:
            return f"missing key {key!r}"
        if not isinstance(row[key], kind):
            names = "/".join(map(json_type_name, kind if isinstance(kind, tuple) else (kind,)))
            return f"key {key!r} must be {names}, got {json_type_name(type(row[key]))}"
    if not all(isinstance(alias, str) for alias in row["aliases"]):
        return "key 'aliases' must be a list of str"
    try:  # as prepare checked them: an answer no output can match (``!!!``) is no gold
        required_text(row, "question")
        required_answer(row)
    except BadRow as err:
        return str(err)
    return None


def json_type_name(kind: type) -> str:
    """A parsed JSON value's type as a person who wrote the JSON knows it (``null``, not ``NoneType``)."""
    return "null" if kind is type(None) else kind.__name__
