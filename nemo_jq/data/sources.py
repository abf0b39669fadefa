"""Reading raw records: local JSON / JSONL / parquet files or folders, or HF hub datasets."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

SUFFIXES = (".jsonl", ".json", ".parquet")


def find_split_file(folder: Path, names: tuple[str, ...]) -> Path:
    """The first ``{name}{suffix}`` present in ``folder`` (e.g. FinQA's dev.json for validation)."""
    for name in names:
        for suffix in SUFFIXES:
            path = folder / f"{name}{suffix}"
            if path.exists():
                return path
    raise FileNotFoundError(f"no file named {list(names)} with suffix {list(SUFFIXES)} in {folder}")


def read_file(path: Path) -> list[dict[str, Any]]:
    """Records from one local file; a JSON file may hold a list of records or ``{"data": [...]}``."""
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        return records
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{path} must hold a list of records (or {{'data': [...]}})")
        return data
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use one of {list(SUFFIXES)}")


def read_hub(name: str, config: str | None, split: str) -> tuple[list[dict[str, Any]], str]:
    """Records of a hub dataset split and its ``datasets`` fingerprint (needs a network or an HF cache)."""
    from datasets import load_dataset

    dataset = load_dataset(name, config, split=split)
    return list(dataset), dataset._fingerprint


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
