"""Reading raw records: local JSON / JSONL / parquet files or folders, or HF hub datasets."""

from __future__ import annotations

import codecs
import hashlib
import json
from pathlib import Path
from typing import Any

from nemo_jq.typed import utf8_text

SUFFIXES = (".jsonl", ".json", ".parquet")


def folder_split_names(target: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """The files a source folder is searched for, for split ``target``: the task's ``names``, after a file named for
    the split itself where they do not name it (a folder's own test.jsonl is its test split; the hub's HotPotQA has
    none, so the task draws test from validation)."""
    return names if target in names else (target, *names)


def find_split_file(folder: Path, names: tuple[str, ...]) -> Path:
    """The first ``{name}{suffix}`` present in ``folder`` (e.g. FinQA's dev.json for validation); two files of one
    name (``train.jsonl`` and ``train.parquet``) are refused: one of them would be left unread without a word."""
    for name in names:
        found = [path for path in (folder / f"{name}{suffix}" for suffix in SUFFIXES) if path.exists()]
        if len(found) > 1:
            raise ValueError(f"{folder} holds {' and '.join(path.name for path in found)}: which one is the {name} split "
                             "is not clear; keep one of them there")
        if found:
            return found[0]
    raise FileNotFoundError(f"{folder} holds no {' or '.join(names)} split file (one of {', '.join(SUFFIXES)}): add "
                            f"one (e.g. {folder / (names[0] + SUFFIXES[0])}), or give a single file as the source, which "
                            "gives every split")


class UnreadableRow:
    """A line of a JSONL file that is not UTF-8 or not JSON: a bad row like any other, with its reason."""

    def __init__(self, reason: str):
        self.reason = reason


class WrittenFloat(float):
    """A JSON number with a fraction or an exponent that keeps how it was written (``written``): an answer ``3.10``
    is the text ``3.10``, which the float alone would make ``3.1``."""

    def __new__(cls, text: str) -> WrittenFloat:
        number = super().__new__(cls, text)
        number.written = text
        return number


def read_rows(path: Path) -> list[tuple[int, Any]]:
    """``(row, record)`` pairs from one local file, ``row`` counted from 1 (a JSONL file's line number).

    A JSONL line that is not UTF-8 or not valid JSON comes back as an :class:`UnreadableRow`; a JSON
    file may hold a list of records or ``{"data": [...]}``. A UTF-8 byte-order mark at the start is skipped;
    a file saved as UTF-16 or UTF-32 is an error.
    """
    if path.suffix == ".jsonl":
        data = path.read_bytes()
        check_not_wide_text(path, data)
        rows = []
        for number, raw in enumerate(data.removeprefix(codecs.BOM_UTF8).splitlines(), 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                rows.append((number, UnreadableRow(f"not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1})")))
                continue
            if line.strip():
                try:
                    rows.append((number, json.loads(line, parse_float=WrittenFloat)))
                except json.JSONDecodeError as err:
                    rows.append((number, UnreadableRow(f"not valid JSON ({err.msg} at column {err.colno})")))
                except (ValueError, RecursionError) as err:  # a number of over 4300 digits, nesting past the stack
                    rows.append((number, UnreadableRow(f"not JSON this reader takes ({_unreadable(err)})")))
        return rows
    if path.suffix == ".json":
        data = _load_json(path)
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{path} must hold a list of records (or {{'data': [...]}})")
        return list(enumerate(data, 1))
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return list(enumerate(pq.read_table(path).to_pylist(), 1))
        except (pa.ArrowInvalid, OSError) as err:  # not Parquet, or cut short
            raise ValueError(f"{path} is not a readable Parquet file ({str(err).splitlines()[0]}): write it again, or "
                             "give the rows as .jsonl") from None
    raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use one of {list(SUFFIXES)}")


#: The byte-order marks of the wide encodings an editor may save a text file in (UTF-32's first: its
#: little-endian mark begins with UTF-16's).
WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
             (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def check_not_wide_text(path: Path, data: bytes) -> None:
    """Refuse a text file saved as UTF-16 or UTF-32, whose every line would otherwise be a bad row of "not valid JSON".

    Without a byte-order mark, a quarter or more NUL bytes at the start gives it away (UTF-8 JSON holds none); a
    stray NUL further on is left to make its line a bad row.
    """
    for bom, encoding in WIDE_BOMS:
        if data.startswith(bom):
            raise ValueError(f"{path} is {encoding} text (its byte-order mark says so): save it as UTF-8")
    head = data[:4096]
    if head and head.count(0) * 4 >= len(head):
        raise ValueError(f"{path} holds NUL bytes ({head.count(0)} of its first {len(head)}): it looks like UTF-16 or "
                         "UTF-32 text; save it as UTF-8")


def _load_json(path: Path) -> Any:
    """A JSON file's content; bad bytes or bad syntax is an error naming the file and line."""
    data = path.read_bytes()
    check_not_wide_text(path, data)
    text = utf8_text(path, data, encoding="utf-8-sig")  # a byte-order mark some editors write first is not JSON
    try:
        return json.loads(text, parse_float=WrittenFloat)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg}); fix the file there") from None
    except (ValueError, RecursionError) as err:
        raise ValueError(f"{path}: not JSON this reader takes ({_unreadable(err)}); fix the file") from None


def _unreadable(err: Exception) -> str:
    """Why valid JSON syntax was not read: an integer too long for Python to convert, or nesting too deep."""
    return "arrays or objects nested too deep" if isinstance(err, RecursionError) else str(err).split(";")[0]


def read_hub(name: str, config: str | None, split: str) -> tuple[list[dict[str, Any]], str]:
    """Records of a hub dataset split and its ``datasets`` fingerprint (needs a network or an HF cache).

    Any failure to load becomes one line that says ``--source`` takes local files.
    """
    from datasets import load_dataset

    try:
        dataset = load_dataset(name, config, split=split)
    except Exception as err:  # connection, cache and hub errors come from several libraries
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ValueError(
            f"cannot load {name} (split {split}) from the Hugging Face hub: {type(err).__name__}: {reason}. "
            "Without a network, pass --source (data.source) with local files: a file, or a folder of "
            "train/validation .json/.jsonl/.parquet files"
        ) from None
    return list(dataset), dataset._fingerprint


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
