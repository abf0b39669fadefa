"""HF folders out of any policy: what ``nemo-jq export`` writes, whole or streamed tensor by tensor."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from nemo_jq.data.chat import ChatFormat
from nemo_jq.models.common import WEIGHTS_FILE, quiet_weight_files
from nemo_jq.runtime.monitor import read_json_file
from nemo_jq.runtime.outputs import LOCK_FILE, STAGED_INSIDE
from nemo_jq.typed import first_few

#: Marks a folder as written by ``HFPolicy.export`` and lists its files, so a later export may replace them.
EXPORT_MARKER = "nemo_jq_export.json"

#: The rollouts' sampling at the paper's and the config's default (temperature 1, no top-k or top-p truncation;
#: ``nemo-jq export`` writes a run's own, :func:`sample_as`), written out because ``generate``'s own defaults are
#: greedy decoding, and top_k=50 when sampling. Pass ``do_sample=False`` to ``generate`` for greedy decoding.
ROLLOUT_SAMPLING = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


def sample_as(out_dir: Path, rollout: Any) -> None:
    """``out_dir``'s ``generation_config.json`` sampling as a run's rollouts did (``rollout``: its
    ``temperature``, ``top_k``, ``top_p``; temperature 0 is greedy), its stop and pad ids kept: a run at
    temperature 0.7 exported with the paper's temperature 1 was sampled otherwise than it trained."""
    from transformers import GenerationConfig

    written = GenerationConfig.from_pretrained(out_dir)
    sampling = ({"do_sample": False} if rollout.temperature == 0 else
                {**ROLLOUT_SAMPLING, "temperature": rollout.temperature, "top_k": rollout.top_k, "top_p": rollout.top_p})
    GenerationConfig(eos_token_id=written.eos_token_id, pad_token_id=written.pad_token_id, **sampling).save_pretrained(out_dir)


def files_of_earlier_export(out_dir: Path) -> list[str]:
    """The files an earlier export left in ``out_dir`` (none if it is missing or empty).

    Refuses anything else, so an export never overwrites or mixes with a user's own files.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"export target {out_dir} is a file: choose another --out or remove it")
    if out_dir.is_symlink() and not out_dir.exists():
        raise ValueError(f"export target {out_dir} is a link to {os.readlink(out_dir)}, which does not exist: make that "
                         "folder, or choose another --out")
    present = {path.name for path in out_dir.iterdir()} - {STAGED_INSIDE, LOCK_FILE} if out_dir.exists() else set()
    if not present:
        return []
    marker = out_dir / EXPORT_MARKER
    earlier = [EXPORT_MARKER, *read_marker(marker)["files"]] if marker.is_file() else []
    if not present <= set(earlier):
        foreign = sorted(present - set(earlier))
        raise ValueError(f"export target {out_dir} holds files that are not from an earlier export ({first_few(foreign)}): "
                         "choose another --out or remove them")
    return earlier


def read_marker(marker: Path) -> dict[str, Any]:
    """An export's marker file; one edited or cut short is one line naming it (the export's files are not known)."""
    return read_json_file(marker, "an export's record", lambda value: None if isinstance(value.get("files"), list) and all(
        isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name for name in value["files"])
        else "no list of its files' names", "remove the folder's files by hand (what it holds is no longer known to be "
        "an export's), or choose another --out")  # a name with a folder in it: a re-export deleted a file elsewhere


def record_source(out_dir: Path, source: dict[str, Any], written: list[str] = ()) -> None:
    """Add where an export's weights come from (run, checkpoint, step, why that one) to its marker file, and the files
    ``written`` into the export after it (its model card), so that the next export over it replaces them too."""
    marker = Path(out_dir) / EXPORT_MARKER
    recorded = read_marker(marker)
    recorded["files"] = sorted({*recorded["files"], *written})
    marker.write_text(json.dumps({**recorded, "source": source}, indent=2) + "\n")
    make_readable(Path(out_dir))


def make_readable(folder: Path, *, folder_too: bool = True) -> None:
    """Give group and others read access to ``folder``'s files, whatever the umask or writer chose, and, unless
    ``folder_too`` is false (a folder of the user's, whose mode is theirs), to ``folder`` itself."""
    if folder_too:
        folder.chmod(folder.stat().st_mode | 0o755)
    for path in folder.iterdir():
        path.chmod(path.stat().st_mode | 0o644)


def export_hf_model(model: Any, out_dir: Path, tokenizer: Any) -> None:
    """Write an HF folder where plain ``apply_chat_template`` + ``generate`` behave like training's rollouts.

    The chat template ends the generation prompt in ``<think>\\n`` (thinking on), as training
    prompts do; ``config.json`` and ``generation_config.json`` stop at ``<|im_end|>`` and pad;
    the generation config samples as the rollouts did (``ROLLOUT_SAMPLING``);
    every file is readable by group and others. ``out_dir`` must be missing, empty or an
    earlier export (which is replaced); anything else raises ``ValueError``, untouched.
    """
    with quiet_weight_files():
        _export(out_dir, tokenizer, model.config, model.save_pretrained)


def export_hf_stream(config: Any, tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path, tokenizer: Any,
                     max_shard_bytes: int = 5 * 1024**3) -> None:
    """As :func:`export_hf_model`, from HF-named tensors that arrive one at a time (a model that never
    exists whole in this process): safetensors shards of at most ``max_shard_bytes`` and their index,
    as ``save_pretrained`` writes them. ``tensors`` is always consumed to the end, even on an error,
    since other ranks may be producing it collectively."""
    tensors = iter(tensors)
    try:
        _export(out_dir, tokenizer, config, lambda folder: write_safetensors_shards(tensors, folder, max_shard_bytes))
    finally:
        for _ in tensors:
            pass


def write_safetensors_shards(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path, max_shard_bytes: int) -> None:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    files, weight_map, shard, shard_bytes, total = [], {}, {}, 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            files.append(out_dir / f".shard-{len(files)}.safetensors")
            save_file(shard, str(files[-1]), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, len(files) - 1))
            shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard[name], shard_bytes, total = tensor.detach().cpu().contiguous(), shard_bytes + size, total + size
    flush()
    names = ([WEIGHTS_FILE] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    for path, name in zip(files, names):
        path.rename(out_dir / name)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in sorted(weight_map.items())}}
        (out_dir / f"{WEIGHTS_FILE}.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _export(out_dir: Path, tokenizer: Any, config: Any, write_weights: Callable[[Path], None]) -> None:
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    earlier_files = files_of_earlier_export(out_dir)
    chat = ChatFormat(tokenizer)
    for name in earlier_files:
        (out_dir / name).unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)

    write_weights(out_dir)
    stop_ids = [chat.end_of_turn_id]  # and the tokenizer's own eos, where it differs (Qwen3's convention)
    if tokenizer.eos_token_id not in (None, chat.end_of_turn_id):
        stop_ids.append(tokenizer.eos_token_id)
    config = copy.deepcopy(config)
    config.eos_token_id, config.pad_token_id = stop_ids, chat.pad_id
    config.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=stop_ids, pad_token_id=chat.pad_id, **ROLLOUT_SAMPLING).save_pretrained(out_dir)
    original_template = tokenizer.chat_template
    tokenizer.chat_template = chat.chat_template
    try:
        tokenizer.save_pretrained(out_dir)
    finally:
        tokenizer.chat_template = original_template

    written = sorted(path.name for path in out_dir.iterdir() if path.name not in (EXPORT_MARKER, LOCK_FILE))  # staged's
    (out_dir / EXPORT_MARKER).write_text(json.dumps({"files": written}, indent=2) + "\n")
    make_readable(out_dir)
