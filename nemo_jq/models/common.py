"""Helpers every backend uses: devices, precision, where a pretrained model lives, and reading its weights."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch

from nemo_jq.models import PRECISIONS


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    return precision


def autocast_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """The dtype a forward runs in under ``precision``: bf16 on GPU ("auto") or anywhere ("bf16"); None for fp32."""
    return torch.bfloat16 if precision == "bf16" or (precision == "auto" and device.type == "cuda") else None


def autocast_context(device: torch.device, precision: str):
    """bf16 autocast over fp32 master weights on GPU ("auto" or "bf16"); plain fp32 otherwise."""
    dtype = autocast_dtype(device, precision)
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def resolve_pretrained(path: str) -> str:
    """A local HF folder (checked to exist and hold config.json), or a hub name passed through."""
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").exists():
            raise FileNotFoundError(f"model folder {local} has no config.json")
        return str(local)
    if path.startswith(("/", ".", "~")):
        raise FileNotFoundError(f"model folder {local} does not exist")
    return path


#: An HF folder's weights (unsharded), and the weights of an HF policy's checkpoint.
WEIGHTS_FILE = "model.safetensors"


class SafetensorsFolder(Mapping[str, torch.Tensor]):
    """An HF folder's weights by name (``model.safetensors``, or the shards its index lists), each read
    from its file only when asked for: a model too large for one process is loaded tensor by tensor."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        folder = Path(folder)
        index = folder / f"{WEIGHTS_FILE}.index.json"
        if index.exists():
            self.files = {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        elif (folder / WEIGHTS_FILE).exists():
            with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as weights:
                self.files = dict.fromkeys(weights.keys(), folder / WEIGHTS_FILE)
        else:
            raise FileNotFoundError(f"{folder} has neither {WEIGHTS_FILE} nor {WEIGHTS_FILE}.index.json")
        absent = sorted({str(path) for path in self.files.values() if not path.exists()})
        if absent:
            raise FileNotFoundError(f"{index} lists weight files that do not exist: {', '.join(absent)}")

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as weights:
            return weights.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def require_files(directory: Path, names: Sequence[str]) -> None:
    """Raise ``FileNotFoundError`` naming every file of ``names`` that ``directory`` lacks."""
    missing = [name for name in names if not (Path(directory) / name).exists()]
    if missing:
        raise FileNotFoundError(f"checkpoint {directory} is missing {', '.join(missing)}")
